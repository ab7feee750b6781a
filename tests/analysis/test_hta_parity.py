"""The breakdowns against HolisticTraceAnalysis itself, run on the same real traces.

DLRM's Kineto times are whole microseconds, so HTA (which works in integer µs) and the views
must agree exactly once HTA's own window (first kernel start to last kernel end) is accounted
for. HTA-NCCL has sub-µs times that HTA truncates, and HTA drops the last profiler step; there
the comparison is bounded (see docs/analysis.md, "Comparison with HTA").
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import polars as pl
import pytest
from prism_trace.analysis import idle, kernels, overlap, temporal

from prism_trace.store import Store

pytestmark = [
    pytest.mark.shared_data,
    pytest.mark.slow,
    # HTA 0.5.0 uses pandas APIs that newer pandas deprecates; not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning"),
]

hta_trace_analysis = pytest.importorskip("hta.trace_analysis")


def _hta(trace_dir: Path):  # type: ignore[no-untyped-def]
    """HTA's analysis of ``trace_dir``, parsed in this process.

    HTA parses ranks in a *fork* pool by default; forking this process, which holds DuckDB and
    torch threads, can crash or hang the children (seen as a segfault in a worker while the pool
    waits forever), so the parse runs without multiprocessing. The results are the same.
    """
    from hta.common import trace as hta_trace

    load = hta_trace.Trace.load_traces

    def load_in_process(self, include_last_profiler_step=False, *_args, **_kw):  # type: ignore[no-untyped-def]
        return load(self, include_last_profiler_step, use_multiprocessing=False)

    logging.disable(logging.WARNING)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(hta_trace.Trace, "load_traces", load_in_process)
            return hta_trace_analysis.TraceAnalysis(trace_dir=str(trace_dir))
    finally:
        logging.disable(logging.NOTSET)


@pytest.fixture(scope="module")
def hta_dlrm(shared_datasets: Path):  # type: ignore[no-untyped-def]
    return _hta(shared_datasets / "param-dlrm-8rank" / "kineto")


@pytest.fixture(scope="module")
def hta_nccl(shared_datasets: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("hta_nccl")
    shutil.copy(shared_datasets / "hta-nccl-rank0" / "nccl_data.json.gz", d)
    return _hta(d)


def test_dlrm_temporal_equals_hta(real_store: Store, hta_dlrm) -> None:  # type: ignore[no-untyped-def]
    ours = temporal(real_store, "dlrm")
    theirs = pl.from_pandas(hta_dlrm.get_temporal_breakdown(visualize=False))
    for o, t in zip(ours.iter_rows(named=True), theirs.iter_rows(named=True), strict=True):
        assert o["rank"] == t["rank"]
        assert o["compute_ns"] == t["compute_time(us)"] * 1000
        assert o["comm_ns"] + o["memory_ns"] + o["other_ns"] == t["non_compute_time(us)"] * 1000
        # HTA's window is the kernel span; ours the ProfilerStep: the busy time is the same.
        busy = o["window_ns"] - o["idle_ns"]
        assert busy == (t["kernel_time(us)"] - t["idle_time(us)"]) * 1000


def test_dlrm_overlap_equals_hta(real_store: Store, hta_dlrm) -> None:  # type: ignore[no-untyped-def]
    ours = overlap(real_store, "dlrm")["overlap_pct"].to_list()
    theirs = hta_dlrm.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].tolist()
    assert ours == pytest.approx(theirs, abs=0.005)


def test_dlrm_kernel_stats_equal_hta(real_store: Store, hta_dlrm) -> None:  # type: ignore[no-untyped-def]
    _, per_kernel = hta_dlrm.get_gpu_kernel_breakdown(
        visualize=False, include_memory_kernels=True, num_kernels=1000, duration_ratio=1.0
    )
    theirs = pl.from_pandas(per_kernel)
    ours = kernels(real_store, "dlrm", per_rank=True)
    assert theirs.height == ours.height
    types = {"COMPUTATION": "compute", "COMMUNICATION": "comm", "MEMORY": "memory"}
    by_key = {(r["rank"], r["name"]): r for r in ours.iter_rows(named=True)}
    for t in theirs.iter_rows(named=True):
        o = by_key[(t["rank"], t["name"])]
        assert o["kernel_type"] == types[t["kernel_type"]]
        assert o["total_ns"] == t["sum (us)"] * 1000
        assert (o["min_ns"], o["max_ns"]) == (t["min (us)"] * 1000, t["max (us)"] * 1000)
        assert o["mean_ns"] == pytest.approx(t["mean (us)"] * 1000)
        assert o["std_ns"] == pytest.approx(t["stddev"] * 1000)


def test_dlrm_idle_equals_hta(real_store: Store, hta_dlrm) -> None:  # type: ignore[no-untyped-def]
    theirs, _ = hta_dlrm.get_idle_time_breakdown(ranks=list(range(8)), visualize=False)
    theirs = pl.from_pandas(theirs).filter(pl.col("idle_time") > 0)
    ours = idle(real_store, "dlrm")
    got = {
        (r["rank"], r["stream"], r["idle_category"]): r["idle_ns"]
        for r in ours.iter_rows(named=True)
    }
    want = {
        (r["rank"], r["stream"], r["idle_category"]): r["idle_time"] * 1000
        for r in theirs.iter_rows(named=True)
    }
    # Kernels with no launch event in the trace: HTA's join falls back to the trace's first row
    # and compares *its* start with the previous kernel's end (docs/analysis.md); those streams
    # agree on the total idle time only.
    unlaunched = set(
        real_store.con.execute(
            "SELECT DISTINCT d.rank, d.stream FROM core_device_op d JOIN run USING (run_id)"
            " WHERE run.name = 'dlrm' AND d.launch_ts IS NULL"
        ).fetchall()
    )
    assert unlaunched, "the quirk this test documents is gone: tighten the test"
    for key in got.keys() | want.keys():
        if key[:2] not in unlaunched:
            assert got.get(key) == want.get(key), key
    for rank, stream in unlaunched:
        total = sum(v for k, v in got.items() if k[:2] == (rank, stream))
        assert total == sum(v for k, v in want.items() if k[:2] == (rank, stream))


def test_hta_nccl_within_truncation_of_hta(real_store: Store, hta_nccl) -> None:  # type: ignore[no-untyped-def]
    """HTA truncates each time to whole µs and drops the last step (6): bounded agreement."""
    steps = temporal(real_store, "hta", by="iteration").filter(pl.col("iteration") < 6)
    t = hta_nccl.get_temporal_breakdown(visualize=False).iloc[0]
    n_ops = real_store.con.execute(
        "SELECT count(*) FROM core_device_op d JOIN run USING (run_id)"
        " WHERE run.name = 'hta' AND d.iteration < 6"
    ).fetchall()[0][0]
    bound = n_ops * 1000  # at most 1 µs lost per op
    assert abs(steps["compute_ns"].sum() - t["compute_time(us)"] * 1000) <= bound
    non_compute = (steps["comm_ns"] + steps["memory_ns"] + steps["other_ns"]).sum()
    assert abs(non_compute - t["non_compute_time(us)"] * 1000) <= bound
    ov = overlap(real_store, "hta", by="iteration").filter(pl.col("iteration") < 6)
    ours_pct = 100 * ov["overlap_ns"].sum() / ov["comm_ns"].sum()
    theirs_pct = hta_nccl.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"][0]
    assert ours_pct == pytest.approx(theirs_pct, abs=1.0)

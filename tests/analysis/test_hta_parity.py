"""The breakdowns against HolisticTraceAnalysis itself, run on the same real traces.

With `window="hta"` (HTA's semantics: one window per rank from the first to the last kept
device op, the last profiler step dropped, times on HTA's integer-µs clock) temporal, kernels,
overlap and idle equal HTA within 1 % per rank (most exactly) on DLRM and HTA-NCCL; see
docs/analysis.md, "Comparison with HTA".
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import polars as pl
import pytest
from prism_trace.analysis import idle, kernels, overlap, temporal

from prism_trace.store.connection import Store

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


def _pct_close(ours: float, theirs: float) -> bool:
    """Within 1 % of HTA's value (the issue's bar); most agree exactly."""
    return abs(ours - theirs) <= 0.01 * abs(theirs) + 1e-9


def _temporal_vs_hta(store: Store, run: str, ta) -> None:  # type: ignore[no-untyped-def]
    ours = temporal(store, run, window="hta")
    theirs = pl.from_pandas(ta.get_temporal_breakdown(visualize=False))
    assert ours["rank"].to_list() == theirs["rank"].to_list()
    for o, t in zip(ours.iter_rows(named=True), theirs.iter_rows(named=True), strict=True):
        assert _pct_close(o["window_ns"], t["kernel_time(us)"] * 1000), o["rank"]
        assert _pct_close(o["compute_ns"], t["compute_time(us)"] * 1000), o["rank"]
        assert _pct_close(o["idle_ns"], t["idle_time(us)"] * 1000), o["rank"]
        non_compute = o["comm_ns"] + o["memory_ns"] + o["other_ns"]
        assert _pct_close(non_compute, t["non_compute_time(us)"] * 1000), o["rank"]


def _overlap_vs_hta(store: Store, run: str, ta) -> None:  # type: ignore[no-untyped-def]
    ours = overlap(store, run, window="hta")["overlap_pct"].to_list()
    theirs = ta.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].tolist()
    assert ours == pytest.approx(theirs, abs=0.005)  # HTA rounds to 2 decimals


def _kernels_vs_hta(store: Store, run: str, ta) -> None:  # type: ignore[no-untyped-def]
    _, per_kernel = ta.get_gpu_kernel_breakdown(
        visualize=False, include_memory_kernels=True, num_kernels=1000, duration_ratio=1.0
    )
    theirs = pl.from_pandas(per_kernel)
    ours = kernels(store, run, per_rank=True, window="hta")
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


def _idle_vs_hta(store: Store, run: str, ta, ranks: list[int]) -> dict[tuple[int, int], int]:  # type: ignore[no-untyped-def]
    """Per (rank, stream): total idle within 1 %; returns the categories that differ."""
    theirs, _ = ta.get_idle_time_breakdown(ranks=ranks, visualize=False)
    theirs = pl.from_pandas(theirs).filter(pl.col("idle_time") > 0)
    ours = idle(store, run, window="hta")
    got = {
        (r["rank"], r["stream"], r["idle_category"]): r["idle_ns"]
        for r in ours.iter_rows(named=True)
    }
    want = {
        (r["rank"], r["stream"], r["idle_category"]): r["idle_time"] * 1000
        for r in theirs.iter_rows(named=True)
    }
    streams = {k[:2] for k in got} | {k[:2] for k in want}
    for rank, stream in streams:
        total = sum(v for k, v in got.items() if k[:2] == (rank, stream))
        assert _pct_close(total, sum(v for k, v in want.items() if k[:2] == (rank, stream)))
    return {k[:2]: 1 for k in got.keys() | want.keys() if got.get(k) != want.get(k)}


def test_dlrm_temporal_equals_hta(real_store: Store, hta_dlrm) -> None:  # type: ignore[no-untyped-def]
    _temporal_vs_hta(real_store, "dlrm", hta_dlrm)
    # the default window (device work counts to the step that launched it) has the same busy time
    ours = temporal(real_store, "dlrm")
    theirs = temporal(real_store, "dlrm", window="hta")
    assert (ours["window_ns"] - ours["idle_ns"]).to_list() == (
        theirs["window_ns"] - theirs["idle_ns"]
    ).to_list()


def test_dlrm_overlap_equals_hta(real_store: Store, hta_dlrm) -> None:  # type: ignore[no-untyped-def]
    _overlap_vs_hta(real_store, "dlrm", hta_dlrm)
    assert overlap(real_store, "dlrm")["overlap_pct"].to_list() == pytest.approx(
        overlap(real_store, "dlrm", window="hta")["overlap_pct"].to_list()
    )


def test_dlrm_kernel_stats_equal_hta(real_store: Store, hta_dlrm) -> None:  # type: ignore[no-untyped-def]
    _kernels_vs_hta(real_store, "dlrm", hta_dlrm)


def test_dlrm_idle_equals_hta(real_store: Store, hta_dlrm) -> None:  # type: ignore[no-untyped-def]
    differing = _idle_vs_hta(real_store, "dlrm", hta_dlrm, list(range(8)))
    # Kernels with no launch event in the trace: HTA's join falls back to the trace's first row
    # and compares *its* start with the previous kernel's end (docs/analysis.md); only those
    # streams differ by category, their totals agree.
    unlaunched = set(
        real_store.con.execute(
            "SELECT DISTINCT d.rank, d.stream FROM core_device_op d JOIN run USING (run_id)"
            " WHERE run.name = 'dlrm' AND d.launch_ts IS NULL"
        ).fetchall()
    )
    assert unlaunched, "the quirk this test documents is gone: tighten the test"
    assert set(differing) <= unlaunched


def test_hta_nccl_equals_hta(real_store: Store, hta_nccl) -> None:  # type: ignore[no-untyped-def]
    """Sub-µs times: with HTA's window (last step dropped, integer-µs clock) all four agree."""
    _temporal_vs_hta(real_store, "hta", hta_nccl)
    _overlap_vs_hta(real_store, "hta", hta_nccl)
    _kernels_vs_hta(real_store, "hta", hta_nccl)
    _idle_vs_hta(real_store, "hta", hta_nccl, [0])
    # prism's default keeps every step and exact ns: more device time, none clipped at a step end
    step = temporal(real_store, "hta")
    assert step["compute_ns"][0] > temporal(real_store, "hta", window="hta")["compute_ns"][0]
    launched = real_store.con.execute(
        "SELECT sum(d.dur) FILTER (WHERE kernel_type = 'compute') FROM core_device_op d"
        " JOIN run USING (run_id) WHERE run.name = 'hta' AND d.in_steps"
    ).fetchall()[0][0]
    assert step["compute_ns"][0] == launched  # one stream: the union is the sum


def test_cuda_sync_trace_equals_hta(
    shared_datasets: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """HTA-NCCL with CUDA sync events (Kineto >= 2.1): HTA's temporal window takes the syncs on a
    stream as device time, so a sync after the last kernel widens it (75.8 ms here, the window
    prism used to miss) and counts as non-compute; Event/Context Sync (stream -1) do not."""
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store
    from tests.analysis.foreign_traces import with_cuda_sync

    d = tmp_path_factory.mktemp("hta_sync")
    src = shared_datasets / "hta-nccl-rank0" / "nccl_data.json.gz"
    trace = with_cuda_sync(src, d / "nccl_sync.json", stream=7, tail_us=75_800)
    ta = _hta(d)
    with open_store(tmp_path_factory.mktemp("hta_sync_db") / "s.duckdb") as store:
        ingest(store, [trace], run="sync", progress=False)
        _temporal_vs_hta(store, "sync", ta)
        _overlap_vs_hta(store, "sync", ta)
        _kernels_vs_hta(store, "sync", ta)
        _idle_vs_hta(store, "sync", ta, [0])
        ours = temporal(store, "sync", window="hta").row(0, named=True)
        theirs = ta.get_temporal_breakdown(visualize=False).iloc[0]
        assert ours["window_ns"] == theirs["kernel_time(us)"] * 1000  # exact, not within 1 %
        assert ours["other_ns"] == 75_799_000  # the tail sync on HTA's integer-µs clock
        # prism's own window is unchanged by syncs: device work, not waiting for it
        step = temporal(store, "sync")
        assert step["other_ns"].sum() == 0

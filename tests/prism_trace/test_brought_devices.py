"""Device traces of other backends and older Kineto, built from one real DLRM rank (CUDA) by
rewriting what those writers write differently (``brought_traces``).

What would break if the device model were CUDA's only: an MTIA trace's device ops would be
stored as ``other`` (its rank analysed as a host rank: 71.6 % "compute" where HTA says 6.6 %,
no kernels, no idle, ``--window hta`` in host mode), a ROCm trace's ``hipLaunchKernel`` would
launch nothing (no launch flows, so a kernel's move is not seen), and an older trace's
``"stream 7"`` track would have no stream id (idle rows and report lanes read ``None``).
"""

from __future__ import annotations

from pathlib import Path

import brought_traces as bt
import polars as pl
import pytest
from polars.testing import assert_frame_equal
from prism_trace.analysis import idle, kernels, overlap, temporal
from prism_trace.analysis.views import load_views

from prism_trace.formats.device import SYNC_CALLS, category_sql
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store

pytestmark = pytest.mark.shared_data

_RANKS = ("worker3_step_12.1694128201557", "worker5_step_12.1694128201549")


@pytest.fixture(scope="module")
def store(shared_datasets: Path, tmp_path_factory: pytest.TempPathFactory) -> Store:
    """Runs ``cuda`` (two DLRM ranks as recorded) and their rewrites ``mtia``, ``amd``,
    ``amd_cuda_cat`` (HIP names under ``cuda_runtime``) and ``old_streams``: two files each,
    so the batch reader and the per-file reader (``--rank``-less single files) both run."""
    tmp = tmp_path_factory.mktemp("brought_devices")
    kineto = shared_datasets / "param-dlrm-8rank" / "kineto"
    src = [kineto / f"{r}.pt.trace.json.gz" for r in _RANKS]
    variants = {
        "mtia": bt.as_mtia,
        "amd": bt.as_amd,
        "amd_cuda_cat": lambda t: bt.as_amd(t, category="cuda_runtime"),
        "old_streams": bt.with_string_streams,
    }
    s = open_store(tmp / "t.duckdb")
    ingest(s, src, run="cuda", progress=False)
    for name, rewrite in variants.items():
        folder = tmp / name
        folder.mkdir()
        files = [bt.save(rewrite(bt.load(p)), folder / p.name) for p in src]
        ingest(s, files, run=name, progress=False)
    return s


def _frame(store: Store, sql: str, run: str) -> pl.DataFrame:
    run_id = f"(SELECT run_id FROM run WHERE name = '{run}')"
    return store.con.sql(sql.replace("$run", run_id)).pl()


@pytest.mark.parametrize("run", ["mtia", "amd", "amd_cuda_cat", "old_streams"])
def test_device_ops_launches_and_streams_are_cudas(store: Store, run: str) -> None:
    """Every device op keeps its category, its stream id and the launch that issued it."""
    sql = """SELECT e.rank, e.category, t.kind, t.tid AS stream, count(*) AS n
             FROM event e JOIN track t USING (run_id, rank, track_id)
             WHERE e.run_id = $run GROUP BY ALL ORDER BY ALL"""
    assert _frame(store, sql, run).equals(_frame(store, sql, "cuda"))
    flows = (
        "SELECT rank, kind, count(*) AS n FROM flow WHERE run_id = $run GROUP BY ALL ORDER BY ALL"
    )
    got = _frame(store, flows, run)
    assert got.filter(pl.col("kind") == "launch")["n"].sum() > 0
    assert got.equals(_frame(store, flows, "cuda"))
    load_views(store.con, names=["core_rank_mode"])
    modes = _frame(store, "SELECT mode FROM core_rank_mode WHERE run_id = $run", run)
    assert modes["mode"].to_list() == ["device", "device"]


@pytest.mark.parametrize("run", ["mtia", "amd", "old_streams"])
def test_hta_breakdowns_equal_the_cuda_recordings(store: Store, run: str) -> None:
    """With HTA's window the four breakdowns of a rewrite are those of the CUDA recording (which
    the HTA parity tests hold to HTA itself)."""
    for frame in (
        lambda r: temporal(store, r, window="hta"),
        lambda r: overlap(store, r, window="hta"),
        lambda r: idle(store, r, window="hta"),
        lambda r: kernels(store, r, window="hta", per_rank=True),
    ):
        got, want = frame(run), frame("cuda")
        # the same rows, up to float summation order (std over the same durations)
        assert_frame_equal(got.sort(got.columns), want.sort(want.columns), check_exact=False)
    lanes = idle(store, run, window="hta")
    assert lanes["stream"].null_count() == 0
    assert sorted(set(lanes["stream"])) == [7, 22, 24, 84]


@pytest.mark.filterwarnings("ignore::Warning")  # HTA 0.5's pandas calls that pandas deprecates
def test_hta_itself_reads_the_mtia_rewrite_as_the_cuda_one(
    shared_datasets: Path, tmp_path: Path
) -> None:
    """HTA (where installed) gives the MTIA rewrite the compute share of the CUDA rank, which is
    ours (the point of the MTIA rule: the same classes as HTA)."""
    ta = pytest.importorskip("hta.trace_analysis")
    from hta.common import trace as hta_trace

    src = shared_datasets / "param-dlrm-8rank" / "kineto" / f"{_RANKS[0]}.pt.trace.json.gz"
    (tmp_path / "m").mkdir()
    bt.save(bt.as_mtia(bt.load(src)), tmp_path / "m" / src.name)
    load = hta_trace.Trace.load_traces
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            hta_trace.Trace,
            "load_traces",
            lambda self, last=False, *a, **k: load(self, last, use_multiprocessing=False),
        )
        hta = ta.TraceAnalysis(trace_dir=str(tmp_path / "m")).get_temporal_breakdown(
            visualize=False
        )
    s = open_store(tmp_path / "t.duckdb")
    ingest(s, [tmp_path / "m" / src.name], run="m", progress=False)
    ours = temporal(s, "m", window="hta")
    assert ours["compute_pct"][0] == pytest.approx(float(hta["compute_time_pctg"][0]), abs=0.01)


def test_the_category_rule_reads_each_backends_names() -> None:
    """The rule itself, on the activity-type names Kineto writes for each backend."""
    import duckdb

    cases = {
        ("mtia_ccp_events", "Memcpy HtoD"): "memcpy",
        ("mtia_ccp_events", "fused_op"): "kernel",
        ("kernel", "Memcpy stays a kernel"): "kernel",
        ("MTIA_RUNTIME", "runFunction - job_prep_and_submit_for_execution"): "cuda_runtime",
        ("hip_runtime", "hipLaunchKernel"): "cuda_runtime",
        ("xpu_runtime", "urEnqueueKernelLaunch"): "cuda_runtime",
        ("privateuse1_driver", "x"): "cuda_driver",
        ("gpu_memset", "Memset"): "memset",
        ("mtia_insight", "x"): "other",
        ("Operator", "aten::mm"): "cpu_op",
    }
    sql = category_sql("cat", "name", "'X'")
    for (cat, name), want in cases.items():
        got = duckdb.execute(f"SELECT {sql} FROM (SELECT ? AS cat, ? AS name)", [cat, name])
        assert got.fetchall() == [(want,)], (cat, name)
    assert SYNC_CALLS["hipStreamSynchronize"] == "stream"
    assert SYNC_CALLS["hipDeviceSynchronize"] == "device"

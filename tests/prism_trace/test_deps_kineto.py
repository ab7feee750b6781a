"""Cross-stream waits recovered from ``cudaStreamWaitEvent`` when a trace has no ``cuda_sync``
flows: a hand-built rank, and the real HTA NCCL rank."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from prism_trace.graph.build import build_graph
from prism_trace.graph.kineto import kineto_graph
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import open_store
from tests.prism_trace.test_graph import EV_COLS, empty_comm, frame


def _rank(*, wait_call: bool = True, k3_ts: int = 131_000, flow: bool = False) -> tuple:
    """Thread 0: A > [launch K1 (stream 1), cudaEventRecord, cudaStreamWaitEvent, launch K3
    (stream 2)]. K1 runs 30-130 us; K3, launched at 40 us on an idle stream, starts at ``k3_ts``."""
    rows = [
        (0, 0, 0, "user_annotation", "ProfilerStep#1", 0, 1_000_000, None, None, 1),
        (0, 1, 0, "cpu_op", "A", 10_000, 100_000, None, 0, 1),
        (0, 2, 0, "cuda_runtime", "cudaLaunchKernel", 20_000, 5_000, 7, 1, 1),
        (0, 3, 0, "cuda_runtime", "cudaEventRecord", 26_000, 1_000, None, 1, 1),
        (0, 5, 0, "cuda_runtime", "cudaLaunchKernel", 40_000, 5_000, 9, 1, 1),
        (0, 10, 1, "kernel", "K1", 30_000, 100_000, 7, None, 1),
        (0, 13, 2, "kernel", "K3", k3_ts, 10_000, 9, None, 1),
    ]
    if wait_call:
        rows.append((0, 4, 0, "cuda_runtime", "cudaStreamWaitEvent", 30_000, 1_000, None, 1, 1))
    flows = [(0, "launch", 2, 10), (0, "launch", 5, 13)]
    if flow:
        rows.append((0, 12, 2, "cuda_sync", "Wait Event", 32_000, 0, None, None, 1))
        flows.append((0, "sync", 10, 12))
    tracks = frame(
        [(0, 0, "thread"), (0, 1, "stream"), (0, 2, "stream")], ["rank", "track_id", "kind"]
    )
    return (
        frame(rows, EV_COLS),
        tracks,
        frame(flows, ["rank", "kind", "src_event_id", "dst_event_id"]),
        *empty_comm(),
    )


def _waits(g: object) -> list[tuple[int, int, int]]:
    nodes = g.nodes  # type: ignore[attr-defined]
    ev = dict(zip(nodes["node_id"].to_list(), nodes["event_id"].to_list(), strict=True))
    w = g.edges.filter(pl.col("kind") == "wait")  # type: ignore[attr-defined]
    return [(ev[s], ev[d], dl) for s, d, dl in w.select("src", "dst", "delay").iter_rows()]


def test_wait_only_as_cuda_stream_wait_event() -> None:
    # K3 starts 91 us after its launch on an idle stream, 1 us after K1 ends: it waited for K1.
    assert _waits(kineto_graph(*_rank())) == [(10, 13, 1_000)]


def test_no_wait_without_the_call_or_without_a_late_start() -> None:
    assert _waits(kineto_graph(*_rank(wait_call=False))) == []
    # K3 starts right after its launch: nothing to explain, even though a wait call exists
    assert _waits(kineto_graph(*_rank(k3_ts=42_000))) == []
    # K3 starts 20 us after K1's end: not "exactly when" it ended
    assert _waits(kineto_graph(*_rank(k3_ts=150_000))) == []


def test_flows_win_when_the_trace_has_them() -> None:
    # the cuda_sync flow gives the wait (delay 0); nothing is inferred on top of it
    assert _waits(kineto_graph(*_rank(flow=True))) == [(10, 13, 0)]


@pytest.mark.shared_data
def test_hta_nccl_rank_replays_kernel_starts(shared_datasets: Path, tmp_path: Path) -> None:
    from prism_trace.replay.emulate.config import CompletionConfig, EmulationConfig
    from prism_trace.replay.emulate.driver import emulate_in_memory

    store = open_store(tmp_path / "h.duckdb")
    ingest(store, [shared_datasets / "hta-nccl-rank0"], run="h", progress=False)
    build_graph(store, "h")
    ((n,),) = store.con.execute("SELECT count(*) FROM graph_edge WHERE kind = 'wait'").fetchall()
    assert n >= 1
    cfg = EmulationConfig(completion=CompletionConfig(allow_partial=True))

    def worst_start_error() -> float:
        res, _ = emulate_in_memory(store, run="h", config=cfg)
        nodes = res.inputs.nodes
        dev = np.isin(nodes["kind"].to_numpy(), ["kernel", "memcpy", "memset"])
        start = res.timeline.start + res.inputs.origin
        return float(np.abs(start[dev] - nodes["ts"].to_numpy()[dev]).max())

    with_waits = worst_start_error()
    store.con.execute("DELETE FROM graph_edge WHERE kind = 'wait'")
    without = worst_start_error()
    # every device op within 0.1 ms of its recorded start; without the waits one starts early
    assert with_waits < 100_000
    assert without > 4 * with_waits


@pytest.mark.shared_data
def test_hta_nccl_rank_validates_with_partial_instances(
    shared_datasets: Path, tmp_path: Path
) -> None:
    from prism_trace.replay import validate_run

    from prism_trace.errors import PrismError

    store = open_store(tmp_path / "h.duckdb")
    ingest(store, [shared_datasets / "hta-nccl-rank0"], run="h", progress=False)
    with pytest.raises(PrismError, match="--partial"):
        validate_run(store, run="h")
    d = validate_run(store, run="h", allow_partial=True).as_dict()
    assert d["replay_iteration_time_error_pct"] < 0.1
    assert d["replay_op_start_error_p99_pct"] < 1.0  # measured 0.011 %
    assert d["replay_comm_time_error_pct"] < 1.0  # measured 0.0000 %
    assert d["slice_iteration_time_error_pct"] is None


@pytest.mark.shared_data
def test_validate_partial_has_one_meaning_under_both_names(
    shared_datasets: Path, tmp_path: Path
) -> None:
    """`validate --partial` is emulate's spelling; the old `--allow-partial` still works."""
    from click.testing import CliRunner

    from prism_trace.cli import main

    db = tmp_path / "h.duckdb"
    store = open_store(db)
    ingest(store, [shared_datasets / "hta-nccl-rank0"], run="h", progress=False)
    store.con.close()
    runner = CliRunner()
    refused = runner.invoke(main, ["validate", str(db), "--run", "h", "--json"])
    assert refused.exit_code != 0
    assert "--partial" in refused.output
    outs = [
        runner.invoke(main, ["validate", str(db), "--run", "h", flag, "--json"])
        for flag in ("--partial", "--allow-partial")
    ]
    assert [o.exit_code for o in outs] == [0, 0], [o.output for o in outs]
    new, old = (json.loads(o.output) for o in outs)
    assert new["replay_iteration_time_error_pct"] == old["replay_iteration_time_error_pct"]
    assert new["slice_iteration_time_error_pct"] is None

"""Critical path across ranks: exact accounting, tight constraints on emulated runs, the raw ST
parquet, and what-ifs through the emulator (slowing an op on the path moves the step)."""

from __future__ import annotations

import itertools
import json
import shutil
from collections import defaultdict
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from prism_trace.analysis import critical_path, critical_path_shares, critical_path_summary
from prism_trace.replay import emulate_run

from prism_trace.errors import RunStateError
from prism_trace.store.connection import Store, open_store

ST = "megatron-straggler-st-8rank"


@pytest.fixture(scope="module")
def st_store(st_emulated_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Store:
    """ST as `st` (with its graph) and its emulation `st_emu`: the module's own copy of the
    conftest template (writable: the what-if test)."""
    from tests.conftest import copy_of_template

    return open_store(copy_of_template(st_emulated_template, tmp_path_factory, "cp_st"))


@pytest.fixture(scope="module")
def derived(
    real_store: Store, sample_store: Store, tmp_path_factory: pytest.TempPathFactory
) -> Store:
    """Copies of the DLRM and sample stores with their graphs and emulations."""
    tmp = tmp_path_factory.mktemp("cp_derived")
    shutil.copy(real_store.path, tmp / "r.duckdb")
    s = open_store(tmp / "r.duckdb")
    emulate_run(s, run="dlrm", out_run="dlrm_emu")
    shutil.copy(sample_store.path, tmp / "s.duckdb")
    with open_store(tmp / "s.duckdb") as ss:
        emulate_run(ss, run="sample", out_run="sample_emu")
    return s


def _check_accounting(path: pl.DataFrame) -> None:
    """Per iteration: the parts and gaps add up to the path; rows follow each other in time."""
    for (it,), p in path.group_by("iteration"):
        p = p.sort("step")
        first, last = p.row(0, named=True), p.row(-1, named=True)
        assert first["reason"] == "start", it
        total = last["path_ts"] + last["path_ns"] - first["path_ts"]
        assert p["path_ns"].sum() + p["gap_ns"].sum() == total, it
        assert (p["path_ns"] >= 0).all()
        assert (p["path_ts"] >= p["ts"]).all()  # the on-path part lies inside the node
        assert (p["path_ts"] + p["path_ns"] <= p["ts"] + p["dur"]).all()
        # A rank change happens only where a communication's last arriver bound the node.
        change = p.filter(pl.col("rank") != pl.col("rank").shift(1)).slice(1)
        assert (change["reason"] == "comm-last-arriver").all(), it


def test_st_path_accounts_for_the_iteration(st_store: Store, shared_datasets: Path) -> None:
    path = critical_path(st_store, "st")
    _check_accounting(path)
    summary = critical_path_summary(st_store, "st")
    assert summary.height == 32
    assert (summary["path_pct"] > 99.5).all()  # from the first all-gather to the last optimizer
    assert (summary["path_ns"] <= summary["span_ns"]).all()
    assert (summary["busy_ns"] + summary["gap_ns"] == summary["path_ns"]).all()
    # Independent: the path ends with the step's last op, as the raw parquet has it.
    t = pq.read_table(shared_datasets / ST / "trace-ST.parquet").to_pydict()
    last_end: dict[int, float] = defaultdict(float)
    compute: dict[int, list[float]] = defaultdict(list)
    for step, stage, op, start, dur in zip(
        t["step"], t["stage"], t["optype"], t["start_ts"], t["duration"], strict=True
    ):
        last_end[step] = max(last_end[step], start + dur)
        if op in ("forward-compute", "backward-compute"):
            compute[stage].append(dur)
    it_ts = dict(
        st_store.con.sql(
            "SELECT iteration, min(ts) FROM iteration WHERE run_id ="
            " (SELECT run_id FROM run WHERE name = 'st') GROUP BY ALL"
        ).fetchall()
    )
    for (it,), p in path.group_by("iteration"):
        end = p["path_ts"][-1] + p["path_ns"][-1] - it_ts[it]
        assert end == pytest.approx(last_end[it] * 1e9, abs=1000), it
    # Independent: the slowest stage by mean compute op (raw) holds most of the path's compute.
    slowest = max(compute, key=lambda s: sum(compute[s]) / len(compute[s]))
    stage_of = {r: r // 2 for r in range(8)}  # dp2 x pp4
    on_path = (
        path.filter(pl.col("name").str.ends_with("-compute"))
        .with_columns(pl.col("rank").replace_strict(stage_of).alias("stage"))
        .group_by("stage")
        .agg(pl.col("path_ns").sum())
        .sort("path_ns", descending=True)
    )
    assert on_path["stage"][0] == slowest == 3
    # Under Megatron's dependencies (prism_trace.graph.deps_op_timeline) the path runs the
    # pipeline's forwards down to the last stage and that stage's backwards: forward-compute leads,
    # as in StragglerAnalysis's own decomposition of ST (S_t forward 1.087 > backward 1.074).
    shares = critical_path_shares(st_store, "st", by="name")["name"].to_list()
    assert shares[:2] == ["forward-compute", "backward-compute"]


def test_emulated_path_is_tight(st_store: Store) -> None:
    """Emulated times are exact max-plus: every link of the path is a tight constraint."""
    path = critical_path(st_store, "st_emu")
    _check_accounting(path)
    edges = {
        (r, s, d): delay
        for r, s, d, delay in st_store.con.sql(
            "SELECT rank, src, dst, delay FROM graph_edge"
            " WHERE run_id = (SELECT run_id FROM run WHERE name = 'st')"
        ).fetchall()
    }
    for (_,), p in path.group_by("iteration"):
        rows = p.sort("step").to_dicts()
        for prev, row in itertools.pairwise(rows):
            if row["reason"] in ("program", "stream", "data"):  # previous end + the edge delay
                assert row["gap_ns"] == edges[(row["rank"], prev["node_id"], row["node_id"])]
            else:  # the last arriver's arrival is where the waiting node's path part starts
                assert row["reason"] == "comm-last-arriver"
                assert row["gap_ns"] == 0
                assert prev["path_ns"] == 0
                assert row["path_ts"] == prev["ts"]


def test_slowing_an_op_on_the_path_moves_the_step(st_store: Store) -> None:
    """What-if through the emulator (independent code): +50 ms on a path op moves the step by
    50 ms; on an op with more slack than that, not at all."""
    path = critical_path(st_store, "st_emu", iteration=23)
    on = path.filter(pl.col("name") == "backward-compute").row(0, named=True)
    on_ids = set(zip(path["rank"], path["node_id"], strict=True))
    delta = 50_000_000

    def step_after(rank: int, node: int) -> int:
        con = st_store.con
        con.execute(
            "UPDATE graph_node SET dur = dur + ? WHERE rank = ? AND node_id = ?"
            " AND run_id = (SELECT run_id FROM run WHERE name = 'st')",
            [delta, rank, node],
        )
        try:
            emulate_run(st_store, run="st", out_run="st_whatif", replace=True)
        finally:
            con.execute(
                "UPDATE graph_node SET dur = dur - ? WHERE rank = ? AND node_id = ?"
                " AND run_id = (SELECT run_id FROM run WHERE name = 'st')",
                [delta, rank, node],
            )
        ((end,),) = con.execute(
            "SELECT max(ts + dur) FROM iteration WHERE iteration = 23"
            " AND run_id = (SELECT run_id FROM run WHERE name = 'st_whatif')"
        ).fetchall()
        return int(end)

    ((base,),) = st_store.con.execute(
        "SELECT max(ts + dur) FROM iteration WHERE iteration = 23"
        " AND run_id = (SELECT run_id FROM run WHERE name = 'st_emu')"
    ).fetchall()
    assert step_after(on["rank"], on["node_id"]) - base == pytest.approx(delta, abs=10_000)
    # Off the path: the first forward of stage 1's dp-1 replica (rank 3), which has slack.
    off = st_store.con.sql(
        "SELECT rank, event_id FROM event WHERE iteration = 23 AND rank = 3"
        " AND name = 'forward-compute' AND run_id = (SELECT run_id FROM run WHERE name = 'st_emu')"
        " ORDER BY ts LIMIT 1"
    ).fetchall()[0]
    assert off not in on_ids
    assert step_after(*off) - base < delta


def test_dlrm_path_crosses_ranks_through_the_all_to_all(derived: Store) -> None:
    """Recorded: a host op blocked in a copy that waited for an all-to-all, whose last arriver
    is another rank. The trace has no event flows: the copy's wait on the NCCL stream is a
    ``wait`` edge recovered from its ``cudaStreamWaitEvent`` (prism_trace.graph.deps_kineto)."""
    path = critical_path(derived, "dlrm")
    _check_accounting(path)
    assert {"comm-last-arriver", "sync", "launch", "program", "wait"} <= set(path["reason"])
    jump = path.filter(pl.col("reason") == "comm-last-arriver")
    assert jump["name"].str.starts_with("ncclKernel").all()  # NCCL kernels are the sync nodes
    assert path["rank"].n_unique() >= 2
    # Emulated: the graph has no such wait, so the copy did not wait; times are exact, nothing
    # needs inferring, and the path is the host program of one rank.
    emu = critical_path(derived, "dlrm_emu")
    _check_accounting(emu)
    assert "inferred-wait" not in set(emu["reason"])


def test_sample_emulated_path_and_missing_graph(derived: Store, sample_store: Store) -> None:
    s = open_store(Path(derived.path).parent / "s.duckdb", read_only=True)
    try:
        path = critical_path(s, "sample_emu")
        _check_accounting(path)
        summary = critical_path_summary(s, "sample_emu")
        assert summary["iteration"].to_list() == [1, 2]
        assert (summary["ranks"] >= 2).all()  # gloo collectives and pp sends join the ranks
        shares = critical_path_shares(s, "sample_emu", by="kind")
        assert shares["share_pct"].sum() == pytest.approx(100.0)
    finally:
        s.close()
    with pytest.raises(RunStateError, match="prism graph"):
        critical_path(sample_store, "sample")  # recorded, read-only, never graphed
    json.dumps(summary.to_dicts())  # plain values only


@pytest.fixture(scope="module")
def resnet_store(shared_datasets: Path, tmp_path_factory: pytest.TempPathFactory) -> Store:
    """PARAM's single-GPU ResNet, first 5 steps, with ProfilerStep (`steps`) and without
    (`plain`), both with their graphs."""
    from prism_trace.graph.build import build_graph
    from prism_trace.ingestion.pipeline import ingest
    from tests.analysis.foreign_traces import resnet_steps

    d = tmp_path_factory.mktemp("resnet_cp")
    store = open_store(d / "r.duckdb")
    for run, marked in (("steps", True), ("plain", False)):
        trace = resnet_steps(shared_datasets, d / f"{run}.json", profiler_steps=marked)
        ingest(store, [trace], run=run, rank=0, progress=False)
        build_graph(store, run)
    return store


def test_single_gpu_path_covers_the_step_through_the_host(resnet_store: Store) -> None:
    """The first step waits 1.9 s on the data loader (host-bound); the later ones start with a
    copy queued behind the previous step's kernels. The path covers each step and its host time
    is host time, not kernels (was: 10 % and 36-65 % of the step, all of it `compute_ns`)."""
    summary = critical_path_summary(resnet_store, "steps")
    assert summary.height == 5
    assert (summary["path_pct"] > 99.9).all()
    first = summary.row(0, named=True)
    assert first["host_ns"] > 0.8 * first["path_ns"]  # the data loader, on the host
    assert first["compute_ns"] < 0.1 * first["path_ns"]
    assert (
        summary["busy_ns"] == summary["host_ns"] + summary["compute_ns"] + summary["comm_ns"]
    ).all()
    path = critical_path(resnet_store, "steps")
    _check_accounting(path)
    # later steps: the wait for the previous step's kernels is named, and the path goes on
    # through the host op that launched the copy
    carried = path.filter(pl.col("reason") == "carried-over")
    assert carried.height >= 3
    assert (carried["kind"] != "host").all()


def test_trace_without_profiler_step_has_one_whole_trace_path(resnet_store: Store) -> None:
    """No ProfilerStep: HTA's rule is the whole trace as the window; the path covers it (was:
    "nothing for run")."""
    summary = critical_path_summary(resnet_store, "plain")
    assert summary.height == 1
    row = summary.row(0, named=True)
    assert row["iteration"] is None
    assert row["path_pct"] > 99.9
    span = resnet_store.con.execute(
        "SELECT max(ts + dur) - min(ts) FROM graph_node JOIN run USING (run_id)"
        " WHERE run.name = 'plain'"
    ).fetchall()[0][0]
    assert row["span_ns"] == span
    path = critical_path(resnet_store, "plain")
    assert path["iteration"].null_count() == path.height
    _check_accounting(path.with_columns(pl.lit(-1).alias("iteration")))
    assert critical_path_shares(resnet_store, "plain", by="kind")["path_ns"].sum() == row["busy_ns"]


def test_host_time_on_the_path_is_not_compute(real_store: Store, tmp_path: Path) -> None:
    """HTA-NCCL's path runs on the host (the GPU trails far behind it): host ops are
    `host_ns`, not `compute_ns` (was: all 102.7 ms of host ops counted as compute)."""
    from prism_trace.graph.build import build_graph

    shutil.copy(real_store.path, tmp_path / "h.duckdb")
    with open_store(tmp_path / "h.duckdb") as s:
        build_graph(s, "hta")
        summary = critical_path_summary(s, "hta")
        path = critical_path(s, "hta")
    host = path.filter(pl.col("kind") == "host").group_by("iteration").agg(pl.col("path_ns").sum())
    got = summary.join(host, on="iteration", suffix="_host")
    assert (got["host_ns"] == got["path_ns_host"]).all()
    assert (got["host_ns"] > 0).all()
    assert (got["compute_ns"] + got["host_ns"] + got["comm_ns"] == got["busy_ns"]).all()

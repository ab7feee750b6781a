"""Selection (--iteration, --ranks, --window), op timelines, and the straggler ranking against
the critical path on runs with a known straggler."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner
from prism_trace.analysis import (
    analyze,
    critical_path_shares,
    idle,
    kernels,
    overlap,
    skew,
    temporal,
)

from prism_trace.cli import main
from prism_trace.errors import SelectionError, UsageError
from prism_trace.graph.build import build_graph
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store

STEP_S = 1.0


def _dp_timeline(folder: Path, *, slow_rank: int, factor: float, steps: int = 4) -> Path:
    """A 4-rank data-parallel op timeline where ``slow_rank`` computes ``factor`` times slower.

    Each step: forward and backward compute, then a gradient reduce-scatter that every rank
    leaves when the last one arrives (so the others wait for the slow rank).
    """
    rows = []
    for step in range(steps):
        ends = {}
        for rank in range(4):
            f = factor if rank == slow_rank else 1.0
            fwd, bwd = 0.2 * f, 0.4 * f
            rows.append((rank, 0, rank, step, "forward-compute", 0.0, fwd))
            rows.append((rank, 0, rank, step, "backward-compute", fwd, bwd))
            ends[rank] = fwd + bwd
        last = max(ends.values())
        for rank in range(4):
            rows.append(
                (rank, 0, rank, step, "grads-reduce-scatter", ends[rank], last - ends[rank] + 0.01)
            )
    df = pl.DataFrame(
        rows,
        schema={
            "dp_rank": pl.Int64,
            "stage": pl.Int64,
            "rank": pl.Int64,
            "step": pl.Int64,
            "optype": pl.Utf8,
            "start_ts": pl.Float32,
            "duration": pl.Float32,
        },
        orient="row",
    )
    folder.mkdir(parents=True, exist_ok=True)
    df.write_parquet(folder / "trace-DP.parquet")
    (folder / "meta-DP.yaml").write_text(
        "dp_size: 4\npp_size: 1\ntp_size: 1\nworld_size: 4\n", encoding="utf-8"
    )
    return folder


@pytest.fixture(scope="module")
def straggler_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """Run `dp` (rank 2 computes 1.5 times slower), with its execution graph."""
    tmp = tmp_path_factory.mktemp("straggler")
    db = tmp / "s.duckdb"
    with open_store(db) as s:
        ingest(s, [_dp_timeline(tmp / "dp", slow_rank=2, factor=1.5)], run="dp", progress=False)
        build_graph(s, "dp")
    return open_store(db, read_only=True)


def test_parse_ranks() -> None:
    from prism_trace.ranks import parse_ranks

    assert parse_ranks("0,3,5-7") == [0, 3, 5, 6, 7]
    assert parse_ranks("2..4, 2") == [2, 3, 4]
    for bad in ("x", "5-3", ","):
        with pytest.raises(UsageError):
            parse_ranks(bad)


def test_op_timeline_compute_and_comm(straggler_store: Store) -> None:
    t = temporal(straggler_store, "dp")
    assert set(t["mode"]) == {"timeline"}
    slow = t.filter(pl.col("rank") == 2).row(0, named=True)
    fast = t.filter(pl.col("rank") == 0).row(0, named=True)
    # compute ops are compute, the reduce-scatter is communication; the slow rank computes more
    # and waits less
    assert slow["compute_ns"] == pytest.approx(4 * 0.9e9, rel=1e-3)
    assert fast["compute_ns"] == pytest.approx(4 * 0.6e9, rel=1e-3)
    assert fast["comm_ns"] > slow["comm_ns"] > 0
    for row in t.iter_rows(named=True):
        parts = sum(row[f"{p}_ns"] for p in ("compute", "comm", "memory", "other", "idle"))
        assert parts == row["window_ns"]
    ov = overlap(straggler_store, "dp")
    # compute and the collective never run together (up to the file's float32 seconds)
    assert (ov["overlap_ns"] < 1000).all()
    assert ov["comm_ns"].to_list() == pytest.approx(t["comm_ns"].to_list(), abs=1000)


def test_selection_filters_and_refuses_what_is_not_there(straggler_store: Store) -> None:
    one = temporal(straggler_store, "dp", iteration=1, ranks=[1, 2])
    assert one["rank"].to_list() == [1, 2]
    assert one["iteration"].to_list() == [1, 1]
    per_it = temporal(straggler_store, "dp", by="iteration")
    assert per_it.height == 16
    assert skew(straggler_store, "dp", ranks=[2])["rank"].to_list() == [2]
    assert skew(straggler_store, "dp", iteration=3)["calls"].to_list() == [1, 1, 1, 1]
    with pytest.raises(SelectionError, match="no iteration 9"):
        analyze(straggler_store, "temporal", "dp", iteration=9)
    with pytest.raises(SelectionError, match="none of ranks 7-8"):
        analyze(straggler_store, "skew", "dp", ranks=[7, 8])
    with pytest.raises(UsageError, match="no --iteration"):
        temporal(straggler_store, "dp", window="hta", iteration=1)
    # op timelines have no device streams: idle and kernels are empty, not an error
    assert idle(straggler_store, "dp").is_empty()
    assert kernels(straggler_store, "dp").is_empty()


def test_cli_selection_and_json_numbers(straggler_store: Store) -> None:
    db = str(straggler_store.path)
    runner = CliRunner()
    res = runner.invoke(
        main, ["analyze", db, "temporal", "--run", "dp", "--iteration", "1", "--json"]
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert all(isinstance(r["compute_pct"], float) for r in rows)
    assert all(isinstance(r["window_ns"], int) for r in rows)
    res = runner.invoke(main, ["analyze", db, "kernels", "--run", "dp", "--iteration", "42"])
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [
        "error: run 'dp' has no iteration 42 (its iterations: 0-3)"
    ]
    res = runner.invoke(main, ["analyze", db, "idle", "--run", "dp", "--ranks", "0-1"])
    assert res.exit_code == 0
    assert "idle: nothing for run 'dp', ranks 0-1" in res.output


def test_injected_straggler_ranks_first_as_on_the_critical_path(straggler_store: Store) -> None:
    ranking = skew(straggler_store, "dp")
    assert ranking["rank"][0] == 2
    on_path = critical_path_shares(straggler_store, "dp", by="rank").sort(
        "path_ns", descending=True
    )
    assert on_path["rank"][0] == 2


@pytest.mark.shared_data
def test_st_last_stage_is_the_straggler(shared_datasets: Path, tmp_path: Path) -> None:
    """ST's straggler is its last stage (StragglerAnalysis: stage 3 slowdown 1.23, others
    below 1): the skew ranking puts its ranks (6, 7) first, the critical path that stage."""
    db = tmp_path / "st.duckdb"
    with open_store(db) as s:
        ingest(s, [shared_datasets / "megatron-straggler-st-8rank"], run="st", progress=False)
        build_graph(s, "st")
        ranking = skew(s, "st")
        assert set(ranking["rank"][:2]) == {6, 7}
        on_path = critical_path_shares(s, "st", by="rank").sort("path_ns", descending=True)
        # The path crosses every stage (the warm-up forwards run down the pipeline), but the last
        # stage holds the most of it, and its rank on the path most often leads.
        assert on_path["rank"][0] in {6, 7}
        by_stage = on_path.group_by(pl.col("rank") // 2).agg(pl.col("path_ns").sum())
        assert by_stage.sort("path_ns", descending=True)["rank"][0] == 3
        t = temporal(s, "st")
        assert set(t["mode"]) == {"timeline"}
        assert (t["compute_pct"] > 30).all()


@pytest.mark.slow
@pytest.mark.shared_data
def test_device_work_past_the_step_end_counts_to_its_step(
    shared_datasets: Path, tmp_path: Path
) -> None:
    """A compute kernel launched in step 4 that runs 20 ms past the ProfilerStep end is not
    clipped: step 4's window stretches to its end, step 5's starts there, and temporal's compute
    equals the kernel breakdown's compute time."""
    db = tmp_path / "h.duckdb"
    with open_store(db) as s:
        ingest(s, [shared_datasets / "hta-nccl-rank0"], run="hta", progress=False)
        rid = s.require_run("hta")
        end4, start5 = s.con.execute(
            "SELECT max(ts + dur) FILTER (WHERE iteration = 4),"
            " min(ts) FILTER (WHERE iteration = 5) FROM iteration WHERE run_id = $1",
            [rid],
        ).fetchall()[0]
        before = temporal(s, "hta", by="iteration")
        # the last compute kernel launched in step 4 now ends 20 ms past the step's end
        (eid, ts) = s.con.execute(
            "SELECT event_id, ts FROM event WHERE run_id = $1 AND category = 'kernel'"
            " AND iteration = 4 AND NOT regexp_matches(name, '^nccl')"
            " ORDER BY ts DESC LIMIT 1",
            [rid],
        ).fetchall()[0]
        new_end = end4 + 20_000_000
        s.con.execute(
            "UPDATE event SET dur = $3 - ts WHERE run_id = $1 AND event_id = $2",
            [rid, eid, new_end],
        )
        after = temporal(s, "hta", by="iteration")
        w4 = after.filter(pl.col("iteration") == 4).row(0, named=True)
        b4 = before.filter(pl.col("iteration") == 4).row(0, named=True)
        assert w4["window_ns"] == new_end - (end4 - b4["window_ns"])  # stretched to the kernel
        assert w4["compute_ns"] > b4["compute_ns"] + 19_000_000
        w5 = after.filter(pl.col("iteration") == 5).row(0, named=True)
        assert w5["window_ns"] < before.filter(pl.col("iteration") == 5)["window_ns"][0]
        assert new_end > start5 > ts  # the kernel really runs into step 5's time
        k = kernels(s, "hta", per_rank=True, iteration=4).filter(pl.col("kernel_type") == "compute")
        # one compute stream: step 4's union of compute is the sum of its kernels
        assert w4["compute_ns"] == k["total_ns"].sum()


@pytest.mark.slow
def test_cli_points_at_the_class_exemplar(tmp_path: Path, sample_template: Path) -> None:
    """Ranks of an emulated run that store no events: the one line names their exemplars."""
    from prism_trace.replay import emulate_run

    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.slicer import slice_run
    from tests.conftest import sample_copy

    db = tmp_path / "e.duckdb"
    with sample_copy(sample_template, db) as s:
        layout = ParallelLayout.parse("tp=2,dp=8,pp=2")
        slice_run(s, run="sample", layout=layout, world=32, out_run="s32")
        emulate_run(s, run="s32", out_run="s32_emu")
        stored = {
            r[0]
            for r in s.con.execute(
                "SELECT DISTINCT rank FROM event e JOIN run USING (run_id)"
                " WHERE run.name = 's32_emu'"
            ).fetchall()
        }
    missing = next(r for r in range(32) if r not in stored)
    res = CliRunner().invoke(
        main, ["analyze", str(db), "temporal", "--run", "s32_emu", "--ranks", str(missing)]
    )
    assert res.exit_code == 0, res.output
    assert "stores events only for class exemplars: for these ranks, ask for rank" in res.output

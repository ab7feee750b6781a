"""Per-rank, per-step waits, lateness and peak memory of an emulated run (``replay.rank_step``).

What would break if ``rank_step`` were wrong: its waits would disagree with the
``comm_collective_wait`` view over the same emulated calls, the replica vector and the expanded
units (two emulation paths, one table) would write different rows, or a slow replica would not
show up as the late one while every other replica waits for it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from prism_trace.analysis.stragglers import collective_waits
from prism_trace.replay.emulate import frames as emulate_frames
from prism_trace.replay.emulate import prepare as emulate_prepare
from prism_trace.replay.emulate import rank_step
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.driver import emulate_in_memory, emulate_run
from prism_trace.replay.emulate.rank_step import rank_step_rows, rank_steps
from prism_trace.replay.whatif.config import parse_what_if

from prism_trace.cli import main
from prism_trace.layout.mesh import ParallelLayout
from prism_trace.store.connection import Store


@pytest.fixture(scope="module")
def store(sliced_sample_store: Store) -> Store:
    """The sample with its graph and the slices `s4` and `s2048` (`tp=2,dp=N,pp=2`; the conftest
    store also holds `s16384`, which this module does not use)."""
    return sliced_sample_store


def test_sums_per_unit_step_and_column(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two units, two columns; instance 0 is shared by the columns, instance 1 is not.
    start = np.array([[10, 30], [20, 20], [5, 7], [9, 3]])
    arrival = np.array([[30, 30], [9, 7]])
    s = rank_steps(
        start,
        arrival,
        sync_node=np.array([0, 1, 2, 3]),
        instance=np.array([0, 0, 1, 1]),
        unit=np.array([0, 1, 0, 1]),
        iteration=np.array([1, 1, 1, -1]),
        shared=np.array([True, False]),
    )
    assert s.unit.tolist() == [0, 1]
    assert s.calls.tolist() == [2, 1]  # unit 1's call without a step is left out
    # unit 0: instance 0 waits 30-10 / 30-30, late 10-10 / 30-10; instance 1: 9-5 / 7-7, 0 / 4
    assert s.wait.tolist() == [[24, 0], [10, 10]]
    assert s.late.tolist() == [[0, 24], [10, 10]]
    monkeypatch.setattr(rank_step, "_BLOCK", 1)  # a block per column: the same sums
    again = rank_steps(
        start,
        arrival,
        sync_node=np.array([0, 1, 2, 3]),
        instance=np.array([0, 0, 1, 1]),
        unit=np.array([0, 1, 0, 1]),
        iteration=np.array([1, 1, 1, -1]),
        shared=np.array([True, False]),
    )
    assert np.array_equal(again.wait, s.wait)
    assert np.array_equal(again.late, s.late)
    rows = rank_step_rows(s, rank_of=np.array([[0, 2], [1, 3]]), column_of=np.array([0, 1]))
    rows = rows.sort("rank")
    assert rows["rank"].to_list() == [0, 1, 2, 3]
    assert rows["wait_ns"].to_list() == [24, 10, 0, 10]
    assert rows["peak_allocated"].null_count() == 4


def test_the_scalar_path_agrees_with_the_wait_view(store: Store) -> None:
    rep = emulate_run(store, run="sample", out_run="emu")
    mine = store.con.sql(
        "SELECT rank, iteration, comm_calls, wait_ns, late_ns, peak_allocated FROM rank_step"
        " WHERE run_id = $1 ORDER BY rank, iteration",
        params=[rep.run_id],
    ).pl()
    assert mine.height == 8 * 2
    view = (
        collective_waits(store, "emu")
        .group_by(pl.col("rank").cast(pl.Int32), pl.col("iteration").cast(pl.Int32))
        .agg(
            pl.len().cast(pl.Int32).alias("n"),
            pl.col("wait_ns").sum().cast(pl.Int64).alias("w"),
            pl.col("lateness_ns").sum().cast(pl.Int64).alias("l"),
        )
    )
    j = mine.join(view, on=["rank", "iteration"], how="full", coalesce=True)
    assert j.height == mine.height
    assert (j["comm_calls"] == j["n"]).all()
    assert (j["wait_ns"] == j["w"]).all()
    assert (j["late_ns"] == j["l"]).all()
    assert mine["wait_ns"].sum() > 0
    peaks = store.con.sql(
        "SELECT rank, iteration, max(total_allocated) AS p FROM memory WHERE run_id = $1"
        " GROUP BY ALL",
        params=[rep.run_id],
    ).pl()
    j = mine.join(peaks.cast({"rank": pl.Int32, "iteration": pl.Int32}), on=["rank", "iteration"])
    assert j.height == mine.height
    assert (j["peak_allocated"] == j["p"]).all()


def test_vector_and_expanded_units_write_the_same_rows(store: Store) -> None:
    cfg = EmulationConfig(what_if=parse_what_if(["slow-ranks=0,9@1.3"]))
    res, _ = emulate_in_memory(store, run="s4", config=cfg)
    assert res.replicas is not None
    eligible = emulate_prepare.vector_eligible
    try:
        emulate_prepare.vector_eligible = lambda w: False  # the expanded units instead
        res_x, _ = emulate_in_memory(store, run="s4", config=cfg)
    finally:
        emulate_prepare.vector_eligible = eligible
    assert res_x.replicas is None
    vec = emulate_frames._rank_step_rows(res, 1).sort("rank", "iteration")
    exp = emulate_frames._rank_step_rows(res_x, 1).sort("rank", "iteration")
    assert vec.height == 16 * 2
    assert vec.equals(exp)


def test_every_rank_at_8192_and_the_slow_replica_is_late(store: Store) -> None:
    cfg = EmulationConfig(what_if=parse_what_if(["slow-ranks=13@1.5"]))
    rep = emulate_run(store, run="s2048", out_run="slow8192", config=cfg)
    rows = store.con.sql(
        "SELECT rank, sum(wait_ns) AS wait, sum(late_ns) AS late FROM rank_step"
        " WHERE run_id = $1 GROUP BY rank ORDER BY rank",
        params=[rep.run_id],
    ).pl()
    assert rows.height == 8192
    layout = ParallelLayout.parse("tp=2,dp=2048,pp=2")
    c = layout.coords(rows["rank"].to_numpy())
    mine = layout.coords(np.array([13]))
    same = (c["tp"] == mine["tp"][0]) & (c["pp"] == mine["pp"][0])
    peers = rows.filter(pl.Series(same) & (pl.col("rank") != 13))
    slow = rows.filter(pl.col("rank") == 13)
    assert peers.height == 2047
    # rank 13 arrives late at the data-parallel collectives of its class, the others wait for it
    assert slow["late"][0] > peers["late"].max()
    assert slow["wait"][0] < peers["wait"].min()
    assert peers["wait"].n_unique() == 1  # the 2047 identical replicas share one column


def test_skew_and_the_report_draw_on_rank_step(store: Store, tmp_path: Path) -> None:
    from prism_trace.analysis import analyze
    from prism_trace.analysis.report.html import write_report
    from prism_trace.analysis.report.sections import ReportLimits

    if store.run_id("slow8192") is None:
        cfg = EmulationConfig(what_if=parse_what_if(["slow-ranks=13@1.5"]))
        emulate_run(store, run="s2048", out_run="slow8192", config=cfg)
    frames = analyze(store, "skew", "slow8192", ranks=[12, 13, 14, 15, 17])
    every = frames["rank_step"]
    assert every["rank"].to_list()[0] == 13  # the slow rank arrived latest of the selection
    assert every.height == 5
    assert "rank_step" not in analyze(store, "skew", "sample")  # a recorded run has none
    out = tmp_path / "r.html"
    rep = write_report(store, run="slow8192", out=out, limits=ReportLimits(heatmap_cells=4000))
    text = out.read_text()
    assert "from the rank_step table" in text
    assert any("2000 of 8192 ranks shown" in n for n in rep.notes)
    store.con.execute("CHECKPOINT")
    copy = tmp_path / "copy.duckdb"  # the CLI opens the file read-only: not beside this handle
    shutil.copy(store.path, copy)
    out = CliRunner().invoke(
        main, ["analyze", str(copy), "skew", "--run", "slow8192", "--ranks", "13"]
    )
    assert out.exit_code == 0, out.output
    assert "rank_step: every rank of the world, from the rank_step table" in out.output


@pytest.mark.parametrize("cols", [1, 3])
def test_a_run_without_collectives_has_no_rows_and_no_crash(cols: int) -> None:
    """A single-GPU training step has nodes but no collective instance: the empty ``arrival``
    says nothing of the columns (``reshape(0, -1)`` raised "cannot reshape array of size 0"),
    so they come from ``start``."""
    start = np.arange(5 * cols, dtype=np.int64).reshape(5, cols) if cols > 1 else np.arange(5)
    empty = np.zeros(0, dtype=np.int64)
    got = rank_steps(start, empty, sync_node=empty, instance=empty, unit=empty, iteration=empty)
    assert got.unit.size == 0
    assert got.wait.shape == (0, cols)
    assert got.late.shape == (0, cols)

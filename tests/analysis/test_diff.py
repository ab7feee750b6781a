"""Run diff: recorded vs emulated (ST, DLRM, sample), a synthetic slowdown that the diff must
name, ordinal alignment, and the `prism analyze ... diff` command."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
from click.testing import CliRunner
from prism_trace.analysis import analyze, run_diff
from prism_trace.replay import emulate_run

from prism_trace.cli import main
from prism_trace.errors import RunNotFoundError
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store

ST = "megatron-straggler-st-8rank"
SLOW = 1.2


@pytest.fixture(scope="module")
def st_store(shared_datasets: Path, tmp_path_factory: pytest.TempPathFactory) -> Store:
    """ST as `st`, its emulation `st_emu`, and `slow`: a copy of ST whose backward-compute ops
    take 20 % longer, with its emulation `slow_emu`; reopened read-only."""
    db = tmp_path_factory.mktemp("diff_st") / "st.duckdb"
    with open_store(db) as s:
        ingest(s, [shared_datasets / ST], run="st", progress=False)
        _copy_run(s, "st", "slow")
        s.con.execute(
            "UPDATE event SET dur = CAST(round(dur * ?) AS BIGINT) WHERE name = 'backward-compute'"
            " AND run_id = (SELECT run_id FROM run WHERE name = 'slow')",
            [SLOW],
        )
        emulate_run(s, run="st", out_run="st_emu")
        emulate_run(s, run="slow", out_run="slow_emu")
    return open_store(db, read_only=True)


def _copy_run(store: Store, src: str, name: str) -> None:
    """A second recorded run with the rows of ``src`` (a re-ingest of the file is refused)."""
    con = store.con
    old = store.require_run(src)
    ((new,),) = con.execute("SELECT max(run_id) + 1 FROM run").fetchall()
    con.execute(
        "INSERT INTO run SELECT * REPLACE (? AS run_id, ? AS name) FROM run WHERE run_id = ?",
        [new, name, old],
    )
    tables = [
        t
        for (t,) in con.execute(
            "SELECT DISTINCT table_name FROM duckdb_columns() WHERE column_name = 'run_id'"
            " AND NOT internal AND table_name <> 'run'"
            " AND table_name IN (SELECT table_name FROM duckdb_tables())"
        ).fetchall()
    ]
    for t in tables:
        con.execute(
            f"INSERT INTO {t} SELECT * REPLACE (? AS run_id) FROM {t} WHERE run_id = ?",
            [new, old],
        )


def _iteration_means(store: Store, run: str) -> dict[int, float]:
    """Mean iteration duration over ranks, from the iteration rows with a plain loop."""
    acc: dict[int, list[int]] = defaultdict(list)
    for it, dur in store.con.execute(
        "SELECT iteration, dur FROM iteration WHERE run_id = (SELECT run_id FROM run"
        " WHERE name = ?)",
        [run],
    ).fetchall():
        acc[it].append(dur)
    return {k: sum(v) / len(v) for k, v in acc.items()}


def test_st_recorded_vs_emulated(st_store: Store) -> None:
    d = run_diff(st_store, "st", "st_emu")
    assert d.alignment == "node"
    ((events,),) = st_store.con.execute(
        "SELECT count(*) FROM event WHERE run_id = (SELECT run_id FROM run WHERE name = 'st')"
    ).fetchall()
    assert d.matched_ops == events
    assert d.unmatched_a == d.unmatched_b == 0
    a, b = _iteration_means(st_store, "st"), _iteration_means(st_store, "st_emu")
    assert d.iterations["iteration"].to_list() == sorted(a)
    for row in d.iterations.iter_rows(named=True):
        it = row["iteration"]
        assert row["diff_ns"] == pytest.approx(b[it] - a[it], abs=1e-3)
        assert abs(row["diff_pct"]) < 0.01  # the emulator's replay error on ST: ~0.001 %
    assert d.divergence.is_empty()  # no op moves by 1 % of its iteration
    tight = run_diff(st_store, "st", "st_emu", threshold_ns=10_000)
    assert not tight.divergence.is_empty()  # but some move by more than 10 µs (clock jitter)
    assert (tight.divergence["shift_ns"].abs() > 10_000).all()


def test_synthetic_slowdown_is_named_first(st_store: Store) -> None:
    d = run_diff(st_store, "st_emu", "slow_emu")
    assert d.alignment == "ordinal"  # emulated from two different runs: aligned by occurrence
    top = d.contributors.row(0, named=True)
    assert top["name"] == "backward-compute"
    assert top["dur_rank"] == 1
    assert top["dur_diff_ns"] == pytest.approx((SLOW - 1) * top["a_ns"], rel=1e-6)
    assert (d.iterations["diff_ns"] > 0).all()
    # The first divergent op of each iteration starts after the iteration's first
    # backward-compute ends (everything before it is identical), on any rank.
    first_bwd = dict(
        st_store.con.sql(
            "SELECT iteration, min(ts + dur) FROM event WHERE name = 'backward-compute'"
            " AND run_id = (SELECT run_id FROM run WHERE name = 'st_emu') GROUP BY ALL"
        ).fetchall()
    )
    for row in d.divergence.iter_rows(named=True):
        assert row["a_ts"] >= first_bwd[row["iteration"]], row
        assert row["shift_ns"] > 0


def test_ordinal_alignment_between_unrelated_runs(st_store: Store) -> None:
    d = run_diff(st_store, "st", "slow")  # two recordings: no graph link between them
    assert d.alignment == "ordinal"
    assert d.unmatched_a == d.unmatched_b == 0
    assert d.contributors["name"][0] == "backward-compute"
    assert d.divergence.is_empty()  # recorded starts are untouched: only durations changed
    assert (d.iterations["diff_ns"] == 0).all()


def test_dlrm_and_sample(real_store: Store, sample_store: Store, tmp_path: Path) -> None:
    for src, run in ((real_store, "dlrm"), (sample_store, "sample")):
        db = tmp_path / f"{run}.duckdb"
        shutil.copy(src.path, db)
        with open_store(db) as s:
            emulate_run(s, run=run, out_run=f"{run}_emu")
            d = run_diff(s, run, f"{run}_emu")
            ((nodes,),) = s.con.execute(
                "SELECT count(*) FROM graph_node WHERE iteration IS NOT NULL AND run_id ="
                " (SELECT run_id FROM run WHERE name = ?)",
                [run],
            ).fetchall()
        assert d.alignment == "node"
        assert d.matched_ops == nodes
        if run == "sample":  # replay with per-rank completion skew is exact by construction
            assert (d.iterations["diff_ns"] == 0).all()
            assert d.divergence.is_empty()
        else:  # DLRM: 0.0375 % in docs/emulator.md
            assert abs(d.iterations["diff_pct"][0]) < 0.1
            assert d.ranks.height == 8


def test_cli_diff_and_bubbles(st_store: Store) -> None:
    runner = CliRunner()
    db = str(st_store.path)
    res = runner.invoke(main, ["analyze", db, "--run", "st_emu", "diff", "--compare", "slow_emu"])
    assert res.exit_code == 0, res.output
    assert "contributors:" in res.output
    assert "backward-compute" in res.output
    res = runner.invoke(
        main,
        [
            *("analyze", db, "--run", "st_emu", "diff", "--compare", "slow_emu"),
            *("--iteration", "23", "--threshold-pct", "0.5", "--json"),
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [r["iteration"] for r in out["iterations"]] == [23]
    res = runner.invoke(main, ["analyze", db, "--run", "st", "bubbles", "--json"])
    assert res.exit_code == 0, res.output
    assert [r["stage"] for r in json.loads(res.output)] == [0, 1, 2, 3]
    res = runner.invoke(main, ["analyze", db, "--run", "st", "critical-path", "--iteration", "23"])
    assert res.exit_code == 0, res.output
    assert "comm-last-arriver" in res.output
    res = runner.invoke(main, ["analyze", db, "--run", "st", "diff"])
    assert res.exit_code == 1
    assert "--compare" in res.output
    frames = analyze(st_store, "diff", "st", compare="st_emu", iteration=23)
    assert set(frames) == {"iterations", "divergence", "contributors", "ranks"}
    assert frames["ranks"]["iteration"].unique().to_list() == [23]
    with pytest.raises(RunNotFoundError, match="no run named"):
        run_diff(st_store, "st", "nope")

"""Outputs that used to mislead on traces unlike the project's own: each says what it measures,
or that there is nothing to measure and why."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner
from prism_trace.analysis import nothing_to_rank, skew

from prism_trace.cli import main
from prism_trace.store.connection import Store, open_store

pytestmark = pytest.mark.shared_data


def _cli(*args: object) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


def test_skew_places_are_not_rank_ids(real_store: Store) -> None:
    """DLRM: three ranks were ever last; they get places 1-3, the others none (was: places 4-8
    for all-zero rows in rank-id order, under a column named `straggler_rank`)."""
    ranking = skew(real_store, "dlrm")
    assert "straggler_rank" not in ranking.columns
    placed = ranking.filter(pl.col("straggler_place").is_not_null())
    assert placed["rank"].to_list() == [7, 5, 4]
    assert placed["straggler_place"].to_list() == [1, 2, 3]
    assert (ranking.filter(pl.col("straggler_place").is_null())["caused_wait_ns"] == 0).all()
    assert nothing_to_rank(real_store, "dlrm") is None


def test_skew_of_one_rank_says_there_is_nothing_to_rank(real_store: Store) -> None:
    """HTA-NCCL is rank 0 of 2: no call has a second participant, so no ranking (was: one
    all-zero row ranked first)."""
    why = nothing_to_rank(real_store, "hta")
    assert why is not None
    assert "one rank" in why
    code, out, err = _cli("analyze", real_store.path, "--run", "hta", "skew")
    assert code == 0
    assert out == ""
    assert err.startswith("skew: nothing to rank for run 'hta': the run has one rank")
    # --json still gives the rows, with no place
    code, out, _ = _cli("analyze", real_store.path, "--run", "hta", "skew", "--json")
    assert code == 0
    assert '"straggler_place": null' in out


def test_skew_of_unmatched_calls_says_why(real_store: Store, tmp_path: Path) -> None:
    """DLRM with every call's sequence made unique per rank (as traces whose records share no
    group and sequence): nothing is matched, and skew says so."""
    shutil.copy(real_store.path, tmp_path / "u.duckdb")
    with open_store(tmp_path / "u.duckdb") as s:
        run_id = s.require_run("dlrm")
        s.con.execute("UPDATE collective SET seq = seq + 1000 * rank WHERE run_id = ?", [run_id])
        why = nothing_to_rank(s, "dlrm")
    assert why is not None
    assert "none of its 64 communication calls on 8 ranks is matched" in why


def test_slowdown_says_how_to_read_it(real_store: Store, tmp_path: Path) -> None:
    """DLRM's slowdown is below 1 (the typical times come out slower than the recording): the
    CLI says what the ratio is and that below 1 is no speed-up (was: a bare `all 0.744`)."""
    shutil.copy(real_store.path, tmp_path / "s.duckdb")
    code, out, err = _cli("analyze", tmp_path / "s.duckdb", "--run", "dlrm", "slowdown")
    assert code == 0, err
    assert "no-stragglers" in err
    assert "< 1" in err
    assert "not a speed-up" in err
    assert "e7" not in out  # step_ns in whole ns


def test_slowdown_of_a_run_without_steps_takes_the_whole_trace(
    shared_datasets: Path, tmp_path: Path
) -> None:
    """A run without steps is one window, the whole trace (``prism_trace.query.steps``), as its
    emulations are: slowdown compares those (was: `unexpected TypeError`, then a refusal)."""
    from prism_trace.ingestion.pipeline import ingest
    from tests.analysis.foreign_traces import resnet_steps

    db = tmp_path / "nosteps.duckdb"
    trace = resnet_steps(shared_datasets, tmp_path / "plain.json", steps=2, profiler_steps=False)
    with open_store(db) as s:
        ingest(s, [trace], run="plain", rank=0, progress=False)
    code, out, err = _cli("analyze", db, "--run", "plain", "slowdown")
    assert code == 0, err
    assert "Traceback" not in err + out
    assert "slowdown = mean step without own delays" in err
    assert "┆ all " in out


def test_partial_refusal_names_what_is_missing_and_the_option(
    real_store: Store, tmp_path: Path
) -> None:
    """Emulating rank 0 of a 2-rank job: the refusal says the member was not recorded and
    names --partial (was: "never issued by rank(s) []", "allow partial instances")."""
    shutil.copy(real_store.path, tmp_path / "p.duckdb")
    code, _, err = _cli("emulate", tmp_path / "p.duckdb", "--run", "hta", "--out-run", "e")
    assert code != 0
    assert err.count("\n") == 1
    assert "rank(s) []" not in err
    assert "not recorded" in err
    assert "--partial" in err
    code, _, err = _cli(
        "emulate", tmp_path / "p.duckdb", "--run", "hta", "--out-run", "e", "--partial"
    )
    assert code == 0, err


def test_diff_times_are_whole_ns_and_no_divergence_is_explained(
    st_emulated_template: Path,
) -> None:
    """ST against its emulation: per-iteration means in whole ns (was `2.3817e9` floats), and
    an empty divergence says there is none and what the bar is (was: "nothing for run")."""
    from prism_trace.analysis import run_diff

    with open_store(st_emulated_template, read_only=True) as s:
        d = run_diff(s, "st", "st_emu")
    assert d.divergence.is_empty()
    for col in ("a_ns", "b_ns", "diff_ns"):
        assert d.iterations.schema[col] == pl.Int64, col
    assert d.contributors.schema["mean_shift_ns"] == pl.Int64
    code, out, err = _cli(
        "analyze", st_emulated_template, "--run", "st", "diff", "--compare", "st_emu"
    )
    assert code == 0, err
    assert "divergence: none between run 'st' and 'st_emu'" in err
    assert "--threshold-pct" in err
    assert "nothing for" not in err
    assert "e9" not in out


def test_validate_without_a_layout_says_so(real_store: Store, tmp_path: Path) -> None:
    """Validating rank 0 of 2 with --partial infers no layout: the summary says so and why
    (was "layout None")."""
    shutil.copy(real_store.path, tmp_path / "v.duckdb")
    code, out, err = _cli("validate", tmp_path / "v.duckdb", "--run", "hta", "--partial")
    assert code == 0, err
    assert "None" not in out
    assert "layout not inferred" in out.splitlines()[0]
    assert "note: " in out

"""A diff of recordings of different ranks and steps (``analysis.diff_map``).

What would break: a control recorded on rank 3 and a test on rank 1 "share no (rank,
iteration)"; steps kept by different profiler schedules (3-5 against 10-12) likewise; and the
same job's files could not be ingested into the two runs compared.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from prism_trace.analysis.diff import run_diff

from prism_trace.cli import main
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store

pytestmark = pytest.mark.shared_data


@pytest.fixture(scope="module")
def store(shared_datasets: Path, tmp_path_factory: pytest.TempPathFactory) -> Store:
    """DLRM's rank 3 (``control``), rank 1 (``test``) and all 8 ranks twice (``a``, ``b``:
    the same files in two runs)."""
    kineto = shared_datasets / "param-dlrm-8rank" / "kineto"
    s = open_store(tmp_path_factory.mktemp("diffmap") / "d.duckdb")
    ingest(s, sorted(kineto.glob("worker3_*")), run="control", progress=False)
    ingest(s, sorted(kineto.glob("worker1_*")), run="test", progress=False)
    ingest(s, [kineto], run="a", progress=False)
    ingest(s, [kineto], run="b", progress=False)
    return s


def _step(store: Store, run: str, rank: int) -> int:
    (dur,) = store.con.execute(
        "SELECT dur FROM iteration i JOIN run r USING (run_id) WHERE r.name = ? AND i.rank = ?",
        [run, rank],
    ).fetchone()
    return int(dur)


def test_rank_3_of_one_run_against_rank_1_of_another(store: Store) -> None:
    d = run_diff(store, "a", "b", rank_map={3: 1})
    row = d.ranks.row(0, named=True)
    assert d.ranks.height == 1
    assert (row["rank"], row["rank_b"]) == (3, 1)
    assert (row["a_ns"], row["b_ns"]) == (_step(store, "a", 3), _step(store, "b", 1))
    assert d.matched_ops > 1000  # the two ranks run the same ops
    assert d.pairing == []  # asked for: no note


def test_the_one_rank_of_each_run_is_paired_and_said(store: Store) -> None:
    d = run_diff(store, "control", "test")
    assert d.ranks.select("rank", "rank_b").rows() == [(3, 1)]
    assert d.frames()["pairing"]["note"][0].startswith("rank 3 compared with rank 1")
    assert d.matched_ops == run_diff(store, "a", "b", rank_map={3: 1}).matched_ops


def test_iterations_map(sample_store: Store) -> None:
    """The sample's step 1 against its own step 2, and steps paired in order when no number is
    shared."""
    d = run_diff(sample_store, "sample", "sample", iteration_map={1: 2})
    assert set(d.ranks["iteration"]) == {1}
    assert set(d.ranks["iteration_b"]) == {2}
    steps = sample_store.con.execute(
        "SELECT rank, iteration, dur FROM iteration i JOIN run r USING (run_id)"
        " WHERE r.name = 'sample' ORDER BY ALL"
    ).fetchall()
    dur = {(r, i): x for r, i, x in steps}
    for row in d.ranks.iter_rows(named=True):
        assert (row["a_ns"], row["b_ns"]) == (dur[(row["rank"], 1)], dur[(row["rank"], 2)])


def test_the_cli_takes_maps_and_refuses_bad_ones(store: Store, tmp_path: Path) -> None:
    store.con.execute("CHECKPOINT")
    db = str(tmp_path / "copy.duckdb")
    shutil.copyfile(store.path, db)
    runner = CliRunner()
    ok = runner.invoke(
        main, ["analyze", db, "--run", "a", "diff", "--compare", "b", "--map", "3:1"]
    )
    assert ok.exit_code == 0, ok.output
    for bad, says in (
        ("x", "is not A:B"),
        ("3:2,4:2", "mapped twice"),
        ("9:1", "has no steps on rank 9"),
    ):
        out = runner.invoke(
            main, ["analyze", db, "--run", "a", "diff", "--compare", "test", "--map", bad]
        )
        assert out.exit_code != 0
        assert says in out.output
        assert "Traceback" not in out.output

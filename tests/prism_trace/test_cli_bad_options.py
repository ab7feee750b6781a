"""Bad options and arguments of the CLI: each is one `error:` line with exit 1, nothing written.

The project's rule for bad input: one line naming the file or option and the problem; no
traceback, no hang, no store change, no invalid value accepted. Each test here is an input a probe
found accepted, silently ignored, or answered with an unexpected exception.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from prism_trace.datasets import SAMPLE

from prism_trace.cli import main
from prism_trace.errors import UsageError
from prism_trace.limits import MAX_RANKS
from tests.conftest import copy_of_template

HUGE = 1_000_000_000_000


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory, sample_template: Path) -> Path:
    """A closed store file holding the bundled sample as run `sample` (8 ranks)."""
    return copy_of_template(sample_template, tmp_path_factory, "bad_options")


def prism(*args: object) -> Result:
    """Run `prism ARGS` in this process."""
    return CliRunner().invoke(main, [str(a) for a in args])


def slice_sample(
    db: Path, *, out_run: str = "s", layout: str = "tp=2,dp=4,pp=2", world: object = 16
) -> Result:
    """`prism slice DB --run sample --layout LAYOUT --world WORLD --out-run OUT_RUN`."""
    return prism(
        "slice", db, "--run", "sample", "--layout", layout, "--world", world, "--out-run", out_run
    )


def refused(res: Result, *words: str) -> str:
    """Assert ``res`` is one `error:` line with exit 1 holding ``words``; return the line."""
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, res.output
    assert lines[0].startswith("error: "), res.output
    assert "unexpected" not in lines[0]
    for word in words:
        assert word in lines[0], res.output
    return lines[0]


def runs(db: Path) -> list[str]:
    """The run names of ``db``, via `prism info --json`."""
    import json

    res = prism("info", db, "--json")
    assert res.exit_code == 0, res.output
    return [r["name"] for r in json.loads(res.output)["runs"]]


# --- 1. a world above MAX_RANKS ------------------------------------------------------------


def test_slice_world_above_the_rank_limit_is_refused_while_parsing(db: Path) -> None:
    """Refused before the layout is even compared with it (nothing is sized by it)."""
    res = slice_sample(db, out_run="huge", world=HUGE)
    assert res.exit_code != 0
    assert f"--world': {HUGE} is outside [1, {MAX_RANKS}]" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert "huge" not in runs(db)


def test_slice_run_refuses_a_world_above_the_rank_limit(db: Path) -> None:
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.plan import SliceError
    from prism_trace.slicing.slicer import slice_run
    from prism_trace.store.connection import open_store

    layout = ParallelLayout.parse("tp=2,dp=4,pp=2")
    with open_store(db) as store, pytest.raises(SliceError, match="world-size limit"):
        slice_run(store, run="sample", layout=layout, world=MAX_RANKS + 1, out_run="big")


def test_run_world_above_the_rank_limit_is_refused() -> None:
    res = prism("run", "--world", HUGE, "--ranks", "0", "--", "python", "-c", "print(1)")
    assert res.exit_code != 0
    assert f"{HUGE} is outside [1, {MAX_RANKS}]" in res.output
    assert len(res.output.strip().splitlines()) == 1


# --- 2. a missing DB is never created ------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["validate", "{db}", "--run", "sample"],
        ["graph", "{db}", "--run", "sample"],
        ["emulate", "{db}", "--run", "sample", "--out-run", "e"],
        ["slice", "{db}", "--run", "sample", "--layout", "tp=2", "--world", "2", "--out-run", "s"],
        ["replay", "{db}", "--run", "sample", "--ranks", "0", "--out-run", "r"],
        ["export", "chakra", "{db}", "--run", "sample", "-o", "{tmp}/et"],
        ["analyze", "{db}", "slowdown", "--run", "sample"],
    ],
    ids=lambda c: "-".join(w for w in c[:2] if "{" not in w),
)
def test_missing_db_is_named_and_not_created(tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "missing.duckdb"
    res = prism(*(w.format(db=missing, tmp=tmp_path) for w in command))
    assert refused(res) == f"error: {missing}: no such database"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- 3. a refused ingest leaves no new store -------------------------------------------------


def test_refused_ingest_into_a_new_path_leaves_no_file(tmp_path: Path, db: Path) -> None:
    new = tmp_path / "f.duckdb"
    res = prism("ingest", SAMPLE, "--db", new, "--run", "new", "--layout", "tp=3", "-q")
    refused(res, "layout tp=3")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # ...while a store that existed stays, with its runs.
    res = prism("ingest", tmp_path / "nope.json", "--db", db, "--run", "new2", "-q")
    assert res.exit_code == 1, res.output
    assert db.exists()
    assert runs(db)[0] == "sample"


def test_refused_ingest_of_a_bad_file_leaves_no_file(tmp_path: Path) -> None:
    bad = tmp_path / "in" / "bad.json"
    bad.parent.mkdir()
    bad.write_text('{"traceEvents": [')
    new = tmp_path / "out" / "f.duckdb"
    new.parent.mkdir()
    res = prism("ingest", bad, "--db", new, "-q")
    assert res.exit_code == 1, res.output
    assert list(new.parent.iterdir()) == []


# --- 4. run names ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "  ", "a\nb", "tab\there", "esc\x1b[31m"])
def test_blank_or_control_character_out_run_is_refused(db: Path, name: str) -> None:
    res = slice_sample(db, out_run=name)
    assert res.exit_code == 1, res.output
    assert res.output.startswith("error: ")
    assert "--out-run" in res.output
    assert runs(db) == ["sample"]


def test_ingest_empty_run_name_is_refused_not_defaulted(tmp_path: Path) -> None:
    new = tmp_path / "f.duckdb"
    refused(prism("ingest", SAMPLE, "--db", new, "--run=", "-q"), "--run", "blank")
    assert not new.exists()


@pytest.mark.parametrize("name", ["", " ", "a\nb", "x\x00"])
def test_claim_run_name_refuses_blank_and_control_characters(db: Path, name: str) -> None:
    from prism_trace.store.connection import open_store
    from prism_trace.store.write import claim_run_name

    with open_store(db, read_only=True) as store, pytest.raises(UsageError, match="run name"):
        claim_run_name(store, name, replace=False)


# --- 5. ranks the run lacks ------------------------------------------------------------------


def test_validate_slice_ranks_outside_the_recording_name_the_option(db: Path) -> None:
    refused(prism("validate", db, "--run", "sample", "--slice-ranks", "999"), "--slice-ranks 999")


def test_info_ranks_outside_the_world_are_refused(db: Path) -> None:
    refused(prism("info", db, "--run", "sample", "--ranks", "3,999"), "--ranks 999", "0..7")


# --- 6. output paths -------------------------------------------------------------------------


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    """An existing regular file, where a folder is expected."""
    path = tmp_path / "existing.csv"
    path.write_text("x\n")
    return path


def test_query_output_under_a_file_is_one_line(db: Path, a_file: Path) -> None:
    out = a_file / "x.csv"
    refused(prism("query", db, "SELECT 1", "-o", out), str(out), "not a folder")


def test_query_output_that_is_a_folder_is_one_line(db: Path, tmp_path: Path) -> None:
    refused(prism("query", db, "SELECT 1", "-o", tmp_path), str(tmp_path), "is a folder")


def test_query_output_parent_folders_are_created(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "x.csv"
    assert prism("query", db, "SELECT 1 AS one", "--format", "csv", "-o", out).exit_code == 0
    assert out.read_text() == "one\n1\n"


def test_report_output_under_a_file_is_one_line(db: Path, a_file: Path) -> None:
    out = a_file / "r.html"
    refused(prism("report", db, "--run", "sample", "-o", out), str(out), "not a folder")


@pytest.mark.parametrize("what", ["chakra", "parquet"])
def test_export_to_a_file_or_under_one_is_one_line(db: Path, a_file: Path, what: str) -> None:
    run = ["--run", "sample"]
    refused(prism("export", what, db, *run, "-o", a_file), str(a_file), "not a folder")
    under = a_file / "out"
    refused(prism("export", what, db, *run, "-o", under), str(under), "not a folder")


@pytest.mark.parametrize("what", ["chakra", "parquet"])
def test_export_into_a_non_empty_folder_is_refused(db: Path, tmp_path: Path, what: str) -> None:
    out = tmp_path / "et"
    out.mkdir()
    (out / "stale.0.et").write_bytes(b"")
    refused(prism("export", what, db, "--run", "sample", "-o", out), "not empty", "stale.0.et")
    assert [p.name for p in out.iterdir()] == ["stale.0.et"]


# --- 7. lenient parsing ----------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["tp=2,,dp=4,pp=2", "tp=2,dp=4,pp=2,", ",tp=2"])
def test_layout_with_an_empty_item_is_refused(db: Path, spec: str) -> None:
    res = slice_sample(db, layout=spec)
    refused(res, "empty item")
    assert runs(db) == ["sample"]


def test_ingest_order_without_layout_is_refused(tmp_path: Path) -> None:
    new = tmp_path / "f.duckdb"
    refused(prism("ingest", SAMPLE, "--db", new, "--order", "bogus", "-q"), "--order", "--layout")
    assert not new.exists()


def test_graph_order_without_layout_is_refused(db: Path) -> None:
    refused(prism("graph", db, "--run", "sample", "--order", "dp-tp"), "--order", "--layout")


@pytest.mark.parametrize("sql", ["", "  ;  ", "/* only a comment */"])
def test_query_empty_statement_is_refused(db: Path, sql: str) -> None:
    refused(prism("query", db, sql), "empty")


def test_query_of_several_statements_is_refused(db: Path) -> None:
    refused(prism("query", db, "SELECT 1; SELECT 2"), "2 statements")


def test_analyze_compare_is_refused_where_unused(db: Path) -> None:
    res = prism("analyze", db, "idle", "--run", "sample", "--compare", "sample")
    refused(res, "--compare", "diff", "idle")


# --- 8. prism query writes no files ----------------------------------------------------------


@pytest.mark.parametrize(
    "sql",
    [
        "COPY (SELECT 1) TO '{out}'",
        "COPY run TO '{out}' (FORMAT parquet)",
        "EXPORT DATABASE '{out}'",
        "ATTACH '{out}' AS other",
    ],
)
def test_query_refuses_statements_that_write_files(db: Path, tmp_path: Path, sql: str) -> None:
    out = tmp_path / "written"
    refused(prism("query", db, sql.format(out=out)), "read-only", "-o FILE", "export parquet")
    assert not out.exists()


def test_report_refuses_a_bad_path_before_building(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder given as `-o` is refused before the report's work (seconds on a large run),
    and no parent folder is made for a report that is not written."""
    import prism_trace.analysis.report.html as report

    def never(*_args: object, **_kwargs: object) -> object:
        raise AssertionError("the report was built before its path was checked")

    monkeypatch.setattr(report, "timeline_section", never)
    refused(prism("report", db, "--run", "sample", "-o", tmp_path), "is a folder")
    monkeypatch.undo()
    bad = tmp_path / "new" / "r.html"
    monkeypatch.setattr(report, "memory_section", never)
    res = prism("report", db, "--run", "sample", "-o", bad)
    assert res.exit_code != 0
    assert not bad.parent.exists()


def test_run_with_a_missing_db_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "missing.duckdb"
    args = ["run", "--world", "2", "--ranks", "0", "--db", missing, "--run", "x", "--"]
    refused(prism(*args, "python", "-c", "print(1)"), "no such database")
    assert not missing.exists()

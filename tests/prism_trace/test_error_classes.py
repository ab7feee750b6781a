"""Every refusal a user can cause is a named `PrismError` subclass, with its message unchanged.

A script catches what it expects (``except RunNotFoundError``) and a test asserts the kind; the
CLI still prints each as one ``error:`` line with exit 1. One cheap refusal per class, through
the CLI where a command gives it and through the function otherwise; each message is asserted
in full (or up to the part DuckDB words), since users and tests match on them.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner, Result

import prism_trace
from prism_trace import errors
from prism_trace.cli import main
from prism_trace.errors import (
    ConfigError,
    NotAStoreError,
    OutputError,
    PrismError,
    ProcessFailedError,
    QueryError,
    RunNotFoundError,
    RunStateError,
    SchemaVersionError,
    SelectionError,
    StoreError,
    StoreLockedError,
    UsageError,
)
from prism_trace.store.connection import Store, open_store
from tests.conftest import copy_of_template


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory, sample_template: Path) -> Path:
    """A closed store file holding the bundled sample as run `sample` (8 ranks, recorded)."""
    return copy_of_template(sample_template, tmp_path_factory, "error_classes")


@pytest.fixture
def store(db: Path) -> object:
    """``db`` opened read-only for one test."""
    with open_store(db, read_only=True) as s:
        yield s


def prism(*args: object) -> Result:
    """Run `prism ARGS` in this process."""
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line(res: Result) -> str:
    """The one `error:` line of a refused command (exit 1, no traceback), without `error: `."""
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, res.output
    assert lines[0].startswith("error: "), res.output
    assert "unexpected" not in lines[0], res.output
    return lines[0].removeprefix("error: ")


# --- the tree ------------------------------------------------------------------------------------


def test_every_class_is_a_documented_prism_error_exported_by_the_facade() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert inspect.isclass(cls), name
        assert issubclass(cls, PrismError), name
        assert (cls.__doc__ or "").strip(), f"{name} has no docstring"
        assert getattr(prism_trace, name) is cls, f"prism_trace.{name}"
        assert name in prism_trace.__all__


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (RunNotFoundError, LookupError),
        (SelectionError, LookupError),
        (UsageError, ValueError),
        (ConfigError, ValueError),
        (RunStateError, ValueError),
        (ProcessFailedError, RuntimeError),
    ],
)
def test_each_class_is_also_the_builtin_a_caller_expects(cls: type, builtin: type) -> None:
    assert issubclass(cls, builtin)


def test_store_errors_share_one_base() -> None:
    for cls in (NotAStoreError, SchemaVersionError, StoreLockedError):
        assert issubclass(cls, StoreError)


def test_the_replays_config_errors_are_config_errors() -> None:
    from prism_trace.replay.emulate.config import EmulationConfigError
    from prism_trace.replay.hybrid.options import ReplayOptionsError
    from prism_trace.replay.model.topology import TopologyError
    from prism_trace.replay.whatif.config import WhatIfError

    for cls in (EmulationConfigError, ReplayOptionsError, TopologyError, WhatIfError):
        assert issubclass(cls, ConfigError), cls.__name__


# --- one refusal of each class -----------------------------------------------------------------


def test_run_not_found(db: Path, store: Store) -> None:
    with pytest.raises(RunNotFoundError) as exc:
        store.require_run("nope")
    assert str(exc.value) == f"{db}: no run named 'nope' (runs: sample)"
    assert one_line(prism("info", db, "--run", "nope")) == str(exc.value)


def test_selection(db: Path, store: Store) -> None:
    from prism_trace.query.info import require_ranks

    with pytest.raises(SelectionError) as exc:
        require_ranks(store, "sample", [9], option="--ranks")
    assert str(exc.value) == f"{db}: --ranks 9: not in run 'sample' (world 0..7)"
    assert one_line(prism("info", db, "--run", "sample", "--ranks", "9")) == str(exc.value)

    from prism_trace.analysis.selection import check_selection

    with pytest.raises(SelectionError) as exc:
        check_selection(store, "sample", ranks=None, iteration=99)
    assert str(exc.value).startswith("run 'sample' has no iteration 99 (")


def test_usage(db: Path) -> None:
    from prism_trace.ranks import parse_ranks

    with pytest.raises(UsageError) as exc:
        parse_ranks("3..1")
    assert str(exc.value) == "rank range '3..1' in '3..1': needs start <= end and a step >= 1"
    assert one_line(prism("info", db, "--ranks", "0")) == "--ranks goes with --run"


def test_not_a_store(tmp_path: Path) -> None:
    missing = tmp_path / "missing.duckdb"
    with pytest.raises(NotAStoreError) as exc:
        open_store(missing, read_only=True)
    assert str(exc.value) == f"{missing}: no such database"
    assert one_line(prism("info", missing)) == str(exc.value)

    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    with pytest.raises(NotAStoreError) as exc:
        open_store(text)
    assert str(exc.value).startswith(f"{text}: not a DuckDB database")

    bare = tmp_path / "bare.duckdb"
    duckdb.connect(str(bare)).close()
    with pytest.raises(NotAStoreError) as exc:
        open_store(bare, read_only=True)
    assert (
        str(exc.value) == f"{bare}: a DuckDB database but not a prism-trace store (no `meta` table)"
    )


def test_schema_version_is_a_store_error(tmp_path: Path) -> None:
    from prism_trace.store.schema import SCHEMA_VERSION

    path = tmp_path / "old.duckdb"
    open_store(path).close()
    con = duckdb.connect(str(path))
    con.execute("UPDATE meta SET value = '0' WHERE key = 'schema_version'")
    con.close()
    with pytest.raises(SchemaVersionError) as exc:
        open_store(path, read_only=True)
    assert isinstance(exc.value, StoreError)
    assert str(exc.value) == (
        f"{path}: store has schema version 0, this prism-trace reads {SCHEMA_VERSION};"
        " re-ingest into a new file (see docs/schema-changes.md)"
    )


def test_output(db: Path, tmp_path: Path) -> None:
    from prism_trace.outputs import output_dir, output_file

    with pytest.raises(OutputError) as exc:
        output_file(tmp_path)
    assert str(exc.value) == f"{tmp_path}: is a folder; give a file path"
    res = prism("query", db, "SELECT 1", "--format", "csv", "-o", tmp_path)
    assert one_line(res) == str(exc.value)

    (tmp_path / "x").write_text("")
    with pytest.raises(OutputError) as exc:
        output_dir(tmp_path)
    assert str(exc.value) == f"{tmp_path}: exists and is not empty (holds 'x'); give a new folder"


def test_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prism_trace.replay.config_file import load_emulation_config
    from prism_trace.replay.model.timing import TimingConfig

    bad = tmp_path / "bad.toml"
    bad.write_text("[netwrok]\nx = 1\n")  # [network] is a section now (issue 34)
    with pytest.raises(ConfigError) as exc:
        load_emulation_config(bad)
    assert str(exc.value).startswith(f"{bad}: unknown section(s) ['netwrok']; known: ")

    with pytest.raises(ConfigError) as exc:
        TimingConfig(model="exact")  # type: ignore[arg-type]
    assert str(exc.value) == ("timing `model` must be recorded, scaled or alpha_beta, got 'exact'")

    from prism_trace.ingestion.memory import ingest_memory_limit

    monkeypatch.setenv("PRISM_INGEST_MEMORY_LIMIT", "1MB")
    with pytest.raises(ConfigError) as exc:
        ingest_memory_limit()
    assert str(exc.value) == (
        "PRISM_INGEST_MEMORY_LIMIT='1MB': expected a size of at least 256MB, such as 2GB"
    )


def test_run_state(db: Path, store: Store) -> None:
    res = prism("info", db, "--run", "sample", "--config")
    assert one_line(res) == (
        f"{db}: run 'sample' (recorded) was not made from a config file; its parameters are in"
        f' run.config_json (prism query {db} "SELECT config_json FROM run")'
    )
    from prism_trace.replay.emulate.load import load_run

    with pytest.raises(RunStateError) as exc:
        load_run(store, "sample")  # read-only, never graphed
    assert str(exc.value) == (
        f"{db}: run 'sample' has no graph; open the store writable to build it"
    )


def test_query(db: Path, store: Store) -> None:
    from prism_trace.query.sql import run_query

    with pytest.raises(QueryError) as exc:
        run_query(store, "SELECT 1; SELECT 2")
    assert str(exc.value) == "the SQL holds 2 statements; give one (its result is printed)"
    with pytest.raises(QueryError) as exc:
        run_query(store, "SELECT * FROM no_such_table")
    assert str(exc.value).startswith(f"{db}: query failed: Catalog Error")
    assert one_line(prism("query", db, " ")) == (
        'the SQL is empty; give one statement, e.g. "SELECT name FROM run"'
    )


def test_process_failed() -> None:
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from prism_trace.ingestion.discover import TraceFile
    from prism_trace.ingestion.parts import _results

    fut: Future = Future()
    fut.set_exception(BrokenProcessPool("a child process terminated abruptly"))
    with pytest.raises(ProcessFailedError) as exc:
        list(_results([fut], [[TraceFile(Path("/x/rank3.json"), "kineto")]]))
    assert str(exc.value) == (
        "/x/rank3.json: the worker process reading it (or another file) died, e.g. killed for"
        " memory; try fewer --workers"
    )


def test_docs_api_lists_every_class() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    section = doc.split("## Errors", 1)[1]
    missing = [n for n in errors.__all__ if n != "PrismError" and f"`{n}`" not in section]
    assert not missing, f"docs/api.md's Errors section misses {missing}"

"""One check for store files: anything that is not a whole prism store is one line naming the file,
on every command, and the file is left as it was (no schema written into a foreign database, no
extension downloaded)."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import sqlite3
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.errors import CorruptStoreError, NotAStoreError
from prism_trace.store.connection import open_store
from tests.conftest import SAMPLE

_HEADERS = 3 * 4096


def _commands(db: Path, tmp: Path) -> dict[str, list[str]]:
    return {
        "info": ["info", str(db)],
        "query": ["query", str(db), "SELECT count(*) FROM event"],
        "analyze": ["analyze", str(db), "temporal", "--run", "sample"],
        "graph": ["graph", str(db), "--run", "sample"],
        "emulate": ["emulate", str(db), "--run", "sample", "--out-run", "e"],
        "slice": [
            "slice",
            str(db),
            "--run",
            "sample",
            "--layout",
            "tp=2,dp=4",
            "--world",
            "8",
            "--out-run",
            "s",
        ],
        "perfetto": ["export", "perfetto", str(db), "--run", "sample", "-o", str(tmp / "p.json")],
        "report": ["report", str(db), "--run", "sample", "-o", str(tmp / "r.html")],
        "ingest": ["ingest", "--db", str(db), "--run", "again", str(SAMPLE)],
    }


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _last_used_block(db: Path) -> int:
    """The highest block a table's segment or the metadata uses (asked of DuckDB itself, on a
    copy: another test of this process may hold ``db`` open with the store's own settings, and
    DuckDB refuses a second connection to one file with other settings)."""
    copy = db.with_name(f".{db.name}.blocks")
    shutil.copyfile(db, copy)
    with duckdb.connect(str(copy), read_only=True) as con:
        tables = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()]
        used = [
            con.execute(f"SELECT max(block_id) FROM pragma_storage_info('{t}')").fetchall()[0][0]
            for t in tables
        ]
        used.append(
            con.execute("SELECT max(block_id) FROM pragma_metadata_info()").fetchall()[0][0]
        )
    copy.unlink()
    return max(u for u in used if u is not None)


def test_a_free_tail_cut_off_is_still_the_store(sample_template: Path, tmp_path: Path) -> None:
    """DuckDB itself trims free blocks at the end after writing the header: a file shorter than
    its header says, with every block in use present, is a whole store."""
    whole = sample_template.read_bytes()
    end = _HEADERS + (_last_used_block(sample_template) + 1) * 262144
    if end >= len(whole):
        pytest.skip("no free block at the end of this store")
    trimmed = tmp_path / "trimmed.db"
    trimmed.write_bytes(whole[:end])
    r = CliRunner().invoke(main, ["query", str(trimmed), "SELECT count(*) AS n FROM event"])
    s = CliRunner().invoke(main, ["query", str(sample_template), "SELECT count(*) AS n FROM event"])
    assert r.exit_code == 0, r.output
    assert r.output == s.output


def _damaged_files(sample_template: Path, tmp: Path) -> dict[str, Path]:
    """Files that are no whole prism store, each made here (not by prism)."""
    whole = sample_template.read_bytes()
    end = _HEADERS + (_last_used_block(sample_template) + 1) * 262144  # the rest is free
    files: dict[str, bytes] = {
        "random": bytes((i * 7919 + 13) % 251 for i in range(100_000)),
        "text": b"not a database\n",
        "half": whole[: len(whole) // 2],
        # Without the last block in use: DuckDB opened this and read emptied tables.
        "last block cut": whole[: end - 262144],
        "one byte short": whole[: end - 1],
        "headers only": whole[:_HEADERS],
        "flipped first block": whole[:_HEADERS]
        + bytes(b ^ 0x5A for b in whole[_HEADERS : _HEADERS + 64])
        + whole[_HEADERS + 64 :],
    }
    out = {name: tmp / f"{name.replace(' ', '_')}.db" for name in files}
    for name, data in files.items():
        out[name].write_bytes(data)
    lite = tmp / "sqlite.db"
    with sqlite3.connect(lite) as con:
        con.execute("CREATE TABLE t (a)")
    out["sqlite"] = lite
    foreign = tmp / "foreign.duckdb"
    with duckdb.connect(str(foreign)) as con:
        con.execute("CREATE TABLE t (a INTEGER)")
        con.execute("INSERT INTO t VALUES (1)")
    out["foreign duckdb"] = foreign
    renamed = tmp / "renamed_column.duckdb"
    shutil.copyfile(sample_template, renamed)
    with duckdb.connect(str(renamed)) as con:
        con.execute("ALTER TABLE comm_group ADD COLUMN extra INTEGER")
    out["altered schema"] = renamed
    return out


@pytest.fixture(scope="module")
def damaged(sample_template: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _damaged_files(sample_template, tmp_path_factory.mktemp("damaged"))


@pytest.mark.parametrize(
    "command",
    ["info", "query", "analyze", "graph", "emulate", "slice", "perfetto", "report", "ingest"],
)
def test_every_command_refuses_every_damaged_file_in_one_line(
    command: str, damaged: dict[str, Path], tmp_path: Path
) -> None:
    for name, path in damaged.items():
        before = _digest(path)
        r = CliRunner().invoke(main, _commands(path, tmp_path)[command])
        assert r.exit_code == 1, (name, r.output)
        assert r.output.startswith(f"error: {path}: "), (name, r.output)
        assert r.output.count("\n") == 1, (name, r.output)
        assert "unexpected" not in r.output, (name, r.output)
        assert "download" not in r.output.lower(), (name, r.output)
        assert _digest(path) == before, name
        assert not path.with_name(path.name + ".wal").exists(), name


def test_the_classes_say_what_is_wrong(damaged: dict[str, Path]) -> None:
    for name in ("half", "last block cut", "one byte short", "headers only", "flipped first block"):
        with pytest.raises(CorruptStoreError, match=r"cut short|damaged"):
            open_store(damaged[name], read_only=True)
    for name, words in (
        ("sqlite", "is an SQLite database"),
        ("random", "not a DuckDB database"),
        ("foreign duckdb", "no `meta` table; it holds t"),
        ("altered schema", "table comm_group: an extra column `comm_group.extra INTEGER`"),
    ):
        with pytest.raises(NotAStoreError, match=words):
            open_store(damaged[name])


def test_a_block_damaged_later_is_one_line_naming_the_store(
    sample_template: Path, tmp_path: Path
) -> None:
    """DuckDB reads data blocks lazily: flipped bytes met in the middle of a command."""
    whole = sample_template.read_bytes()
    blocks = (len(whole) - _HEADERS) // 262144
    outcomes = set()
    for b in range(blocks // 3, blocks, 2):
        path = tmp_path / f"flip{b}.db"
        start = _HEADERS + b * 262144 + 4096
        path.write_bytes(
            whole[:start]
            + bytes(x ^ 0x5A for x in whole[start : start + 4096])
            + whole[start + 4096 :]
        )
        r = CliRunner().invoke(main, ["analyze", str(path), "temporal", "--run", "sample"])
        assert r.exit_code in (0, 1), r.output
        if r.exit_code == 1:
            assert r.output.startswith(f"error: {path}: the store is damaged: "), r.output
            assert r.output.count("\n") == 1
        outcomes.add(r.exit_code)
        if r.exit_code == 1:
            break
    assert 1 in outcomes  # at least one damaged block was met (the check can fail)


def test_remote_parquet_without_httpfs_is_one_line() -> None:
    installed = duckdb.sql(
        "SELECT installed FROM duckdb_extensions() WHERE extension_name = 'httpfs'"
    ).fetchall()
    if installed and installed[0][0]:
        pytest.skip("httpfs is installed here")
    r = CliRunner().invoke(main, ["query", "--parquet", "s3://no-bucket/x", "SELECT 1"])
    assert r.exit_code == 1, r.output
    assert r.output.startswith("error: s3://no-bucket/x: reading a remote Parquet export needs")
    assert "never downloaded" in r.output


def _race(building: contextlib.AbstractContextManager[Path], other: Path) -> None:
    """Build a store in ``building`` while "another process" creates ``other``."""
    with building as tmp:
        open_store(tmp).close()
        other.write_text("the other process's store")


def test_a_new_store_is_built_beside_and_never_clobbers(tmp_path: Path) -> None:
    """Ingest builds a new store beside its path and links it into place at the end; a store
    another process created there meanwhile is kept, and this one is refused."""
    from prism_trace.errors import StoreLockedError
    from prism_trace.store.connection import removed_if_new_and_failed

    db = tmp_path / "new.db"
    with removed_if_new_and_failed(db) as building:
        assert building != db
        assert building.parent == db.parent
        open_store(building, shown_as=db).close()
        assert not db.exists()
    with open_store(db, read_only=True) as store:
        assert store.path == db
    other = tmp_path / "raced.db"
    with pytest.raises(StoreLockedError, match="another process created this store"):
        _race(removed_if_new_and_failed(other), other)
    assert other.read_text() == "the other process's store"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.db", "raced.db"]


@pytest.mark.parametrize("command", ["info", "query", "emulate", "ingest"])
def test_a_fifo_a_folder_or_a_device_is_no_store(command: str, tmp_path: Path) -> None:
    """DuckDB's open of a FIFO blocked forever; a folder and a device are refused too."""
    import os
    import stat

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    for path, words in ((fifo, "is not a regular file"), (folder, "is a folder")):
        r = CliRunner().invoke(main, _commands(path, tmp_path)[command])
        assert r.exit_code == 1, r.output
        assert r.output.startswith(f"error: {path}: {words}"), r.output
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert not any(folder.iterdir())

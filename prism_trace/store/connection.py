"""The DuckDB file: opening it safely, its schema version, and one transaction per write."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from prism_trace.errors import (
    CorruptStoreError,
    NotAStoreError,
    RunNotFoundError,
    SchemaVersionError,
    StoreLockedError,
)
from prism_trace.store import schema
from prism_trace.store.integrity import (
    check_blocks,
    check_store_file,
    corrupt_store_error,
    schema_checksum,
    stored_schema_checksum,
)
from prism_trace.version import __version__

__all__ = ["RunLink", "Store", "open_store", "opened_stores", "removed_if_new_and_failed"]


@dataclass(frozen=True)
class RunLink:
    """One run on a run's line of descent (see ``Store.run_ancestry``)."""

    run_id: int
    name: str
    kind: str
    depth: int  # 0: the run itself, 1: its parent, ...


@dataclass
class Store:
    """An open store: the DuckDB connection plus the path, for messages."""

    con: duckdb.DuckDBPyConnection
    path: Path
    read_only: bool
    _depth: int = field(default=0, repr=False)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """All-or-nothing write: commit on success, roll back on any exception (then re-raise).

        A transaction opened inside another joins it, so a command that calls several writers
        (build a graph, slice, emulate) commits once, at the end, or leaves the store as it was.
        DuckDB has no savepoints: an error inside a joined block aborts the whole transaction,
        so it must reach the outermost block (catching it halfway cannot keep the writes).
        """
        if self._depth:
            self._depth += 1
            try:
                yield self.con
            finally:
                self._depth -= 1
            return
        self.con.execute("BEGIN TRANSACTION")
        self._depth = 1
        try:
            yield self.con
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        finally:
            self._depth = 0
        self.con.execute("COMMIT")

    @property
    def in_transaction(self) -> bool:
        """Whether a ``transaction()`` block is open (a writer may then skip its own checks
        that only matter between commands)."""
        return self._depth > 0

    def run_id(self, name: str) -> int | None:
        """The id of the run called ``name``, or None."""
        rows = self.con.execute("SELECT run_id FROM run WHERE name = ?", [name]).fetchall()
        return int(rows[0][0]) if rows else None

    def require_run(self, name: str) -> int:
        """The id of run ``name``.

        Raises:
            RunNotFoundError: no such run; the message lists the runs there are.
        """
        rid = self.run_id(name)
        if rid is None:
            names = [
                r[0] for r in self.con.execute("SELECT name FROM run ORDER BY run_id").fetchall()
            ]
            msg = f"{self.path}: no run named {name!r} (runs: {', '.join(names) or 'none'})"
            raise RunNotFoundError(msg)
        return rid

    def run_ancestry(self, run_id: int) -> list[RunLink]:
        """The run and its ancestors, nearest first: an emulation, the slice it came from, the
        recording that was sliced. The one way every module walks ``run.parent_run_id``."""
        rows = self.con.execute(
            "WITH RECURSIVE up(run_id, depth) AS (SELECT ?::INTEGER, 0"
            " UNION ALL SELECT r.parent_run_id, u.depth + 1 FROM run r JOIN up u USING (run_id)"
            " WHERE r.parent_run_id IS NOT NULL AND u.depth < 64)"
            " SELECT u.run_id, r.name, r.kind, u.depth FROM up u JOIN run r USING (run_id)"
            " ORDER BY u.depth",
            [run_id],
        ).fetchall()
        return [RunLink(int(i), str(n), str(k), int(d)) for i, n, k, d in rows]

    def recorded_ancestor(self, run_id: int) -> RunLink | None:
        """The nearest recorded run on ``run_id``'s line (itself when it is recorded)."""
        return next((r for r in self.run_ancestry(run_id) if r.kind == "recorded"), None)

    def close(self) -> None:
        """Close the connection (checkpointing the WAL)."""
        self.con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def removed_if_new_and_failed(path: Path) -> Iterator[Path]:
    """The file to open as the store at ``path``, for a command that may create it (ingest).

    A new store is built in a temporary file beside ``path`` (``.<name>.*.part``) and renamed
    onto ``path`` only when the block succeeds, so a refused, failed or killed ingest into a new
    path leaves no store there (a SIGKILL may leave the hidden temporary file). An existing
    store is opened in place and never removed; its transactions already undo a failed write.

    Close the store inside the block (its WAL is then checkpointed), so the whole file is
    renamed. Pass ``path`` as ``open_store``'s ``shown_as``, so messages name it.
    """
    if path.exists() or path.is_symlink() or not path.parent.is_dir():
        yield path
        return
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(name)
    tmp.unlink()  # DuckDB creates the file itself
    try:
        yield tmp
        _rename_no_clobber(tmp, path)
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + ".wal")):
            with contextlib.suppress(OSError):
                leftover.unlink(missing_ok=True)


def _rename_no_clobber(tmp: Path, path: Path) -> None:
    """Move the new store ``tmp`` to ``path`` unless a store appeared there meanwhile (another
    ingest into the same new path): that one is kept, and this ingest is refused.

    Raises:
        StoreLockedError: ``path`` was created by another process during the ingest.
    """
    try:
        os.link(tmp, path)  # fails when `path` exists, unlike a rename
    except FileExistsError as exc:
        msg = f"{path}: another process created this store during the ingest; ingest again"
        raise StoreLockedError(msg) from exc
    except OSError:  # a file system without hard links
        os.replace(tmp, path)
        return
    tmp.unlink()


_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
}
"""No extension is downloaded or loaded behind the user's back: a store needs none, and an
SQLite file given as a store made DuckDB download its sqlite extension."""

_OPENED: list[Path] = []


def opened_stores() -> list[Path]:
    """The store files opened in this process, latest last: the CLI names the file when
    DuckDB reports a damaged block later, in a query that has no path of its own."""
    return list(_OPENED)


def _connect(path: Path, *, read_only: bool) -> duckdb.DuckDBPyConnection:
    short = check_store_file(path)
    try:
        con = duckdb.connect(str(path), read_only=read_only, config=_CONFIG)
    except duckdb.Error as exc:
        text = str(exc)
        if isinstance(exc, duckdb.IOException) and "lock" in text.lower():
            msg = f"{path}: the database is locked by another process; close it and retry"
            raise StoreLockedError(msg) from exc
        damaged = corrupt_store_error(path, exc)
        if damaged is not None:
            raise damaged from exc
        msg = f"{path}: cannot open the store: {text.splitlines()[0] if text else exc!r}"
        raise NotAStoreError(msg) from exc
    if short:  # shorter than its header says: damaged, or only its free tail trimmed
        try:
            check_blocks(con, path)
        except duckdb.Error as exc:
            con.close()
            damaged = corrupt_store_error(path, exc)
            if damaged is None:
                msg = f"{path}: the store is shorter than its header says and cannot be read"
                damaged = CorruptStoreError(msg)
            raise damaged from exc
        except BaseException:
            con.close()
            raise
    return con


def open_store(path: str | Path, *, read_only: bool = False, shown_as: Path | None = None) -> Store:
    """Open (and, when writable and new, create) a store.

    A store is recognised by its DuckDB header (a whole file, ``check_store_file``), its
    ``meta`` table, and its tables' checksum (``stored_schema_checksum``); only a new or empty
    database becomes a store, never a DuckDB file that holds other tables.

    Args:
        path: the DuckDB file.
        read_only: open without a write lock, so readers never block each other.
        shown_as: the path messages name, when ``path`` is a temporary file that becomes it
            (``removed_if_new_and_failed``).

    Returns:
        The open store.

    Raises:
        StoreLockedError: another process holds the file.
        SchemaVersionError: the file was written with another schema version.
        CorruptStoreError: the file is cut short or a block's checksum is wrong.
        NotAStoreError: the path is not a DuckDB database or a prism store, or (read-only) does
            not exist.
    """
    path = Path(path)
    if read_only and not path.exists():
        msg = f"{path}: no such database"
        raise NotAStoreError(msg)
    con = _connect(path, read_only=read_only)
    try:
        store = _recognised(con, path, read_only=read_only)
    except duckdb.Error as exc:
        con.close()
        damaged = corrupt_store_error(path, exc)
        if damaged is not None:
            raise damaged from exc
        msg = f"{path}: not a prism-trace store: {str(exc).splitlines()[0]}"
        raise NotAStoreError(msg) from exc
    except BaseException:
        con.close()
        raise
    if shown_as is not None:
        store.path = shown_as
    _OPENED.append(store.path)
    del _OPENED[:-8]  # the latest few are enough to name a damaged one
    return store


def _recognised(con: duckdb.DuckDBPyConnection, path: Path, *, read_only: bool) -> Store:
    """``con`` as a store: its schema version and checksum checked, or (new) created.

    Raises:
        SchemaVersionError: another schema version.
        NotAStoreError: a database with other tables, without ``meta``, or whose tables differ
            from the declared ones.
    """
    store = Store(con, path, read_only)
    tables = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
            " ORDER BY table_name"
        ).fetchall()
    ]
    if "meta" in tables:
        rows = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
        found = rows[0][0] if rows else None
        if found != str(schema.SCHEMA_VERSION):
            msg = (
                f"{path}: store has schema version {found}, this prism-trace reads"
                f" {schema.SCHEMA_VERSION}; re-ingest into a new file (see docs/schema-changes.md)"
            )
            raise SchemaVersionError(msg)
        checksum, diff = stored_schema_checksum(con)
        if diff is not None or checksum != schema_checksum():
            msg = (
                f"{path}: not a prism-trace store of schema version {schema.SCHEMA_VERSION}:"
                f" its tables differ from the declared ones ({diff})"
            )
            raise NotAStoreError(msg)
        return store
    if tables or read_only:
        held = f"; it holds {', '.join(tables[:3])}" if tables else ""
        msg = f"{path}: a DuckDB database but not a prism-trace store (no `meta` table{held})"
        raise NotAStoreError(msg)
    with store.transaction():
        schema.create_all(con)
        con.execute(
            "INSERT INTO meta VALUES ('schema_version', ?), ('created_by', ?),"
            " ('schema_checksum', ?)",
            [str(schema.SCHEMA_VERSION), f"prism-trace {__version__}", schema_checksum()],
        )
    return store

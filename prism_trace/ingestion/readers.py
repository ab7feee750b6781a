"""Reading one file, wherever ingest reads it (here or in a worker): the reader of its format,
the work database a Kineto reader runs in, and which files may be read in a batch.

The Kineto readers (``formats.kineto``) run their SQL on a connection they are given and make
their work tables in its default database, which the caller gives fresh for each file (or
batch) and drops afterwards (``formats/base.py``). ``_work_database`` is that caller's side:
a cursor of a connection, a database attached to it and made its default, detached (its file
deleted) on leaving. Here the connection is the store's (the work shares the ingest's one
DuckDB: its memory limit, threads and spill directory); in a worker, the worker's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb

from prism_trace.formats.base import FormatName, TraceTables
from prism_trace.formats.kineto.json_array import json_size_guess
from prism_trace.ingestion import memory as ingest_memory
from prism_trace.ingestion.discover import TraceFile

__all__ = ["read_trace"]


def _reader(fmt: FormatName) -> Callable[..., TraceTables]:
    """The reader of ``fmt``, imported when first needed (a run of one format loads one)."""
    if fmt == "kineto":
        from prism_trace.formats.kineto.reader import read_kineto

        return read_kineto
    if fmt == "host_et":
        from prism_trace.formats.host_et.reader import read_host_et

        return read_host_et
    if fmt == "chakra":
        from prism_trace.formats.chakra.reader import read_chakra

        return read_chakra
    from prism_trace.formats.op_timeline.reader import read_op_timeline

    return read_op_timeline


def read_trace(trace: TraceFile, *, rank: int | None = None) -> TraceTables:
    """Read one file with the reader of its format, conformed to the contract."""
    return _reader(trace.format)(trace.path, rank=rank).conform()


def _quote(path: Path) -> str:
    """``path`` for a single-quoted SQL string."""
    return str(path).replace("'", "''")


# The name of a work database attached to a connection (the caller adds a suffix unique to the
# file or batch, as files are read at the same time on cursors of one connection).
_WORK = "_prism_work"


@contextlib.contextmanager
def _work_database(
    con: duckdb.DuckDBPyConnection,
    alias: str,
    *,
    file: Path | None = None,
    lock: contextlib.AbstractContextManager[object] | None = None,
    spill_to: Path | None = None,
) -> Iterator[duckdb.DuckDBPyConnection]:
    """A cursor of ``con`` whose default database is a fresh one named ``alias``: in memory, or
    the database file ``file`` (deleted on leaving, with its WAL). On leaving, the cursor goes
    back to its own default database, detaches the work database and is closed.

    Args:
        con: the connection to attach to (the store's, or a worker's).
        alias: the work database's name, unique among those attached to ``con`` at once.
        file: where the work database lives when not in memory (a large trace).
        lock: held while the cursor is made (the store's connection is shared by threads).
        spill_to: a ``temp_directory`` to set first (a worker's scratch directory).
    """
    with lock if lock is not None else contextlib.nullcontext():
        cur = con.cursor()
    try:
        (home,) = cur.execute("SELECT current_database()").fetchall()[0]
        if spill_to is not None:
            cur.execute(f"SET temp_directory = '{_quote(spill_to)}'")
        cur.execute(f"ATTACH '{':memory:' if file is None else _quote(file)}' AS {alias}")
        cur.execute(f"USE {alias}")
        try:
            yield cur
        finally:
            cur.execute(f'USE "{home.replace(chr(34), chr(34) * 2)}"')
            cur.execute(f"DETACH DATABASE IF EXISTS {alias}")
    finally:
        cur.close()
        if file is not None:
            for p in (file, file.with_name(file.name + ".wal")):
                p.unlink(missing_ok=True)


def _works_on_disk(path: Path, memory_limit: float) -> bool:
    """Whether the Kineto file at ``path`` is read in a work database file (``ingest_memory``)."""
    return ingest_memory.works_on_disk(json_size_guess(path), memory_limit)


def _batch_candidates(files: list[TraceFile], ranks: dict[Path, int]) -> list[Path | None]:
    """The paths of the files that may be read in a batch (``kineto_batch.plan_batches``):
    Kineto files read with no rank given (``ranks``) that would be worked on in memory; None
    for the others."""
    return [
        f.path
        if f.format == "kineto"
        and f.path not in ranks
        and json_size_guess(f.path) < ingest_memory.WORK_ON_DISK_BYTES
        else None
        for f in files
    ]

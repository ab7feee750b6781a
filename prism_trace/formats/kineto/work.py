"""One Kineto file's SQL on its work database: the statements, the fetches, and the one line a
failed statement becomes.

The reader's stages (``load``, ``events``, ``frames``, ``comms``) are mixins of ``_Work``: each
adds the statements of one stage, and ``reader._Reader`` (and the batch reader,
``batch._BatchReader``) puts them together over one work database.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from prism_trace.errors import OutOfMemoryError, PrismError, TraceFormatError
from prism_trace.formats.kineto.json_array import TraceEventsFile, json_size_guess

__all__: list[str] = []

_BATCH_ROWS = 1 << 18
_DUPLICATE_RE = re.compile(r"Object (.*) has duplicate key \"(.*)\"$")


_TEMP_FILE = re.compile(r' in file "[^"]*"')
_DUCKDB_PLACE = re.compile(r",? at byte \d+ in record/value \d+")
_LOCATE_BYTES = 256 << 20


def _parse_failure(path: Path, message: str) -> str:
    """The trace's own JSON error for a failed parse, named by the user's file.

    DuckDB parses the events from a temporary copy of the array (``TraceEventsFile``), and its
    message names that copy and counts records within one part of it: neither means anything
    to the user. The copy's name is dropped; when Python's parser finds the fault in the file
    itself (up to 256 MB: only on this failure path), its line and column are given instead.
    """
    import gzip
    import json

    what = _DUCKDB_PLACE.sub("", _TEMP_FILE.sub("", message)).strip().rstrip(".")
    try:
        if json_size_guess(path) <= _LOCATE_BYTES:
            raw = path.read_bytes()
            if raw[:2] == b"\x1f\x8b":
                raw = gzip.decompress(raw)
            json.loads(raw)
    except json.JSONDecodeError as exc:
        return f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
    except (OSError, EOFError, ValueError):
        pass
    return f"cannot parse the trace events: {what}"


def _short(value: str) -> str:
    """A value quoted in a message, cut to 60 characters."""
    return value if len(value) <= 60 else value[:57] + "..."


class _Work:
    """The state of one file's read (set by the reader's ``__init__``) and its SQL helpers.

    Attributes:
        path: the trace file (messages name it).
        rank: the file's rank.
        meta: the trace's top-level keys other than ``traceEvents``.
        info: its ``distributedInfo`` (empty when it has none).
        tef: the events array, copied into files DuckDB reads.
        con: the connection whose default database holds the work tables.
        world_size: ``distributedInfo.world_size``, checked; None when not stated.
        base_ns: ``baseTimeNanoseconds``, checked; 0 when not stated.
        bound: fwd-bwd flow points' events, from ``event_ids`` to ``flows``.
        object_bytes: the largest JSON object ``read_json`` takes now (``load_files``).
        free: whether work tables are dropped as soon as they are done with.
    """

    path: Path
    rank: int
    meta: dict[str, Any]
    info: dict[str, Any]
    tef: TraceEventsFile
    con: duckdb.DuckDBPyConnection
    world_size: int | None
    base_ns: int
    bound: pl.DataFrame
    object_bytes: int
    free: bool

    def _fail(self, exc: duckdb.Error) -> PrismError:
        """One line for a failed statement: the trace's fault, unless DuckDB ran out of memory
        (then the file is not blamed, and the line says what to change)."""
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, duckdb.OutOfMemoryException):
            return OutOfMemoryError.of(self.path, "reading the trace", first)
        dup = _DUPLICATE_RE.search(first)
        if dup:  # DuckDB refuses a record stating a column it reads twice
            record, key = dup.groups()
            msg = (
                f"{self.path}: duplicate key {key!r} in a `traceEvents` record ({_short(record)});"
                " a key may appear once in an object"
            )
            return TraceFormatError(msg)
        ours = first.removeprefix("Invalid Input Error: ")
        if ours.startswith("traceEvents["):  # a check of ours, raised by SQL's error()
            return TraceFormatError(f"{self.path}: {ours}")
        return TraceFormatError(f"{self.path}: {_parse_failure(self.path, ours)}")

    def sql(self, query: str, params: list[Any] | None = None) -> None:
        """Run a statement that returns no rows (DDL)."""
        try:
            self.con.execute(query, params)
        except duckdb.Error as exc:
            raise self._fail(exc) from exc

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        """Fetch a small result as tuples.

        Through ``execute``, not a relation: a relation binds its query for its schema before it
        runs it, which plans a statement of the reader's twice (~2 ms a query on a small trace).
        """
        try:
            return self.con.execute(query).fetchall()
        except duckdb.Error as exc:
            raise self._fail(exc) from exc

    def frame(self, query: str) -> pl.DataFrame:
        """Fetch a result batch by batch, so it exists once in Arrow form at a time, not whole."""
        try:
            reader = self.con.sql(query).to_arrow_reader(_BATCH_ROWS)
            # A RecordBatch always converts to a DataFrame (``from_arrow`` is typed wider).
            parts = [pl.DataFrame(pl.from_arrow(batch)) for batch in reader]
        except duckdb.Error as exc:
            raise self._fail(exc) from exc
        if not parts:
            # Not ``pl.from_arrow(schema.empty_table())``: that imports pandas (0.2 s a process).
            return self.con.sql(query).limit(0).pl()
        return pl.concat(parts, rechunk=False) if len(parts) > 1 else pl.DataFrame(parts[0])

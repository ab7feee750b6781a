"""The driver's appends of an ingest: one per table for many files, not one per file per table.

Appending a frame to the store costs a few milliseconds whatever its size (register it, plan the
INSERT, unregister); ingest appends six tables a file, so on many small files the appends were a
fixed cost per file. ``Pending``
keeps the rows of the files read so far, in file order, and appends them per table when they
reach ``FLUSH_ROWS`` rows or when the caller asks (before a host ET is linked to events that must
be in the store, and at the end). Events a worker left in a Parquet part are appended by one
``read_parquet`` over the parts.

A file's rows are then stored with other files' rows in one statement; when the store refuses
one (a key given twice, a NULL where it may not be), the statement does not say whose rows those
were, so each file's frame is tried alone in a scratch database with the table's schema
(``_first_refused``) and the message names the first file refused, as a per-file append would.
The store's transaction is aborted either way, and ingest rolls it back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import polars as pl

from prism_trace.errors import OutOfMemoryError, TraceFormatError
from prism_trace.formats.base import FRAME_SCHEMAS
from prism_trace.ingest.read import _quote
from prism_trace.store import tables
from prism_trace.store.write import append

__all__ = ["FLUSH_ROWS", "Pending"]

FLUSH_ROWS = 1 << 18
"""Rows held before they are appended (the frames of a Kineto batch are in memory anyway)."""


def _concat(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """One frame of the files' frames, in order (their columns matched by name)."""
    if len(frames) == 1:
        return frames[0]
    same = all(f.schema == frames[0].schema for f in frames)
    return pl.concat(frames, how="vertical" if same else "diagonal_relaxed")


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


@dataclass
class Pending:
    """Rows waiting to be appended to the store, per table, in file order.

    Attributes:
        run_id: the run the rows belong to.
        frames: per table, ``(file, frame)`` pairs.
        parts: ``(file, Parquet part, ranks)`` of events a worker wrote: the part's events of
            ``ranks`` are to be stored (the part is deleted once stored).
        rows: rows held (frames and parts' rows are counted by the frames only).
    """

    run_id: int
    frames: dict[str, list[tuple[Path, pl.DataFrame]]] = field(default_factory=dict)
    parts: list[tuple[Path, Path, list[int], bool]] = field(default_factory=list)
    rows: int = 0

    def add(self, table: str, path: Path, df: pl.DataFrame) -> None:
        """Hold ``df`` (rows of ``path``) for ``table``."""
        if df.is_empty():
            return
        self.frames.setdefault(table, []).append((path, df))
        self.rows += df.height

    def add_part(self, path: Path, part: Path, ranks: list[int], *, whole: bool) -> None:
        """Hold the events of ``ranks`` in ``part`` (``whole``: they are all its events)."""
        self.parts.append((path, part, ranks, whole))

    def full(self) -> bool:
        """Whether enough is held to append it now."""
        return self.rows >= FLUSH_ROWS or len(self.parts) >= 256

    def flush(self, con: duckdb.DuckDBPyConnection) -> None:
        """Append everything held, one statement per table; then hold nothing."""
        frames, parts = self.frames, self.parts
        self.frames, self.parts, self.rows = {}, [], 0
        for table, items in frames.items():
            df = _concat([d for _, d in items])
            try:
                append(con, table, run_id=self.run_id, df=df)
            except duckdb.OutOfMemoryException as exc:  # not a file's fault: nothing to find
                raise OutOfMemoryError.of(
                    items[0][0], "storing its rows", _first_line(exc)
                ) from exc
            except duckdb.Error as exc:
                raise self._refused(table, items, exc) from exc
        self._flush_parts(con, parts)

    def _flush_parts(
        self, con: duckdb.DuckDBPyConnection, parts: list[tuple[Path, Path, list[int], bool]]
    ) -> None:
        cols = ", ".join(FRAME_SCHEMAS["events"])
        whole = [p for p in parts if p[3] and p[2]]
        rest = [p for p in parts if not p[3] and p[2]]
        sources = []
        if whole:
            files = ", ".join(f"'{_quote(p[1])}'" for p in whole)
            sources.append((whole, f"SELECT {cols} FROM read_parquet([{files}])"))
        for p in rest:
            ranks = ", ".join(str(r) for r in p[2])
            sources.append(
                ([p], f"SELECT {cols} FROM read_parquet('{_quote(p[1])}') WHERE rank IN ({ranks})")
            )
        for group, select in sources:
            try:
                con.execute(
                    f"INSERT INTO event (run_id, {cols}) SELECT {self.run_id}, {cols}"
                    f" FROM ({select})"
                )
            except duckdb.OutOfMemoryException as exc:  # not a file's fault: nothing to find
                raise OutOfMemoryError.of(
                    group[0][0], "storing its rows", _first_line(exc)
                ) from exc
            except duckdb.Error as exc:
                table, items = "event", [(p[0], pl.read_parquet(p[1])) for p in group]
                raise self._refused(table, items, exc) from exc
        for p in parts:
            p[1].unlink(missing_ok=True)

    def _refused(
        self, table: str, items: list[tuple[Path, pl.DataFrame]], exc: duckdb.Error
    ) -> TraceFormatError:
        path = _first_refused(table, items, self.run_id) if len(items) > 1 else items[0][0]
        return TraceFormatError(f"{path}: its rows cannot be stored: {_first_line(exc)}")


def _first_refused(table: str, items: list[tuple[Path, pl.DataFrame]], run_id: int) -> Path:
    """The first file whose rows a fresh ``table`` refuses, the files appended one by one (so a
    key two files give is refused at the second); the first file when none is refused."""
    with contextlib.closing(duckdb.connect()) as scratch:
        scratch.execute(tables.table(table).ddl())
        for path, df in items:
            try:
                append(scratch, table, run_id=run_id, df=df)
            except duckdb.Error:
                return path
    return items[0][0]

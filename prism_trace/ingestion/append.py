"""The ingest's writes of a file's rows into the store, and the one statement that stores events.

Appending a frame to the store costs a few milliseconds whatever its size (register it, plan the
INSERT, unregister); ingest appends six tables a file, so on many small files the appends were a
fixed cost per file. ``Pending`` keeps the rows of the files read so far, in file order, and
appends them per table when they reach ``FLUSH_ROWS`` rows or when the caller asks (before a
host ET is linked to events that must be in the store, and at the end). Events a worker left in
a Parquet part are appended by one ``read_parquet`` over the parts.

A file's rows are then stored with other files' rows in one statement; when the store refuses
one (a key given twice, a NULL where it may not be), the statement does not say whose rows those
were, so each file's frame is tried alone in a scratch database with the table's schema
(``_first_refused``) and the message names the first file refused, as a per-file append would.
The store's transaction is aborted either way, and ingest rolls it back.

Events, the one table as large as the traces, enter the store by one statement
(``_insert_events``) and one rule for naming the file refused (``_refusal``), from the source
they are in once their file is read; moving them to another would cost a copy of the trace:

- a frame (a reader other than Kineto's, or a batch of small Kineto files, read here or by a
  worker): held in ``Pending`` with the file's other rows;
- a Parquet part a worker wrote (a file read alone by a worker): held in ``Pending`` too, and
  read by DuckDB from the part, never made a frame in the driver;
- a relation over the work database of a Kineto file read here (``_stream_events``): appended
  by the reading thread as the reader hands it over, as a stream of Arrow batches, so the
  file's events are never a frame (its work database is dropped when the reader returns, so
  the relation cannot wait in ``Pending`` for the driver's turn, and making it a frame or a
  part to wait there would cost the memory or the Parquet round trip the stream avoids).

So two routes stay, both through ``_insert_events``: ``Pending``'s, in file order by the
driver, and the stream's, at read time by the reading thread (which is why the reading threads
claim each rank's events before writing them: ``read._Shared.claim``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import polars as pl

from prism_trace.errors import OutOfMemoryError, PrismError, TraceFormatError
from prism_trace.formats.base import FRAME_SCHEMAS
from prism_trace.ingestion.readers import _quote
from prism_trace.store import tables
from prism_trace.store.write import append

__all__ = ["FLUSH_ROWS", "Pending"]

FLUSH_ROWS = 1 << 18
"""Rows held before they are appended (the frames of a Kineto batch are in memory anyway)."""

# Rows per Arrow batch when a file's events stream from its work database into the store.
_EVENT_BATCH_ROWS = 1 << 16
# The columns of an ``event`` row a source gives (all but ``run_id``), in the table's order.
_EVENT_COLUMNS = ", ".join(FRAME_SCHEMAS["events"])
# Names of the sources registered on the store's connection: one per append, as reading
# threads register theirs while the driver registers its own.
_SOURCES = itertools.count()


def _concat(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """One frame of the files' frames, in order (their columns matched by name)."""
    if len(frames) == 1:
        return frames[0]
    same = all(f.schema == frames[0].schema for f in frames)
    return pl.concat(frames, how="vertical" if same else "diagonal_relaxed")


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _refusal(path: Path, exc: duckdb.Error) -> PrismError:
    """One line for rows of ``path`` the store refused: its rows' fault (a key given twice, a
    value out of range), unless DuckDB ran out of memory (then the file is not blamed)."""
    if isinstance(exc, duckdb.OutOfMemoryException):
        return OutOfMemoryError.of(path, "storing its rows", _first_line(exc))
    return TraceFormatError(f"{path}: its rows cannot be stored: {_first_line(exc)}")


@contextlib.contextmanager
def _stored(path: Path) -> Iterator[None]:
    """Name the file when the store refuses its rows (``_refusal``)."""
    try:
        yield
    except duckdb.Error as exc:
        raise _refusal(path, exc) from exc


@contextlib.contextmanager
def _registered(con: duckdb.DuckDBPyConnection, source: object) -> Iterator[str]:
    """``source`` (Arrow data) registered on ``con`` under a fresh name, for one statement."""
    name = f"_prism_events_{next(_SOURCES)}"
    con.register(name, source)
    try:
        yield name
    finally:
        # After a failed insert the transaction is aborted and unregistering fails too; the
        # insert's error is the one to report.
        with contextlib.suppress(duckdb.Error):
            con.unregister(name)


def _insert_events(con: duckdb.DuckDBPyConnection, run_id: int, source: str) -> None:
    """The one statement that stores events: ``source``'s rows (a table or a subquery with the
    ``FRAME_SCHEMAS["events"]`` columns) under ``run_id``."""
    con.execute(
        f"INSERT INTO event (run_id, {_EVENT_COLUMNS}) SELECT {int(run_id)}, {_EVENT_COLUMNS}"
        f" FROM {source}"
    )


def _stream_events(
    con: duckdb.DuckDBPyConnection, run_id: int, path: Path, events: duckdb.DuckDBPyRelation
) -> None:
    """Store the events of ``path`` from ``events`` (a relation on another connection of the
    same database), consumed in Arrow batches of ``_EVENT_BATCH_ROWS`` rows: at most a few
    batches exist outside DuckDB's tables at a time."""
    with _registered(con, events.to_arrow_reader(_EVENT_BATCH_ROWS)) as name, _stored(path):
        _insert_events(con, run_id, name)


# A part: the file it holds events of, the Parquet file, the ranks to store, and whether those
# are all the part's ranks.
_Part = tuple[Path, Path, list[int], bool]


@dataclass
class Pending:
    """Rows waiting to be appended to the store, per table, in file order.

    Attributes:
        run_id: the run the rows belong to.
        frames: per table, ``(file, frame)`` pairs.
        parts: ``(file, Parquet part, ranks, whole)`` of events a worker wrote: the part's
            events of ``ranks`` are to be stored (``whole``: they are all its events); the part
            is deleted once stored.
        rows: rows held (frames and parts' rows are counted by the frames only).
    """

    run_id: int
    frames: dict[str, list[tuple[Path, pl.DataFrame]]] = field(default_factory=dict)
    parts: list[_Part] = field(default_factory=list)
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
                if table == "event":
                    arrow = df.select(list(FRAME_SCHEMAS["events"])).to_arrow()
                    with _registered(con, arrow) as name:
                        _insert_events(con, self.run_id, name)
                else:
                    append(con, table, run_id=self.run_id, df=df)
            except duckdb.Error as exc:
                held = functools.partial(_frames_of, items)
                err = self._refused(table, [p for p, _ in items], held, exc)
                raise err from exc
        self._flush_parts(con, parts)

    def _flush_parts(self, con: duckdb.DuckDBPyConnection, parts: list[_Part]) -> None:
        """The events of ``parts``: the wholly kept parts in one ``read_parquet``, each other
        part filtered to its ranks; then delete every part."""
        whole = [p for p in parts if p[3] and p[2]]
        rest = [p for p in parts if not p[3] and p[2]]
        sources: list[tuple[list[_Part], str]] = []
        if whole:
            files = ", ".join(f"'{_quote(p[1])}'" for p in whole)
            sources.append((whole, f"read_parquet([{files}])"))
        for p in rest:
            ranks = ", ".join(str(r) for r in p[2])
            sources.append(
                (
                    [p],
                    f"(SELECT * FROM read_parquet('{_quote(p[1])}') WHERE rank IN ({ranks}))",
                )
            )
        for group, source in sources:
            try:
                _insert_events(con, self.run_id, source)
            except duckdb.Error as exc:
                paths = [p[0] for p in group]
                err = self._refused("event", paths, functools.partial(_read_parts, group), exc)
                raise err from exc
        for p in parts:
            p[1].unlink(missing_ok=True)

    def _refused(
        self,
        table: str,
        paths: list[Path],
        frames: Callable[[], list[pl.DataFrame]],
        exc: duckdb.Error,
    ) -> PrismError:
        """The error for rows of ``paths`` (whose frames ``frames`` gives) the store refused:
        named by the first file a fresh ``table`` refuses (``_first_refused``), unless one
        file gave them or DuckDB ran out of memory (no file is to blame then)."""
        path = paths[0]
        if len(paths) > 1 and not isinstance(exc, duckdb.OutOfMemoryException):
            path = _first_refused(table, list(zip(paths, frames(), strict=True)), self.run_id)
        return _refusal(path, exc)


def _frames_of(items: list[tuple[Path, pl.DataFrame]]) -> list[pl.DataFrame]:
    """The frames of held ``(file, frame)`` pairs."""
    return [d for _, d in items]


def _read_parts(parts: list[_Part]) -> list[pl.DataFrame]:
    """The events of ``parts``, read back to find whose the store refused."""
    return [pl.read_parquet(p[1]) for p in parts]


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

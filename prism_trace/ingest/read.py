"""Reading the files of an ingest: here, in a thread beside the store's writes, or by workers.

``ingest`` owns the store and its one transaction; this module hands it each file's frames in file
order (``_reading``). With one worker (or one file) the files are read in this process, one
ahead of the one being stored, and a Kineto file's events stream from a work database of its own
straight into the store's ``event`` table (``_read_file``); with more, worker processes or a dask
cluster read them into parts (``ingest_parts``) whose events the driver appends (``_hold_part``).
Also the rules both paths share: which reader reads a format, when a trace is worked on in a
database file, how a clash between two files giving one rank reads.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from prism_trace.errors import (
    DuplicateRankError,
    OutOfMemoryError,
    PrismError,
    TraceFormatError,
)
from prism_trace.formats.base import FRAME_SCHEMAS, FormatName, TraceTables
from prism_trace.ingest import memory as ingest_memory
from prism_trace.ingest.discover import TraceFile
from prism_trace.store.connection import Store

if TYPE_CHECKING:
    from prism_trace.ingest.append import Pending
    from prism_trace.ingest.parts import Engine, FilePart

__all__ = ["read_trace"]


def _reader(fmt: FormatName) -> Callable[..., TraceTables]:
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


@contextlib.contextmanager
def _stored(path: Path) -> Iterator[None]:
    """Name the file when the store refuses its rows (a key given twice, a value out of range)."""
    try:
        yield
    except duckdb.Error as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, duckdb.OutOfMemoryException):  # not the file's fault
            raise OutOfMemoryError.of(path, "storing its rows", first) from exc
        msg = f"{path}: its rows cannot be stored: {first}"
        raise TraceFormatError(msg) from exc


def _clash(path: Path, rank: int, other: Path) -> DuplicateRankError:
    msg = (
        f"{path}: rank {rank} appears twice in one run (also in {other});"
        " ingest each job as its own --run"
    )
    return DuplicateRankError(msg)


# The database a Kineto reader works in, a fresh one per file (in memory, or a file for a large
# trace), dropped after the file.
_WORK = "_prism_work"
# Rows per Arrow batch when a file's events stream from its work database into the store.
_EVENT_BATCH_ROWS = 1 << 16


# With ``--workers`` left to prism (``auto``), files are read by worker processes only when the
# set holds at least this many JSON bytes (guessed) and two files: below it the workers' start, a
# DuckDB setup and a planning of the reader's statements per worker, and the events' round trip
# through Parquet cost more than the second core saves, and reading here is faster
# (benchmarks/bench_ingest_scale.py; docs/ingest.md, "How many workers"). Workers forked from a
# warm process (``ingest_parts.preforked``: the CLI) start in milliseconds; from a fork server
# they first import DuckDB, polars and the readers (~0.6 s), so the set must be larger to pay.
_PARALLEL_MIN_BYTES_FORKED = 16 << 20
_PARALLEL_MIN_BYTES_SERVER = 64 << 20


@dataclass(frozen=True)
class _Plan:
    """Where files are read: here, or by worker processes / a dask cluster.

    ``workers`` is the most files read at the same time; ``auto`` (the CLI's default) lets the
    plan read a small set here instead (``processes``).
    """

    workers: int
    engine: Engine = "local"
    scheduler: str | None = None
    auto: bool = False

    def processes(self, files: list[TraceFile], *, forked: bool | None = None) -> int:
        """How many worker processes read ``files``; 0: they are read here.

        Here: one worker, or a single file (nothing to share out, and the events stream
        straight into the store instead of via a part), or, with ``auto``, a set too small for
        workers to pay (``_PARALLEL_MIN_BYTES_*``; ``forked``: whether the workers would be
        forked from a warm process, default: whether they are now) or fewer than two idle cores
        (``_idle_cores``). Else ``workers`` processes (with ``auto``: at most one an idle
        core), at most one a file. A dask cluster reads every file, whatever the set.
        """
        if self.engine != "local":
            return self.workers
        if self.workers == 1 or len(files) == 1:
            return 0
        if self.auto:
            if forked is None:
                from prism_trace.ingest.parts import preforked_workers

                forked = preforked_workers() > 1
            least = _PARALLEL_MIN_BYTES_FORKED if forked else _PARALLEL_MIN_BYTES_SERVER
            if sum(_json_size_guess(f.path) for f in files) < least:
                return 0
            n = min(self.workers, len(files), _idle_cores())
            return n if n > 1 else 0
        return min(self.workers, len(files))


def _idle_cores() -> int:
    """Cores not busy with other work, from the 1-minute load average (rounded): a worker
    gains only on an idle core (``_Plan.processes``). All of them where there is no load
    average."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cores
    return max(1, round(cores - load))


@contextlib.contextmanager
def _reading(
    shared: _Shared, files: list[TraceFile], plan: _Plan
) -> Iterator[Iterator[tuple[TraceTables, FilePart | None]]]:
    """Each file's frames, in file order, with the part holding its events when a worker read
    it (None when it was read here: its events are in the store or in ``events`` then)."""
    n = plan.processes(files)
    if n:
        from prism_trace.ingest.parts import parts

        with parts(
            files,
            rank=shared.rank,
            out_dir=shared.tmp,
            workers=n,
            memory_limit=ingest_memory.worker_limit(shared.memory_limit, n),
            engine=plan.engine,
            scheduler=plan.scheduler,
        ) as got:
            yield ((p.tables, p) for p in got)
        return
    from prism_trace.formats.kineto.batch import plan_batches

    small = _batch_candidates(files, shared.rank)
    pool = ThreadPoolExecutor(max_workers=1)  # reads the next batch while one is stored
    futures = [pool.submit(_read_files, shared, files, b) for b in plan_batches(small, 1)]
    try:
        yield ((t, None) for fut in futures for t in _raised(fut.result()))
    except BaseException:
        shared.stop.set()
        for fut in futures:
            fut.cancel()
        raise
    finally:
        pool.shutdown(wait=True)  # no thread may touch the store once this returns


def _batch_candidates(files: list[TraceFile], rank: int | None) -> list[Path | None]:
    """The paths of the files that may be read in a batch (``kineto_batch.plan_batches``):
    Kineto files with no ``--rank`` that would be worked on in memory; None for the others."""
    return [
        f.path
        if f.format == "kineto"
        and rank is None
        and _json_size_guess(f.path) < ingest_memory.WORK_ON_DISK_BYTES
        else None
        for f in files
    ]


def _raised(got: list[TraceTables | Exception]) -> Iterator[TraceTables]:
    """``got`` in order, an error raised at its file's turn."""
    for t in got:
        if isinstance(t, Exception):
            raise t
        yield t


def _read_files(
    shared: _Shared, files: list[TraceFile], batch: list[int]
) -> list[TraceTables | Exception]:
    """Read the files ``batch`` indexes: small Kineto files in one batch (``kineto_batch``,
    their events as frames the driver appends), else one by one (``_read_file``) up to the
    first that fails, whose error takes its place (the driver raises it at that file's turn)."""
    if len(batch) > 1:
        got = _read_batch_here(shared, [files[i] for i in batch], batch[0])
        if got is not None:
            return list(got)
    out: list[TraceTables | Exception] = []
    for i in batch:
        try:
            out.append(_read_file(shared, files[i], i))
        except Exception as exc:  # raised in the driver at this file's turn
            out.append(exc)
            break
    return out


def _read_batch_here(
    shared: _Shared, files: list[TraceFile], index: int
) -> list[TraceTables] | None:
    """The batch read in a work database of its own beside the store (as ``_read_file``)."""
    from prism_trace.formats.kineto.batch import try_read_kineto_batch

    alias = f"{_WORK}b{index}"
    with shared.lock:
        (catalog,) = shared.store.con.execute("SELECT current_database()").fetchall()[0]
        cur = shared.store.con.cursor()
    try:
        cur.execute(f"ATTACH ':memory:' AS {alias}")
        cur.execute(f"USE {alias}")
        return try_read_kineto_batch(
            [f.path for f in files], ranks=[None] * len(files), con=cur, tmp_dir=shared.tmp
        )
    finally:
        cur.execute(f'USE "{catalog.replace(chr(34), chr(34) * 2)}"')
        cur.execute(f"DETACH DATABASE IF EXISTS {alias}")
        cur.close()


def _hold_part(shared: _Shared, pending: Pending, part: FilePart, ranks: list[int]) -> None:
    """Hold the events of a worker's part for ``ranks`` for the store (hold ``lock``); the part
    is deleted once stored, so scratch holds the parts not yet stored."""
    path = part.events_path
    if path is None:
        return
    mine = [r for r in part.event_ranks if r in ranks]
    shared.claim(part.tables.path, mine)
    pending.add_part(
        part.tables.path, path, mine, whole=sorted(mine) == sorted(set(part.event_ranks))
    )


@dataclass
class _Shared:
    """What the threads reading files share: the store's connection, one statement at a time.

    ``claims`` holds which file's events each rank got: a Kineto file's events are written by its
    thread as soon as they are ready, possibly before an earlier file's are, so a rank given by
    two files is refused here, before its second set of rows is written (``_RankBook`` tells the
    same clash in file order, for everything else).
    """

    store: Store
    run_id: int
    tmp: Path
    rank: int | None
    memory_limit: float  # bytes DuckDB may use in this ingest (``ingest._ingest_settings``)
    lock: threading.Lock = field(default_factory=threading.Lock)
    claims: dict[int, Path] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)  # set when the ingest failed

    def claim(self, path: Path, ranks: list[int]) -> None:
        """Record that ``path`` writes the events of ``ranks`` (hold ``lock``)."""
        for r in ranks:
            other = self.claims.setdefault(r, path)
            if other != path:
                raise _clash(path, r, other)


def _read_file(shared: _Shared, trace: TraceFile, index: int) -> TraceTables:
    """Read one file; a Kineto file's events go straight into the store's ``event`` table.

    The Kineto reader runs on a cursor of its own, in a database of its own dropped after the
    file: the store's transaction must not touch that database (a transaction keeps every
    database it read alive until it ends), so the events cross over as a stream of Arrow batches
    that the store's connection appends. The work database is in memory, which is faster (no
    compressed write), unless the trace is larger than the memory limit (``works_on_disk``):
    then it is a file, its tables compressed there and evicted by DuckDB, which bounds the
    peak and keeps the spill of a trace many times the limit small.
    """
    if trace.format != "kineto":
        return read_trace(trace, rank=shared.rank)
    from prism_trace.formats.kineto.reader import stage_kineto

    store = shared.store
    on_disk = ingest_memory.works_on_disk(_json_size_guess(trace.path), shared.memory_limit)
    work = shared.tmp / f"work{index}.duckdb"
    alias = f"{_WORK}{index}"
    batches = f"_event_batches{index}"
    cols = ", ".join(FRAME_SCHEMAS["events"])

    def append(the_rank: int, events: duckdb.DuckDBPyRelation) -> None:
        with shared.lock:
            if shared.stop.is_set():  # another file failed: the transaction will roll back
                msg = f"{trace.path}: not written, the ingest failed on another file"
                raise PrismError(msg)
            shared.claim(trace.path, [the_rank])
            store.con.register(batches, events.to_arrow_reader(_EVENT_BATCH_ROWS))
            try:
                with _stored(trace.path):
                    store.con.execute(
                        f"INSERT INTO event (run_id, {cols}) SELECT {shared.run_id}, {cols}"
                        f" FROM {batches}"
                    )
            finally:
                # After a failed insert the transaction is aborted and unregistering fails
                # too; the insert's error is the one to report.
                with contextlib.suppress(duckdb.Error):
                    store.con.unregister(batches)

    with shared.lock:
        (catalog,) = store.con.execute("SELECT current_database()").fetchall()[0]
        cur = store.con.cursor()
    try:
        cur.execute(f"ATTACH '{_quote(work) if on_disk else ':memory:'}' AS {alias}")
        cur.execute(f"USE {alias}")
        return stage_kineto(
            trace.path, con=cur, events_into=append, rank=shared.rank, tmp_dir=shared.tmp
        )
    finally:
        cur.execute(f'USE "{catalog.replace(chr(34), chr(34) * 2)}"')
        cur.execute(f"DETACH DATABASE IF EXISTS {alias}")
        cur.close()
        for p in (work, work.with_name(work.name + ".wal")):
            p.unlink(missing_ok=True)


def _json_size_guess(path: Path) -> int:
    """The JSON bytes of ``path``, guessed: gzipped Kineto JSON shrinks about 8 times."""
    with path.open("rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    return path.stat().st_size * (8 if gz else 1)


def _quote(path: Path) -> str:
    """``path`` for a single-quoted SQL string."""
    return str(path).replace("'", "''")

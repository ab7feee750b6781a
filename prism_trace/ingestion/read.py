"""The driver's side of reading an ingest's files: here, in a thread beside the store's writes, or
by workers whose parts it holds for the store.

``ingest`` owns the store and its one transaction; this module hands it each file's frames in file
order (``_reading``). With one worker (or one file) the files are read in this process, one
ahead of the one being stored, and a Kineto file's events stream from a work database of its own
straight into the store's ``event`` table (``_read_file``); with more, worker processes or a dask
cluster read them into parts (``ingest_parts``) whose events the driver appends (``_hold_part``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from prism_trace.errors import PrismError
from prism_trace.formats.base import TraceTables
from prism_trace.formats.kineto import batch as kineto_batch
from prism_trace.formats.kineto import reader as kineto_reader
from prism_trace.ingestion import memory as ingest_memory
from prism_trace.ingestion.append import Pending, _stream_events
from prism_trace.ingestion.discover import TraceFile
from prism_trace.ingestion.parts import FilePart, parts
from prism_trace.ingestion.plan import _Plan
from prism_trace.ingestion.ranks import _clash
from prism_trace.ingestion.readers import (
    _WORK,
    _batch_candidates,
    _work_database,
    _works_on_disk,
    read_trace,
)
from prism_trace.store.connection import Store

__all__: list[str] = []


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
    ranks: dict[Path, int]  # the rank to read a file with, where known before (``pairing``)
    memory_limit: float  # bytes DuckDB may use in this ingest (``settings._ingest_settings``)
    lock: threading.Lock = field(default_factory=threading.Lock)
    claims: dict[int, Path] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)  # set when the ingest failed

    def claim(self, path: Path, ranks: list[int]) -> None:
        """Record that ``path`` writes the events of ``ranks`` (hold ``lock``)."""
        for r in ranks:
            other = self.claims.setdefault(r, path)
            if other != path:
                raise _clash(path, r, other)


@contextlib.contextmanager
def _reading(
    shared: _Shared, files: list[TraceFile], plan: _Plan
) -> Iterator[Iterator[tuple[TraceTables, FilePart | None]]]:
    """Each file's frames, in file order, with the part holding its events when a worker read
    it (None when it was read here: its events are in the store or in ``events`` then)."""
    n = plan.processes(files)
    if n:
        with parts(
            files,
            ranks=shared.ranks,
            out_dir=shared.tmp,
            workers=n,
            memory_limit=ingest_memory.worker_limit(shared.memory_limit, n),
            engine=plan.engine,
            scheduler=plan.scheduler,
        ) as got:
            yield ((p.tables, p) for p in got)
        return
    small = _batch_candidates(files, shared.ranks)
    pool = ThreadPoolExecutor(max_workers=1)  # reads the next batch while one is stored
    batches = kineto_batch.plan_batches(small, 1)
    futures = [pool.submit(_read_files, shared, files, b) for b in batches]
    try:
        yield ((t, None) for fut in futures for t in _raised(fut.result()))
    except BaseException:
        shared.stop.set()
        for fut in futures:
            fut.cancel()
        raise
    finally:
        pool.shutdown(wait=True)  # no thread may touch the store once this returns


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
    with _work_database(shared.store.con, f"{_WORK}b{index}", lock=shared.lock) as cur:
        return kineto_batch.try_read_kineto_batch(
            [f.path for f in files], ranks=[None] * len(files), con=cur, tmp_dir=shared.tmp
        )


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


def _read_file(shared: _Shared, trace: TraceFile, index: int) -> TraceTables:
    """Read one file; a Kineto file's events go straight into the store's ``event`` table.

    The Kineto reader runs on a cursor of its own, in a database of its own dropped after the
    file: the store's transaction must not touch that database (a transaction keeps every
    database it read alive until it ends), so the events cross over as a stream of Arrow batches
    that the store's connection appends (``append._stream_events``). The work database is in
    memory, which is faster (no compressed write), unless the trace is larger than the memory
    limit (``works_on_disk``): then it is a file, its tables compressed there and evicted by
    DuckDB, which bounds the peak and keeps the spill of a trace many times the limit small.
    """
    if trace.format != "kineto":
        return read_trace(trace, rank=shared.ranks.get(trace.path))
    store = shared.store
    on_disk = _works_on_disk(trace.path, shared.memory_limit)

    def append(the_rank: int, events: duckdb.DuckDBPyRelation) -> None:
        with shared.lock:
            if shared.stop.is_set():  # another file failed: the transaction will roll back
                msg = f"{trace.path}: not written, the ingest failed on another file"
                raise PrismError(msg)
            shared.claim(trace.path, [the_rank])
            _stream_events(store.con, shared.run_id, trace.path, events)

    work = shared.tmp / f"work{index}.duckdb" if on_disk else None
    with _work_database(store.con, f"{_WORK}{index}", file=work, lock=shared.lock) as cur:
        return kineto_reader.stage_kineto(
            trace.path,
            con=cur,
            events_into=append,
            rank=shared.ranks.get(trace.path),
            tmp_dir=shared.tmp,
        )

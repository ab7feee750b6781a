"""Files read in other processes (``--workers``) or on a cluster (``--engine dask``), as parts.

Ingest's driver owns the store and its one transaction; everything else about a file (parsing,
the Kineto reader's SQL, nesting) is the file's own and can run anywhere. ``parse_file`` does
that work for one file in a worker and hands back a ``FilePart``: the file's small frames
(tracks, flows, collectives, ...) in memory, and its events, the one table as large as the
trace, written as a Parquet file under a scratch directory the driver can read. The driver then
appends each part to the store in file order, inside its transaction, exactly as it appends the
rows of a file it read itself, so the stored rows do not depend on where a file was read
(``tests/prism_trace/test_ingest_workers.py``).

Small Kineto files go to a worker in batches (``parse_batch``: one run of the reader's
statements for several files, ``formats/kineto/batch.py``), about one batch a worker; a batch
that cannot be read as one is read file by file, each file's error raised at its turn. A
batch's events come back in its frames, not as parts: they are small, and the pipe is cheaper
than Parquet written and read back.

A worker process sets up DuckDB once (``_connection``) and reuses it for every file it gets: a
file costs an in-memory work database attached and detached, not a new connection, and the
worker's imports (DuckDB, polars) are paid once per worker, not once per file.

Two engines run ``parse_file``:

- ``local``: a ``ProcessPoolExecutor`` of ``workers`` processes forked from a fork server that
  imported the readers once (``spawn`` where there is no fork server): the driver's DuckDB
  threads must not be forked. As with any ``multiprocessing`` code, a script that calls
  ``ingest(..., workers=N)`` must do so under ``if __name__ == "__main__":``. The CLI instead
  forks its workers from itself before it opens the store (``preforked``), which saves each
  ingest the fork server's start (a fresh interpreter importing DuckDB, polars, the readers).
- ``dask``: ``dask.distributed`` (the ``prism-trace[cluster]`` extra), on a scheduler given by
  address or on a ``LocalCluster`` of ``workers`` processes. The trace paths and the scratch
  directory must then be visible to every worker under the same names (a shared file system).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import multiprocessing
import os
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import duckdb

from prism_trace.errors import ProcessFailedError, UsageError
from prism_trace.formats.base import TraceTables
from prism_trace.formats.kineto import batch as kineto_batch
from prism_trace.formats.kineto import reader as kineto_reader
from prism_trace.ingestion.discover import TraceFile
from prism_trace.ingestion.readers import (
    _batch_candidates,
    _work_database,
    _works_on_disk,
    read_trace,
)

__all__ = [
    "Engine",
    "FileJob",
    "FilePart",
    "parse_file",
    "parts",
    "preforked",
    "preforked_workers",
]

Engine = Literal["local", "dask"]


@dataclass(frozen=True)
class FileJob:
    """One file to read in a worker, and where its parts go.

    Attributes:
        index: the file's place in the ingest (names its parts).
        trace: the file and its detected format.
        rank: the rank to read the file with (``pairing.file_ranks``), if any.
        out_dir: where the worker writes the file's events (Parquet); the driver reads them.
        threads: DuckDB threads of the worker's connection (set when it is made).
        memory_limit: DuckDB memory limit of the worker's connection, bytes.
    """

    index: int
    trace: TraceFile
    rank: int | None
    out_dir: Path
    threads: int
    memory_limit: int


@dataclass
class FilePart:
    """What a worker hands back for one file.

    Attributes:
        tables: the file's frames, conformed; ``events`` empty when they are in a part.
        events_path: the Parquet file holding its events (``FRAME_SCHEMAS["events"]`` columns,
            in the order the driver stores them); None when the file has none, or when they are
            in ``tables`` (a file of a batch).
        event_ranks: the ranks its events belong to.
    """

    tables: TraceTables
    events_path: Path | None
    event_ranks: list[int]


# The worker's one DuckDB connection, made on its first file (``_connection``), and the memory
# limit it was made with (a long-lived dask worker keeps its first job's).
_CON: duckdb.DuckDBPyConnection | None = None
_CON_LIMIT: float = 0.0
_CON_LOCK = threading.Lock()


def _connection(threads: int, memory_limit: int) -> duckdb.DuckDBPyConnection:
    """The worker's connection: made once, with the first job's thread count and memory limit.

    ``preserve_insertion_order`` stays on (DuckDB's default): the Kineto reader numbers records
    by the order a CREATE TABLE AS keeps, and the events part must keep ``event_id`` order.
    """
    global _CON, _CON_LIMIT  # one connection per worker process, by design
    with _CON_LOCK:
        if _CON is None:
            _CON_LIMIT = float(memory_limit)
            _CON = duckdb.connect(
                config={
                    "threads": max(1, threads),
                    "memory_limit": f"{memory_limit}B",
                    "preserve_insertion_order": True,
                }
            )
        return _CON


# What a worker imports before its first file (in the fork server, when there is one).
_PRELOAD = (
    "prism_trace.ingestion.parts",
    "prism_trace.ingestion.pipeline",
    "prism_trace.formats.kineto.reader",
    "prism_trace.formats.kineto.batch",
)


def _warm(threads: int, memory_limit: int) -> None:
    """Pool initializer: import the readers and make the connection before the first file."""
    for module in _PRELOAD:
        importlib.import_module(module)
    _connection(threads, memory_limit)


def parse_file(job: FileJob) -> FilePart:
    """Read one file in a worker; its events go to a Parquet part under ``job.out_dir``.

    Raises:
        The reader's errors (``TraceFormatError`` and its kin), which name the file; the driver
        re-raises the first one in file order.
    """
    out = job.out_dir / f"events{job.index:06d}.parquet"
    if job.trace.format != "kineto":
        t = read_trace(job.trace, rank=job.rank)
        if t.events.is_empty():
            return FilePart(t, None, [])
        ranks = sorted(t.events["rank"].unique().to_list())
        t.events.write_parquet(out)
        t.events = t.events.clear()
        return FilePart(t, out, ranks)
    return _parse_kineto(job, out)


def _parse_kineto(job: FileJob, out: Path) -> FilePart:
    """The Kineto reader on the worker's connection, in a work database of its own (a file for
    a large trace: the same rule as the driver's own path)."""
    con = _connection(job.threads, job.memory_limit)
    on_disk = _works_on_disk(job.trace.path, _CON_LIMIT)
    work = job.out_dir / f"work{job.index:06d}.duckdb" if on_disk else None
    seen: list[int] = []

    def write(rank: int, events: duckdb.DuckDBPyRelation) -> None:
        events.to_parquet(str(out))
        seen.append(rank)

    alias = f"_prism_part{job.index}"
    with _work_database(con, alias, file=work, spill_to=job.out_dir) as cur:
        t = kineto_reader.stage_kineto(
            job.trace.path, con=cur, events_into=write, rank=job.rank, tmp_dir=job.out_dir
        )
    return FilePart(t, out if seen else None, seen)


def parse_batch(jobs: list[FileJob]) -> list[FilePart | Exception]:
    """Read several small Kineto files in a worker in one batch (``kineto_batch``).

    Where the batch cannot be read as one, its files are read one by one (``parse_file``) up to
    the first that fails, whose error takes its place in the list: the driver raises it when it
    comes to that file, as it would had the files been read one by one.
    """
    if len(jobs) > 1:
        got = _parse_kineto_batch(jobs)
        if got is not None:
            return list(got)
    out: list[FilePart | Exception] = []
    for job in jobs:
        try:
            out.append(parse_file(job))
        except Exception as exc:  # raised in the driver at this file's turn
            out.append(exc)
            break
    return out


def _parse_kineto_batch(jobs: list[FileJob]) -> list[FilePart] | None:
    """The batch read on the worker's connection, in a work database of its own; each file's
    events come back in its frames (no Parquet part)."""
    first = jobs[0]
    con = _connection(first.threads, first.memory_limit)
    alias = f"_prism_batch{first.index}"
    with _work_database(con, alias, spill_to=first.out_dir) as cur:
        got = kineto_batch.try_read_kineto_batch(
            [j.trace.path for j in jobs],
            ranks=[j.rank for j in jobs],
            con=cur,
            tmp_dir=first.out_dir,
        )
    if got is None:
        return None
    # The events stay in the frames: a batch is small files (``kineto_batch.BATCH_TOTAL_BYTES``
    # of JSON at most), whose frames the pipe carries faster than a Parquet part written here
    # and read back by the driver (zstd both ways).
    return [FilePart(t, None, t.rank_ids) for t in got]


@contextlib.contextmanager
def parts(
    files: list[TraceFile],
    *,
    ranks: dict[Path, int],
    out_dir: Path,
    workers: int,
    memory_limit: int,
    engine: Engine = "local",
    scheduler: str | None = None,
) -> Iterator[Iterator[FilePart]]:
    """Read ``files`` on ``engine``; yield their parts one by one, in file order.

    Every file is submitted at once and read as workers come free; the parts come back in the
    order of ``files`` whichever worker finished first, so the driver stores them in the same
    order as it would read them itself. On leaving (after a failure too) files not yet started
    are cancelled and the workers stopped.
    """
    n = max(1, min(workers, len(files)))
    threads = max(1, (os.cpu_count() or 1) // n)
    jobs = [
        FileJob(i, f, ranks.get(f.path), out_dir, threads, memory_limit)
        for i, f in enumerate(files)
    ]
    if engine == "dask":
        with _dask_parts(jobs, workers=n, scheduler=scheduler) as it:
            yield it
        return
    planned = kineto_batch.plan_batches(_batch_candidates(files, ranks), n)
    batches = [[jobs[i] for i in b] for b in planned]
    forked = _PREFORKED
    if forked is not None and forked[1] >= n:
        futures = [forked[0].submit(parse_batch, b) for b in batches]
        try:
            yield _results(futures, [[j.trace for j in b] for b in batches])
        finally:
            for fut in futures:  # the pool is ``preforked``'s: only this ingest's files stop
                fut.cancel()
            concurrent.futures.wait(futures)
        return
    pool = ProcessPoolExecutor(
        max_workers=n,
        mp_context=_context(),
        initializer=_warm,
        initargs=(threads, memory_limit),
    )
    futures = [pool.submit(parse_batch, b) for b in batches]
    try:
        yield _results(futures, [[j.trace for j in b] for b in batches])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# Worker processes forked by ``preforked``, and how many; None outside it.
_PREFORKED: tuple[ProcessPoolExecutor, int] | None = None


def preforked_workers() -> int:
    """How many worker processes ``preforked`` holds now (0 outside it)."""
    return 0 if _PREFORKED is None else _PREFORKED[1]


# Threads a process may run and still be forked safely: idle helpers of the allocator and of
# polars that exist from import on (the fork server's workers are forked with them too).
_FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd", "polars-ooc-clea"})


def _safe_to_fork() -> bool:
    """Whether this process is as a fork server's is when it forks: modules imported, nothing
    started. No other Python thread, no DuckDB connection object alive (open or closed: a
    closed one cannot be told apart without using it), and no OS thread but the import-time
    helpers (``_FORK_SAFE_THREADS``) and at most one a core named as the main thread (the main
    thread and BLAS's pool; a DuckDB database or polars' thread pool adds more, or others).
    False where threads cannot be listed (no ``/proc``): the fork server is used there.
    """
    import gc
    import threading

    if threading.active_count() > 1:
        return False
    try:
        main_name = Path("/proc/self/comm").read_text().strip()
        names = [
            Path(f"/proc/self/task/{t}/comm").read_text().strip()
            for t in os.listdir("/proc/self/task")
        ]
    except OSError:
        return False
    others = [n for n in names if n not in _FORK_SAFE_THREADS]
    if any(n != main_name for n in others) or len(others) > (os.cpu_count() or 1):
        return False
    return not any(isinstance(o, duckdb.DuckDBPyConnection) for o in gc.get_objects())


def _noop() -> None:
    """A task that makes the pool fork its processes."""


@contextlib.contextmanager
def preforked(workers: int) -> Iterator[None]:
    """Fork ``workers`` worker processes now, for the ingests of this process to read with.

    A forked worker starts as a copy of this process: the readers, DuckDB and polars already
    imported, in milliseconds, where a fork server's worker first imports them in a fresh
    interpreter (~0.6 s on 2 cores, before it reads a file; the 32 DLRM ranks read in ~1.3 s).
    But a fork also copies any DuckDB database this process has open without the threads that
    run it, and DuckDB's state is not fork-safe (duckdb/duckdb-python#292), so this must be
    called before this process opens any DuckDB connection: the CLI calls it before it opens
    the store. The workers then hold what the fork server's workers hold: imported modules,
    no database, no polars thread pool; each opens its own connection (``_connection``). Does
    nothing (``parts`` then starts a pool of its own, from the fork server) for fewer than 2
    workers, where there is no ``fork``, inside another ``preforked``, or where this process
    has started more than its imports did (``_safe_to_fork``: a DuckDB connection, polars'
    thread pool, a thread; as a test runner invoking the CLI in its own process has).
    """
    global _PREFORKED  # one pool per process, for the ingests run inside the block
    if (
        workers < 2
        or _PREFORKED is not None
        or "fork" not in multiprocessing.get_all_start_methods()
        or not _safe_to_fork()
    ):
        yield
        return
    for module in _PRELOAD:
        importlib.import_module(module)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))
    with warnings.catch_warnings():
        # Python >= 3.12 warns on any fork of a process with threads; ours are the allocator's
        # and polars' idle helper threads, which the fork server's workers are forked with too.
        warnings.simplefilter("ignore", DeprecationWarning)
        pool.submit(_noop).result()  # a fork pool forks all its processes on the first task
    _PREFORKED = (pool, workers)
    try:
        yield
    finally:
        _PREFORKED = None
        pool.shutdown(wait=True, cancel_futures=True)


def _context() -> multiprocessing.context.BaseContext:
    """``forkserver`` where the platform has it, else ``spawn``; never a plain ``fork``.

    The driver holds DuckDB (and its threads) open, which a fork would copy in an unknown state.
    A fork server is a fresh process that imports the readers once (``_PRELOAD``) and forks each
    worker from there, so N workers cost one import, not N; it lives as long as the driver, so a
    second ingest in the same process starts its workers without importing again.
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        return ctx
    return multiprocessing.get_context("spawn")


def _results(
    futures: list[Future[list[FilePart | Exception]]], batches: list[list[TraceFile]]
) -> Iterator[FilePart]:
    """The parts in file order; a worker that died (killed for memory, say) named by its file
    (the first of its batch); a file's error raised at its turn."""
    for fut, files in zip(futures, batches, strict=True):
        try:
            got = fut.result()
        except BrokenProcessPool:
            msg = (
                f"{files[0].path}: the worker process reading it (or another file) died, e.g."
                " killed for memory; try fewer --workers"
            )
            raise ProcessFailedError(msg) from None
        for part in got:
            if isinstance(part, Exception):
                raise part
            yield part


@contextlib.contextmanager
def _dask_parts(
    jobs: list[FileJob], *, workers: int, scheduler: str | None
) -> Iterator[Iterator[FilePart]]:
    """``parts`` on dask.distributed: the scheduler at ``scheduler``, or a local cluster."""
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        msg = "--engine dask needs dask.distributed: pip install 'prism-trace[cluster]'"
        raise UsageError(msg) from None
    with contextlib.ExitStack() as stack:
        if scheduler is None:
            import logging

            cluster: Any = stack.enter_context(
                LocalCluster(
                    n_workers=workers,
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=None,
                    silence_logs=logging.ERROR,
                )
            )
            client = stack.enter_context(Client(cluster))
        else:
            client = stack.enter_context(Client(scheduler))
        futures = client.map(parse_file, jobs, pure=False)
        try:
            yield (fut.result() for fut in futures)
        finally:
            client.cancel(futures)

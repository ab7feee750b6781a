"""Where an ingest reads its files: in this process, or by how many worker processes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from prism_trace.formats.kineto.json_array import json_size_guess
from prism_trace.ingestion.discover import Found, TraceFile
from prism_trace.ingestion.parts import Engine, preforked_workers

__all__ = ["reader_processes"]

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
                forked = preforked_workers() > 1
            least = _PARALLEL_MIN_BYTES_FORKED if forked else _PARALLEL_MIN_BYTES_SERVER
            if sum(json_size_guess(f.path) for f in files) < least:
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


def reader_processes(found: Found, *, workers: int | Literal["auto"] = "auto") -> int:
    """How many worker processes ``ingest`` would read ``found``'s files with, were they forked
    from a warm process (``ingest_parts.preforked``); 0 when it would read them here.

    The CLI asks before it opens the store, to fork that many (a fork must come before any
    DuckDB connection), then hands ``found`` to ``ingest``; a set ``ingest`` would refuse (no
    files, or ``discover`` failed) gives 0 (``ingest`` then says why).
    """
    auto = workers == "auto"
    n = (os.cpu_count() or 1) if workers == "auto" else workers
    if found.error is not None or not found.files:
        return 0
    return _Plan(workers=n, auto=auto).processes(found.files, forked=True)

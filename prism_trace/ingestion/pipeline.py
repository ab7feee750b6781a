"""Ingest: discover → read → check → link → derive → write, all or nothing.

The whole ingest is one DuckDB transaction on the store: the files' rows are appended in file
order as they are read, one append per table for many files (``ingest_append.Pending``; a large
Kineto file's events stream from its work database straight into ``event``), and any failure
(a bad file, a rank or run-name clash, a full disk) rolls everything back, so a failed ingest
leaves the store exactly as it was. Rows are written once: there is no staging copy.
With several workers the files are read in other processes (or on a dask cluster) and each file's
events come back as a Parquet part that this process appends, in file order, inside the same
transaction (``ingest_parts``). ``ingesting`` leaves that transaction open for the caller's own
writes (``prism ingest --layout``), which then commit or roll back with the run.

This module is the driver; the steps are its neighbours': finding the files (``discover``), where
they are read (``plan``, ``read``, ``parts``), the rank book-keeping and checks (``ranks``), the
writes (``append``), the columns derived across files (``derive``) and the linking of host ETs
(``link``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import duckdb
import polars as pl
from tqdm import tqdm

from prism_trace.errors import TraceFormatError, UsageError
from prism_trace.formats.base import FRAME_SCHEMAS
from prism_trace.graph.matching import check_member_counts, settle_order_matching
from prism_trace.ingestion import memory as ingest_memory
from prism_trace.ingestion.append import Pending, _stored
from prism_trace.ingestion.derive import (
    _TIMELINE_PRIORITY,
    _concat,
    _merge_groups,
    _number,
    _rank_rows,
    assign_iteration,
    fill_sizes,
)
from prism_trace.ingestion.discover import FormatArg, Found, TraceFile, find, no_trace_message
from prism_trace.ingestion.pairing import file_ranks
from prism_trace.ingestion.parts import Engine
from prism_trace.ingestion.plan import _Plan
from prism_trace.ingestion.ranks import (
    _check_bounds,
    _check_fingerprints,
    _RankBook,
    _WorldSizes,
)
from prism_trace.ingestion.read import _hold_part, _reading, _Shared
from prism_trace.ingestion.settings import _ingest_settings
from prism_trace.store.connection import Store
from prism_trace.store.write import (
    RUN_TABLES,
    append,
    claim_run_name,
    drop_run,
    new_run,
    next_run_id,
)

__all__ = ["IngestReport", "ingest", "ingesting"]


@dataclass
class IngestReport:
    """What an ingest wrote: enough for the CLI to print and for tests to assert."""

    run: str
    run_id: int
    world_size: int
    ranks: list[int]
    files: list[tuple[str, str, list[int]]]
    skipped: list[str]
    rows: dict[str, int] = field(default_factory=dict)
    et_ops: dict[int, int] = field(default_factory=dict)
    et_ops_linked: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "run": self.run,
            "run_id": self.run_id,
            "world_size": self.world_size,
            "ranks": self.ranks,
            "files": [{"path": p, "format": f, "ranks": r} for p, f, r in self.files],
            "skipped": self.skipped,
            "rows": self.rows,
            "et_ops": self.et_ops,
            "et_ops_linked": self.et_ops_linked,
        }


def _link_rank(
    con: duckdb.DuckDBPyConnection, run_id: int, rank: int, ops: pl.DataFrame
) -> tuple[pl.DataFrame, int]:
    """Link one rank's host ET ops to its Kineto events already written by this ingest."""
    # Imported here: only a run with host ETs pays for the linker and the host ET reader.
    from prism_trace.ingestion.link import HOST_CATEGORIES, link_et_to_kineto

    cols = ", ".join(FRAME_SCHEMAS["events"])
    cats = ", ".join(f"'{c}'" for c in HOST_CATEGORIES)
    events = con.sql(
        f"SELECT {cols} FROM event WHERE run_id = $1 AND rank = $2 AND category IN ({cats})",
        params=[run_id, rank],
    ).pl()
    linked, report = link_et_to_kineto(ops, events)
    return linked, report.linked


# Files read at the same time (worker processes), by default; the CLI's default is the cores.
_WORKERS = 1


def ingest(
    store: Store,
    paths: list[Path],
    *,
    run: str,
    format: FormatArg = "auto",
    rank: int | None = None,
    replace: bool = False,
    progress: bool = True,
    workers: int | Literal["auto"] | None = None,
    engine: Engine = "local",
    scheduler: str | None = None,
    scratch: Path | None = None,
    jobs: int | None = None,
    found: Found | None = None,
    allow_empty: bool = False,
    allow_cycles: bool = False,
) -> IngestReport:
    """Ingest the traces under ``paths`` as one recorded run.

    The whole ingest is one store transaction, so any failure (a bad file, a rank clash, a full
    disk) rolls back and leaves the store exactly as it was. Inside it, each file is read and its
    rows appended to the store's tables as the file is done; DuckDB writes large uncommitted
    appends to the database file as they come (and frees them on rollback), so memory holds one
    file's work, not the job's. A Kineto file is worked on in a scratch database of its own, and
    its events stream from there into the store without being made a frame.

    Args:
        store: an open, writable store.
        paths: files or folders holding the ranks of one job.
        run: the run name; must be new unless ``replace``.
        format: force a format instead of detecting it per file.
        rank: the rank of one rank's files (a trace, its host ET) that do not tell it; without
            it, a host ET takes the rank of the Kineto trace it pairs with (``pairing``).
        replace: overwrite an existing run of that name (atomically).
        progress: show a progress bar (stderr).
        workers: files read at the same time (default ``_WORKERS``). With one, files are read
            in this process; with more (and more than one file), in that many worker processes,
            each of which hands its files' events back as Parquet parts
            (``prism_trace.ingestion.parts``). More is faster on idle cores, but each file in
            flight holds its own work tables. ``"auto"`` (the CLI's default): up to one a core,
            but a set too small for workers to pay is read here (``ingest_plan._Plan``:
            docs/ingest.md, "How many workers"). The stored rows are the same either way.
        engine: ``local`` (worker processes on this machine) or ``dask`` (dask.distributed,
            the ``prism-trace[cluster]`` extra; every file is read by a dask worker).
        scheduler: with ``engine="dask"``, the scheduler's address; default: a local cluster
            of ``workers`` processes.
        scratch: where the work files and parts go (default: the system temp dir); with a
            remote dask scheduler, a directory every worker sees under the same path.
        jobs: the former name of ``workers`` (deprecated).
        found: ``discover``'s answer for ``paths`` and ``format`` when the caller has it
            already (``discover.find``: the CLI, which plans its worker fork on it), so the
            files are not looked for twice; default: found here.
        allow_empty: keep a rank whose trace holds nothing (an empty ``traceEvents`` or
            ``nodes``); by default such a file is refused, since a rank of no rows reads as a
            rank that did nothing.
        allow_cycles: keep a Chakra graph whose dependencies form a cycle (the 2023 PyTorch
            converter wrote some); by default refused, since emulate and slice cannot order it.

    Returns:
        What was written.

    Raises:
        DuplicateRunError: the run exists and ``replace`` is false.
        DuplicateRankError: a rank appears twice, or a file was already ingested.
        TraceFormatError: a file is bad (its subclasses say how).
        OutOfMemoryError: DuckDB ran out of its memory limit (``ingest_memory``).
        PrismError: ``PRISM_INGEST_MEMORY_LIMIT`` is not a size of at least 256 MB, or another
            argument is invalid.
    """
    with ingesting(
        store,
        paths,
        run=run,
        format=format,
        rank=rank,
        replace=replace,
        progress=progress,
        workers=workers,
        engine=engine,
        scheduler=scheduler,
        scratch=scratch,
        jobs=jobs,
        found=found,
        allow_empty=allow_empty,
        allow_cycles=allow_cycles,
    ) as report:
        return report


@contextlib.contextmanager
def ingesting(
    store: Store,
    paths: list[Path],
    *,
    run: str,
    format: FormatArg = "auto",
    rank: int | None = None,
    replace: bool = False,
    progress: bool = True,
    workers: int | Literal["auto"] | None = None,
    engine: Engine = "local",
    scheduler: str | None = None,
    scratch: Path | None = None,
    jobs: int | None = None,
    found: Found | None = None,
    allow_empty: bool = False,
    allow_cycles: bool = False,
) -> Iterator[IngestReport]:
    """``ingest``, its transaction open around the caller's block: what the block writes on
    ``store`` commits with the run, and what it raises rolls the run back with it (a replaced
    run is then as it was). ``prism ingest --layout`` declares the layout there.

    The block runs before the ingest's DuckDB settings are put back (``_ingest_settings``):
    they are the whole database's, and a failed statement leaves the transaction unable to
    run any other until it is rolled back, so the transaction must end first.

    Args and raises: as ``ingest``.
    """
    auto = workers == "auto"
    if workers == "auto":
        workers = os.cpu_count() or 1
    workers = workers if workers is not None else jobs if jobs is not None else _WORKERS
    if not isinstance(workers, int) or workers < 1:
        msg = f"--workers must be at least 1, got {workers}"
        raise UsageError(msg)
    if engine not in ("local", "dask"):
        msg = f"--engine must be local or dask, got {engine!r}"
        raise UsageError(msg)
    if engine == "dask" and scheduler is not None and scratch is None:
        msg = "--scheduler needs --scratch: a directory every dask worker sees at the same path"
        raise UsageError(msg)
    if found is not None and (found.paths != list(paths) or found.format != format):
        msg = f"found is discover's answer for {found.paths} ({found.format}), not {paths}"
        raise UsageError(msg)
    memory_limit = ingest_memory.ingest_memory_limit()  # a bad variable stops it here
    old_id = claim_run_name(store, run, replace=replace)
    files, skipped = (found or find(paths, format=format)).checked()
    if not files:
        raise TraceFormatError(no_trace_message(list(paths), skipped))
    read_with = file_ranks(files, rank)  # --rank for one rank's files; an ET's from its pair
    # Timelines first, so a host ET can be linked to its rank's Kineto events already written.
    files.sort(key=lambda f: f.format == "host_et")
    prints = _check_fingerprints(store, files, old_id)
    with (
        tempfile.TemporaryDirectory(prefix="prism-ingest-", dir=scratch) as tmp,
        _ingest_settings(store, memory_limit) as limit_in_force,
        store.transaction() as con,
    ):
        if old_id is not None:
            drop_run(con, old_id)
        yield _ingest_files(
            store,
            run_id=next_run_id(con),
            tmp=Path(tmp),
            files=files,
            skipped=skipped,
            prints=prints,
            paths=paths,
            run=run,
            format=format,
            read_with=read_with,
            progress=progress,
            plan=_Plan(workers=workers, engine=engine, scheduler=scheduler, auto=auto),
            memory_limit=limit_in_force,
            allow=_Allow(empty=allow_empty, cycles=allow_cycles),
        )


def _ingest_files(
    store: Store,
    *,
    run_id: int,
    tmp: Path,
    files: list[TraceFile],
    skipped: list[Path],
    prints: list[str],
    paths: list[Path],
    run: str,
    format: str,
    read_with: dict[Path, int],
    progress: bool,
    plan: _Plan,
    memory_limit: float,
    allow: _Allow,
) -> IngestReport:
    """Append every file's rows to the store under ``run_id`` (inside the caller's transaction).

    Collectives and p2p calls wait in memory (they are few) until every file has named its
    groups, which mints the group ids they are stored with.
    """
    con = store.con
    shared = _Shared(
        store=store, run_id=run_id, tmp=tmp, ranks=read_with, memory_limit=memory_limit
    )
    book = _RankBook()
    rank_frames: list[pl.DataFrame] = []
    group_frames: list[pl.DataFrame] = []
    coll_frames: list[pl.DataFrame] = []
    p2p_frames: list[pl.DataFrame] = []
    comm_names: set[str] = set()
    sizes: list[int] = []
    et_counts: dict[int, tuple[int, int]] = {}
    formats: set[str] = set()
    graph_files: dict[int, Path] = {}
    file_ranks: list[list[int]] = []
    sources: list[list[object]] = []
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    total = sum(f.path.stat().st_size for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="ingest")
    pending = Pending(run_id)
    worlds = _WorldSizes()
    with contextlib.closing(bar), _reading(shared, files, plan) as results:
        for f, fp, (t, part) in zip(files, prints, results, strict=True):
            _check_bounds(t)
            if t.cycle is not None and not allow.cycles:
                msg = (
                    f"{t.path}: {t.cycle}; emulate and slice cannot order it (--allow-cycles"
                    " ingests it anyway)"
                )
                raise TraceFormatError(msg)
            if t.world_size:
                worlds.check(t.path, t.world_size)
            with shared.lock, _stored(f.path):
                book.add(t)
                file_ranks.append(t.rank_ids)
                formats.add(t.format)
                if t.format == "chakra":  # a graph: whole iterations (check_member_counts)
                    graph_files.update(dict.fromkeys(t.rank_ids, t.path))
                if t.world_size:
                    sizes.append(t.world_size)
                rank_frames.append(t.ranks.with_columns(_prio=pl.lit(_TIMELINE_PRIORITY[t.format])))
                group_frames.append(t.comm_groups)
                mine = t.rank_ids
                if t.format == "host_et":
                    # Timeline frames come from the rank's timeline source when it has one.
                    mine = [r for r in t.rank_ids if r not in book.timeline]
                    pending.flush(con)  # the rank's Kineto events must be in the store
                    for r in t.rank_ids:
                        ops = t.et_ops.filter(pl.col("rank") == r)
                        n_linked = 0
                        if book.timeline.get(r, ("",))[0] == "kineto":
                            ops, n_linked = _link_rank(con, run_id, r, ops)
                        et_counts[r] = (ops.height, n_linked)
                        pending.add("et_op", f.path, ops)
                else:
                    pending.add("et_op", f.path, t.et_ops)
                keep = pl.col("rank").is_in(mine)
                iterations = t.iterations.filter(keep)
                colls = _number(t.collectives.filter(keep), ["rank", "group_name"])
                p2p = _number(t.p2p.filter(keep), ["rank", "group_name", "peer", "direction"])
                comm_names |= set(colls["group_name"].drop_nulls()) | set(
                    p2p["group_name"].drop_nulls()
                )
                events = t.events.filter(keep)
                shared.claim(t.path, events["rank"].unique().to_list())
                pending.add("track", f.path, t.tracks.filter(keep))
                pending.add("event", f.path, events)
                if part is not None:
                    _hold_part(shared, pending, part, mine)
                pending.add("flow", f.path, t.flows.filter(keep))
                pending.add("iteration", f.path, iterations)
                pending.add(
                    "memory", f.path, assign_iteration(t.memory.filter(keep), "ts", iterations)
                )
                if pending.full():
                    pending.flush(con)
            coll_frames.append(assign_iteration(colls, "host_ts", iterations))
            p2p_frames.append(assign_iteration(p2p, "host_ts", iterations))
            size = f.path.stat().st_size
            one = t.rank_ids[0] if len(t.rank_ids) == 1 else None
            sources.append([one, str(f.path.resolve()), t.format, size, fp, now])
            bar.update(size)
            del t, events, part
        with shared.lock:
            pending.flush(con)

    if not allow.empty:
        _check_not_empty(con, run_id, book, {r: n for r, (n, _) in et_counts.items()})
    ranks = book.ranks
    world = max([*sizes, max(ranks) + 1])  # ranks and sizes are within MAX_RANKS (_check_bounds)
    if worlds.first is not None:
        _check_peers(p2p_frames, files, worlds.first)
    groups = _merge_groups(group_frames, comm_names, world)
    calls = _concat(coll_frames)
    check_member_counts(calls, groups, graph_files)
    colls = fill_sizes(calls, groups)
    colls, groups, matching = settle_order_matching(colls, groups, ranks)
    coll_frames = [colls]
    rank_rows = _rank_rows(rank_frames, et_counts)
    config = {"paths": [str(p) for p in paths], "format": format, "comm_matching": matching}
    source_format = formats.pop() if len(formats) == 1 else "mixed"
    new_run(
        con,
        name=run,
        kind="recorded",
        world_size=world,
        source_format=source_format,
        config=config,
        run_id=run_id,
    )
    append(con, "comm_group", run_id=run_id, df=groups)
    append(con, "rank", run_id=run_id, df=rank_rows)
    group_ids = groups.select(pl.col("name").alias("group_name"), "group_id")
    for tbl, frames in (("collective", coll_frames), ("p2p", p2p_frames)):
        calls = _concat(frames)
        if not calls.is_empty():
            calls = calls.join(group_ids, on="group_name", how="left", nulls_equal=False)
        append(con, tbl, run_id=run_id, df=calls)
    con.executemany(
        "INSERT INTO source_file VALUES (?, ?, ?, ?, ?, ?, ?)", [[run_id, *s] for s in sources]
    )
    counts = {tbl: _count(con, tbl, run_id) for tbl in RUN_TABLES}
    return IngestReport(
        run=run,
        run_id=run_id,
        world_size=world,
        ranks=ranks,
        files=[(str(f.path), f.format, r) for f, r in zip(files, file_ranks, strict=True)],
        skipped=[str(p) for p in skipped],
        rows=counts,
        et_ops={r: v[0] for r, v in et_counts.items()},
        et_ops_linked={r: v[1] for r, v in et_counts.items()},
    )


def _check_peers(
    p2p_frames: list[pl.DataFrame], files: list[TraceFile], stated: tuple[int, Path]
) -> None:
    """Refuse a point-to-point peer outside the world a file states (a Chakra ``comm_dst`` of
    10**6 in a world of 8): it names a rank that cannot exist, and every schedule built from
    the run would wait on it."""
    world, where = stated
    for f, p2p in zip(files, p2p_frames, strict=True):
        if p2p.is_empty():
            continue
        out = p2p.filter(pl.col("peer") >= world)
        if out.height:
            row = out.row(0, named=True)
            msg = (
                f"{f.path}: rank {row['rank']}'s {row['direction']} of event {row['event_id']}"
                f" names peer {row['peer']}, outside the world of {world} ranks that {where}"
                " states"
            )
            raise TraceFormatError(msg)


@dataclass(frozen=True)
class _Allow:
    """What the user allows that ingest otherwise refuses (``ingest``'s ``allow_*``)."""

    empty: bool = False
    cycles: bool = False


def _check_not_empty(
    con: duckdb.DuckDBPyConnection, run_id: int, book: _RankBook, et_ops: dict[int, int]
) -> None:
    """Refuse a rank whose timeline file gave no event, or whose host ET gave no node: an
    empty ``traceEvents`` or ``nodes`` (or only metadata) would be stored as a rank that did
    nothing, which every analysis would then average in."""
    counts = dict(
        con.execute(
            "SELECT rank, count(*) FROM event WHERE run_id = ? GROUP BY rank", [run_id]
        ).fetchall()
    )
    for r, (_, path) in sorted(book.timeline.items()):
        if not counts.get(r):
            msg = (
                f"{path}: rank {r} holds no events (an empty trace); --allow-empty ingests it"
                " anyway"
            )
            raise TraceFormatError(msg)
    for r, path in sorted(book.host_et.items()):
        if not et_ops.get(r):
            msg = (
                f"{path}: rank {r} holds no nodes (an empty host execution trace);"
                " --allow-empty ingests it anyway"
            )
            raise TraceFormatError(msg)


def _count(con: duckdb.DuckDBPyConnection, table_name: str, run_id: int) -> int:
    """Rows of ``table_name`` the run holds (the report's counts)."""
    row = con.execute(f"SELECT count(*) FROM {table_name} WHERE run_id = ?", [run_id]).fetchall()
    return int(row[0][0])

"""Ingest: discover → read → check → link → derive → write, all or nothing.

The whole ingest is one DuckDB transaction on the store: the files' rows are appended in file
order as they are read, one append per table for many files (``ingest_append.Pending``; a large
Kineto file's events stream from its scratch database straight into ``event``), and any failure
(a bad file, a rank or run-name clash, a full disk) rolls everything back, so a failed ingest
leaves the store exactly as it was. Rows are written once: there is no staging copy.
With several workers the files are read in other processes (or on a dask cluster) and each file's
events come back as a Parquet part that this process appends, in file order, inside the same
transaction (``ingest_parts``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import duckdb
import polars as pl
from tqdm import tqdm

from prism_trace.errors import DuplicateRankError, PrismError, TraceFormatError
from prism_trace.formats.base import FRAME_SCHEMAS, TraceTables
from prism_trace.graph.matching import check_member_counts, settle_order_matching
from prism_trace.ingest import memory as ingest_memory
from prism_trace.ingest.append import Pending
from prism_trace.ingest.discover import TraceFile, discover, fingerprint
from prism_trace.ingest.read import (
    _clash,
    _hold_part,
    _Plan,
    _reading,
    _Shared,
    _stored,
    read_trace,
)
from prism_trace.limits import check_rank, check_world_size
from prism_trace.store.connection import Store
from prism_trace.store.write import (
    RUN_TABLES,
    append,
    claim_run_name,
    drop_run,
    new_run,
    next_run_id,
)

if TYPE_CHECKING:
    from prism_trace.ingest.parts import Engine

__all__ = ["IngestReport", "assign_iteration", "ingest", "read_trace", "reader_processes"]

# Frames concatenated across files into the run's tables, and the table each one fills.
_TABLE_OF_FRAME = {
    "tracks": "track",
    "events": "event",
    "flows": "flow",
    "iterations": "iteration",
    "et_ops": "et_op",
}
# Parallel coordinates a reader may put in a rank's args (directly, or as our generator's
# ``prism_layout`` {"tp_rank": ...}); slicing infers them otherwise.
_AXES = ("tp", "cp", "ep", "dp", "pp")
# Where a rank has several sources, timeline frames come from the best one.
_TIMELINE_PRIORITY: dict[str, int] = {"kineto": 0, "op_timeline": 1, "chakra": 2, "host_et": 3}


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


def _concat(frames: list[pl.DataFrame]) -> pl.DataFrame:
    return pl.concat(frames, how="vertical") if len(frames) > 1 else frames[0]


def _merge_groups(frames: list[pl.DataFrame], comm_names: set[str], world: int) -> pl.DataFrame:
    """One row per group name; member lists from whichever source knows them."""
    groups = _concat(frames).with_columns(has_ranks=pl.col("ranks").is_not_null())
    groups = (
        groups.sort(["name", "has_ranks"], descending=[False, True], nulls_last=True)
        .group_by("name", maintain_order=True)
        .agg(
            pl.col("description").drop_nulls().first(),
            pl.col("backend").drop_nulls().first(),
            pl.col("size").drop_nulls().first(),
            pl.col("ranks").drop_nulls().first(),
        )
    )
    missing = sorted(comm_names - set(groups["name"].to_list()))
    if missing:
        groups = pl.concat(
            [groups, pl.DataFrame({"name": missing}, schema={"name": pl.Utf8})], how="diagonal"
        )
    groups = groups.with_columns(
        size=pl.coalesce(pl.col("size"), pl.col("ranks").list.len().cast(pl.Int32))
    )
    default = list(range(world))
    # The default group "0" spans the world when no source lists its members.
    groups = groups.with_columns(
        ranks=pl.when(pl.col("ranks").is_null() & (pl.col("name") == "0"))
        .then(pl.lit(default, dtype=pl.List(pl.Int32)))
        .otherwise(pl.col("ranks")),
    ).with_columns(size=pl.coalesce(pl.col("size"), pl.col("ranks").list.len().cast(pl.Int32)))
    return (
        groups.sort([pl.col("name").cast(pl.Int64, strict=False), "name"], nulls_last=True)
        .with_row_index("group_id")
        .with_columns(pl.col("group_id").cast(pl.Int32))
    )


def fill_sizes(calls: pl.DataFrame, groups: pl.DataFrame) -> pl.DataFrame:
    """Sizes a reader could not finish without the group's size, from the run's groups.

    A Chakra file without process groups gives an all-gather's input (``comm_size``) but not
    its output, which is ``group size x`` that; the number of files tells the default group's
    size only here. Fills ``group_size``, an all-gather's ``out_bytes`` (a reduce-scatter's:
    ``in / size``) and ``msg_bytes = max(in, out)`` where they are NULL; known values stay.
    """
    need = ("kind", "group_name", "group_size", "in_bytes", "out_bytes", "msg_bytes")
    if calls.is_empty() or any(c not in calls.columns for c in need):
        return calls
    if calls["msg_bytes"].null_count() == 0 and calls["group_size"].null_count() == 0:
        return calls
    sizes = groups.select(pl.col("name").alias("group_name"), pl.col("size").alias("_gsize"))
    n = pl.col("group_size")
    return (
        calls.join(sizes, on="group_name", how="left", maintain_order="left")
        .with_columns(group_size=pl.coalesce(n, pl.col("_gsize")).cast(calls["group_size"].dtype))
        .with_columns(
            out_bytes=pl.coalesce(
                pl.col("out_bytes"),
                pl.when(pl.col("kind") == "all_gather")
                .then(pl.col("in_bytes") * n)
                .when(pl.col("kind") == "reduce_scatter")
                .then(pl.col("in_bytes") // n),
            ).cast(calls["out_bytes"].dtype)
        )
        .with_columns(
            msg_bytes=pl.coalesce(
                pl.col("msg_bytes"), pl.max_horizontal("in_bytes", "out_bytes")
            ).cast(calls["msg_bytes"].dtype)
        )
        .drop("_gsize")
    )


def _number(df: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Fill a null ``seq`` by host-time order within ``keys`` (all rows of a key, or none).

    ``seq_by_order`` says which rows were numbered here: across ranks they are one instance
    only if ``collectives.settle_order_matching`` finds the ranks' sequences agree.
    """
    if df.is_empty() or df["seq"].null_count() == 0:
        return df.with_columns(seq_by_order=pl.lit(value=False))
    by_order = pl.col("seq").null_count().over(keys) > 0
    return df.sort([*keys, "host_ts", "event_id"], nulls_last=True).with_columns(
        seq=pl.when(by_order)
        .then(pl.int_range(pl.len()).over(keys))
        .otherwise(pl.col("seq"))
        .cast(pl.Int64),
        seq_by_order=by_order,
    )


def assign_iteration(df: pl.DataFrame, ts_col: str, iterations: pl.DataFrame) -> pl.DataFrame:
    """Fill a null ``iteration`` from the step window containing ``ts_col`` on the same rank.

    ``iterations`` has ``rank, iteration, ts, dur``; rows outside every window stay null. Used for
    the rows a reader could not place (ingest) and for a replay's allocator rows.
    """
    if df.is_empty() or iterations.is_empty() or df["iteration"].null_count() == 0:
        return df
    steps = iterations.select(
        "rank",
        pl.col("iteration").alias("_it"),
        pl.col("ts").alias("_ts"),
        (pl.col("ts") + pl.col("dur")).alias("_end"),
    ).sort("_ts")
    known = df.filter(pl.col(ts_col).is_not_null()).with_row_index("_row")
    # Both sides are sorted on their time column as a whole, so within every rank too: polars
    # cannot check that itself when ``by`` is given (and warns), so it is told.
    joined = known.sort(ts_col).join_asof(
        steps,
        left_on=ts_col,
        right_on="_ts",
        by="rank",
        strategy="backward",
        check_sortedness=False,
    )
    joined = joined.with_columns(
        iteration=pl.coalesce(
            pl.col("iteration"), pl.when(pl.col(ts_col) < pl.col("_end")).then(pl.col("_it"))
        )
    ).sort("_row")
    return pl.concat(
        [joined.select(df.columns), df.filter(pl.col(ts_col).is_null())], how="vertical"
    )


class _RankBook:
    """Which file gave each rank what, so clashes are caught as files stream in."""

    def __init__(self) -> None:
        self.timeline: dict[int, tuple[str, Path]] = {}
        self.host_et: dict[int, Path] = {}

    def add(self, t: TraceTables) -> None:
        for r in t.rank_ids:
            if t.format == "host_et":
                other = self.host_et.get(r)
                self.host_et[r] = t.path
            else:
                prev = self.timeline.get(r)
                other = None if prev is None else prev[1]
                self.timeline[r] = (t.format, t.path)
            if other is not None:
                raise _clash(t.path, r, other)


def _check_bounds(t: TraceTables) -> None:
    """Whatever a reader let through, no rank or world size beyond ``MAX_RANKS`` is stored:
    ingest builds the default group's member list from them."""
    if t.world_size is not None:
        check_world_size(t.path, t.world_size, "the world size")
    for r in t.rank_ids:
        check_rank(t.path, r, "a rank")
        if t.world_size is not None and r >= t.world_size:
            msg = f"{t.path}: rank {r} is not below the world size {t.world_size} it states"
            raise TraceFormatError(msg)


def _link_rank(con: object, run_id: int, rank: int, ops: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """Link one rank's host ET ops to its Kineto events already written by this ingest."""
    from prism_trace.ingest.link import HOST_CATEGORIES, link_et_to_kineto

    cols = ", ".join(FRAME_SCHEMAS["events"])
    cats = ", ".join(f"'{c}'" for c in HOST_CATEGORIES)
    events = con.sql(  # type: ignore[attr-defined]
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
    format: Literal["auto", "kineto", "host_et", "chakra", "op_timeline"] = "auto",
    rank: int | None = None,
    replace: bool = False,
    progress: bool = True,
    workers: int | Literal["auto"] | None = None,
    engine: Engine = "local",
    scheduler: str | None = None,
    scratch: Path | None = None,
    jobs: int | None = None,
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
        rank: the rank of a single file whose rank cannot be told otherwise.
        replace: overwrite an existing run of that name (atomically).
        progress: show a progress bar (stderr).
        workers: files read at the same time (default ``_WORKERS``). With one, files are read
            in this process; with more (and more than one file), in that many worker processes,
            each of which hands its files' events back as Parquet parts
            (``prism_trace.ingest.parts``). More is faster on idle cores, but each file in
            flight holds its own work tables. ``"auto"`` (the CLI's default): up to one a core,
            but a set too small for workers to pay is read here (``ingest_read._Plan``:
            docs/ingest.md, "How many workers"). The stored rows are the same either way.
        engine: ``local`` (worker processes on this machine) or ``dask`` (dask.distributed,
            the ``prism-trace[cluster]`` extra; every file is read by a dask worker).
        scheduler: with ``engine="dask"``, the scheduler's address; default: a local cluster
            of ``workers`` processes.
        scratch: where the work files and parts go (default: the system temp dir); with a
            remote dask scheduler, a directory every worker sees under the same path.
        jobs: the former name of ``workers`` (deprecated).

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
    auto = workers == "auto"
    if workers == "auto":
        workers = os.cpu_count() or 1
    workers = workers if workers is not None else jobs if jobs is not None else _WORKERS
    if not isinstance(workers, int) or workers < 1:
        msg = f"--workers must be at least 1, got {workers}"
        raise PrismError(msg)
    if engine not in ("local", "dask"):
        msg = f"--engine must be local or dask, got {engine!r}"
        raise PrismError(msg)
    if engine == "dask" and scheduler is not None and scratch is None:
        msg = "--scheduler needs --scratch: a directory every dask worker sees at the same path"
        raise PrismError(msg)
    memory_limit = ingest_memory.ingest_memory_limit()  # a bad variable stops it here
    old_id = claim_run_name(store, run, replace=replace)
    files, skipped = discover(paths, format=format)
    if not files:
        msg = f"{', '.join(map(str, paths))}: no trace files found"
        raise PrismError(msg)
    if rank is not None and len(files) > 1:
        msg = f"{files[0].path}: --rank applies to a single file, but {len(files)} were given"
        raise PrismError(msg)
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
        return _ingest_files(
            store,
            run_id=next_run_id(con),
            tmp=Path(tmp),
            files=files,
            skipped=skipped,
            prints=prints,
            paths=paths,
            run=run,
            format=format,
            rank=rank,
            progress=progress,
            plan=_Plan(workers=workers, engine=engine, scheduler=scheduler, auto=auto),
            memory_limit=limit_in_force,
        )


def reader_processes(
    paths: list[Path],
    *,
    format: Literal["auto", "kineto", "host_et", "chakra", "op_timeline"] = "auto",
    workers: int | Literal["auto"] = "auto",
) -> int:
    """How many worker processes ``ingest`` would read ``paths`` with, were they forked from a
    warm process (``ingest_parts.preforked``); 0 when it would read them here.

    The CLI asks before it opens the store, to fork that many (a fork must come before any
    DuckDB connection); a set ``ingest`` would refuse gives 0 (``ingest`` then says why).
    """
    auto = workers == "auto"
    n = (os.cpu_count() or 1) if workers == "auto" else workers
    try:
        files, _ = discover(paths, format=format)
    except PrismError:
        return 0
    return _Plan(workers=n, auto=auto).processes(files, forked=True) if files else 0


@contextlib.contextmanager
def _ingest_settings(store: Store, memory_limit: int) -> Iterator[float]:
    """DuckDB settings for the ingest, put back afterwards (they are the whole database's);
    yields the memory limit in force, in bytes.

    - ``memory_limit`` set to ``memory_limit`` (``ingest_memory.ingest_memory_limit``) when the
      store's is DuckDB's default (80% of RAM, which lets one large trace's sorts and joins grow
      to several times the file); under it they spill to the store's temporary directory. A
      limit the caller set on the store is kept, and is the one in force. DuckDB shows the limit
      rounded, so ours is put back by RESET.
    - ``preserve_insertion_order`` on: the Kineto reader numbers the records of a trace by the
      order a CREATE TABLE AS keeps (``formats.kineto``).
    """
    con = store.con
    limit_sql = "SELECT current_setting('memory_limit')"
    (limit,) = con.execute(limit_sql).fetchall()[0]
    ours = limit == _default_memory_limit()
    (keep_order,) = con.execute("SELECT current_setting('preserve_insertion_order')").fetchall()[0]
    if ours:
        con.execute(f"SET memory_limit = '{memory_limit}B'")
    con.execute("SET preserve_insertion_order = true")
    try:
        yield memory_limit if ours else ingest_memory.size_bytes(str(limit))
    finally:
        if ours:
            con.execute("RESET memory_limit")
        con.execute(f"SET preserve_insertion_order = {'true' if keep_order else 'false'}")


@functools.cache
def _default_memory_limit() -> str:
    """DuckDB's default ``memory_limit`` as it shows it, asked once a process: opening a
    connection to ask costs ~20 ms, twice an ingest."""
    with duckdb.connect() as fresh:
        (default,) = fresh.execute("SELECT current_setting('memory_limit')").fetchall()[0]
    return str(default)


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
    rank: int | None,
    progress: bool,
    plan: _Plan,
    memory_limit: float,
) -> IngestReport:
    """Append every file's rows to the store under ``run_id`` (inside the caller's transaction).

    Collectives and p2p calls wait in memory (they are few) until every file has named its
    groups, which mints the group ids they are stored with.
    """
    con = store.con
    shared = _Shared(store=store, run_id=run_id, tmp=tmp, rank=rank, memory_limit=memory_limit)
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
    with contextlib.closing(bar), _reading(shared, files, plan) as results:
        for f, fp, (t, part) in zip(files, prints, results, strict=True):
            _check_bounds(t)
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

    ranks = sorted(set(book.timeline) | set(book.host_et))
    world = max([*sizes, max(ranks) + 1])  # ranks and sizes are within MAX_RANKS (_check_bounds)
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


def _check_fingerprints(store: Store, files: list[TraceFile], old_id: int | None) -> list[str]:
    """Refuse a file given twice, or one already ingested into another run of this store."""
    prints = [fingerprint(f.path) for f in files]
    seen_fp: dict[str, Path] = {}
    for f, fp in zip(files, prints, strict=True):
        if fp in seen_fp:
            msg = f"{f.path}: same content as {seen_fp[fp]}; each file may be given once"
            raise DuplicateRankError(msg)
        seen_fp[fp] = f.path
    clash = store.con.execute(
        "SELECT s.path, r.name FROM source_file s JOIN run r USING (run_id)"
        " WHERE s.fingerprint IN (SELECT unnest(?)) AND s.run_id IS DISTINCT FROM ?",
        [list(seen_fp), old_id],
    ).fetchall()
    if clash:
        msg = (
            f"{clash[0][0]}: already ingested as run {clash[0][1]!r}; re-ingesting is refused"
            f" (use --run {clash[0][1]} --replace to redo it)"
        )
        raise DuplicateRankError(msg)
    return prints


def _rank_rows(frames: list[pl.DataFrame], et_counts: dict[int, tuple[int, int]]) -> pl.DataFrame:
    """One row per rank: the timeline source's facts first, the others fill its gaps."""
    rows = (
        pl.concat(frames, how="vertical")
        .sort(["rank", "_prio"])
        .drop("_prio")
        .group_by("rank", maintain_order=True)
        .agg(pl.all().drop_nulls().first())
    )
    rows = rows.with_columns(
        [
            pl.coalesce(
                pl.col("args").str.json_path_match(f"$.{axis}"),
                pl.col("args").str.json_path_match(f"$.prism_layout.{axis}_rank"),
            )
            .cast(pl.Int32, strict=False)
            .alias(axis)
            for axis in _AXES
        ]
    )
    et_df = pl.DataFrame(
        {
            "rank": list(et_counts),
            "et_ops": [v[0] for v in et_counts.values()],
            "et_ops_linked": [v[1] for v in et_counts.values()],
        },
        schema={"rank": pl.Int32, "et_ops": pl.Int64, "et_ops_linked": pl.Int64},
    )
    return rows.join(et_df, on="rank", how="left")


# Every per-run table: what a --replace deletes and what the report counts.
def _count(con: object, table_name: str, run_id: int) -> int:
    row = con.execute(  # type: ignore[attr-defined]
        f"SELECT count(*) FROM {table_name} WHERE run_id = ?", [run_id]
    ).fetchall()[0]
    return int(row[0])

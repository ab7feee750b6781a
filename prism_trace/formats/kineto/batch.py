"""Read a batch of small Kineto files at once: the reader's statements planned once per batch.

On a small trace nearly all of the per-file reader's time (``kineto._Reader``) is DuckDB planning
its ~40 statements, anew for every file (docs/ingest.md, "Where the per-file cost goes"). This
reader runs the same pipeline over several files together: ``raw`` holds every file's records
with a file key ``f`` (the place of the file in the batch), tracks and events are numbered with
batch-wide ids ordered by file first, so the joins on ``track_id``/``event_id`` stay as they are
and only the joins on what is unique within a file only (``correlation``, flow ids, process ids,
the step windows) gain ``f``. The frames are then cut back into one ``TraceTables`` a file, their
ids shifted down to what the per-file reader gives (its ids are dense per file, in the same
order, so a file's ids are the batch's minus the file's first).

Only the happy path is batched: a batch that fails anywhere (a file that cannot be split, a bad
or lossy record, an event over the object size, a rank or header problem, anything) is read
again file by file by ``kineto.read_kineto``/``stage_kineto``, so every bad-input message is
the per-file reader's, raised for the first bad file in order. Large traces never come here
(``BATCH_MAX_BYTES``): their cost is the data, not the planning, and the per-file reader bounds
their memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from prism_trace.errors import TraceFormatError
from prism_trace.formats.base import TraceTables
from prism_trace.formats.kineto.comms import _CommTables, comm_raw_sql, groups_by_id
from prism_trace.formats.kineto.events import _DEVICE_CATEGORIES
from prism_trace.formats.kineto.frames import _MEMORY_COLUMNS
from prism_trace.formats.kineto.header import _base_ns, _resolve_rank, ranks_frame_of
from prism_trace.formats.kineto.json_array import (
    TraceEventsFile,
    json_size_guess,
    split_trace_events,
)
from prism_trace.formats.kineto.load import _OBJECT_BYTES
from prism_trace.formats.kineto.reader import _FREE_BYTES, _Reader, read_kineto
from prism_trace.formats.kineto.sql import (
    _LAUNCH_CATEGORIES,
    _SELECT_FAST,
    ARG_ROW_SQL,
    ev0_sql,
    track_sql,
)
from prism_trace.formats.unseen_frees import with_unseen_frees
from prism_trace.limits import check_world_size

__all__ = [
    "BATCH_MAX_BYTES",
    "batchable",
    "plan_batches",
    "read_kineto_batch",
    "try_read_kineto_batch",
]

BATCH_MAX_BYTES = _FREE_BYTES
"""A file of at least this many bytes of JSON is never batched (``read_kineto_batch``)."""
BATCH_FILES = 32
"""The most files a batch holds (``plan_batches``)."""
BATCH_TOTAL_BYTES = 64 << 20
"""The most JSON bytes (guessed) a batch holds: its work tables are in memory at once."""

# The per-file load with the file key: ``filename`` (the part read) mapped to its file's place.
_SELECT_BATCH = _SELECT_FAST.replace(
    "SELECT ph_t AS ph,", "SELECT {{file_of}}[list_position({{parts}}, filename)] AS f, ph_t AS ph,"
).replace(
    "FROM read_json(?, format = 'array',", "FROM read_json(?, filename = true, format = 'array',"
)
assert _SELECT_BATCH.count("filename") == 2  # the template changed under us


def _split(df: pl.DataFrame) -> Callable[[int], pl.DataFrame]:
    """``df``'s rows of file ``f``, by ``f`` (one pass over the frame, not a filter a file)."""
    if "f" not in df.columns:
        return lambda _f: df
    parts = {k[0]: v for k, v in df.partition_by("f", as_dict=True, maintain_order=True).items()}
    empty = df.clear()
    return lambda f: parts.get(f, empty)


def _shifted(df: pl.DataFrame, cols: tuple[str, ...], off: int) -> pl.DataFrame:
    """``df`` with ids ``cols`` lowered by ``off``: a file's batch-wide ids to its own."""
    return df.with_columns(pl.col(c) - off for c in cols)


class _Fallback(Exception):
    """The batch cannot be read as one: read its files one by one."""


def read_kineto_batch(
    paths: list[Path],
    *,
    ranks: list[int | None] | None = None,
    tmp_dir: Path | None = None,
) -> list[TraceTables]:
    """Read several ranks' Kineto traces, each into the frames ``read_kineto`` gives it.

    Args:
        paths: the trace files.
        ranks: each file's rank argument (as ``read_kineto``'s ``rank``), default all None.
        tmp_dir: where the events arrays are copied (default: the system temp dir).

    Returns:
        One ``TraceTables`` a file, in order, conformed, events included: the frames equal
        ``read_kineto``'s for the file (the batch read, or each file read alone if it fails).

    Raises:
        The errors of ``read_kineto`` for the first file it refuses.
    """
    paths = [Path(p) for p in paths]
    the_ranks: list[int | None] = list(ranks) if ranks is not None else [None] * len(paths)
    with contextlib.closing(duckdb.connect()) as con:
        got = try_read_kineto_batch(paths, ranks=the_ranks, con=con, tmp_dir=tmp_dir)
    if got is not None:
        return got
    return [read_kineto(p, rank=r, tmp_dir=tmp_dir) for p, r in zip(paths, the_ranks, strict=True)]


def batchable(path: Path) -> bool:
    """Whether a file is small enough to be read in a batch (its JSON size guessed)."""
    return json_size_guess(path) < BATCH_MAX_BYTES


def try_read_kineto_batch(
    paths: list[Path],
    *,
    ranks: list[int | None],
    con: duckdb.DuckDBPyConnection,
    tmp_dir: Path | None = None,
) -> list[TraceTables] | None:
    """The batch read of ``paths`` on ``con``, or None where the batch cannot be read as one.

    ``con``'s default database must be a fresh work database (the caller drops it afterwards,
    whatever happened). None is the caller's cue to read the files one by one with the per-file
    reader, which then says what is wrong with which file (or reads a file the batch does not
    take: a large one, a lossy ``ts``, an event over the object size).
    """
    try:
        return _read_batch([Path(p) for p in paths], ranks, con, tmp_dir)
    except Exception:  # any failure: the per-file reader says what it is
        return None


def _read_batch(
    paths: list[Path],
    ranks: list[int | None],
    con: duckdb.DuckDBPyConnection,
    tmp_dir: Path | None,
) -> list[TraceTables]:
    if not paths or not all(batchable(p) for p in paths):
        raise _Fallback
    with contextlib.ExitStack() as stack:
        # One directory for the batch's arrays, not one a file (``split_trace_events``).
        work = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="prism-batch-", dir=tmp_dir))
        )
        tefs = [
            stack.enter_context(split_trace_events(p, work_dir=(work, f"f{i}")))
            for i, p in enumerate(paths)
        ]
        if any(t.json_bytes >= BATCH_MAX_BYTES for t in tefs):
            raise _Fallback
        return _BatchReader(paths, ranks, tefs, con).read_all()


class _FileComms(_CommTables):
    """One file's communication frames, from its share of the batch's ``comm_raw``."""

    def __init__(self, tables: TraceTables, rank: int, meta: dict[str, Any]) -> None:
        self.path = tables.path
        self.rank = rank
        self.meta = meta
        info = meta.get("distributedInfo")
        self.info = info if isinstance(info, dict) else {}
        self.world_size = tables.world_size
        self.raw = pl.DataFrame()

    def named_groups(self) -> list[tuple[Any, ...]]:
        """As the per-file query over ``comm_raw``, on the file's rows (first non-null values)."""
        named = (
            self.raw.filter(pl.col("group_name").is_not_null())
            .group_by("group_name")
            .agg(
                pl.col("group_desc").drop_nulls().first(),
                pl.col("group_ranks").drop_nulls().first(),
                pl.col("group_size").max(),
                pl.col("source").min(),
            )
            .sort("group_name")
        )
        return list(named.iter_rows())


class _BatchReader(_Reader):
    """The per-file reader's pipeline over a batch; methods it keeps work as they are on the
    batch-wide ids (nesting, slices, ``event_ids``, ``eva``)."""

    def __init__(
        self,
        paths: list[Path],
        ranks: list[int | None],
        tefs: list[TraceEventsFile],
        con: duckdb.DuckDBPyConnection,
    ) -> None:
        self.paths = paths
        self.tefs = tefs
        self.file_ranks = [
            _resolve_rank(p, t.meta, r) for p, t, r in zip(paths, tefs, ranks, strict=True)
        ]
        self.world_sizes: list[int | None] = []
        self.bases: list[int] = []
        for path, tef, rank in zip(paths, tefs, self.file_ranks, strict=True):
            info = tef.meta.get("distributedInfo")
            ws = info.get("world_size") if isinstance(info, dict) else None
            ws = None if ws is None else check_world_size(path, ws, "distributedInfo.world_size")
            if ws is not None and rank >= ws:
                raise _Fallback
            self.world_sizes.append(ws)
            self.bases.append(_base_ns(path, tef.meta.get("baseTimeNanoseconds")))
        if not all(t.parts for t in tefs):
            raise _Fallback
        # What the inherited methods read: the first file stands for the batch in messages
        # (which never leave it: a failure reads the files again one by one).
        self.path = paths[0]
        self.rank = self.file_ranks[0]
        self.meta = tefs[0].meta
        self.tef = tefs[0]
        self.info: dict[str, Any] = {}
        self.world_size = None
        self.base_ns = 0
        self.con = con
        self.bound = pl.DataFrame()
        self.object_bytes = _OBJECT_BYTES
        self.free = False

    def _list(self, values: list[Any], sql_type: str) -> str:
        """A SQL list literal of ``values`` (ints or None), indexed by ``f + 1``."""
        return (
            "(["
            + ", ".join("NULL" if v is None else str(int(v)) for v in values)
            + f"]::{sql_type}[])"
        )

    # -- the pipeline ----------------------------------------------------------------------------

    def read_all(self) -> list[TraceTables]:
        """Every file's frames, events included."""
        self.load()
        self.build_tracks()
        self.keep_side_records()
        self.build_events()
        self.assign_iterations()
        tracks = self.frame("SELECT f, track_id, kind, pid, tid, name FROM track ORDER BY track_id")
        steps = self.frame("SELECT f, iteration, ts, dur, name FROM step ORDER BY f, iteration")
        memory = self.batch_memory()
        flows = self.batch_flows()
        # The group size of a call naming no group is filled per file below, where the
        # per-file statement writes the world size.
        self.sql(comm_raw_sql("NULL", " AND k.f = r.f"))
        comm = self.frame(
            "SELECT e.f, c.* FROM comm_raw c JOIN ev e USING (event_id)"
            " ORDER BY e.f, c.ts, c.event_id"
        )
        pids = {f: (pid, dev) for f, pid, dev in self.batch_pids()}
        self.sql("DROP TABLE IF EXISTS _bound")
        events = self.frame(
            """SELECT e.f, e.event_id, e.track_id, e.category, e.name, e.ts, e.dur,
                      e.correlation, e.external_id, e.rf_id, e.parent_id, e.depth,
                      i.iteration::INTEGER AS iteration, r.args
               FROM ev e JOIN raw r ON r.rowid = e.ord LEFT JOIN ev_it i USING (event_id)
               ORDER BY e.event_id"""
        )
        track_off = dict(tracks.group_by("f").agg(pl.col("track_id").min()).iter_rows())
        event_off = dict(events.group_by("f").agg(pl.col("event_id").min()).iter_rows())
        by_file = {
            name: _split(df)
            for name, df in (
                ("tracks", tracks),
                ("steps", steps),
                ("memory", memory),
                ("flows", flows),
                ("events", events),
                ("comm", comm),
            )
        }
        out = []
        blank = TraceTables(path=self.paths[0], format="kineto")
        for f, (path, tef) in enumerate(zip(self.paths, self.tefs, strict=True)):
            rank = self.file_ranks[f]
            t_off = int(track_off.get(f, 0))
            e_off = int(event_off.get(f, 0))
            lit_rank = pl.lit(rank, pl.Int32).alias("rank")
            ids = _shifted
            # (``replace``: the empty frames made once for the batch, not ten a file; files may
            # share them: nothing changes a frame in place)
            tables = dataclasses.replace(blank, path=path, world_size=self.world_sizes[f])
            tables.tracks = ids(
                by_file["tracks"](f).select(lit_rank, pl.exclude("f")), ("track_id",), t_off
            )
            tables.iterations = by_file["steps"](f).select(lit_rank, pl.exclude("f"))
            tables.memory = by_file["memory"](f).select(lit_rank, pl.exclude("f"))
            tables.flows = ids(
                by_file["flows"](f).select(lit_rank, pl.exclude("f")),
                ("src_event_id", "dst_event_id"),
                e_off,
            )
            fc = _FileComms(tables, rank, tef.meta)
            groups = fc.comm_groups_from_meta()
            raw = ids(by_file["comm"](f).drop("f"), ("event_id", "kernel_event_id"), e_off)
            ws = self.world_sizes[f]
            if ws is not None:  # what ``{ws}`` of the per-file statement gives sources 2 and 3
                raw = raw.with_columns(
                    pl.when((pl.col("source") >= 2) & pl.col("group_size").is_null())
                    .then(pl.lit(ws, pl.Int32))
                    .otherwise(pl.col("group_size"))
                    .alias("group_size")
                )
            raw = groups_by_id(raw, groups, ws)
            fc.raw = raw
            tables.collectives, tables.p2p = fc.comm_frames(raw, groups)
            tables.comm_groups = fc.comm_groups(groups, tables.collectives, tables.p2p)
            pid, dev = pids.get(f, (None, None))
            info = tef.meta.get("distributedInfo")
            tables.ranks = ranks_frame_of(
                rank, tef.meta, info if isinstance(info, dict) else {}, pid, dev
            )
            tables.events = ids(
                ids(
                    by_file["events"](f).select(lit_rank, pl.exclude("f")),
                    ("event_id", "parent_id"),
                    e_off,
                ),
                ("track_id",),
                t_off,
            )
            out.append(with_unseen_frees(tables).conform())
        return out

    # -- loading -------------------------------------------------------------------------------

    def load(self) -> None:
        """``raw`` for the batch with its file key; any record the per-file reader would refuse
        or read another way (bad, lossy, missing a field) sends the batch back file by file."""
        (keep_order,) = self.rows("SELECT current_setting('preserve_insertion_order')")[0]
        if not keep_order:
            raise _Fallback
        parts = [str(p) for t in self.tefs for p in t.parts]
        file_of = [f for f, t in enumerate(self.tefs) for _ in t.parts]
        quoted = "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in parts) + "]"
        select = _SELECT_BATCH.replace("{{parts}}", quoted).replace(
            "{{file_of}}", self._list(file_of, "INTEGER")
        )
        self.con.execute(self.load_sql(select), [parts])
        (bad,) = self.rows(
            """SELECT count(*) FROM raw
                WHERE bad IS NOT NULL
                   OR ts_inexact
                   OR (ph IN ('X', 'i', 'I') AND (ts_us_ns IS NULL OR pid IS NULL))"""
        )[0]
        if bad:
            raise _Fallback
        try:
            self.check_nested_keys()
        except TraceFormatError:  # the per-file reader names the file
            raise _Fallback from None
        base = self._list(self.bases, "BIGINT")
        self.sql(ev0_sql(f"{base}[f + 1]", keys="f, "))

    def build_tracks(self) -> None:
        device = ", ".join(f"'{c}'" for c in _DEVICE_CATEGORIES)
        self.sql(track_sql(device, keys="f"))

    def keep_side_records(self) -> None:
        base = self._list(self.bases, "BIGINT")
        self.sql(
            f"""CREATE TABLE mem_record AS
                SELECT f, ts_us_ns + {base}[f + 1] AS ts, args FROM raw
                WHERE ph IN ('i', 'I') AND name = '[memory]' AND ts_us_ns IS NOT NULL"""
        )
        self.sql(
            f"""CREATE TABLE flow_point AS
                SELECT r.id, r.ph, t.track_id, r.ts_us_ns + {base}[r.f + 1] AS ts
                FROM raw r JOIN track t ON t.f = r.f AND t.pid = r.pid AND t.tid_text = r.tid
                WHERE r.ph IN ('s', 'f') AND r.cat = 'fwdbwd' AND r.ts_us_ns IS NOT NULL"""
        )
        self.sql(ARG_ROW_SQL)

    def build_events(self) -> None:
        self.sql(
            """CREATE TABLE ev_base AS
               SELECT e.ord, e.f, t.track_id, t.kind = 'stream' AS on_device, e.category, e.name,
                      e.ts, e.dur, e.correlation, e.external_id, e.rf_id
               FROM ev0 e JOIN track t ON t.f = e.f AND t.pid = e.pid AND t.tid_text = e.tid"""
        )
        self.sql("DROP VIEW ev0")
        self.event_ids()
        self.sql(
            """CREATE TABLE ev AS
               SELECT i.event_id, b.*, i.parent_id, i.depth
               FROM ev_base b JOIN ev_id i USING (ord)"""
        )
        self.sql("CREATE VIEW eva AS SELECT ev.*, a.args FROM ev JOIN arg_row a USING (ord)")

    def assign_iterations(self) -> None:
        self.sql(
            r"""CREATE TABLE step AS
                SELECT f, TRY_CAST(regexp_extract(name, '^ProfilerStep#(\d+)$', 1) AS INTEGER)
                           AS iteration,
                       min(ts) AS ts, arg_min(dur, ts) AS dur, arg_min(name, ts) AS name
                FROM ev
                WHERE NOT on_device AND regexp_matches(name, '^ProfilerStep#\d+$')
                GROUP BY 1, 2"""
        )
        self.refuse_step_beyond_int32()
        launch = ", ".join(f"'{c}'" for c in _LAUNCH_CATEGORIES)
        self.sql(
            f"""CREATE TABLE ev_it AS
                WITH by_time AS (
                    SELECT e.f, e.event_id, e.on_device, e.correlation, e.category,
                           CASE WHEN e.ts < s.ts + greatest(s.dur, 1) THEN s.iteration END AS it
                    FROM ev e ASOF LEFT JOIN step s ON e.f = s.f AND e.ts >= s.ts),
                launched AS (
                    SELECT f, correlation, min(it) AS it FROM by_time
                    WHERE category IN ({launch}) AND correlation IS NOT NULL
                    GROUP BY f, correlation)
                SELECT b.event_id,
                       CASE WHEN b.on_device THEN coalesce(l.it, b.it) ELSE b.it END AS iteration
                FROM by_time b
                LEFT JOIN launched l
                  ON b.on_device AND l.f = b.f AND l.correlation = b.correlation
                WHERE b.it IS NOT NULL OR l.it IS NOT NULL"""
        )

    # -- other frames --------------------------------------------------------------------------

    def batch_memory(self) -> pl.DataFrame:
        """``_Reader.memory`` with the file key (steps of the record's own file)."""
        return self.frame(
            f"""SELECT m.f, m.ts,
                       {_MEMORY_COLUMNS}
                       CASE WHEN m.ts < s.ts + greatest(s.dur, 1) THEN s.iteration END AS iteration
                FROM mem_record m ASOF LEFT JOIN step s ON m.f = s.f AND m.ts >= s.ts
                ORDER BY m.f, m.ts"""
        )

    def batch_flows(self) -> pl.DataFrame:
        """``_Reader.flows`` with the file key on the correlation, flow-id and pid joins."""
        launch = ", ".join(f"'{c}'" for c in _LAUNCH_CATEGORIES)
        bound = self.bound.filter(pl.col("event_id").is_not_null())
        self.bound = pl.DataFrame()
        self.con.register("_bound_points", bound)
        try:
            self.sql(
                """CREATE TEMP TABLE _bound AS
                   SELECT e.f, b.id, b.ph, max(b.event_id) AS event_id
                   FROM _bound_points b JOIN ev e USING (event_id) GROUP BY e.f, b.id, b.ph"""
            )
        finally:
            self.con.unregister("_bound_points")
        return self.frame(
            f"""WITH launcher AS (
                    SELECT f, correlation, min(event_id) AS event_id FROM ev
                    WHERE category IN ({launch}) AND correlation IS NOT NULL
                    GROUP BY f, correlation),
                launches AS (
                    SELECT d.f, 'launch' AS kind, l.event_id AS src_event_id,
                           d.event_id AS dst_event_id, d.correlation AS flow_id
                    FROM ev d JOIN launcher l ON l.f = d.f AND l.correlation = d.correlation
                    WHERE d.category IN ('kernel', 'memcpy', 'memset')),
                fwdbwd AS (
                    SELECT s.f, 'fwdbwd' AS kind, s.event_id AS src_event_id,
                           f.event_id AS dst_event_id, TRY_CAST(s.id AS BIGINT) AS flow_id
                    FROM _bound s JOIN _bound f
                      ON s.f = f.f AND s.id = f.id AND s.ph = 's' AND f.ph = 'f'),
                waits AS (
                    SELECT e.f, e.event_id, e.ts, t.pid,
                           TRY_CAST(e.args->>'wait_on_stream' AS BIGINT) AS stream,
                           TRY_CAST(e.args->>'wait_on_cuda_event_record_corr_id' AS BIGINT) AS rec
                    FROM eva e JOIN track t USING (track_id)
                    WHERE e.category = 'cuda_sync'),
                done AS (
                    SELECT e.f, t.pid, t.tid AS stream, e.correlation, e.event_id FROM ev e
                    JOIN track t USING (track_id)
                    WHERE e.on_device AND e.category IN ('kernel', 'memcpy', 'memset')
                      AND e.correlation IS NOT NULL),
                syncs AS (
                    SELECT w.f, 'sync' AS kind, d.event_id AS src_event_id,
                           w.event_id AS dst_event_id, NULL::BIGINT AS flow_id
                    FROM waits w ASOF JOIN done d
                      ON d.f = w.f AND d.pid = w.pid AND d.stream = w.stream
                     AND w.rec > d.correlation
                    WHERE w.stream IS NOT NULL AND w.rec IS NOT NULL AND w.rec > 0)
                SELECT * FROM (
                    SELECT * FROM launches UNION ALL SELECT * FROM fwdbwd
                    UNION ALL SELECT * FROM syncs)
                ORDER BY f, kind, dst_event_id, src_event_id"""
        )

    def batch_pids(self) -> list[tuple[Any, ...]]:
        """Each file's process id and device id, as ``_Reader.ranks_frame`` finds them."""
        return self.rows(
            r"""WITH tp AS (
                    SELECT t.f, t.pid, t.kind, count(*) AS n
                    FROM ev e JOIN track t USING (track_id) GROUP BY t.f, t.pid, t.kind),
                sp AS (
                    SELECT e.f, TRY_CAST(any_value(t.pid) AS BIGINT) AS pid
                    FROM ev e JOIN track t USING (track_id)
                    WHERE regexp_matches(e.name, '^ProfilerStep#\d+$') AND NOT e.on_device
                    GROUP BY e.f),
                hp AS (
                    SELECT f, TRY_CAST(pid AS BIGINT) AS pid FROM tp
                    WHERE kind = 'thread' AND TRY_CAST(pid AS BIGINT) IS NOT NULL
                    QUALIFY row_number() OVER (PARTITION BY f ORDER BY n DESC) = 1),
                dp AS (
                    SELECT f, TRY_CAST(pid AS INTEGER) AS dev FROM tp WHERE kind = 'stream'
                    QUALIFY row_number() OVER (PARTITION BY f ORDER BY n DESC) = 1)
                SELECT hp_f.f, coalesce(sp.pid, hp.pid), dp.dev
                FROM (SELECT DISTINCT f FROM tp) hp_f
                LEFT JOIN sp USING (f) LEFT JOIN hp USING (f) LEFT JOIN dp USING (f)"""
        )


def plan_batches(paths: list[Path | None], ways: int) -> list[list[int]]:
    """Cut ``paths`` (by index, in order) into batches for ``ways`` readers working at once.

    A None is a file not to be batched (not Kineto, say). Consecutive batchable files
    (``batchable``) go together, about a ``ways``-th of each run of them a batch (so every
    reader gets one), at most ``BATCH_FILES`` files and ``BATCH_TOTAL_BYTES`` of JSON (guessed)
    a batch; any other file is a batch of its own.
    """
    out: list[list[int]] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            size = min(BATCH_FILES, max(1, -(-len(run) // max(1, ways))))
            batch: list[int] = []
            total = 0
            for i in run:
                guess = json_size_guess(Path(str(paths[i])))
                if batch and (len(batch) >= size or total + guess > BATCH_TOTAL_BYTES):
                    out.append(batch)
                    batch, total = [], 0
                batch.append(i)
                total += guess
            out.append(batch)
            run.clear()

    for i, path in enumerate(paths):
        if path is not None and batchable(path):
            run.append(i)
        else:
            flush()
            out.append([i])
    flush()
    return out

"""Read a Kineto (torch.profiler Chrome-trace JSON) file of one rank into the contract's frames.

The ``traceEvents`` array is copied into files of its own (``_json_array``; cut in parts DuckDB
parses in parallel) and parsed by DuckDB; every transformation is SQL (plus vectorised nesting, a
slice of a track at a time), so no Python object is made per event.

Conventions:

- ``ts``/``dur`` are integer ns. When the trace has ``baseTimeNanoseconds`` (Kineto >= 2024), its
  ``ts`` are microseconds after that base and ``ts`` here is ``base + ts * 1000``, i.e. ns since the
  epoch, like older traces whose ``ts`` are epoch microseconds.
- Categories: ``cpu_op``, ``user_annotation``, ``python_function``, ``cuda_runtime``,
  ``cuda_driver``, ``kernel``, ``gpu_memcpy`` -> ``memcpy``, ``gpu_memset`` -> ``memset``,
  ``gpu_user_annotation``, ``cuda_sync``; ``i``/``I`` instants -> ``instant`` (``[memory]`` goes to
  ``memory``); any other ``X`` -> ``other``. The profiler's own ``Trace`` span and the
  ``Spans``/``Traces`` pids are skipped.
- Tracks: a ``stream`` per (device, CUDA stream) holding device events, a ``thread`` per (pid, tid)
  otherwise; ``track_id`` and ``event_id`` are minted densely in (track, ts, -dur) order.
- Collectives come from, in order of preference, ``prism_comm:`` annotations (our generator's),
  ``record_param_comms`` ops with ``Collective name`` (PyTorch >= 2.1), and older
  ``record_param_comms`` ops enclosing an ``nccl:<op>`` annotation (group ``0`` of all ranks),
  then the ``c10d::<op>`` op itself where nothing better describes the call (its input tensor's
  size). A call whose host record names no group takes the group (and ``Seq``) from its NCCL
  kernel's args when they have them. Call names are normalised (``c10d::_allgather_base_``,
  ``nccl:_all_gather_base``, ``all_gather_into_tensor``, the ``_coalesced`` forms, ``isend``).
  A comm op inside another one on the same thread is not counted again. ``wait``, coalescing
  markers (``coalesced``) and unknown names are not collectives. ``Seq`` (1-based per group)
  becomes 0-based ``seq``; calls without one are numbered in order at ingest and matched across
  ranks only where the ranks agree (``prism_trace.graph.matching``).
  A p2p call whose peer the trace does not state has a null ``peer``.
- Memory: the ``traceEvents`` args are held once (in ``raw``, with the three ids moved to typed
  columns); every join between events is an equi-join, an ASOF join, a window or a sorted search,
  never a range join.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import orjson
import polars as pl

from prism_trace.errors import (
    MissingFieldError,
    OutOfMemoryError,
    PrismError,
    RankUnknownError,
    TraceFormatError,
)
from prism_trace.formats.base import TraceTables
from prism_trace.formats.kineto.comms import _CommTables, _json_list
from prism_trace.formats.kineto.json_array import TraceEventsFile, split_trace_events
from prism_trace.formats.kineto.sql import (
    _LAUNCH_CATEGORIES,
    _LOAD,
    _MAX_BASE_NS,
    _MAX_DUR_US,
    _MAX_TS_US,
    _SELECT_EXACT,
    _SELECT_FAST,
    ARG_ROW_SQL,
    ev0_sql,
)
from prism_trace.formats.nesting import innermost_enclosing, nest_events
from prism_trace.limits import check_rank, check_world_size

__all__ = ["EventsSink", "rank_from_file_name", "read_kineto", "stage_kineto"]

EventsSink = Callable[[int, duckdb.DuckDBPyRelation], None]
"""Takes the rank and the events relation of a file (``stage_kineto``) and consumes it."""

_RANK_NAME_RES = (
    re.compile(r"(?:^|[^a-z])(?:rank|worker)[_-]?(\d{1,6})(?!\d)", re.IGNORECASE),
    re.compile(r"\.(\d{1,6})(?:\.pt\.trace)?\.json(?:\.gz)?$", re.IGNORECASE),
)

_DEVICE_CATEGORIES = ("kernel", "memcpy", "memset", "gpu_user_annotation", "cuda_sync")
# c10::DeviceType, indexed by value.
_DEVICE_TYPES = [
    "cpu",
    "cuda",
    "mkldnn",
    "opengl",
    "opencl",
    "ideep",
    "hip",
    "fpga",
    "maia",
    "xla",
    "vulkan",
    "metal",
    "xpu",
    "mps",
    "meta",
    "hpu",
    "ve",
    "lazy",
    "ipu",
    "mtia",
    "privateuseone",
]
_BATCH_ROWS = 1 << 18
# Events nested at a time (``_Reader.quiet_slices``): a slice's working arrays take a few hundred
# bytes an event.
_NEST_ROWS = 1 << 18
# read_json buffers scale with the largest object allowed; a Kineto event is a few KB, and a file
# with a larger one is read again with the large limit (``load``).
_OBJECT_BYTES = 16 << 20
_OBJECT_BYTES_MAX = 1 << 30
# A trace of at least this many JSON bytes has its work tables freed as soon as they are done
# with (``_Reader.free``); ~15 statements, ~10 ms a file, that a small trace does without.
_FREE_BYTES = 32 << 20

# The columns of a ``[memory]`` record (alias ``m``): its device, address, bytes and the
# allocator's totals; the per-file and the batch reader both select them.
_DEVICE_LIST = "[" + ", ".join(f"'{t}'" for t in _DEVICE_TYPES) + "]"
# A device type outside c10's enum is kept as written: ``list_extract`` counts a negative index
# from the end, so the index is bounded first.
_MEMORY_COLUMNS = f"""CASE WHEN TRY_CAST(m.args->>'Device Type' AS BIGINT)
                                 BETWEEN 0 AND {len(_DEVICE_TYPES) - 1}
                            THEN list_extract({_DEVICE_LIST},
                                              TRY_CAST(m.args->>'Device Type' AS BIGINT) + 1)
                            WHEN TRY_CAST(m.args->>'Device Type' AS BIGINT) IS NOT NULL
                            THEN m.args->>'Device Type'
                            ELSE lower(m.args->>'Device Type') END AS device_type,
                       TRY_CAST(m.args->>'Device Id' AS INTEGER) AS device_id,
                       TRY_CAST(m.args->>'Addr' AS BIGINT) AS addr,
                       coalesce(TRY_CAST(m.args->>'Bytes' AS BIGINT), 0) AS bytes,
                       TRY_CAST(m.args->>'Total Allocated' AS BIGINT) AS total_allocated,
                       TRY_CAST(m.args->>'Total Reserved' AS BIGINT) AS total_reserved,"""


def rank_from_file_name(path: Path) -> int | None:
    """The rank a file name states: ``worker3_step_12...``, ``rank3_trace.json``, ``x.3.json``.

    Args:
        path: the trace file.

    Returns:
        The rank, or None when the name states none.
    """
    for pattern in _RANK_NAME_RES:
        m = pattern.search(path.name)
        if m:
            return int(m.group(1))
    return None


def read_kineto(path: Path, *, rank: int | None = None, tmp_dir: Path | None = None) -> TraceTables:
    """Read one rank's Kineto trace (``.json`` or ``.json.gz``, any size) into conformed frames.

    Args:
        path: the trace file.
        rank: the rank, when neither ``distributedInfo.rank`` nor the file name tells it; it wins
            over the file name, and must agree with ``distributedInfo.rank``.
        tmp_dir: where to put the temporary copy of the events array (default: system temp dir).

    Returns:
        The frames of the file, conformed to ``FRAME_SCHEMAS``.

    Raises:
        RankUnknownError: no rank in the trace, its name or the arguments.
        TruncatedTraceError: the gzip stream or the JSON ends early.
        MissingFieldError: the JSON has no ``traceEvents``.
        TraceFormatError: corrupt data, or ``rank`` disagrees with the trace.
    """
    path = Path(path)
    with split_trace_events(path, tmp_dir=tmp_dir) as tef:
        the_rank = _resolve_rank(path, tef.meta, rank)
        con = duckdb.connect()
        spill = str(tef.parts[0].parent).replace("'", "''")
        con.execute(f"SET temp_directory = '{spill}'")  # spill next to the events copy
        try:
            return _Reader(path, the_rank, tef, con).read()
        finally:
            con.close()


def stage_kineto(
    path: Path,
    *,
    con: duckdb.DuckDBPyConnection,
    events_into: EventsSink,
    rank: int | None = None,
    tmp_dir: Path | None = None,
) -> TraceTables:
    """Read one rank's Kineto trace on ``con``, handing its events to ``events_into`` as SQL.

    Ingest's path: the events (the one table as large as the trace) are never made a frame;
    ``events_into`` gets a relation on ``con`` (columns of ``FRAME_SCHEMAS["events"]``, sorted
    by ``event_id``) and consumes it, e.g. streams it in Arrow batches into the store, so at most
    a few batches of them exist outside DuckDB's tables at a time. ``con``'s default database is
    where the reader makes its work tables; the caller gives a fresh one per file and drops it
    afterwards. ``preserve_insertion_order`` must be on (DuckDB's default): records are numbered
    by the order it keeps.

    Args:
        path: the trace file.
        con: the connection to run the reader's SQL on.
        events_into: called once with the file's rank and its events relation, which it must
            consume before returning; what it raises propagates as is (the data are typed by
            then, so an error there is the sink's, e.g. the store's, not the trace's).
        rank: as for ``read_kineto``.
        tmp_dir: as for ``read_kineto``.

    Returns:
        The other frames of the file, conformed; ``events`` is empty.

    Raises:
        The errors of ``read_kineto``.
    """
    path = Path(path)
    with split_trace_events(path, tmp_dir=tmp_dir) as tef:
        the_rank = _resolve_rank(path, tef.meta, rank)
        return _Reader(path, the_rank, tef, con).read(events_into=events_into)


def _resolve_rank(path: Path, meta: dict[str, Any], rank: int | None) -> int:
    info = meta.get("distributedInfo")
    traced = info.get("rank") if isinstance(info, dict) else None
    if traced is not None:
        traced = check_rank(path, traced, "distributedInfo.rank")
        if rank is not None and rank != traced:
            msg = f"{path}: `rank` {rank} disagrees with distributedInfo.rank {traced}"
            raise TraceFormatError(msg)
        return traced
    if rank is not None:
        return check_rank(path, rank, "the rank given")
    named = rank_from_file_name(path)
    if named is not None:
        return named
    msg = (
        f"{path}: cannot tell the rank (no distributedInfo.rank, none in the file name);"
        " pass --rank"
    )
    raise RankUnknownError(msg)


def _short(value: str) -> str:
    return value if len(value) <= 60 else value[:57] + "..."


def _base_ns(path: Path, base: Any) -> int:
    """``baseTimeNanoseconds`` checked: a non-negative integer (or integral float) in range."""
    if base is None:
        return 0
    ok = isinstance(base, int) and not isinstance(base, bool)
    if isinstance(base, float) and math.isfinite(base) and base.is_integer():
        base, ok = int(base), True
    if not ok or not 0 <= base < _MAX_BASE_NS:
        msg = (
            f"{path}: `baseTimeNanoseconds` = {str(base)[:40]} is not an integer in"
            f" [0, {_MAX_BASE_NS:.0e})"
        )
        raise TraceFormatError(msg)
    return int(base)


class _Reader(_CommTables):
    """One file's SQL pipeline; the methods run in ``read``'s order."""

    def __init__(
        self, path: Path, rank: int, tef: TraceEventsFile, con: duckdb.DuckDBPyConnection
    ) -> None:
        self.path = path
        self.rank = rank
        self.meta = tef.meta
        self.tef = tef
        self.con = con
        info = self.meta.get("distributedInfo")
        self.info: dict[str, Any] = info if isinstance(info, dict) else {}
        ws = self.info.get("world_size")
        self.world_size = (
            None if ws is None else check_world_size(path, ws, "distributedInfo.world_size")
        )
        if self.world_size is not None and rank >= self.world_size:
            msg = f"{path}: rank {rank} is not below distributedInfo.world_size {self.world_size}"
            raise TraceFormatError(msg)
        self.base_ns = _base_ns(path, self.meta.get("baseTimeNanoseconds"))
        self.bound = pl.DataFrame()  # fwd-bwd flow points' events, from ``event_ids`` to ``flows``
        self.object_bytes = _OBJECT_BYTES
        # Whether to free work tables as soon as they are done with: worth it for a large trace,
        # but for a small one the statements cost more than the memory (the caller drops the
        # work database after the file anyway).
        self.free = tef.json_bytes >= _FREE_BYTES

    def _fail(self, exc: duckdb.Error) -> PrismError:
        """One line for a failed statement: the trace's fault, unless DuckDB ran out of memory
        (then the file is not blamed, and the line says what to change)."""
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, duckdb.OutOfMemoryException):
            return OutOfMemoryError.of(self.path, "reading the trace", first)
        ours = first.removeprefix("Invalid Input Error: ")
        if ours.startswith("traceEvents["):  # a check of ours, raised by SQL's error()
            return TraceFormatError(f"{self.path}: {ours}")
        return TraceFormatError(f"{self.path}: cannot parse the trace events: {first}")

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

    def read(self, events_into: EventsSink | None = None) -> TraceTables:
        """All frames; with ``events_into``, the events go there (as SQL) instead of a frame."""
        self.load()
        self.build_tracks()
        self.keep_side_records()
        self.build_events()
        if self.free:  # raw keeps only the args (ev holds the rest): frees the other columns
            for column in self.rows(
                "SELECT column_name FROM duckdb_columns()"
                " WHERE table_name = 'raw' AND column_name <> 'args'"
                " AND database_name = current_database() AND schema_name = current_schema()"
            ):
                self.sql(f'ALTER TABLE raw DROP COLUMN "{column[0]}"')
        self.assign_iterations()
        tables = TraceTables(path=self.path, format="kineto", world_size=self.world_size)
        tables.tracks = self.frame(
            f"SELECT {self.rank} AS rank, track_id, kind, pid, tid, name"
            " FROM track ORDER BY track_id"
        )
        tables.iterations = self.frame(
            f"SELECT {self.rank} AS rank, iteration, ts, dur, name FROM step ORDER BY iteration"
        )
        tables.memory = self.memory()
        tables.flows = self.flows()
        groups = self.comm_groups_from_meta()
        tables.collectives, tables.p2p = self.comms(groups)
        tables.comm_groups = self.comm_groups(groups, tables.collectives, tables.p2p)
        tables.ranks = self.ranks_frame()
        # Last, with the other tables gone: the one frame as large as the trace.
        # (``_bound`` is a temporary table: it would outlive the work database)
        done = ("comm_raw", "flow_point", "mem_record", "arg_row", "track", "step")
        for name in ("_bound", *(done if self.free else ())):
            self.sql(f"DROP TABLE IF EXISTS {name}")
        events = self.events_sql()
        if events_into is None:
            tables.events = self.frame(events)
        else:
            try:
                events_into(self.rank, self.con.sql(events))
            except duckdb.OutOfMemoryException as exc:  # the sort of the whole trace's events
                raise self._fail(exc) from exc
        return tables.conform()

    def events_sql(self) -> str:
        """The events in ``FRAME_SCHEMAS["events"]`` order, sorted by ``event_id``.

        ``ev`` already holds every column but the iteration and the args; ``raw`` is in file
        order, so its args are joined by ``ord`` (one hash join) and the rows sorted once.
        """
        return f"""SELECT {self.rank}::INTEGER AS rank, e.event_id, e.track_id, e.category,
                       e.name, e.ts, e.dur, e.correlation, e.external_id, e.rf_id, e.parent_id,
                       e.depth, i.iteration::INTEGER AS iteration, r.args
                FROM ev e JOIN raw r ON r.rowid = e.ord LEFT JOIN ev_it i USING (event_id)
                ORDER BY e.event_id"""

    # -- loading -------------------------------------------------------------------------------

    def load_sql(self, select: str) -> str:
        return _LOAD.format(select=select.format(object_bytes=self.object_bytes))

    def read_records(self, select: str) -> None:
        """Make ``raw`` from the array's parts, or from the whole array if they are not JSON.

        A part is not valid JSON when a cut fell inside an event (a layout other than Kineto's
        one event a line); the whole array then goes to DuckDB as one file, which also gives
        the message for a trace that is really corrupt.
        """
        (keep_order,) = self.rows("SELECT current_setting('preserve_insertion_order')")[0]
        if not keep_order:
            msg = "the Kineto reader needs DuckDB's preserve_insertion_order on (its default)"
            raise PrismError(msg)
        parts = [str(p) for p in self.tef.parts]
        try:
            self.load_files(select, parts)
        except duckdb.Error as exc:
            if len(parts) == 1 or isinstance(exc, duckdb.OutOfMemoryException):
                raise self._fail(exc) from exc
            try:
                self.load_files(select, [str(self.tef.events_path)])
            except duckdb.Error as exc2:
                raise self._fail(exc2) from exc2

    def load_files(self, select: str, files: list[str]) -> None:
        """Run the load on ``files``; again with the large object limit if an event needs it."""
        try:
            self.con.execute(self.load_sql(select), [files])
        except duckdb.Error as exc:
            if "maximum_object_size" not in str(exc) or self.object_bytes == _OBJECT_BYTES_MAX:
                raise
            self.object_bytes = _OBJECT_BYTES_MAX
            self.con.execute(self.load_sql(select), [files])

    def load(self) -> None:
        """``raw``: every record of the array, in order, typed; ``ev0``: its timed events."""
        self.read_records(_SELECT_FAST)
        self.check_records()
        (lossy,) = self.rows("SELECT count(*) FROM raw WHERE ts_inexact")[0]
        if lossy:
            self.read_records(_SELECT_EXACT)
        bad = self.rows(
            """SELECT rowid, name, CASE WHEN ts_us_ns IS NULL THEN 'ts' ELSE 'pid' END
               FROM raw WHERE ph IN ('X', 'i', 'I') AND (ts_us_ns IS NULL OR pid IS NULL)
               ORDER BY rowid LIMIT 1"""
        )
        if bad:
            index, name, field = bad[0]
            msg = f"{self.path}: event #{index} ({name!r}) has no `{field}` at traceEvents[{index}]"
            raise MissingFieldError(msg)
        self.sql(ev0_sql(str(self.base_ns)))

    def check_records(self) -> None:
        """Refuse the file on its first record with a missing, mistyped or out-of-range field."""
        bad = self.rows(
            "SELECT rowid, name, bad, bad_value FROM raw"
            " WHERE bad IS NOT NULL ORDER BY rowid LIMIT 1"
        )
        if bad:
            index, name, field, value = bad[0]
            what = "is missing" if value is None else f"is {_short(value)}"
            rules = {
                "ph": "a string",
                "ts": f"a number of µs below {_MAX_TS_US:.0e}",
                "dur": f"a number of µs in [0, {_MAX_DUR_US:.0e}]",
                "name": "a string",
                "pid": "an integer or a string",
                "tid": "an integer or a string",
                "cat": "a string",
                "args": "an object",
            }
            label = f" ({name!r})" if name is not None else ""
            msg = (
                f"{self.path}: traceEvents[{index}]{label}: `{field}` {what};"
                f" expected {rules[field]}"
            )
            raise (MissingFieldError if value is None else TraceFormatError)(msg)

    def build_tracks(self) -> None:
        """One track per (pid, tid): a ``stream`` if it holds device events, else a ``thread``."""
        device = ", ".join(f"'{c}'" for c in _DEVICE_CATEGORIES)
        self.sql(
            f"""CREATE TABLE track AS
                WITH t AS (
                    SELECT pid, tid, bool_or(category IN ({device})) AS is_stream
                    FROM ev0 GROUP BY pid, tid),
                names AS (
                    SELECT pid, tid, trim(any_value(args->>'name')) AS name
                    FROM raw WHERE ph = 'M' AND name = 'thread_name' GROUP BY pid, tid)
                SELECT (row_number() OVER (
                            ORDER BY t.is_stream, TRY_CAST(t.pid AS BIGINT) NULLS LAST, t.pid,
                                     TRY_CAST(t.tid AS BIGINT) NULLS LAST, t.tid) - 1)::INTEGER
                           AS track_id,
                       CASE WHEN t.is_stream THEN 'stream' ELSE 'thread' END AS kind,
                       t.pid, TRY_CAST(t.tid AS BIGINT) AS tid, t.tid AS tid_text,
                       coalesce(n.name, CASE WHEN TRY_CAST(t.tid AS BIGINT) IS NULL THEN t.tid END)
                           AS name
                FROM t LEFT JOIN names n ON n.pid = t.pid AND n.tid = t.tid"""
        )

    def build_events(self) -> None:
        """``ev``: the timed events with their ids, track, nesting and typed columns (no args)."""
        self.sql(
            """CREATE TABLE ev_base AS
               SELECT e.ord, t.track_id, t.kind = 'stream' AS on_device, e.category, e.name,
                      e.ts, e.dur, e.correlation, e.external_id, e.rf_id
               FROM ev0 e JOIN track t ON t.pid = e.pid AND t.tid_text = e.tid"""
        )
        self.sql("DROP VIEW ev0")
        self.event_ids()
        self.sql(
            """CREATE TABLE ev AS
               SELECT i.event_id, b.*, i.parent_id, i.depth
               FROM ev_base b JOIN ev_id i USING (ord)"""
        )
        for name in ("ev_base", "ev_id", "ev_order") if self.free else ():
            self.sql(f"DROP TABLE {name}")
        self.sql("CREATE VIEW eva AS SELECT ev.*, a.args FROM ev JOIN arg_row a USING (ord)")

    def event_ids(self) -> None:
        """``ev_id``: each event's ``event_id``, ``parent_id`` and ``depth``, by ``ord``.

        ``event_id`` is the rank in (track, ts, -dur, ord) order: the rowid of ``ev_order``, the
        events' keys sorted by DuckDB (a CREATE TABLE AS keeps its ORDER BY). Nesting runs in
        polars on one slice of ``ev_order`` at a time (``slices``): whole tracks up to
        ``_NEST_ROWS`` events together, or part of a long track between two instants when
        nothing is open (``quiet_slices``), so its working arrays (a few hundred bytes an event)
        stay those of a slice, however large the trace. The fwd-bwd flow points of a slice are
        bound to their enclosing events meanwhile (``flows``), so the nested spans need not
        outlive their slice.
        """
        self.sql(
            """CREATE TABLE ev_order AS
               SELECT ord, track_id, ts, dur, category = 'instant' AS instant FROM ev_base
               ORDER BY track_id, ts, dur DESC, ord"""
        )
        self.sql(
            "CREATE TABLE ev_id (ord BIGINT, event_id BIGINT, parent_id BIGINT, depth INTEGER)"
        )
        points = self.frame("SELECT id, ph, track_id, ts FROM flow_point")
        bound: list[pl.DataFrame] = []
        for lo, hi, tracks, t_lo, t_hi in self.slices():
            rows = self.frame(
                "SELECT rowid AS event_id, ord, track_id, ts, dur, instant FROM ev_order"
                f" WHERE rowid >= {lo} AND rowid < {hi}"
            )
            spans = rows.filter(~pl.col("instant")).select("event_id", "track_id", "ts", "dur")
            nested = nest_events(spans)
            ids = rows.select("ord", "event_id").join(
                nested.select("event_id", "parent_id", "depth"), on="event_id", how="left"
            )
            self.con.register("_slice_ids", ids)
            try:
                self.sql("INSERT INTO ev_id BY NAME SELECT * FROM _slice_ids")
            finally:
                self.con.unregister("_slice_ids")
            here = points.filter(
                pl.col("track_id").is_in(tracks),
                pl.lit(value=True) if t_lo is None else pl.col("ts") >= t_lo,
                pl.lit(value=True) if t_hi is None else pl.col("ts") < t_hi,
            )
            if here.height:
                bound.append(
                    here.select("id", "ph", innermost_enclosing(nested, here).alias("event_id"))
                )
            del rows, spans, nested, ids
        self.bound = (
            pl.concat(bound)
            if bound
            else points.select("id", "ph", event_id=pl.lit(None, pl.Int64))
        )

    def slices(self) -> Iterator[tuple[int, int, list[int], int | None, int | None]]:
        """Rows of ``ev_order`` to nest at a time: ``(lo, hi, tracks, t_lo, t_hi)``.

        Consecutive short tracks go together up to ``_NEST_ROWS`` events (nesting is per track
        anyway, and one call per track would cost more than the nesting of a small file); a
        longer track is cut by ``quiet_slices``. ``t_lo``/``t_hi`` bound the times of the flow
        points to bind in a slice of one track (None: unbounded).
        """
        group: list[int] = []
        lo = at = 0
        for track, n in self.rows(
            "SELECT track_id, count(*) FROM ev_order GROUP BY track_id ORDER BY track_id"
        ):
            if group and (n > _NEST_ROWS or at + n - lo > _NEST_ROWS):
                yield lo, at, group, None, None
                group, lo = [], at
            if n > _NEST_ROWS:
                for a, b, t_lo, t_hi in self.quiet_slices(at, at + n):
                    yield a, b, [track], t_lo, t_hi
                lo = at + n
            else:
                group.append(track)
            at += n
        if group:
            yield lo, at, group, None, None

    def quiet_slices(self, lo: int, hi: int) -> list[tuple[int, int, int | None, int | None]]:
        """Cut rows ``[lo, hi)`` of ``ev_order`` (one track) where every earlier span has ended.

        A cut is made before an event that starts after every span before it has ended
        (strictly: an event ending at a point still encloses it), so nothing before it encloses
        anything from there on, and nesting each slice alone gives what nesting the whole track
        does (a parent is open when its child starts). Slices are at least ``_NEST_ROWS`` long
        where the track allows. Returns ``(lo, hi, t_lo, t_hi)``: the rows, and the times
        (None: unbounded) a flow point must have to look for its event in the slice.
        """
        if hi - lo <= _NEST_ROWS:
            return [(lo, hi, None, None)]
        keys = self.con.sql(
            "SELECT ts, CASE WHEN instant THEN NULL ELSE ts + dur END AS end_ts FROM ev_order"
            f" WHERE rowid >= {lo} AND rowid < {hi}"
        ).pl()
        ts = keys["ts"].to_numpy()
        ends = keys["end_ts"].fill_null(np.iinfo(np.int64).min).to_numpy()
        del keys
        # Row i may start a slice when every span before it has ended before its start.
        ok = np.flatnonzero(np.maximum.accumulate(ends)[:-1] < ts[1:]) + 1
        cuts: list[int] = []
        at = _NEST_ROWS
        while (k := int(np.searchsorted(ok, at))) < len(ok):
            cuts.append(int(ok[k]))
            at = int(ok[k]) + _NEST_ROWS
        bounds = [0, *cuts, hi - lo]
        times = [None, *(int(ts[c]) for c in cuts), None]
        return [
            (lo + a, lo + b, times[k], times[k + 1])
            for k, (a, b) in enumerate(itertools.pairwise(bounds))
        ]

    def keep_side_records(self) -> None:
        """Copy what later steps need from ``raw`` besides ``ev``: memory records, flow points."""
        self.sql(
            f"""CREATE TABLE mem_record AS
                SELECT ts_us_ns + {self.base_ns} AS ts, args FROM raw
                WHERE ph IN ('i', 'I') AND name = '[memory]' AND ts_us_ns IS NOT NULL"""
        )
        self.sql(
            f"""CREATE TABLE flow_point AS
                SELECT r.id, r.ph, t.track_id, r.ts_us_ns + {self.base_ns} AS ts
                FROM raw r JOIN track t ON t.pid = r.pid AND t.tid_text = r.tid
                WHERE r.ph IN ('s', 'f') AND r.cat = 'fwdbwd' AND r.ts_us_ns IS NOT NULL"""
        )
        self.sql(ARG_ROW_SQL)

    def refuse_step_beyond_int32(self) -> None:
        """A ``ProfilerStep#N`` whose ``N`` the ``iteration`` column cannot hold is refused by
        name (``step`` holds it with a NULL iteration), not a cast error of the whole file."""
        over = self.rows("SELECT name FROM step WHERE iteration IS NULL LIMIT 1")
        if over:
            msg = (
                f"{self.path}: step annotation {_short(over[0][0])!r}: the step number is"
                f" beyond {2**31 - 1}"
            )
            raise TraceFormatError(msg)

    def assign_iterations(self) -> None:
        """Steps from ``ProfilerStep#N``; host events by time, device events by their launch."""
        self.sql(
            r"""CREATE TABLE step AS
                SELECT TRY_CAST(regexp_extract(name, '^ProfilerStep#(\d+)$', 1) AS INTEGER)
                           AS iteration,
                       min(ts) AS ts, arg_min(dur, ts) AS dur, arg_min(name, ts) AS name
                FROM ev
                WHERE NOT on_device AND regexp_matches(name, '^ProfilerStep#\d+$')
                GROUP BY 1"""
        )
        self.refuse_step_beyond_int32()
        launch = ", ".join(f"'{c}'" for c in _LAUNCH_CATEGORIES)
        self.sql(
            f"""CREATE TABLE ev_it AS
                WITH by_time AS (
                    SELECT e.event_id, e.on_device, e.correlation, e.category,
                           CASE WHEN e.ts < s.ts + greatest(s.dur, 1) THEN s.iteration END AS it
                    FROM ev e ASOF LEFT JOIN step s ON e.ts >= s.ts),
                launched AS (
                    SELECT correlation, min(it) AS it FROM by_time
                    WHERE category IN ({launch}) AND correlation IS NOT NULL GROUP BY correlation)
                SELECT b.event_id,
                       CASE WHEN b.on_device THEN coalesce(l.it, b.it) ELSE b.it END AS iteration
                FROM by_time b
                LEFT JOIN launched l ON b.on_device AND l.correlation = b.correlation
                WHERE b.it IS NOT NULL OR l.it IS NOT NULL"""
        )

    # -- other frames --------------------------------------------------------------------------

    def memory(self) -> pl.DataFrame:
        return self.frame(
            f"""WITH m AS (SELECT * FROM mem_record)
                SELECT {self.rank} AS rank, m.ts,
                       {_MEMORY_COLUMNS}
                       CASE WHEN m.ts < s.ts + greatest(s.dur, 1) THEN s.iteration END AS iteration
                FROM m ASOF LEFT JOIN step s ON m.ts >= s.ts
                ORDER BY m.ts"""
        )

    def flows(self) -> pl.DataFrame:
        """Launch (by correlation), fwd-bwd (by flow id) and stream-sync dependencies.

        A fwd-bwd flow point binds to the innermost event of its track enclosing it
        (``innermost_enclosing``: a sorted search and a walk up the parents, not a range join).
        """
        launch = ", ".join(f"'{c}'" for c in _LAUNCH_CATEGORIES)
        bound = self.bound.filter(pl.col("event_id").is_not_null())
        self.bound = pl.DataFrame()
        self.con.register("_bound_points", bound)
        self.sql(
            """CREATE TEMP TABLE _bound AS
               SELECT id, ph, max(event_id) AS event_id FROM _bound_points GROUP BY id, ph"""
        )
        self.con.unregister("_bound_points")
        return self.frame(
            f"""WITH launcher AS (
                    SELECT correlation, min(event_id) AS event_id FROM ev
                    WHERE category IN ({launch}) AND correlation IS NOT NULL GROUP BY correlation),
                launches AS (
                    SELECT 'launch' AS kind, l.event_id AS src_event_id, d.event_id AS dst_event_id,
                           d.correlation AS flow_id
                    FROM ev d JOIN launcher l USING (correlation)
                    WHERE d.category IN ('kernel', 'memcpy', 'memset')),
                fwdbwd AS (
                    SELECT 'fwdbwd' AS kind, s.event_id AS src_event_id, f.event_id AS dst_event_id,
                           TRY_CAST(s.id AS BIGINT) AS flow_id
                    FROM _bound s JOIN _bound f ON s.id = f.id AND s.ph = 's' AND f.ph = 'f'),
                waits AS (
                    SELECT e.event_id, e.ts, t.pid,
                           TRY_CAST(e.args->>'wait_on_stream' AS BIGINT) AS stream,
                           TRY_CAST(e.args->>'wait_on_cuda_event_record_corr_id' AS BIGINT) AS rec
                    FROM eva e JOIN track t USING (track_id)
                    WHERE e.category = 'cuda_sync'),
                done AS (
                    SELECT t.pid, t.tid AS stream, e.correlation, e.event_id FROM ev e
                    JOIN track t USING (track_id)
                    WHERE e.on_device AND e.category IN ('kernel', 'memcpy', 'memset')
                      AND e.correlation IS NOT NULL),
                syncs AS (
                    SELECT 'sync' AS kind, d.event_id AS src_event_id, w.event_id AS dst_event_id,
                           NULL::BIGINT AS flow_id
                    FROM waits w ASOF JOIN done d
                      ON d.pid = w.pid AND d.stream = w.stream AND w.rec > d.correlation
                    WHERE w.stream IS NOT NULL AND w.rec IS NOT NULL AND w.rec > 0)
                SELECT {self.rank} AS rank, * FROM (
                    SELECT * FROM launches UNION ALL SELECT * FROM fwdbwd
                    UNION ALL SELECT * FROM syncs)
                ORDER BY kind, dst_event_id, src_event_id"""
        )

    def ranks_frame(self) -> pl.DataFrame:
        rows = self.rows(
            """SELECT coalesce(
                   (SELECT TRY_CAST(any_value(t.pid) AS BIGINT)
                    FROM ev e JOIN track t USING (track_id)
                    WHERE regexp_matches(e.name, '^ProfilerStep#\\d+$') AND NOT e.on_device),
                   (SELECT TRY_CAST(t.pid AS BIGINT) FROM ev e JOIN track t USING (track_id)
                    WHERE t.kind = 'thread' AND TRY_CAST(t.pid AS BIGINT) IS NOT NULL
                    GROUP BY t.pid ORDER BY count(*) DESC LIMIT 1)),
               (SELECT TRY_CAST(t.pid AS INTEGER) FROM ev e JOIN track t USING (track_id)
                WHERE t.kind = 'stream' GROUP BY t.pid ORDER BY count(*) DESC LIMIT 1)"""
        )
        pid, device_id = rows[0]
        return ranks_frame_of(self.rank, self.meta, self.info, pid, device_id)


def ranks_frame_of(
    rank: int, meta: dict[str, Any], info: dict[str, Any], pid: int | None, device_id: int | None
) -> pl.DataFrame:
    """The ``ranks`` row of a file: its header's facts, its process and device ids."""
    props = meta.get("deviceProperties")
    props = props if isinstance(props, list) else []
    entry = next((p for p in props if isinstance(p, dict) and p.get("id") == device_id), None)
    if entry is None and len(props) == 1 and isinstance(props[0], dict):
        entry = props[0]
    if entry is not None:
        device = str(entry.get("name"))
    else:
        device = "cpu" if device_id is None else f"device {device_id}"
    args = {
        k: v
        for k, v in {
            "device_properties": entry,
            "trace_name": meta.get("traceName"),
            "base_time_ns": meta.get("baseTimeNanoseconds"),
            "nccl_version": info.get("nccl_version"),
            "schema_version": meta.get("schemaVersion"),
        }.items()
        if v is not None
    }
    layout = _json_list(meta.get("prism_layout"))  # our generator's rank coordinates
    if isinstance(layout, dict):
        args["prism_layout"] = layout
    host = meta.get("host_name") or meta.get("hostname")
    return pl.DataFrame(
        {
            "rank": [rank],
            "backend": [info.get("backend")],
            "hostname": [host if isinstance(host, str) else None],
            "pid": [pid],
            "device": [device],
            "args": [orjson.dumps(args).decode()],
        },
        schema={
            "rank": pl.Int32,
            "backend": pl.Utf8,
            "hostname": pl.Utf8,
            "pid": pl.Int64,
            "device": pl.Utf8,
            "args": pl.Utf8,
        },
    )

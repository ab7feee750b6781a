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
  ranks only where the ranks agree (``prism_trace.collectives``).
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

from prism_trace.errors import MissingFieldError, PrismError, RankUnknownError, TraceFormatError
from prism_trace.formats._json_array import TraceEventsFile, split_trace_events
from prism_trace.formats.base import TraceTables
from prism_trace.limits import check_rank, check_world_size
from prism_trace.nesting import innermost_enclosing, nest_events

__all__ = ["EventsSink", "rank_from_file_name", "read_kineto", "stage_kineto"]

EventsSink = Callable[[int, duckdb.DuckDBPyRelation], None]
"""Takes the rank and the events relation of a file (``stage_kineto``) and consumes it."""

_RANK_NAME_RES = (
    re.compile(r"(?:^|[^a-z])(?:rank|worker)[_-]?(\d{1,6})(?!\d)", re.IGNORECASE),
    re.compile(r"\.(\d{1,6})(?:\.pt\.trace)?\.json(?:\.gz)?$", re.IGNORECASE),
)

_DEVICE_CATEGORIES = ("kernel", "memcpy", "memset", "gpu_user_annotation", "cuda_sync")
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
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
_TWO_POW_43 = 8796093022208  # µs; beyond it a DOUBLE holds less than 1 ns of fraction
# Bounds of a record's times, in µs: ``ts`` up to year ~2096 as epoch µs, so that the base time
# plus ``ts`` in ns still fits a BIGINT; a ``dur`` up to ~11 days.
_MAX_TS_US = 4e15
_MAX_DUR_US = 1e12
_MAX_BASE_NS = 4 * 10**18


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


def _json_list(value: Any) -> Any:
    """A metadata value that may be JSON text holding JSON (``add_metadata`` vs ``_json``)."""
    for _ in range(2):
        if isinstance(value, (str, bytes)):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError:
                return None
    return value


def _backend_of(config: Any, default: str | None) -> str | None:
    """``cuda:nccl`` -> ``nccl``; ``cpu:gloo,cuda:gloo`` -> ``gloo``; mixed -> the text as is."""
    if not isinstance(config, str) or not config:
        return default
    names = {part.split(":")[-1].strip() for part in config.split(",") if part.strip()}
    return names.pop() if len(names) == 1 else config


def _int_list(value: Any) -> list[int] | None:
    value = _json_list(value)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return [int(v) for v in value]
    return None


# The three ids become typed columns and leave ``args`` as the file's rows are stored, so the
# (large) args text exists once, in ``raw``; ``ev`` joins it back by ``ord`` where needed. A
# record's ``ord`` is its position in the array: ``raw``'s rowid, since a CREATE TABLE AS keeps
# the order of its source (``preserve_insertion_order``, on by default) and several files are
# read in the order listed. Numbering rows in the query instead (``row_number() OVER ()``) would
# make DuckDB parse the files on one thread.
_LOAD = """
CREATE OR REPLACE TABLE raw AS
SELECT * EXCLUDE (ids, args),
       TRY_CAST(ids[1] AS BIGINT) AS correlation, TRY_CAST(ids[2] AS BIGINT) AS external_id,
       TRY_CAST(ids[3] AS BIGINT) AS rf_id,
       CASE WHEN ids[1] IS NULL AND ids[2] IS NULL AND ids[3] IS NULL THEN args::VARCHAR
            ELSE nullif(json_merge_patch(args, '{{"correlation": null, "External id": null,
                                                 "Record function id": null}}')::VARCHAR, '{{}}')
       END AS args
FROM (SELECT *, json_extract_string(args, ['$.correlation', '$."External id"',
                                           '$."Record function id"']) AS ids
      FROM ({select}))
"""

# The fields every timed record must have, read as JSON so that their types are checked, not
# cast: a ``ts`` of ``"123"``, a ``dur`` of ``true`` or a ``name`` of ``{}`` would otherwise be
# taken. ``bad`` names the first field of a record that is missing, mistyped or out of range,
# ``bad_value`` shows it; ``load`` refuses the file on the first such record.
_NUMBER = "('DOUBLE', 'BIGINT', 'UBIGINT')"
_ID = "('VARCHAR', 'BIGINT', 'UBIGINT')"
_SELECT_FAST = f"""
SELECT ph_t AS ph, cat->>'$' AS cat, name_t AS name, pid_t AS pid, tid_t AS tid,
       CAST(floor(ts_d) AS BIGINT) * 1000
           + CAST(round((ts_d - floor(ts_d)) * 1000) AS BIGINT) AS ts_us_ns,
       CAST(round(dur_d * 1000) AS BIGINT) AS dur_ns, id, args, ts_d AS ts_raw, bad,
       CASE bad WHEN 'ph' THEN ph WHEN 'ts' THEN ts WHEN 'dur' THEN dur WHEN 'name' THEN name
                WHEN 'pid' THEN pid WHEN 'tid' THEN tid WHEN 'cat' THEN cat
                WHEN 'args' THEN left(args::VARCHAR, 80) END::VARCHAR AS bad_value
FROM (
    SELECT *,
           CASE WHEN ts_ok THEN ts::DOUBLE END AS ts_d,
           CASE WHEN dur_ok THEN dur::DOUBLE END AS dur_d,
           CASE WHEN json_type(ph) IS DISTINCT FROM 'VARCHAR' THEN 'ph'
                WHEN ph_t NOT IN ('X', 'i', 'I') THEN NULL
                WHEN NOT ts_ok THEN 'ts'
                WHEN ph_t = 'X' AND NOT dur_ok THEN 'dur'
                WHEN json_type(name) IS DISTINCT FROM 'VARCHAR' THEN 'name'
                WHEN coalesce(json_type(pid) NOT IN {_ID}, true) THEN 'pid'
                WHEN coalesce(json_type(tid) NOT IN {_ID}, true) THEN 'tid'
                WHEN coalesce(json_type(cat) NOT IN ('VARCHAR', 'NULL'), false) THEN 'cat'
                WHEN coalesce(json_type(args) NOT IN ('OBJECT', 'NULL'), false) THEN 'args'
           END AS bad
    FROM (
        SELECT *, ph->>'$' AS ph_t, name->>'$' AS name_t, pid->>'$' AS pid_t,
               tid->>'$' AS tid_t,
               coalesce(json_type(ts) IN {_NUMBER}
                        AND abs(ts::DOUBLE) < {_MAX_TS_US}, false) AS ts_ok,
               coalesce(json_type(dur) IN {_NUMBER}
                        AND dur::DOUBLE BETWEEN 0 AND {_MAX_DUR_US}, false) AS dur_ok
        FROM read_json(?, format = 'array', maximum_object_size = {{object_bytes}},
                       columns = {{{{ph: 'JSON', cat: 'JSON', name: 'JSON', pid: 'JSON',
                                    tid: 'JSON', ts: 'JSON', dur: 'JSON', id: 'VARCHAR',
                                    args: 'JSON'}}}})))
"""

# Exact path, for traces whose ts are epoch µs with decimals (DOUBLE would lose the ns).
_SELECT_EXACT = r"""
SELECT j->>'ph' AS ph, j->>'cat' AS cat, j->>'name' AS name,
       j->>'pid' AS pid, j->>'tid' AS tid,
       CAST(TRY_CAST(regexp_extract(j, '"ts"\s*:\s*(-?[0-9][0-9.eE+-]*)', 1) AS DECIMAL(38, 3))
            * 1000 AS BIGINT) AS ts_us_ns,
       CAST(TRY_CAST(regexp_extract(j, '"dur"\s*:\s*(-?[0-9][0-9.eE+-]*)', 1) AS DECIMAL(38, 3))
            * 1000 AS BIGINT) AS dur_ns,
       j->>'id' AS id, j->'args' AS args, NULL::DOUBLE AS ts_raw, NULL::VARCHAR AS bad,
       NULL::VARCHAR AS bad_value
FROM read_json_objects(?, format = 'array', maximum_object_size = {object_bytes}) AS t(j)
"""

_CATEGORY_SQL = """
CASE
    WHEN ph IN ('i', 'I') THEN 'instant'
    WHEN lower(cat) IN ('cpu_op', 'user_annotation', 'python_function', 'cuda_runtime',
                        'cuda_driver', 'kernel', 'gpu_user_annotation', 'cuda_sync')
        THEN lower(cat)
    WHEN lower(cat) IN ('gpu_memcpy', 'memcpy') THEN 'memcpy'
    WHEN lower(cat) IN ('gpu_memset', 'memset') THEN 'memset'
    WHEN lower(cat) = 'operator' THEN 'cpu_op'
    WHEN lower(cat) = 'runtime' THEN 'cuda_runtime'
    WHEN lower(cat) = 'driver' THEN 'cuda_driver'
    ELSE 'other'
END
"""

# ``coalesced`` (the record closing a ``_coalescing_manager`` block), ``_coalescing_manager`` and
# ``batch_isend_irecv`` are no entries on purpose: they wrap calls that are recorded one by one.
# Lookups by MAP, not ``CASE x WHEN ...``: DuckDB expands a simple CASE into one comparison per
# branch, each with its own copy of ``x``, and the nested ones (the size of a normalised dtype)
# multiplied the copies; planning them took longer than running the query.
_OP_KIND_MAP = """
MAP {'allreduce': 'all_reduce', 'all_reduce': 'all_reduce',
     'allreduce_coalesced': 'all_reduce', 'all_reduce_coalesced': 'all_reduce',
     'allreduce_sparse': 'all_reduce', 'allgather': 'all_gather',
     'all_gather': 'all_gather', 'allgather_base': 'all_gather',
     'all_gather_base': 'all_gather', 'allgather_coalesced': 'all_gather',
     'all_gather_into_tensor': 'all_gather',
     'allgather_into_tensor_coalesced': 'all_gather',
     'all_gather_into_tensor_coalesced': 'all_gather', 'reduce_scatter': 'reduce_scatter',
     'reducescatter': 'reduce_scatter', 'reduce_scatter_base': 'reduce_scatter',
     'reduce_scatter_tensor': 'reduce_scatter',
     'reduce_scatter_tensor_coalesced': 'reduce_scatter', 'alltoall': 'all_to_all',
     'all_to_all': 'all_to_all', 'alltoall_base': 'all_to_all',
     'all_to_all_single': 'all_to_all', 'alltoallv': 'all_to_all',
     'all_to_allv': 'all_to_all', 'broadcast': 'broadcast', 'broadcast_oop': 'broadcast',
     'reduce': 'reduce', 'reduce_oop': 'reduce', 'gather': 'gather', 'scatter': 'scatter',
     'barrier': 'barrier', 'monitored_barrier': 'barrier', 'send': 'send', 'isend': 'send',
     'recv': 'recv', 'irecv': 'recv', 'recvanysource': 'recv', 'recv_any_source': 'recv',
     'reduce_scatter_base_coalesced': 'reduce_scatter',
     'reduce_scatter_coalesced': 'reduce_scatter', 'allgather_base_coalesced': 'all_gather',
     'all_gather_coalesced': 'all_gather', 'all_gather_base_coalesced': 'all_gather',
     'alltoall_base_coalesced': 'all_to_all', 'broadcast_coalesced': 'broadcast'}
"""

# Lower-case element type names as torch prints them, and their sizes in bytes.
_DTYPE_MAP = """
MAP {'long int': 'long', 'int64': 'long', 'int64_t': 'long', 'int32': 'int', 'int': 'int',
     'short int': 'short', 'int16': 'short', 'unsigned char': 'byte', 'uint8': 'byte',
     'signed char': 'char', 'int8': 'char', 'float32': 'float', 'float64': 'double',
     'float16': 'half'}
"""
_DTYPE_SIZE_MAP = """
MAP {'float': 4, 'double': 8, 'half': 2, 'bfloat16': 2, 'int': 4, 'long': 8, 'short': 2,
     'byte': 1, 'char': 1, 'bool': 1, 'complexfloat': 8, 'complexdouble': 16,
     'complexhalf': 4, 'uint16': 2, 'uint32': 4, 'uint64': 8}
"""


def _op_kind_sql(x: str) -> str:
    """SQL for the collective kind (``all_reduce``, ``send``...) of op name ``x``; NULL if none.

    The name is normalised first: lower case, a ``c10d::``-style namespace and leading or
    trailing underscores dropped, so the c10d op (``c10d::_allgather_base_``), the backend's
    annotation (``nccl:_all_gather_base``) and ``Collective name`` (``_allgather_base``) of one
    call all give ``all_gather``.
    """
    bare = f"regexp_replace(lower(trim({x})), '^[a-z0-9]+::?', '')"
    norm = f"regexp_replace({bare}, '^_+|_+$', '', 'g')"
    return f"({_OP_KIND_MAP.strip()}[{norm}])"


def _dtype_sql(x: str) -> str:
    """SQL for the normalised element type name of ``x`` (``c10::Half`` -> ``half``)."""
    d = f"regexp_replace(lower(trim({x})), '^(c10::|torch\\.)', '')"
    return f"coalesce({_DTYPE_MAP.strip()}[{d}], {d})"


def _dtype_size_sql(x: str) -> str:
    """SQL for the size in bytes of the normalised element type ``x``; NULL if unknown."""
    return f"coalesce({_DTYPE_SIZE_MAP.strip()}[{x}], CASE WHEN {x} LIKE 'float8%' THEN 1 END)"


class _Reader:
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

    def _fail(self, exc: duckdb.Error) -> TraceFormatError:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return TraceFormatError(f"{self.path}: cannot parse the trace events: {first}")

    def sql(self, query: str, params: list[Any] | None = None) -> None:
        """Run a statement that returns no rows (DDL)."""
        try:
            self.con.execute(query, params)
        except duckdb.Error as exc:
            raise self._fail(exc) from exc

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        try:
            return self.con.sql(query).fetchall()
        except duckdb.Error as exc:
            raise self._fail(exc) from exc

    def frame(self, query: str) -> pl.DataFrame:
        """Fetch a result batch by batch, so it exists once in Arrow form at a time, not whole."""
        try:
            reader = self.con.sql(query).to_arrow_reader(_BATCH_ROWS)
            parts = [pl.from_arrow(batch) for batch in reader]
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
        # raw keeps only the args (ev holds the rest); dropping columns frees their memory
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
        for name in ("comm_raw", "flow_point", "mem_record", "arg_row", "_bound", "track", "step"):
            self.sql(f"DROP TABLE IF EXISTS {name}")
        events = self.events_sql()
        if events_into is None:
            tables.events = self.frame(events)
        else:
            events_into(self.rank, self.con.sql(events))
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
            if len(parts) == 1:
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
        (lossy,) = self.rows(
            f"SELECT count(*) FROM raw"
            f" WHERE abs(ts_raw) >= {_TWO_POW_43} AND ts_raw <> floor(ts_raw)"
        )[0]
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
        base = self.base_ns
        self.sql(
            f"""CREATE VIEW ev0 AS
                SELECT rowid AS ord, ph, pid, tid, ts_us_ns + {base} AS ts,
                       CASE WHEN ph IN ('i', 'I') THEN 0 ELSE greatest(coalesce(dur_ns, 0), 0) END
                           AS dur,
                       coalesce(name, '') AS name, {_CATEGORY_SQL} AS category,
                       correlation, external_id, rf_id
                FROM raw
                WHERE ph IN ('X', 'i', 'I') AND ts_us_ns IS NOT NULL
                  AND coalesce(cat, '') <> 'Trace'
                  AND coalesce(pid, '') NOT IN ('Spans', 'Traces', '')
                  AND NOT (ph IN ('i', 'I') AND name = '[memory]')"""
        )

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
        for name in ("ev_base", "ev_id", "ev_order"):
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
        # The args of the few events whose args later steps read (comms, stream waits): joining
        # these to ``ev`` is cheap, where joining ``raw`` would scan every event's args each time.
        self.sql(
            """CREATE TABLE arg_row AS
               SELECT rowid AS ord, args FROM raw
               WHERE name = 'record_param_comms' OR lower(cat) = 'cuda_sync'
                  OR regexp_matches(name, '^(nccl|gloo|mpi|ucc|xccl):')
                  OR starts_with(name, 'c10d::')
                  OR (lower(cat) = 'kernel' AND name ILIKE '%nccl%')"""
        )

    def assign_iterations(self) -> None:
        """Steps from ``ProfilerStep#N``; host events by time, device events by their launch."""
        self.sql(
            r"""CREATE TABLE step AS
                SELECT CAST(regexp_extract(name, '^ProfilerStep#(\d+)$', 1) AS INTEGER)
                           AS iteration,
                       min(ts) AS ts, arg_min(dur, ts) AS dur, arg_min(name, ts) AS name
                FROM ev
                WHERE NOT on_device AND regexp_matches(name, '^ProfilerStep#\d+$')
                GROUP BY 1"""
        )
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
        types = "[" + ", ".join(f"'{t}'" for t in _DEVICE_TYPES) + "]"
        return self.frame(
            f"""WITH m AS (SELECT * FROM mem_record)
                SELECT {self.rank} AS rank, m.ts,
                       CASE WHEN TRY_CAST(m.args->>'Device Type' AS INTEGER) IS NOT NULL
                            THEN coalesce(
                                list_extract({types},
                                             TRY_CAST(m.args->>'Device Type' AS INTEGER) + 1),
                                m.args->>'Device Type')
                            ELSE lower(m.args->>'Device Type') END AS device_type,
                       TRY_CAST(m.args->>'Device Id' AS INTEGER) AS device_id,
                       TRY_CAST(m.args->>'Addr' AS BIGINT) AS addr,
                       coalesce(TRY_CAST(m.args->>'Bytes' AS BIGINT), 0) AS bytes,
                       TRY_CAST(m.args->>'Total Allocated' AS BIGINT) AS total_allocated,
                       TRY_CAST(m.args->>'Total Reserved' AS BIGINT) AS total_reserved,
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

    # -- communication -------------------------------------------------------------------------

    def comm_groups_from_meta(self) -> dict[str, dict[str, Any]]:
        """Groups declared by the trace: ``distributedInfo.pg_config``, then ``prism_groups``."""
        backend = self.info.get("backend")
        groups: dict[str, dict[str, Any]] = {}
        for g in _json_list(self.meta.get("prism_groups")) or []:
            if isinstance(g, dict) and g.get("name") is not None:
                ranks = _int_list(g.get("ranks"))
                groups[str(g["name"])] = {
                    "name": str(g["name"]),
                    "description": g.get("desc"),
                    "backend": _backend_of(g.get("backend"), backend),
                    "size": len(ranks) if ranks is not None else g.get("size"),
                    "ranks": ranks,
                }
        pg_config = _json_list(self.info.get("pg_config"))
        if isinstance(pg_config, dict):  # older torch: {name: {...}}
            pg_config = [{"pg_name": k, **v} for k, v in pg_config.items() if isinstance(v, dict)]
        for g in pg_config or []:
            if not isinstance(g, dict) or g.get("pg_name") is None:
                continue
            name = str(g["pg_name"])
            ranks = _int_list(g.get("ranks"))
            size = g.get("pg_size")
            groups[name] = {
                "name": name,
                "description": g.get("pg_desc") or groups.get(name, {}).get("description"),
                "backend": _backend_of(g.get("backend_config"), backend),
                "size": int(size) if isinstance(size, int) else (len(ranks) if ranks else None),
                "ranks": ranks if ranks is not None else groups.get(name, {}).get("ranks"),
            }
        return groups

    def comms(self, groups: dict[str, dict[str, Any]]) -> tuple[pl.DataFrame, pl.DataFrame]:
        """Collective and p2p calls, each linked to the NCCL kernel it launched (if any)."""
        ws = self.world_size if self.world_size is not None else "NULL"
        rpc_dtype = _dtype_sql("e.args->>'dtype'")
        old_dtype = _dtype_sql("a.args->'Input type'->>0")
        c10d_dtype = _dtype_sql("e.args->'Input type'->>(e.c10d_in)")
        k_dtype = _dtype_sql("ka.args->>'dtype'")
        launch = ", ".join(f"'{c}'" for c in _LAUNCH_CATEGORIES)
        self.sql(
            rf"""CREATE TABLE comm_raw AS
                WITH prism AS (
                    SELECT e.event_id, e.track_id, e.ts, e.dur, 0 AS source,
                           regexp_extract(e.name, '[:;]pg=([^;]*)', 1) AS group_name,
                           nullif(regexp_extract(e.name, '[:;]desc=([^;]*)', 1), '') AS group_desc,
                           NULL::VARCHAR AS group_ranks, NULL::INTEGER AS group_size,
                           {_op_kind_sql("regexp_extract(e.name, '[:;]op=([^;]*)', 1)")} AS op,
                           TRY_CAST(regexp_extract(e.name, '[:;]seq=(-?\d+)', 1) AS BIGINT) AS seq,
                           TRY_CAST(regexp_extract(e.name, '[:;]in_bytes=(\d+)', 1) AS BIGINT)
                               AS in_bytes,
                           TRY_CAST(regexp_extract(e.name, '[:;]out_bytes=(\d+)', 1) AS BIGINT)
                               AS out_bytes,
                           {_dtype_sql("regexp_extract(e.name, '[:;]dtype=([^;]*)', 1)")}
                               AS dtype,
                           TRY_CAST(regexp_extract(e.name, '[:;]peer=(-?\d+)', 1) AS INTEGER)
                               AS peer,
                           TRY_CAST(regexp_extract(e.name, '[:;]tag=(-?\d+)', 1) AS INTEGER) AS tag,
                           NULL::INTEGER AS group_peer
                    FROM ev e WHERE NOT e.on_device AND starts_with(e.name, 'prism_comm:')),
                rpc_new AS (
                    SELECT e.event_id, e.track_id, e.ts, e.dur, 1 AS source,
                           e.args->>'Process Group Name' AS group_name,
                           e.args->>'Process Group Description' AS group_desc,
                           e.args->>'Process Group Ranks' AS group_ranks,
                           TRY_CAST(e.args->>'Group size' AS INTEGER) AS group_size,
                           {_op_kind_sql("e.args->>'Collective name'")} AS op,
                           TRY_CAST(e.args->>'Seq' AS BIGINT) - 1 AS seq,
                           TRY_CAST(e.args->>'In msg nelems' AS BIGINT)
                               * ({_dtype_size_sql(rpc_dtype)}) AS in_bytes,
                           TRY_CAST(e.args->>'Out msg nelems' AS BIGINT)
                               * ({_dtype_size_sql(rpc_dtype)}) AS out_bytes,
                           {rpc_dtype} AS dtype, NULL::INTEGER AS peer, NULL::INTEGER AS tag,
                           coalesce(TRY_CAST(e.args->>'Dst Rank' AS INTEGER),
                                    TRY_CAST(e.args->>'Src Rank' AS INTEGER)) AS group_peer
                    FROM eva e
                    WHERE e.name = 'record_param_comms' AND e.args->>'Collective name' IS NOT NULL),
                old_call AS (
                    SELECT event_id, track_id, ts, dur FROM eva
                    WHERE name = 'record_param_comms' AND args->>'Collective name' IS NULL),
                old_mark AS (
                    SELECT event_id, track_id, ts, dur, name, args FROM eva
                    WHERE category = 'user_annotation'
                      AND regexp_matches(name, '^(nccl|gloo|mpi|ucc|xccl):')),
                rpc_old AS (
                    -- the first backend annotation after the call on its track, if inside it
                    SELECT e.event_id, e.track_id, e.ts, e.dur, 2 AS source,
                           '0' AS group_name, NULL::VARCHAR AS group_desc,
                           NULL::VARCHAR AS group_ranks, {ws}::INTEGER AS group_size,
                           {_op_kind_sql("regexp_extract(a.name, '^[a-z]+:(.*)$', 1)")} AS op,
                           NULL::BIGINT AS seq,
                           list_aggregate(
                               TRY_CAST(a.args->'Input Dims'->0 AS BIGINT[]), 'product')::BIGINT
                               * ({_dtype_size_sql(old_dtype)}) AS in_bytes,
                           NULL::BIGINT AS out_bytes, {old_dtype} AS dtype,
                           NULL::INTEGER AS peer, NULL::INTEGER AS tag, NULL::INTEGER AS group_peer
                    FROM old_call e ASOF JOIN old_mark a
                      ON a.track_id = e.track_id AND a.event_id > e.event_id
                    WHERE a.ts + a.dur <= e.ts + e.dur),
                c10d AS (
                    -- the c10d op itself (`c10d::_allgather_base_`), for a call whose
                    -- record_param_comms is absent or says nothing (no args, no annotation)
                    SELECT e.event_id, e.track_id, e.ts, e.dur, 3 AS source,
                           '0' AS group_name, NULL::VARCHAR AS group_desc,
                           NULL::VARCHAR AS group_ranks, {ws}::INTEGER AS group_size,
                           {_op_kind_sql("e.name")} AS op, NULL::BIGINT AS seq,
                           list_aggregate(
                               TRY_CAST(e.args->'Input Dims'->(c10d_in) AS BIGINT[]), 'product'
                           )::BIGINT * ({_dtype_size_sql(c10d_dtype)}) AS in_bytes,
                           NULL::BIGINT AS out_bytes, {c10d_dtype} AS dtype,
                           NULL::INTEGER AS peer, NULL::INTEGER AS tag, NULL::INTEGER AS group_peer
                    FROM (SELECT *,
                                 -- the input tensor: (output, input, ...) for the *_base_ and
                                 -- *_tensor forms, whose output differs across ranks
                                 CASE WHEN regexp_matches(name, '(_base_?|_tensor)$')
                                      THEN 1 ELSE 0 END AS c10d_in
                          FROM eva) e
                    WHERE e.category = 'cpu_op' AND starts_with(e.name, 'c10d::')),
                said AS (
                    SELECT * FROM prism UNION ALL SELECT * FROM rpc_new
                    UNION ALL SELECT * FROM rpc_old),
                c10d_alone AS (
                    -- only where no better-described call starts inside the op
                    SELECT d.* FROM c10d d ASOF LEFT JOIN said o
                      ON o.track_id = d.track_id AND o.ts >= d.ts
                    WHERE o.ts IS NULL OR o.ts > d.ts + d.dur),
                cand AS (
                    SELECT * FROM said UNION ALL SELECT * FROM c10d_alone),
                kept AS (
                    -- drop a call enclosed by an earlier one in (ts, -dur, source, event_id)
                    -- order on its track: a running max of the ends, not a range join
                    SELECT * EXCLUDE (prev_end) FROM (
                        SELECT c.*, max(c.ts + c.dur) OVER (
                                   PARTITION BY c.track_id
                                   ORDER BY c.ts, c.dur DESC, c.source, c.event_id
                                   ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_end
                        FROM cand c WHERE c.op IS NOT NULL)
                    WHERE prev_end IS NULL OR prev_end < ts + dur),
                nccl AS (
                    SELECT r.track_id, r.ts AS launch_ts, k.event_id, k.ts, k.dur
                    FROM ev r JOIN ev k ON k.correlation = r.correlation
                    WHERE r.category IN ({launch}) AND k.category = 'kernel'
                      AND k.name ILIKE '%nccl%'),
                first_launch AS (
                    -- the first NCCL launch on the call's track at or after its start
                    SELECT c.event_id, n.event_id AS kernel_event_id, n.launch_ts
                    FROM kept c ASOF JOIN nccl n
                      ON n.track_id = c.track_id AND n.launch_ts >= c.ts),
                linked AS (
                    -- launched inside the call, else inside its enclosing op
                    SELECT f.event_id, f.kernel_event_id
                    FROM first_launch f JOIN kept c USING (event_id)
                    LEFT JOIN ev ce ON ce.event_id = c.event_id
                    LEFT JOIN ev p ON p.event_id = ce.parent_id
                    WHERE f.launch_ts <= c.ts + c.dur
                       OR (p.category IN ('cpu_op', 'user_annotation')
                           AND f.launch_ts <= p.ts + p.dur))
                SELECT c.* REPLACE (
                           -- a host record that names no group (sources 2, 3): the NCCL
                           -- kernel's args may (newer Kineto copies them onto the kernel)
                           CASE WHEN c.source >= 2
                                THEN coalesce(ka.args->>'Process Group Name', c.group_name)
                                ELSE c.group_name END AS group_name,
                           CASE WHEN c.source >= 2
                                THEN coalesce(ka.args->>'Process Group Description', c.group_desc)
                                ELSE c.group_desc END AS group_desc,
                           CASE WHEN c.source >= 2
                                THEN coalesce(ka.args->>'Process Group Ranks', c.group_ranks)
                                ELSE c.group_ranks END AS group_ranks,
                           CASE WHEN c.source >= 2
                                THEN coalesce(TRY_CAST(ka.args->>'Group size' AS INTEGER),
                                              c.group_size)
                                ELSE c.group_size END AS group_size,
                           CASE WHEN c.source >= 2
                                THEN coalesce(TRY_CAST(ka.args->>'Seq' AS BIGINT) - 1, c.seq)
                                ELSE c.seq END AS seq,
                           CASE WHEN c.source >= 2
                                THEN coalesce(c.in_bytes,
                                              TRY_CAST(ka.args->>'In msg nelems' AS BIGINT)
                                              * ({_dtype_size_sql(k_dtype)}))
                                ELSE c.in_bytes END AS in_bytes,
                           CASE WHEN c.source >= 2
                                THEN coalesce(c.out_bytes,
                                              TRY_CAST(ka.args->>'Out msg nelems' AS BIGINT)
                                              * ({_dtype_size_sql(k_dtype)}))
                                ELSE c.out_bytes END AS out_bytes,
                           CASE WHEN c.source >= 2 AND coalesce(c.dtype, '') = ''
                                THEN {k_dtype} ELSE c.dtype END AS dtype),
                       l.kernel_event_id, k.ts AS kernel_ts, k.dur AS kernel_dur,
                       i.iteration::INTEGER AS iteration
                FROM kept c
                LEFT JOIN linked l USING (event_id)
                LEFT JOIN ev k ON k.event_id = l.kernel_event_id
                LEFT JOIN eva ka ON ka.event_id = l.kernel_event_id
                LEFT JOIN ev_it i ON i.event_id = c.event_id"""
        )
        raw = self.frame("SELECT * FROM comm_raw ORDER BY ts, event_id")
        ranks_of = {name: g["ranks"] for name, g in groups.items() if g.get("ranks") is not None}
        size_of = {name: g["size"] for name, g in groups.items() if g.get("size") is not None}
        group_ranks = pl.Series(
            "ranks",
            [
                ranks_of.get(n) if ranks_of.get(n) is not None else _int_list(r)
                for n, r in zip(
                    raw["group_name"].to_list(), raw["group_ranks"].to_list(), strict=True
                )
            ],
            dtype=pl.List(pl.Int32),
        )
        raw = raw.with_columns(
            group_ranks,
            pl.coalesce(
                pl.col("group_size"),
                pl.col("group_name").replace_strict(size_of, default=None, return_dtype=pl.Int32),
            ).alias("group_size"),
        )
        return self._collectives(raw), self._p2p(raw)

    def _collectives(self, raw: pl.DataFrame) -> pl.DataFrame:
        coll = raw.filter(~pl.col("op").is_in(["send", "recv"]))
        size = pl.col("group_size").cast(pl.Int64)
        out_est = (
            pl.when(pl.col("out_bytes").is_not_null())
            .then(pl.col("out_bytes"))
            .when(pl.col("op") == "all_gather")
            .then(pl.col("in_bytes") * size)
            .when(pl.col("op") == "reduce_scatter")
            .then(pl.col("in_bytes") // size)
            .when(pl.col("op").is_in(["all_reduce", "all_to_all", "broadcast", "reduce"]))
            .then(pl.col("in_bytes"))
        )
        return coll.select(
            pl.lit(self.rank).alias("rank"),
            "event_id",
            "group_name",
            pl.when(pl.col("seq") >= 0).then(pl.col("seq")).alias("seq"),
            pl.col("op").alias("kind"),
            pl.col("dtype").replace("", None),
            "in_bytes",
            out_est.alias("out_bytes"),
            pl.max_horizontal("in_bytes", out_est).alias("msg_bytes"),
            "group_size",
            pl.col("ts").alias("host_ts"),
            pl.col("dur").alias("host_dur"),
            "kernel_event_id",
            "kernel_ts",
            "kernel_dur",
            "iteration",
        )

    def _p2p(self, raw: pl.DataFrame) -> pl.DataFrame:
        p2p = raw.filter(pl.col("op").is_in(["send", "recv"]))
        # Group-local peer (record_param_comms) -> global rank through the group's ranks.
        from_group = pl.col("ranks").list.get(pl.col("group_peer"), null_on_oob=True)
        peer = pl.coalesce(
            pl.when(pl.col("peer") >= 0).then(pl.col("peer")),
            pl.when(pl.col("group_peer").is_not_null() & pl.col("ranks").is_not_null()).then(
                from_group
            ),
            pl.col("group_peer"),
        )  # null when the peer is unknown
        return (
            p2p.with_columns(peer.cast(pl.Int32).alias("peer"))
            .select(
                pl.lit(self.rank).alias("rank"),
                "event_id",
                "group_name",
                pl.col("op").alias("direction"),
                "peer",
                pl.when(pl.col("op") == "send")
                .then(pl.col("in_bytes"))
                .otherwise(pl.coalesce(pl.col("out_bytes"), pl.col("in_bytes")))
                .alias("bytes"),
                "tag",
                pl.col("dtype").replace("", None),
                pl.col("ts").alias("host_ts"),
                pl.col("dur").alias("host_dur"),
                "kernel_event_id",
                "kernel_ts",
                "kernel_dur",
                "iteration",
            )
            .sort("host_ts", "event_id")
            .with_columns(
                (pl.int_range(pl.len()).over("peer", "direction")).cast(pl.Int64).alias("seq")
            )
        )

    def comm_groups(
        self, groups: dict[str, dict[str, Any]], coll: pl.DataFrame, p2p: pl.DataFrame
    ) -> pl.DataFrame:
        """Declared groups, plus those only named by calls (with their args' ranks)."""
        out = {name: dict(g) for name, g in groups.items()}
        named = self.rows(
            """SELECT group_name, any_value(group_desc), any_value(group_ranks),
                      max(group_size), min(source)
               FROM comm_raw WHERE group_name IS NOT NULL GROUP BY group_name ORDER BY group_name"""
        )
        backend = self.info.get("backend")
        for name, desc, ranks_text, size, source in named:
            if name in out:
                g = out[name]
                g["description"] = g.get("description") or desc
                if g.get("ranks") is None:
                    g["ranks"] = _int_list(ranks_text)
                continue
            ranks = _int_list(ranks_text)
            if ranks is None and source == 2 and self.world_size is not None:
                ranks = list(range(self.world_size))  # old traces: the default group
            out[name] = {
                "name": name,
                "description": desc or ("default_pg" if source == 2 else None),
                "backend": backend,
                "size": len(ranks) if ranks else size,
                "ranks": ranks,
            }
        del coll, p2p
        rows = sorted(out.values(), key=lambda g: (len(g["name"]), g["name"]))
        return pl.DataFrame(
            {
                "name": [g["name"] for g in rows],
                "description": [g.get("description") for g in rows],
                "backend": [g.get("backend") for g in rows],
                "size": [g.get("size") for g in rows],
                "ranks": [g.get("ranks") for g in rows],
            },
            schema={
                "name": pl.Utf8,
                "description": pl.Utf8,
                "backend": pl.Utf8,
                "size": pl.Int32,
                "ranks": pl.List(pl.Int32),
            },
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
        props = self.meta.get("deviceProperties")
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
                "trace_name": self.meta.get("traceName"),
                "base_time_ns": self.meta.get("baseTimeNanoseconds"),
                "nccl_version": self.info.get("nccl_version"),
                "schema_version": self.meta.get("schemaVersion"),
            }.items()
            if v is not None
        }
        layout = _json_list(self.meta.get("prism_layout"))  # our generator's rank coordinates
        if isinstance(layout, dict):
            args["prism_layout"] = layout
        host = self.meta.get("host_name") or self.meta.get("hostname")
        return pl.DataFrame(
            {
                "rank": [self.rank],
                "backend": [self.info.get("backend")],
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

"""The SQL of the Kineto reader: loading the trace-event records, their categories, op kinds and
dtypes, and the bounds of their times."""

from __future__ import annotations

from prism_trace.formats.device import category_sql
from prism_trace.limits import MAX_COMM_BYTES

__all__ = ["ARG_ROW_SQL", "ev0_sql", "track_sql"]

_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
"""Stored categories of the runtime calls that launch device work (of any backend:
``formats.device``)."""

_TWO_POW_43 = 8796093022208  # µs; beyond it a DOUBLE holds less than 1 ns of fraction
# Bounds of a record's times, in µs: ``ts`` up to year ~2096 as epoch µs, so that the base time
# plus ``ts`` in ns still fits a BIGINT; a ``dur`` up to ~11 days.
_MAX_TS_US = 4e15
_MAX_DUR_US = 1e12
_MAX_BASE_NS = 4 * 10**18


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
# ``bad_value`` shows it; ``load`` refuses the file on the first such record. A key twice in
# ``args`` (its top level, here; deeper in ``load``) is ``args key``, shown by the key: DuckDB
# itself refuses a record that states one of the columns read twice, which is why ``bp`` and
# ``s`` (a flow's binding point, an instant's scope: strings) are read and checked too: every
# key Kineto writes is then read, so no key of a record can be stated twice unseen. The casts are
# TRY_CASTs although a number is checked first: DuckDB evaluates both sides of an AND, so a plain
# cast of a ``ts`` of ``"abc"`` or ``[1]`` stopped the whole load with a cast error instead.
_NUMBER = "('DOUBLE', 'BIGINT', 'UBIGINT')"
_ID = "('VARCHAR', 'BIGINT', 'UBIGINT')"
_SELECT_FAST = f"""
SELECT ph_t AS ph, cat->>'$' AS cat, name_t AS name, pid_t AS pid, tid_t AS tid,
       CAST(floor(ts_d) AS BIGINT) * 1000
           + CAST(round((ts_d - floor(ts_d)) * 1000) AS BIGINT) AS ts_us_ns,
       CAST(round(dur_d * 1000) AS BIGINT) AS dur_ns, id, args,
       CASE WHEN abs(ts_d) >= {_TWO_POW_43}
            THEN contains(ts::VARCHAR, '.') OR contains(ts::VARCHAR, 'e')
                 OR contains(ts::VARCHAR, 'E')
            ELSE false END
           AS ts_inexact, bad,
       CASE bad WHEN 'ph' THEN ph WHEN 'ts' THEN ts WHEN 'dur' THEN dur WHEN 'name' THEN name
                WHEN 'pid' THEN pid WHEN 'tid' THEN tid WHEN 'cat' THEN cat
                WHEN 'args' THEN left(args::VARCHAR, 80) WHEN 'bp' THEN bp WHEN 's' THEN s
                WHEN 'args key' THEN to_json(list_filter(
                    json_keys(args), lambda k, i: list_position(json_keys(args), k) < i)[1])
           END::VARCHAR AS bad_value
FROM (
    SELECT *,
           CASE WHEN ts_ok THEN TRY_CAST(ts AS DOUBLE) END AS ts_d,
           CASE WHEN dur_ok THEN TRY_CAST(dur AS DOUBLE) END AS dur_d,
           CASE WHEN json_type(ph) IS DISTINCT FROM 'VARCHAR' THEN 'ph'
                WHEN len(json_keys(args)) <> len(list_distinct(json_keys(args))) THEN 'args key'
                WHEN coalesce(json_type(bp) <> 'VARCHAR', false) THEN 'bp'
                WHEN coalesce(json_type(s) <> 'VARCHAR', false) THEN 's'
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
                        AND abs(TRY_CAST(ts AS DOUBLE)) < {_MAX_TS_US}, false) AS ts_ok,
               coalesce(json_type(dur) IN {_NUMBER}
                        AND TRY_CAST(dur AS DOUBLE) BETWEEN 0 AND {_MAX_DUR_US}, false)
                   AS dur_ok
        FROM read_json(?, format = 'array', maximum_object_size = {{object_bytes}},
                       columns = {{{{ph: 'JSON', cat: 'JSON', name: 'JSON', pid: 'JSON',
                                    tid: 'JSON', ts: 'JSON', dur: 'JSON', id: 'VARCHAR',
                                    args: 'JSON', bp: 'JSON', s: 'JSON'}}}})))
"""


# Exact path, for traces whose ts are epoch µs with decimals (DOUBLE would lose the ns): the
# digits of the record's own ``ts`` and ``dur`` as written. A JSON parse (``->``) keeps a number
# only as a DOUBLE, so they are taken from the object's text; the object may hold other members
# of those names (in ``args``, before or after the record's own), so of every ``"ts": number``
# in it the one kept is the first whose value is the record's own ``ts``. Records the fast path
# does not check (``M`` and the like) may hold any number there: out of range is NULL.
def _exact_ns(field: str) -> str:
    """SQL: the record's ``field`` (µs, as written) in integer ns, from the object text ``j``."""
    number = r"\s*:\s*(-?[0-9][0-9.eE+-]*)"
    text = (
        f"""list_filter(regexp_extract_all(j, '"{field}"{number}', 1),"""
        f" lambda x: TRY_CAST(x AS DOUBLE) = TRY_CAST(j->'{field}' AS DOUBLE))[1]"
    )
    return f"""list_transform([TRY_CAST({text} AS DECIMAL(38, 3))],
                   lambda d: CASE WHEN abs(d) < 9e15 THEN CAST(d * 1000 AS BIGINT) END)[1]"""


_SELECT_EXACT = f"""
SELECT j->>'ph' AS ph, j->>'cat' AS cat, j->>'name' AS name,
       j->>'pid' AS pid, j->>'tid' AS tid,
       {_exact_ns("ts")} AS ts_us_ns,
       {_exact_ns("dur")} AS dur_ns,
       j->>'id' AS id, j->'args' AS args, false AS ts_inexact, NULL::VARCHAR AS bad,
       NULL::VARCHAR AS bad_value
FROM read_json_objects(?, format = 'array', maximum_object_size = {{object_bytes}}) AS t(j)
"""

_CATEGORY_SQL = category_sql("cat", "coalesce(name, '')", "ph")

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


def _once(x: str, body: str) -> str:
    """SQL for ``body`` (an expression of ``v``) at ``v = x``, with ``x`` written once.

    A lambda over a one-element list binds ``x`` once where ``body`` uses it twice: written out,
    every use is a copy of ``x`` (itself a lookup, for a size of a normalised dtype), and
    DuckDB's parse and bind time grows with the copies, which made planning the reader's
    communication query cost more than running it (~0.1 s a file).
    """
    return f"list_transform([{x}], lambda v: {body})[1]"


def _call_bytes_sql(count: str, size: str, field: str, record: str) -> str:
    """SQL for ``count`` elements of ``size`` bytes, a call's byte count, as BIGINT.

    A negative count, or more bytes than one call moves (``MAX_COMM_BYTES``: an all-gather's
    output is its input times the group's size, which must still fit), stops the statement
    through DuckDB's ``error`` naming the record (``record``: SQL for the events-table alias
    whose ``ord`` and ``name`` say which), rather than be stored, or wrap in the arithmetic.
    An unknown ``size`` gives NULL, as before; the count is still checked, as if of bytes.
    """
    message = (
        f"'traceEvents[' || {record}.ord || '] (' || {record}.name || '): `{field}` = ' || v"
        f" || ' is not a count of elements of at most {MAX_COMM_BYTES} bytes'"
    )
    return _once(
        count,
        f"CASE WHEN v < 0 OR v::DOUBLE * coalesce({size}, 1) > {MAX_COMM_BYTES}"
        f" THEN error({message}) ELSE CAST(v AS BIGINT) * ({size}) END",
    )


def _dtype_sql(x: str) -> str:
    """SQL for the normalised element type name of ``x`` (``c10::Half`` -> ``half``)."""
    d = f"regexp_replace(lower(trim({x})), '^(c10::|torch\\.)', '')"
    return _once(d, f"coalesce({_DTYPE_MAP.strip()}[v], v)")


def _dtype_size_sql(x: str) -> str:
    """SQL for the size in bytes of the normalised element type ``x``; NULL if unknown."""
    return _once(
        x, f"coalesce({_DTYPE_SIZE_MAP.strip()}[v], CASE WHEN v LIKE 'float8%' THEN 1 END)"
    )


# The args of the few events whose args later steps read (comms, stream waits): joining these to
# ``ev`` is cheap, where joining ``raw`` would scan every event's args each time. The per-file and
# the batch reader both keep ``raw``'s rowid as ``ord``.
ARG_ROW_SQL = """CREATE TABLE arg_row AS
   SELECT rowid AS ord, args FROM raw
   WHERE name = 'record_param_comms' OR lower(cat) IN ('cuda_sync', 'gcu_sync')
      OR regexp_matches(name, '^(nccl|gloo|mpi|ucc|xccl):')
      OR starts_with(name, 'c10d::')
      OR (lower(cat) IN ('kernel', 'mtia_ccp_events', 'concurrent_kernel')
          AND name ILIKE '%nccl%')"""


def ev0_sql(base_ns: str, *, keys: str = "") -> str:
    """The view of ``raw``'s timed events (``ev0``) that tracks and events are built from.

    ``base_ns`` is the SQL of the nanoseconds added to each ``ts`` (the trace's base time; the
    batch reader indexes a list of them by file), ``keys`` the extra leading columns (``"f, "``).
    """
    return f"""CREATE VIEW ev0 AS
        SELECT rowid AS ord, {keys}ph, pid, tid, ts_us_ns + {base_ns} AS ts,
               CASE WHEN ph IN ('i', 'I') THEN 0 ELSE greatest(coalesce(dur_ns, 0), 0) END AS dur,
               coalesce(name, '') AS name, {_CATEGORY_SQL} AS category,
               correlation, external_id, rf_id
        FROM raw
        WHERE ph IN ('X', 'i', 'I') AND ts_us_ns IS NOT NULL
          AND coalesce(cat, '') <> 'Trace'
          AND coalesce(pid, '') NOT IN ('Spans', 'Traces', '')
          AND NOT (ph IN ('i', 'I') AND name = '[memory]')"""


_STREAM_ARG_CATEGORIES = (
    "('kernel', 'mtia_ccp_events', 'concurrent_kernel', 'gpu_memcpy', 'gpu_memset', 'memcpy',"
    " 'memset')"
)


def track_sql(device: str, *, keys: str = "") -> str:
    """The statement making ``track``: one per (pid, tid), a ``stream`` when it holds device
    events (``device``: their stored categories, SQL list items), else a ``thread``.

    A stream's ``tid`` is its stream id: the ``tid`` itself where it is a number, else the
    ``stream`` arg of its device events, else the number its text ends with. Older Kineto
    names a stream track ``"stream 7"`` and says 7 only in the events' args; taking the text's
    NULL cast lost the id (idle rows and report lanes showed no stream). ``keys`` are the extra
    leading key columns (``"f"`` for a batch of files).
    """
    k = f"{keys}, " if keys else ""
    cols = [*([keys] if keys else []), "pid", "tid"]
    by_names = " AND ".join(f"n.{c} = t.{c}" for c in cols)
    by_args = " AND ".join(f"s.{c} = t.{c}" for c in cols)
    first_key = f"t.{keys}, " if keys else ""
    return rf"""CREATE TABLE track AS
        WITH t AS (
            SELECT {k}pid, tid, bool_or(category IN ({device})) AS is_stream
            FROM ev0 GROUP BY {k}pid, tid),
        names AS (
            SELECT {k}pid, tid, trim(any_value(args->>'name')) AS name
            FROM raw WHERE ph = 'M' AND name = 'thread_name' GROUP BY {k}pid, tid),
        stream_arg AS (
            SELECT {k}pid, tid, min(TRY_CAST(args->>'stream' AS BIGINT)) AS stream
            FROM raw
            WHERE TRY_CAST(tid AS BIGINT) IS NULL AND ph = 'X'
              AND lower(cat) IN {_STREAM_ARG_CATEGORIES}
            GROUP BY {k}pid, tid)
        SELECT (row_number() OVER (
                    ORDER BY {first_key}t.is_stream, TRY_CAST(t.pid AS BIGINT) NULLS LAST, t.pid,
                             TRY_CAST(t.tid AS BIGINT) NULLS LAST, t.tid) - 1)::INTEGER
                   AS track_id, {first_key}
               CASE WHEN t.is_stream THEN 'stream' ELSE 'thread' END AS kind,
               t.pid,
               CASE WHEN t.is_stream
                    THEN coalesce(TRY_CAST(t.tid AS BIGINT), s.stream,
                                  TRY_CAST(regexp_extract(t.tid, '(\d+)\s*$', 1) AS BIGINT))
                    ELSE TRY_CAST(t.tid AS BIGINT) END AS tid,
               t.tid AS tid_text,
               coalesce(n.name, CASE WHEN TRY_CAST(t.tid AS BIGINT) IS NULL THEN t.tid END)
                   AS name
        FROM t LEFT JOIN names n ON {by_names}
        LEFT JOIN stream_arg s ON {by_args}"""

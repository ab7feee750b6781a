"""Writer from the store to the Chrome trace-event JSON that Perfetto and chrome://tracing open.

``export_perfetto`` streams one run (any kind) into one ``.json`` or ``.json.gz`` file: a
process per rank (``pid`` = rank), a thread per track (``tid`` = ``track_id``), an ``X`` event
per timed event, ``s``/``f`` flow arrows for the ``flow`` table, ``C`` counters for allocated
memory and the run's facts in ``otherData``. DuckDB renders each row's JSON text and the rows
are fetched in chunks, so no list of all events is ever built in Python. See docs/export.md.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from prism_trace.errors import SelectionError
from prism_trace.outputs import atomic_file, output_file
from prism_trace.ranks import format_ranks

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["PERFETTO_SCHEMA", "export_perfetto"]

PERFETTO_SCHEMA = "prism-trace-1-chrome-trace"
"""``otherData.schema`` of the files written."""

_CHUNK = 50_000


def _us(col: str) -> str:
    """SQL text of ``col`` (ns since the base, >= 0) as exact decimal µs: ``1234.567``."""
    return f"(({col}) // 1000)::VARCHAR || '.' || lpad((({col}) % 1000)::VARCHAR, 3, '0')"


_EVENT_SQL = f"""
SELECT '{{"ph":"X","pid":' || m.pid || ',"tid":' || coalesce(e.track_id, -1)
    || ',"ts":' || {_us("e.ts - $2")} || ',"dur":' || {_us("greatest(coalesce(e.dur, 0), 0)")}
    || ',"name":' || to_json(e.name) || ',"cat":' || to_json(e.category)
    || ',"args":' || json_merge_patch(
        CASE WHEN json_type(e.args) = 'OBJECT' THEN e.args ELSE '{{}}'::JSON END,
        json_object('category', e.category, 'iteration', e.iteration, 'event_id', e.event_id,
            'depth', e.depth, 'correlation', e.correlation, 'External id', e.external_id,
            'Record function id', e.rf_id, 'collective', c.kind, 'group_id', c.group_id,
            'seq', c.seq, 'msg_bytes', c.msg_bytes))::VARCHAR
    || '}}'
FROM event e JOIN (SELECT unnest($3) AS src, unnest($4) AS pid) m ON m.src = e.rank
LEFT JOIN collective c
    ON c.run_id = e.run_id AND c.rank = e.rank AND c.event_id = e.event_id
WHERE e.run_id = $1 AND e.ts IS NOT NULL
ORDER BY m.pid, e.ts, e.event_id
"""

_NODE_SQL = f"""
SELECT '{{"ph":"X","pid":' || m.pid || ',"tid":' || coalesce(n.track_id, -1)
    || ',"ts":' || {_us("n.ts - $2")} || ',"dur":' || {_us("greatest(coalesce(n.dur, 0), 0)")}
    || ',"name":' || to_json(coalesce(n.name, n.kind)) || ',"cat":' || to_json(n.kind)
    || ',"args":' || json_object('kind', n.kind, 'iteration', n.iteration, 'node_id', n.node_id,
        'event_id', n.event_id, 'group_id', n.group_id, 'seq', n.seq, 'peer', n.peer,
        'msg_bytes', n.msg_bytes, 'collective', n.comm_kind)::VARCHAR
    || '}}'
FROM graph_node n JOIN (SELECT unnest($3) AS src, unnest($4) AS pid) m ON m.src = n.rank
WHERE n.run_id = $1 AND n.ts IS NOT NULL
ORDER BY m.pid, n.ts, n.node_id
"""

_FLOW_SQL = f"""
WITH f AS (
    SELECT row_number() OVER (ORDER BY m.pid, s.ts, f.src_event_id, f.dst_event_id) AS id,
        m.pid AS rank, f.kind, s.track_id AS s_tid, s.ts AS s_ts, d.track_id AS d_tid,
        d.ts AS d_ts
    FROM flow f JOIN (SELECT unnest($3) AS src, unnest($4) AS pid) m ON m.src = f.rank
    JOIN event s ON s.run_id = f.run_id AND s.rank = f.rank AND s.event_id = f.src_event_id
    JOIN event d ON d.run_id = f.run_id AND d.rank = f.rank AND d.event_id = f.dst_event_id
    WHERE f.run_id = $1 AND s.ts IS NOT NULL AND d.ts IS NOT NULL)
SELECT '{{"ph":"s","id":' || id || ',"pid":' || rank || ',"tid":' || coalesce(s_tid, -1)
    || ',"ts":' || {_us("s_ts - $2")} || ',"name":' || to_json(kind) || ',"cat":"flow"}}' || ',\n'
    || '{{"ph":"f","bp":"e","id":' || id || ',"pid":' || rank || ',"tid":' || coalesce(d_tid, -1)
    || ',"ts":' || {_us("d_ts - $2")} || ',"name":' || to_json(kind) || ',"cat":"flow"}}'
FROM f ORDER BY id
"""

_COUNTER_SQL = f"""
SELECT '{{"ph":"C","pid":' || m.pid || ',"tid":0,"ts":' || {_us("ts - $2")}
    || ',"name":"allocated bytes","args":'
    || json_object(coalesce(device_type, '?') || ':' || coalesce(device_id, -1),
        total_allocated)::VARCHAR || '}}'
FROM memory JOIN (SELECT unnest($3) AS src, unnest($4) AS pid) m ON m.src = memory.rank
WHERE run_id = $1 AND total_allocated IS NOT NULL
ORDER BY m.pid, ts
"""


def _rows(store: Store, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    return store.con.execute(sql, params).fetchall()


def _stream(
    store: Store, sql: str, params: list[Any], fh: IO[str], *, first: bool
) -> tuple[int, bool]:
    """Write each row's text, comma-separated, in chunks; return the rows and the ``first`` flag."""
    cur = store.con.cursor()
    try:
        cur.execute(sql, params)
        n = 0
        while True:
            chunk = cur.fetchmany(_CHUNK)
            if not chunk:
                break
            text = ",\n".join(r[0] for r in chunk)
            fh.write(text if first else ",\n" + text)
            first = False
            n += len(chunk)
    finally:
        cur.close()
    return n, first


def _mapping(
    run: str, stored: list[int], class_of: dict[int, int | None], ranks: list[int] | None
) -> tuple[list[int], list[int]]:
    """Which stored rank's events each exported process shows: ``(sources, pids)``.

    Default: every stored rank as itself. With ``ranks``: each listed rank as its own process,
    from its own events or its class exemplar's (the lowest stored member of its class).

    Raises:
        SelectionError: a listed rank is not in the run, or neither it nor its class has events.
    """
    if ranks is None:
        return list(stored), list(stored)
    have = set(stored)
    exemplar: dict[int, int] = {}
    for r in stored:
        c = class_of.get(r)
        if c is not None:
            exemplar[c] = min(exemplar.get(c, r), r)
    src: list[int] = []
    for r in ranks:
        if r not in class_of:
            msg = f"run {run!r} has no rank {r} (world: {len(class_of)} ranks)"
            raise SelectionError(msg)
        c = class_of[r]
        if r in have:
            src.append(r)
        elif c is not None and c in exemplar:
            src.append(exemplar[c])
        else:
            msg = f"run {run!r}: rank {r} has no events and no class exemplar with events"
            raise SelectionError(msg)
    return src, list(ranks)


def _ranges(ranks: list[int]) -> str:
    return format_ranks(ranks, stride=" step ", sep=", ", limit=4)


def _process_label(
    src: int, pid: int, class_id: int | None, members: dict[int, list[int]], *, expanded: bool
) -> str:
    """``rank 3``; ``class 0: ranks 0..8190 step 2 (4096), exemplar rank 0``; or, expanded,
    ``rank 6 (class 0, from exemplar rank 0)``."""
    if class_id is None or class_id not in members:
        return f"rank {pid}"
    if expanded:
        via = "" if src == pid else f", from exemplar rank {src}"
        return f"rank {pid} (class {class_id}{via})"
    m = members[class_id]
    return f"class {class_id}: ranks {_ranges(m)} ({len(m)}), exemplar rank {src}"


def _open(path: Path, *, gz: bool) -> IO[str]:
    if gz:
        return gzip.open(path, "wt", encoding="utf-8", compresslevel=3)
    return path.open("w", encoding="utf-8")


def export_perfetto(
    store: Store,
    *,
    run: str,
    out: Path | str,
    ranks: list[int] | None = None,
    follow_symlinks: bool = False,
) -> dict[str, Any]:
    """Write run ``run`` as Chrome trace JSON for Perfetto (``.json``, or gzipped ``.json.gz``).

    By default every stored rank with events is written, one process each; for a sliced or
    emulated run these are the class exemplars (``rank.class_id``), and each process is named
    with the ranks it stands for (``class 0: ranks 0..8190 step 2 (4096), exemplar rank 0``), so
    an 8192-rank job opens as a handful of readable processes. ``ranks`` expands instead: one
    process per listed rank (``pid`` = the rank), drawn from its own events or, when it has none,
    from its class exemplar's. A sliced run has no events, so its graph nodes (``graph_node``)
    are written instead.

    Times are µs relative to ``baseTimeNanoseconds`` (the run's first exported instant), written
    as exact decimals with three fractional digits, so no nanosecond is lost to a double.

    Args:
        store: an open store (read-only is fine).
        run: the run's name (any kind).
        out: the file to write; a ``.gz`` suffix gzips it.
        ranks: write these ranks, each as its own process (default: the stored ranks).
        follow_symlinks: write where a symbolic link at ``out`` points, even out of its folder.

    Returns:
        What was written: ``path``, ``bytes``, ``ranks``, ``events`` (X events), ``flows``,
        ``counters``, ``untimed`` (events without a time, skipped), ``source`` (``event`` or
        ``graph_node``), ``exemplars`` and ``seconds``.

    Raises:
        RunNotFoundError: no run of that name.
        SelectionError: a listed rank is not in the run or has neither events nor a class
            exemplar with events.
        OutputError: ``out`` is refused (``prism_trace.outputs``) or cannot be written.
    """
    started = time.perf_counter()
    run_id = store.require_run(run)
    out = output_file(Path(out), create=False, follow_symlinks=follow_symlinks)
    run_row = _rows(
        store,
        "SELECT r.name, r.kind, p.name, r.world_size, r.source_format,"
        " CAST(r.created_at AS VARCHAR), CAST(r.config_json AS VARCHAR)"
        " FROM run r LEFT JOIN run p ON p.run_id = r.parent_run_id WHERE r.run_id = $1",
        [run_id],
    )[0]
    source = "event"
    stored = [
        r[0]
        for r in _rows(
            store, "SELECT DISTINCT rank FROM event WHERE run_id = $1 ORDER BY rank", [run_id]
        )
    ]
    if not stored:
        stored = [
            r[0]
            for r in _rows(
                store,
                "SELECT DISTINCT rank FROM graph_node WHERE run_id = $1 ORDER BY rank",
                [run_id],
            )
        ]
        source = "graph_node" if stored else "event"
    table = "event" if source == "event" else "graph_node"
    base_row = _rows(
        store,
        f"SELECT least(min(ts), (SELECT min(ts) FROM memory WHERE run_id = $1)),"
        f" count(*) FILTER (WHERE ts IS NULL) FROM {table} WHERE run_id = $1",
        [run_id],
    )[0]
    base = int(base_row[0] or 0)
    untimed = int(base_row[1] or 0)
    classes = _rows(
        store,
        "SELECT class_id, count(*), min(rank), list(rank ORDER BY rank) FROM rank"
        " WHERE run_id = $1 AND class_id IS NOT NULL GROUP BY class_id ORDER BY class_id",
        [run_id],
    )
    class_all = dict(_rows(store, "SELECT rank, class_id FROM rank WHERE run_id = $1", [run_id]))
    members = {c: m for c, _, _, m in classes}
    src, pids = _mapping(run, stored, class_all, ranks)
    exported = sorted(set(src))
    class_of = {r: class_all.get(r) for r in exported}
    config = json.loads(run_row[6]) if run_row[6] else None
    other: dict[str, Any] = {
        "schema": PERFETTO_SCHEMA,
        "run": run_row[0],
        "run_kind": run_row[1],
        "parent_run": run_row[2],
        "world_size": run_row[3],
        "source_format": run_row[4],
        "created_at": run_row[5],
        "source_table": source,
        "exported_ranks": exported,
        "processes": pids,
        "exemplars": bool(classes) and ranks is None,
        "config": config,
    }
    if classes:
        other["note"] = (
            f"{len(exported)} class exemplars of {run_row[3]} ranks: each process stands for"
            " every rank of its class (rank.class_id), named with them"
            if ranks is None
            else f"{len(pids)} ranks expanded (--ranks), each drawn from its class exemplar"
        )
        other["classes"] = [
            {"class_id": c, "ranks": n, "exemplar": x, "exported": x in class_of}
            for c, n, x, _ in classes
        ]
    tracks = _rows(
        store,
        "SELECT m.pid, t.track_id, t.kind,"
        " coalesce(t.name, t.kind || ' ' || coalesce(t.tid::VARCHAR, '?'))"
        " FROM track t JOIN (SELECT unnest($2) AS src, unnest($3) AS pid) m ON m.src = t.rank"
        " WHERE t.run_id = $1 ORDER BY m.pid, t.track_id",
        [run_id, src, pids],
    )
    if source == "graph_node":
        tracks = _rows(
            store,
            "SELECT DISTINCT m.pid, coalesce(n.track_id, -1), 'thread',"
            " 'track ' || coalesce(n.track_id, -1) FROM graph_node n"
            " JOIN (SELECT unnest($2) AS src, unnest($3) AS pid) m ON m.src = n.rank"
            " WHERE n.run_id = $1 ORDER BY 1, 2",
            [run_id, src, pids],
        )
    counts = {"events": 0, "flows": 0, "counters": 0}
    # Written beside `out` and renamed into place: a failed or killed export leaves `out` as it
    # was, never a half trace under its name.
    with (
        atomic_file(out, follow_symlinks=follow_symlinks) as tmp,
        _open(tmp, gz=out.suffix == ".gz") as fh,
    ):
        head = {"displayTimeUnit": "ns", "baseTimeNanoseconds": base, "otherData": other}
        fh.write(json.dumps(head, default=str)[:-1] + ',\n"traceEvents":[\n')
        meta: list[dict[str, Any]] = []
        for r, pid in zip(src, pids, strict=True):
            label = _process_label(r, pid, class_all.get(r), members, expanded=ranks is not None)
            meta.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}})
            meta.append(
                {
                    "ph": "M",
                    "pid": pid,
                    "name": "process_sort_index",
                    "args": {"sort_index": pid},
                }
            )
        for r, tid, kind, name in tracks:
            meta.append(
                {"ph": "M", "pid": r, "tid": tid, "name": "thread_name", "args": {"name": name}}
            )
            order = tid + (1_000_000 if kind == "stream" else 0)
            meta.append(
                {
                    "ph": "M",
                    "pid": r,
                    "tid": tid,
                    "name": "thread_sort_index",
                    "args": {"sort_index": order},
                }
            )
        fh.write(",\n".join(json.dumps(m) for m in meta))
        first = not meta
        params = [run_id, base, src, pids]
        counts["events"], first = _stream(
            store, _EVENT_SQL if source == "event" else _NODE_SQL, params, fh, first=first
        )
        if source == "event":
            counts["flows"], first = _stream(store, _FLOW_SQL, params, fh, first=first)
            counts["counters"], first = _stream(store, _COUNTER_SQL, params, fh, first=first)
        fh.write("\n]}\n")
    return {
        "run": run,
        "path": str(out),
        "bytes": out.stat().st_size,
        "ranks": len(pids),
        "tracks": len(tracks),
        **counts,
        "untimed": untimed,
        "source": source,
        "exemplars": bool(classes),
        "seconds": time.perf_counter() - started,
    }

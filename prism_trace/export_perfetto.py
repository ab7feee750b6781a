"""Writer from the store to the Chrome trace-event JSON that Perfetto and chrome://tracing open.

``export_perfetto`` streams one run (any kind) into one ``.json`` or ``.json.gz`` file: a
process per rank (``pid`` = rank), a thread per track (``tid`` = ``track_id``), an ``X`` event
per timed event, ``s``/``f`` flow arrows for the ``flow`` table, ``C`` counters for allocated
memory and the run's facts in ``otherData``. DuckDB renders each row's JSON text and the rows
are fetched in chunks, so no list of all events is ever built in Python. See docs/export.md.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from prism_trace.errors import PrismError

if TYPE_CHECKING:
    from prism_trace.store import Store

__all__ = ["PERFETTO_SCHEMA", "export_perfetto"]

PERFETTO_SCHEMA = "prism-trace-1-chrome-trace"
"""``otherData.schema`` of the files written."""

_CHUNK = 50_000


def _us(col: str) -> str:
    """SQL text of ``col`` (ns since the base, >= 0) as exact decimal µs: ``1234.567``."""
    return f"(({col}) // 1000)::VARCHAR || '.' || lpad((({col}) % 1000)::VARCHAR, 3, '0')"


_EVENT_SQL = f"""
SELECT '{{"ph":"X","pid":' || e.rank || ',"tid":' || coalesce(e.track_id, -1)
    || ',"ts":' || {_us("e.ts - $2")} || ',"dur":' || {_us("greatest(coalesce(e.dur, 0), 0)")}
    || ',"name":' || to_json(e.name) || ',"cat":' || to_json(e.category)
    || ',"args":' || json_merge_patch(
        CASE WHEN json_type(e.args) = 'OBJECT' THEN e.args ELSE '{{}}'::JSON END,
        json_object('category', e.category, 'iteration', e.iteration, 'event_id', e.event_id,
            'depth', e.depth, 'correlation', e.correlation, 'External id', e.external_id,
            'Record function id', e.rf_id, 'collective', c.kind, 'group_id', c.group_id,
            'seq', c.seq, 'msg_bytes', c.msg_bytes))::VARCHAR
    || '}}'
FROM event e LEFT JOIN collective c
    ON c.run_id = e.run_id AND c.rank = e.rank AND c.event_id = e.event_id
WHERE e.run_id = $1 AND list_contains($3, e.rank) AND e.ts IS NOT NULL
ORDER BY e.rank, e.ts, e.event_id
"""

_NODE_SQL = f"""
SELECT '{{"ph":"X","pid":' || n.rank || ',"tid":' || coalesce(n.track_id, -1)
    || ',"ts":' || {_us("n.ts - $2")} || ',"dur":' || {_us("greatest(coalesce(n.dur, 0), 0)")}
    || ',"name":' || to_json(coalesce(n.name, n.kind)) || ',"cat":' || to_json(n.kind)
    || ',"args":' || json_object('kind', n.kind, 'iteration', n.iteration, 'node_id', n.node_id,
        'event_id', n.event_id, 'group_id', n.group_id, 'seq', n.seq, 'peer', n.peer,
        'msg_bytes', n.msg_bytes, 'collective', n.comm_kind)::VARCHAR
    || '}}'
FROM graph_node n
WHERE n.run_id = $1 AND list_contains($3, n.rank) AND n.ts IS NOT NULL
ORDER BY n.rank, n.ts, n.node_id
"""

_FLOW_SQL = f"""
WITH f AS (
    SELECT row_number() OVER (ORDER BY f.rank, s.ts, f.src_event_id, f.dst_event_id) AS id,
        f.rank, f.kind, s.track_id AS s_tid, s.ts AS s_ts, d.track_id AS d_tid, d.ts AS d_ts
    FROM flow f
    JOIN event s ON s.run_id = f.run_id AND s.rank = f.rank AND s.event_id = f.src_event_id
    JOIN event d ON d.run_id = f.run_id AND d.rank = f.rank AND d.event_id = f.dst_event_id
    WHERE f.run_id = $1 AND list_contains($3, f.rank) AND s.ts IS NOT NULL AND d.ts IS NOT NULL)
SELECT '{{"ph":"s","id":' || id || ',"pid":' || rank || ',"tid":' || coalesce(s_tid, -1)
    || ',"ts":' || {_us("s_ts - $2")} || ',"name":' || to_json(kind) || ',"cat":"flow"}}' || ',\n'
    || '{{"ph":"f","bp":"e","id":' || id || ',"pid":' || rank || ',"tid":' || coalesce(d_tid, -1)
    || ',"ts":' || {_us("d_ts - $2")} || ',"name":' || to_json(kind) || ',"cat":"flow"}}'
FROM f ORDER BY id
"""

_COUNTER_SQL = f"""
SELECT '{{"ph":"C","pid":' || rank || ',"tid":0,"ts":' || {_us("ts - $2")}
    || ',"name":"allocated bytes","args":'
    || json_object(coalesce(device_type, '?') || ':' || coalesce(device_id, -1),
        total_allocated)::VARCHAR || '}}'
FROM memory
WHERE run_id = $1 AND list_contains($3, rank) AND total_allocated IS NOT NULL
ORDER BY rank, ts
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


def _open(path: Path, *, gz: bool) -> IO[str]:
    if gz:
        return gzip.open(path, "wt", encoding="utf-8", compresslevel=3)
    return path.open("w", encoding="utf-8")


def export_perfetto(store: Store, *, run: str, out: Path | str) -> dict[str, Any]:
    """Write run ``run`` as Chrome trace JSON for Perfetto (``.json``, or gzipped ``.json.gz``).

    Every stored rank with events is written; for a sliced or emulated run these are the class
    exemplars (``rank.class_id``), which ``otherData`` says, with each class's size. A sliced
    run has no events, so its graph nodes (``graph_node``) are written instead.

    Times are µs relative to ``baseTimeNanoseconds`` (the run's first exported instant), written
    as exact decimals with three fractional digits, so no nanosecond is lost to a double.

    Args:
        store: an open store (read-only is fine).
        run: the run's name (any kind).
        out: the file to write; a ``.gz`` suffix gzips it.

    Returns:
        What was written: ``path``, ``bytes``, ``ranks``, ``events`` (X events), ``flows``,
        ``counters``, ``untimed`` (events without a time, skipped), ``source`` (``event`` or
        ``graph_node``), ``exemplars`` and ``seconds``.

    Raises:
        PrismError: no run of that name, or the file cannot be written.
    """
    started = time.perf_counter()
    run_id = store.require_run(run)
    out = Path(out)
    run_row = _rows(
        store,
        "SELECT r.name, r.kind, p.name, r.world_size, r.source_format,"
        " CAST(r.created_at AS VARCHAR), CAST(r.config_json AS VARCHAR)"
        " FROM run r LEFT JOIN run p ON p.run_id = r.parent_run_id WHERE r.run_id = $1",
        [run_id],
    )[0]
    source = "event"
    ranks = [
        r[0]
        for r in _rows(
            store, "SELECT DISTINCT rank FROM event WHERE run_id = $1 ORDER BY rank", [run_id]
        )
    ]
    if not ranks:
        ranks = [
            r[0]
            for r in _rows(
                store,
                "SELECT DISTINCT rank FROM graph_node WHERE run_id = $1 ORDER BY rank",
                [run_id],
            )
        ]
        source = "graph_node" if ranks else "event"
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
        "SELECT class_id, count(*), min(rank) FROM rank WHERE run_id = $1"
        " AND class_id IS NOT NULL GROUP BY class_id ORDER BY class_id",
        [run_id],
    )
    class_of = dict(
        _rows(
            store,
            "SELECT rank, class_id FROM rank WHERE run_id = $1 AND list_contains($2, rank)",
            [run_id, ranks],
        )
    )
    size_of = {c: n for c, n, _ in classes}
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
        "exported_ranks": ranks,
        "exemplars": bool(classes),
        "config": config,
    }
    if classes:
        other["note"] = (
            f"{len(ranks)} class exemplars of {run_row[3]} ranks: each exported rank stands for"
            " every rank of its class (rank.class_id)"
        )
        other["classes"] = [
            {"class_id": c, "ranks": n, "exemplar": x, "exported": x in class_of}
            for c, n, x in classes
        ]
    tracks = _rows(
        store,
        "SELECT rank, track_id, kind, coalesce(name, kind || ' ' || coalesce(tid::VARCHAR, '?'))"
        " FROM track WHERE run_id = $1 AND list_contains($2, rank) ORDER BY rank, track_id",
        [run_id, ranks],
    )
    if source == "graph_node":
        tracks = _rows(
            store,
            "SELECT DISTINCT rank, coalesce(track_id, -1), 'thread',"
            " 'track ' || coalesce(track_id, -1) FROM graph_node WHERE run_id = $1 ORDER BY 1, 2",
            [run_id],
        )
    tmp = out.with_name(out.name + ".part")
    counts = {"events": 0, "flows": 0, "counters": 0}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _open(tmp, gz=out.suffix == ".gz") as fh:
            head = {"displayTimeUnit": "ns", "baseTimeNanoseconds": base, "otherData": other}
            fh.write(json.dumps(head, default=str)[:-1] + ',\n"traceEvents":[\n')
            meta: list[dict[str, Any]] = []
            for r in ranks:
                c = class_of.get(r)
                label = f"rank {r}" if c is None else f"rank {r} (class {c}: {size_of[c]} ranks)"
                meta.append({"ph": "M", "pid": r, "name": "process_name", "args": {"name": label}})
                meta.append(
                    {"ph": "M", "pid": r, "name": "process_sort_index", "args": {"sort_index": r}}
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
            params = [run_id, base, ranks]
            counts["events"], first = _stream(
                store, _EVENT_SQL if source == "event" else _NODE_SQL, params, fh, first=first
            )
            if source == "event":
                counts["flows"], first = _stream(store, _FLOW_SQL, params, fh, first=first)
                counts["counters"], first = _stream(store, _COUNTER_SQL, params, fh, first=first)
            fh.write("\n]}\n")
        os.replace(tmp, out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        msg = f"{out}: cannot write the Perfetto trace: {exc.strerror or exc}"
        raise PrismError(msg) from exc
    return {
        "run": run,
        "path": str(out),
        "bytes": out.stat().st_size,
        "ranks": len(ranks),
        "tracks": len(tracks),
        **counts,
        "untimed": untimed,
        "source": source,
        "exemplars": bool(classes),
        "seconds": time.perf_counter() - started,
    }

"""Per-rank execution graph: the recorded events of a run → ``graph_node`` and ``graph_edge``.

The cores (``kineto_graph``, ``chakra_graph``, ``timeline_graph``) take polars frames of one or
many ranks and return frames; only ``build_graph`` reads and writes the store. Everything is
vectorised: polars joins and numpy walks over nesting *levels*, never a loop over events.

Kineto ranks (the rules, in order):

- Host nodes, on ``thread`` tracks: the outermost *candidates*, where the candidates are the
  ``cpu_op`` events, the communication host events (``collective.event_id``, ``p2p.event_id``)
  and the ``cuda_runtime``/``cuda_driver`` events. Annotations (``user_annotation``,
  ``python_function``, ...) are never nodes; what they enclose is. A candidate that encloses a
  communication event is *dissolved* like an annotation (its children take its place, its own
  time becomes program gaps), so that every communication is one node of kind ``collective``,
  ``send`` or ``recv``; the communication node absorbs everything it encloses.
- Device nodes: every ``kernel``/``memcpy``/``memset`` event on a ``stream`` track.
- ``node_id`` is minted per rank in ``(track_id, ts, event_id)`` order (host tracks first).
- ``program``: consecutive host nodes of a thread in ``(ts, event_id)`` order; anchor ``end``,
  delay = the recorded gap. Where the next node starts before the previous one ends (clock
  rounding), anchor ``start`` and delay = the difference of the starts instead.
- ``launch``: host node enclosing the launching runtime event (flow ``launch``, else the same
  ``correlation``) → device node; anchor ``start``, delay = runtime ts - host node ts.
- ``comm``: communication node → its kernel (``kernel_event_id``); anchor ``start``, delay = its
  launch offset (0 when the launch is not in the trace). When the communication node itself
  launched the kernel, the ``comm`` edge replaces the ``launch`` edge (one edge, not two).
- ``stream``: consecutive device nodes of a stream; anchor ``end``, delay 0.
- ``wait``: a ``sync`` flow (event recorded on stream A, waited on stream B) → from the device node
  on A to the first device node on B starting at or after the wait; anchor ``end``, delay 0. A
  rank without such flows gets the waits its ``cudaStreamWaitEvent`` calls and its device
  timeline show (``prism_trace.graph.deps_kineto``); delay = the few µs the GPU took to resolve it.
- ``sync``: a synchronising runtime call (``SYNC_CALLS``) → from the last device node launched (by
  launch time) at or before the call on each synchronised stream, to the host node enclosing the
  call. It holds back the *end* of ``dst``: ``dst.end >= src.end + delay``, with delay = the time
  the host node ran on after the call returned. Device-wide calls synchronise every stream of the
  rank; a stream or event synchronize uses the stream of the ``cuda_sync`` event with its
  correlation, else the stream of the last device node launched from the same thread (a guess,
  counted in the report).

Chakra ranks: every event is a node (``collective``/``send``/``recv`` when it has a collective or
p2p row, ``memcpy`` for memory nodes, ``kernel`` when ``is_cpu_op`` is false, else ``host``);
flows ``data``/``ctrl`` (and ``sync``, read from prism's own export) become edges of the same kind
(anchor ``end``, delay 0), and a collective
whose kernel is another node gets a ``comm`` edge (anchor ``start``, delay 0).

Op-timeline ranks: every event is a node (``collective``/``send``/``recv`` when it has a row, else
``kernel``; Megatron's grad-norm op ``optimizer-clip-main-grad`` becomes an all-rank
``collective``). Edges are Megatron's dependencies (``prism_trace.graph.deps_op_timeline``), each
with the op's own delay: its start minus the latest end of all its dependencies.

The rules live in ``graph_kineto``, ``graph_chakra`` and ``graph_timeline`` (vocabulary and shared
helpers in ``graph_base``); this module picks each rank's rule set and stores the graph.
"""

from __future__ import annotations

import time
from typing import Literal

import polars as pl

from prism_trace.errors import RunStateError
from prism_trace.graph.base import (
    STAT_COLUMNS,
    GraphFrames,
    GraphReport,
    RankGraph,
    empty_edges,
    empty_nodes,
)
from prism_trace.graph.chakra import chakra_graph
from prism_trace.graph.kineto import kineto_graph
from prism_trace.graph.timeline import TIMELINE_SYNC_OPS, timeline_graph, world_group_of
from prism_trace.store.connection import Store
from prism_trace.store.write import append

__all__ = ["Rule", "build_graph", "run_id_of"]

Rule = Literal["kineto", "chakra", "op_timeline"]


_EVENT_COLS = "rank, event_id, track_id, category, name, ts, dur, correlation, parent_id, iteration"


def _rules(store: Store, run_id: int) -> dict[int, Rule]:
    """The rule set of each rank, from its timeline source file, else from its events."""
    rows = store.con.sql(
        """WITH ev AS (
               SELECT rank, count(*) AS n, count(ts) AS timed FROM event
               WHERE run_id = $1 GROUP BY rank),
           own AS (
               SELECT rank, min(format) AS fmt FROM source_file
               WHERE run_id = $1 AND rank IS NOT NULL AND format <> 'host_et' GROUP BY rank),
           shared AS (
               SELECT min(format) AS fmt FROM source_file
               WHERE run_id = $1 AND rank IS NULL AND format <> 'host_et')
           SELECT r.rank, coalesce(o.fmt, (SELECT fmt FROM shared)) AS fmt,
                  coalesce(e.n, 0), coalesce(e.timed, 0)
           FROM rank r LEFT JOIN own o USING (rank) LEFT JOIN ev e USING (rank)
           WHERE r.run_id = $1 ORDER BY r.rank""",
        params=[run_id],
    ).fetchall()
    rules: dict[int, Rule] = {}
    for rank, fmt, n, timed in rows:
        if n == 0 and fmt in (None, "host_et"):
            msg = (
                f"{store.path}: rank {rank} has no timeline (host ET only); ingest its Kineto trace"
            )
            raise RunStateError(msg)
        if fmt in ("kineto", "chakra", "op_timeline"):
            rules[int(rank)] = fmt
        else:
            rules[int(rank)] = "kineto" if timed else "chakra"
    return rules


def run_id_of(store: Store, run: str) -> int:
    """The id of run ``run`` (``Store.require_run``, fetching all rows so the connection is free).

    Raises:
        RunNotFoundError: no such run.
    """
    rows = store.con.execute("SELECT run_id FROM run WHERE name = ?", [run]).fetchall()
    return int(rows[0][0]) if rows else store.require_run(run)


def _frame(store: Store, sql: str, run_id: int, ranks: list[int]) -> pl.DataFrame:
    return store.con.sql(sql, params=[run_id, ranks]).pl()


def build_graph(store: Store, run: str) -> GraphReport:
    """Build (or rebuild) the execution graph of every rank of a recorded run.

    The run's ``graph_node`` and ``graph_edge`` rows are replaced in one transaction.

    Args:
        store: an open, writable store.
        run: the run name.

    Returns:
        Node and edge counts per rank and kind, and what was notable.

    Raises:
        RunNotFoundError: no such run.
        RunStateError: a rank has no timeline (host ET only).
    """
    started = time.perf_counter()
    run_id = run_id_of(store, run)
    rules = _rules(store, run_id)
    by_rule: dict[Rule, list[int]] = {}
    for rank, rule in rules.items():
        by_rule.setdefault(rule, []).append(rank)
    where = "run_id = $1 AND list_contains($2, rank)"
    parts: list[GraphFrames] = []
    new_group: list[object] | None = None
    for rule, ranks in sorted(by_rule.items()):
        coll = _frame(
            store,
            "SELECT rank, event_id, group_id, seq, kind, msg_bytes, kernel_event_id"
            f" FROM collective WHERE {where}",
            run_id,
            ranks,
        )
        p2p = _frame(
            store,
            "SELECT rank, event_id, group_id, seq, direction, peer, bytes, kernel_event_id"
            f" FROM p2p WHERE {where}",
            run_id,
            ranks,
        )
        if rule == "kineto":
            parts.append(
                kineto_graph(
                    _frame(store, f"SELECT {_EVENT_COLS} FROM event WHERE {where}", run_id, ranks),
                    _frame(
                        store,
                        f"SELECT rank, track_id, kind FROM track WHERE {where}",
                        run_id,
                        ranks,
                    ),
                    _frame(
                        store,
                        "SELECT rank, kind, src_event_id, dst_event_id FROM flow"
                        f" WHERE {where} AND kind IN ('launch', 'sync')",
                        run_id,
                        ranks,
                    ),
                    coll,
                    p2p,
                )
            )
        elif rule == "chakra":
            events = _frame(
                store,
                f"SELECT {_EVENT_COLS},"
                " TRY_CAST(json_extract(args, '$.is_cpu_op') AS BOOLEAN) AS is_cpu_op,"
                " TRY_CAST(json_extract(args, '$.prism_deps') AS BIGINT[]) AS prism_deps,"
                " TRY_CAST(json_extract(args, '$.prism_dep_kinds') AS VARCHAR[])"
                " AS prism_dep_kinds"
                f" FROM event WHERE {where}",
                run_id,
                ranks,
            )
            flows = _frame(
                store,
                f"SELECT rank, kind, src_event_id, dst_event_id FROM flow WHERE {where}",
                run_id,
                ranks,
            )
            parts.append(chakra_graph(events, flows, coll, p2p))
        else:
            events = _frame(
                store,
                f"SELECT {_EVENT_COLS}, TRY_CAST(json_extract(args, '$.mc') AS INTEGER) AS mc"
                f" FROM event WHERE {where}",
                run_id,
                ranks,
            )
            world_group = None
            if events.filter(pl.col("name").is_in(list(TIMELINE_SYNC_OPS))).height:
                world_group, new_group = world_group_of(store, run_id, ranks)
            parts.append(timeline_graph(events, coll, p2p, world_group=world_group))
    nodes = pl.concat([p.nodes for p in parts], how="vertical") if parts else empty_nodes()
    edges = pl.concat([p.edges for p in parts], how="vertical") if parts else empty_edges()
    with store.transaction() as con:
        con.execute("DELETE FROM graph_edge WHERE run_id = ?", [run_id])
        con.execute("DELETE FROM graph_node WHERE run_id = ?", [run_id])
        if new_group is not None:
            con.execute(
                "INSERT INTO comm_group (run_id, group_id, name, description, backend, size,"
                " ranks) VALUES (?, ?, 'world', 'default_pg', ?, ?, ?)",
                new_group,
            )
        append(con, "graph_node", nodes, run_id=run_id)
        append(con, "graph_edge", edges, run_id=run_id)
    report = GraphReport(run=run, run_id=run_id, ranks={})
    node_counts = nodes.group_by("rank", "kind").len()
    edge_counts = edges.group_by("rank", "kind").len()
    for rank, rule in rules.items():
        rg = RankGraph(rank=rank, rule=rule)
        for _, k, c in node_counts.filter(pl.col("rank") == rank).iter_rows():
            rg.nodes[k] = int(c)
        for _, k, c in edge_counts.filter(pl.col("rank") == rank).iter_rows():
            rg.edges[k] = int(c)
        report.ranks[rank] = rg
    for part in parts:
        for row in part.stats.iter_rows(named=True):
            rg = report.ranks[int(row["rank"])]
            for c in STAT_COLUMNS:
                setattr(rg, c, int(row[c]))
    report.seconds = time.perf_counter() - started
    return report

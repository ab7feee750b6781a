"""The graph rules of op timelines (Megatron-style): Megatron's dependency model
(``deps_op_timeline``) and the all-rank synchronisation points."""

from __future__ import annotations

import polars as pl

from prism_trace.graph.base import (
    GraphFrames,
    comm_rows,
    mint_node_ids,
    node_frame,
    rank_stats,
    typed_events,
)
from prism_trace.graph.deps_op_timeline import op_timeline_edges
from prism_trace.store.connection import Store

__all__ = ["TIMELINE_SYNC_OPS", "timeline_graph", "world_group_of"]

TIMELINE_SYNC_OPS: tuple[str, ...] = ("optimizer-clip-main-grad",)
"""Op-timeline ops that are all-rank synchronisation points without a collective row: Megatron's
``optimizer-clip-main-grad`` all-reduces the gradient norm over every rank (the distributed
optimizer's grad-stats group is the whole world; in the ST data it ends within ~1 ms on all
ranks). ``timeline_graph`` makes each one a ``collective`` node (``all_reduce``) on the world
group, numbered per rank in time order."""


def timeline_graph(
    events: pl.DataFrame,
    collectives: pl.DataFrame,
    p2p: pl.DataFrame,
    *,
    world_group: int | None = None,
) -> GraphFrames:
    """The graph of op-timeline ranks: every op a node, its edges Megatron's dependencies.

    The edges and each op's own delay come from ``prism_trace.graph.deps_op_timeline`` (compute and
    p2p streams, sends after their compute, receives before the compute they feed, the
    data-parallel stream and its links to each model chunk, the post-backward chain, steps).
    Waiting is never stored: communication ops end where the emulator's instance says (the
    participants' last arrival plus the transfer), so a wait grows or shrinks when an arrival
    moves. Nodes whose recorded start is earlier than the end of one of their dependencies
    (clock jitter) get own delay 0 and are counted as ``overlaps``.

    Args:
        events: ``rank, event_id, track_id, category, name, ts, dur, iteration``, optionally
            ``mc`` (the op's model chunk).
        collectives: see ``comm_rows``.
        p2p: see ``comm_rows``.
        world_group: the run's all-rank group; ops named in ``TIMELINE_SYNC_OPS`` without a
            communication row become ``collective`` nodes on it (``None``: left as they are).

    Returns:
        Nodes, edges and per-rank counters.
    """
    ranks = sorted({int(r) for r in events["rank"].unique().to_list()})
    comm = comm_rows(collectives, p2p)
    ev = typed_events(events).join(comm, on=["rank", "event_id"], how="left")
    if world_group is not None:
        is_sync = pl.col("name").is_in(list(TIMELINE_SYNC_OPS)) & pl.col("node_kind").is_null()
        ev = (
            ev.sort(["rank", "ts", "event_id"])
            .with_columns(
                pl.when(is_sync)
                .then(pl.int_range(pl.len(), dtype=pl.Int64).over(["rank", is_sync]))
                .otherwise(pl.col("seq"))
                .alias("seq")
            )
            .with_columns(
                pl.when(is_sync)
                .then(pl.lit("collective"))
                .otherwise(pl.col("node_kind"))
                .alias("node_kind"),
                pl.when(is_sync)
                .then(pl.lit(world_group, pl.Int32))
                .otherwise(pl.col("group_id"))
                .alias("group_id"),
                pl.when(is_sync)
                .then(pl.lit("all_reduce"))
                .otherwise(pl.col("comm_kind"))
                .alias("comm_kind"),
            )
        )
    kind = pl.coalesce(pl.col("node_kind"), pl.lit("kernel"))
    nodes = mint_node_ids(node_frame(ev, kind))
    mc = ev.select("rank", "event_id", "mc") if "mc" in ev.columns else None
    with_mc = (
        nodes.join(mc.unique(["rank", "event_id"]), on=["rank", "event_id"], how="left")
        if mc is not None
        else nodes
    )
    edges = op_timeline_edges(with_mc)
    ends = nodes.select(
        "rank", pl.col("node_id").alias("src"), (pl.col("ts") + pl.col("dur")).alias("e")
    )
    starts = nodes.select("rank", pl.col("node_id").alias("dst"), pl.col("ts").alias("s"))
    overlaps = (
        edges.join(ends, on=["rank", "src"])
        .join(starts, on=["rank", "dst"])
        .filter(pl.col("s") < pl.col("e"))
        .unique(["rank", "dst"])
        .select("rank")
    )
    no_kernel = nodes.filter(pl.col("kind").is_in(["collective", "send", "recv"])).select("rank")
    return GraphFrames(
        nodes, edges, rank_stats(ranks, overlaps=overlaps, comm_without_kernel=no_kernel)
    )


def world_group_of(store: Store, run_id: int, ranks: list[int]) -> tuple[int, list[object] | None]:
    """The run's all-rank communicator, and the ``comm_group`` row to insert when it has none
    (``world``, description ``default_pg``). A group that merely has every rank (the dp group of
    a job without pipeline stages) is not it: its collectives number their own sequence."""
    rows = store.con.execute(
        "SELECT r.world_size, (SELECT min(group_id) FROM comm_group g WHERE g.run_id = r.run_id"
        " AND g.size = r.world_size AND len(g.ranks) = r.world_size"
        " AND (g.name = 'world' OR g.description = 'default_pg')),"
        " (SELECT coalesce(max(group_id), -1) + 1 FROM comm_group g WHERE g.run_id = r.run_id),"
        " (SELECT min(backend) FROM comm_group g WHERE g.run_id = r.run_id)"
        " FROM run r WHERE r.run_id = ?",
        [run_id],
    ).fetchall()
    world, found, next_id, backend = rows[0]
    if found is not None:
        return int(found), None
    world = int(world or len(ranks))
    return int(next_id), [run_id, int(next_id), backend, world, list(range(world))]

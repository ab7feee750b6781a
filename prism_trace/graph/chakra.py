"""The graph rules of Chakra ETs: their own dependencies, and prism's exact edges when the file
came from `prism export chakra`."""

from __future__ import annotations

import polars as pl

from prism_trace.graph.base import (
    EDGE_SCHEMA,
    GraphFrames,
    comm_rows,
    edge_frame,
    mint_node_ids,
    node_frame,
    rank_stats,
    typed_events,
)

__all__ = ["PRISM_EDGE_CODES", "chakra_graph"]

PRISM_EDGE_CODES = ("program", "launch", "stream", "wait", "sync", "comm", "data", "ctrl")
"""Edge kinds with a code in the export's ``prism_deps`` attribute, shared by the writer
(``prism_trace.export.chakra.writer``) and this reader (fixed: files written today must read
back later)."""


def _prism_edges(events: pl.DataFrame, ids: pl.DataFrame) -> tuple[pl.DataFrame, list[int]]:
    """The edges prism's Chakra export recorded exactly (``prism_deps``, ``prism_dep_kinds``).

    Chakra's ``data_deps`` lose an edge's kind, anchor and delay; prism's export keeps them in
    ``prism_deps`` (``src, delay, code`` per edge; a code of -1 defers to the ``kind@anchor``
    strings of ``prism_dep_kinds``), so that a read-back run emulates as the exported one did.
    Returns the edges and the ranks that carry them.
    """
    empty = pl.DataFrame(schema=EDGE_SCHEMA)
    if "prism_deps" not in events.columns:
        return empty, []
    own = events.filter(pl.col("prism_deps").is_not_null())
    if own.height == 0:
        return empty, []
    codes = pl.DataFrame(
        {
            "code": list(range(2 * len(PRISM_EDGE_CODES))),
            "kind": [k for k in PRISM_EDGE_CODES for _ in (0, 1)],
            "anchor": ["end", "start"] * len(PRISM_EDGE_CODES),
        },
        schema={"code": pl.Int64, "kind": pl.Utf8, "anchor": pl.Utf8},
    )
    ex = (
        own.select(
            pl.col("rank").cast(pl.Int32),
            pl.col("event_id").cast(pl.Int64).alias("dst_event_id"),
            pl.col("prism_deps").list.gather_every(3).alias("src_event_id"),
            pl.col("prism_deps").list.gather_every(3, offset=1).alias("delay"),
            pl.col("prism_deps").list.gather_every(3, offset=2).alias("code"),
            pl.col("prism_dep_kinds"),
        )
        .with_columns(pl.int_ranges(0, pl.col("code").list.len()).alias("_i"))
        .explode(["src_event_id", "delay", "code", "_i"])
        .join(codes, on="code", how="left")
        .with_columns(
            pl.col("prism_dep_kinds")
            .list.get(pl.col("_i"), null_on_oob=True)
            .str.split_exact("@", 1)
            .struct.rename_fields(["_k", "_a"])
            .alias("_ka")
        )
        .unnest("_ka")
        .with_columns(
            pl.coalesce("kind", "_k").alias("kind"), pl.coalesce("anchor", "_a").alias("anchor")
        )
        .join(
            ids.rename({"event_id": "src_event_id", "node_id": "src"}),
            on=["rank", "src_event_id"],
            how="left",
        )
        .join(
            ids.rename({"event_id": "dst_event_id", "node_id": "dst"}),
            on=["rank", "dst_event_id"],
            how="left",
        )
        .filter(pl.col("src").is_not_null() & pl.col("dst").is_not_null())
    )
    edges = ex.select(list(EDGE_SCHEMA)).cast(pl.Schema(EDGE_SCHEMA))
    return edges, sorted(own["rank"].unique().to_list())


def chakra_graph(
    events: pl.DataFrame, flows: pl.DataFrame, collectives: pl.DataFrame, p2p: pl.DataFrame
) -> GraphFrames:
    """The graph of Chakra-derived ranks: every event a node, dependencies from the flows.

    Args:
        events: ``rank, event_id, track_id, category, name, ts, dur, iteration, is_cpu_op``
            (``is_cpu_op`` from the node's attributes, null when absent).
        flows: ``rank, kind, src_event_id, dst_event_id`` (kinds ``data``, ``ctrl`` and
            ``sync`` used).
        collectives: see ``comm_rows``.
        p2p: see ``comm_rows``.

    Returns:
        Nodes, edges and per-rank counters.
    """
    ranks = sorted({int(r) for r in events["rank"].unique().to_list()})
    comm = comm_rows(collectives, p2p)
    ev = typed_events(events).join(comm, on=["rank", "event_id"], how="left")
    kind = (
        pl.when(pl.col("node_kind").is_not_null())
        .then(pl.col("node_kind"))
        .when(pl.col("category") == "memcpy")
        .then(pl.lit("memcpy"))
        .when(pl.col("is_cpu_op").eq(other=False).fill_null(value=False))
        .then(pl.lit("kernel"))
        .otherwise(pl.lit("host"))
    )
    nodes = mint_node_ids(node_frame(ev, kind))
    ids = nodes.select("rank", "event_id", "node_id")
    fl = flows.filter(pl.col("kind").is_in(["data", "ctrl", "sync"])).with_columns(
        pl.col("rank").cast(pl.Int32),
        pl.col("src_event_id").cast(pl.Int64),
        pl.col("dst_event_id").cast(pl.Int64),
    )
    fl = fl.join(
        ids.rename({"event_id": "src_event_id", "node_id": "src"}),
        on=["rank", "src_event_id"],
        how="left",
    ).join(
        ids.rename({"event_id": "dst_event_id", "node_id": "dst"}),
        on=["rank", "dst_event_id"],
        how="left",
    )
    own, own_ranks = _prism_edges(events, ids)
    if own_ranks:  # prism's own export: its exact edges replace the flows
        fl = fl.filter(~pl.col("rank").is_in(own_ranks))
    dep_edges = [
        edge_frame(fl.filter(pl.col("kind") == k), k, "end", pl.lit(0))
        for k in ("data", "ctrl", "sync")  # sync: prism's own export (its ``sync_deps``)
    ]
    dep_edges.append(own)
    ck = comm.join(ids.rename({"node_id": "src"}), on=["rank", "event_id"], how="inner").join(
        ids.rename({"event_id": "kernel_event_id", "node_id": "dst"}),
        on=["rank", "kernel_event_id"],
        how="left",
    )
    comm_edges = edge_frame(ck, "comm", "start", pl.lit(0))
    no_kernel = ck.filter(pl.col("dst").is_null() | (pl.col("dst") == pl.col("src"))).select("rank")
    edges = pl.concat([*dep_edges, comm_edges], how="vertical")
    return GraphFrames(nodes, edges, rank_stats(ranks, comm_without_kernel=no_kernel))

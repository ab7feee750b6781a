"""The execution graph's vocabulary: node and edge kinds, the frames' schemas, the reports, and the
helpers every rule set shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import polars as pl

from prism_trace.formats.device import SYNC_CALLS

__all__ = [
    "DEVICE_CATEGORIES",
    "EDGE_KINDS",
    "EDGE_SCHEMA",
    "LAUNCH_CATEGORIES",
    "NODE_KINDS",
    "NODE_SCHEMA",
    "STAT_COLUMNS",
    "SYNC_CALLS",
    "GraphFrames",
    "GraphReport",
    "RankGraph",
    "comm_rows",
    "edge_frame",
    "empty_edges",
    "empty_nodes",
    "mint_node_ids",
    "node_frame",
    "program_order_edges",
    "rank_stats",
    "typed_events",
]

NODE_KINDS = ("host", "kernel", "memcpy", "memset", "collective", "send", "recv")
EDGE_KINDS = ("program", "launch", "stream", "wait", "sync", "comm", "data", "ctrl")

LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
DEVICE_CATEGORIES = ("kernel", "memcpy", "memset")

NODE_SCHEMA: dict[str, pl.DataType] = {
    "rank": pl.Int32(),
    "node_id": pl.Int64(),
    "kind": pl.Utf8(),
    "track_id": pl.Int32(),
    "event_id": pl.Int64(),
    "name": pl.Utf8(),
    "ts": pl.Int64(),
    "dur": pl.Int64(),
    "iteration": pl.Int32(),
    "group_id": pl.Int32(),
    "seq": pl.Int64(),
    "peer": pl.Int32(),
    "msg_bytes": pl.Int64(),
    "comm_kind": pl.Utf8(),
}
EDGE_SCHEMA: dict[str, pl.DataType] = {
    "rank": pl.Int32(),
    "src": pl.Int64(),
    "dst": pl.Int64(),
    "kind": pl.Utf8(),
    "anchor": pl.Utf8(),
    "delay": pl.Int64(),
}
STAT_COLUMNS = (
    "unlaunched_device",
    "comm_without_kernel",
    "dissolved_ops",
    "overlaps",
    "guessed_sync_streams",
)
"""Per-rank counters a core reports (see ``RankGraph``)."""


class GraphFrames(NamedTuple):
    """What a core returns: nodes and edges (``graph_node``/``graph_edge`` minus ``run_id``)
    and one row of counters per rank (``rank`` + ``STAT_COLUMNS``)."""

    nodes: pl.DataFrame
    edges: pl.DataFrame
    stats: pl.DataFrame


@dataclass
class RankGraph:
    """One rank's graph in numbers.

    Attributes:
        rank: the rank.
        rule: which rule set built it (``kineto``, ``chakra``, ``op_timeline``).
        nodes: node count by kind.
        edges: edge count by kind.
        unlaunched_device: device nodes whose launch is not in the trace (no incoming ``launch``).
        comm_without_kernel: communication nodes with no device kernel (CPU backends, or the
            kernel is not in the trace).
        dissolved_ops: host ops that enclosed a communication and were split into their children.
        overlaps: ``program`` edges anchored at ``start`` because the next node began before the
            previous one ended.
        guessed_sync_streams: stream/event synchronize calls whose stream was guessed from the
            thread's last launch.
    """

    rank: int
    rule: str
    nodes: dict[str, int] = field(default_factory=dict)
    edges: dict[str, int] = field(default_factory=dict)
    unlaunched_device: int = 0
    comm_without_kernel: int = 0
    dissolved_ops: int = 0
    overlaps: int = 0
    guessed_sync_streams: int = 0


@dataclass
class GraphReport:
    """What ``build_graph`` wrote."""

    run: str
    run_id: int
    ranks: dict[int, RankGraph]
    seconds: float = 0.0

    @property
    def nodes(self) -> int:
        """Nodes over all ranks."""
        return sum(sum(r.nodes.values()) for r in self.ranks.values())

    @property
    def edges(self) -> int:
        """Edges over all ranks."""
        return sum(sum(r.edges.values()) for r in self.ranks.values())

    def notes(self) -> list[str]:
        """One line per notable fact (unlaunched kernels, guessed streams, ...)."""
        out: list[str] = []
        for r in self.ranks.values():
            if r.unlaunched_device:
                out.append(
                    f"rank {r.rank}: {r.unlaunched_device} device ops have no launch in the trace"
                )
            if r.guessed_sync_streams:
                out.append(
                    f"rank {r.rank}: {r.guessed_sync_streams} synchronize calls: stream guessed"
                    " from the thread's last launch"
                )
            if r.overlaps:
                out.append(f"rank {r.rank}: {r.overlaps} program edges between overlapping ops")
        return out

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "run": self.run,
            "run_id": self.run_id,
            "nodes": self.nodes,
            "edges": self.edges,
            "seconds": round(self.seconds, 3),
            "ranks": {
                str(k): {
                    "rule": v.rule,
                    "nodes": v.nodes,
                    "edges": v.edges,
                    **{c: getattr(v, c) for c in STAT_COLUMNS},
                }
                for k, v in sorted(self.ranks.items())
            },
            "notes": self.notes(),
        }


# -- shared helpers ----------------------------------------------------------------------------


def empty_nodes() -> pl.DataFrame:
    """A node frame without rows (a rule set with nothing to build still returns its columns)."""
    return pl.DataFrame(schema=NODE_SCHEMA)


def empty_edges() -> pl.DataFrame:
    """An edge frame without rows."""
    return pl.DataFrame(schema=EDGE_SCHEMA)


def rank_stats(ranks: list[int], **counts: pl.DataFrame) -> pl.DataFrame:
    """One row per rank with every counter (0 where a frame has no row for the rank)."""
    out = pl.DataFrame({"rank": ranks}, schema={"rank": pl.Int32})
    for name in STAT_COLUMNS:
        df = counts.get(name)
        if df is None or df.is_empty():
            out = out.with_columns(pl.lit(0, pl.Int64).alias(name))
            continue
        per = df.group_by("rank").agg(pl.len().cast(pl.Int64).alias(name))
        out = out.join(per.with_columns(pl.col("rank").cast(pl.Int32)), on="rank", how="left")
        out = out.with_columns(pl.col(name).fill_null(0))
    return out


def edge_frame(df: pl.DataFrame, kind: str, anchor: str | pl.Expr, delay: pl.Expr) -> pl.DataFrame:
    """Edge rows from a frame with ``rank``, ``src``, ``dst`` (dropping self loops and nulls)."""
    anchor_expr = pl.lit(anchor) if isinstance(anchor, str) else anchor
    return (
        df.filter(pl.col("src").is_not_null() & pl.col("dst").is_not_null())
        .filter(pl.col("src") != pl.col("dst"))
        .select(
            pl.col("rank").cast(pl.Int32),
            pl.col("src").cast(pl.Int64),
            pl.col("dst").cast(pl.Int64),
            pl.lit(kind).alias("kind"),
            anchor_expr.cast(pl.Utf8).alias("anchor"),
            delay.cast(pl.Int64).alias("delay"),
        )
    )


def comm_rows(collectives: pl.DataFrame, p2p: pl.DataFrame) -> pl.DataFrame:
    """One row per communication host event: what its node carries.

    Args:
        collectives: ``collective`` rows (``rank, event_id, group_id, seq, kind, msg_bytes,
            kernel_event_id``).
        p2p: ``p2p`` rows (``rank, event_id, group_id, seq, direction, peer, bytes,
            kernel_event_id``).

    Returns:
        ``rank, event_id, node_kind, group_id, seq, peer, msg_bytes, comm_kind,
        kernel_event_id``; ``node_kind`` is ``collective``, ``send`` or ``recv`` and
        ``comm_kind`` the collective kind, or the direction for a send/recv.
    """
    coll = collectives.select(
        pl.col("rank").cast(pl.Int32),
        pl.col("event_id").cast(pl.Int64),
        pl.lit("collective").alias("node_kind"),
        pl.col("group_id").cast(pl.Int32),
        pl.col("seq").cast(pl.Int64),
        pl.lit(None, pl.Int32).alias("peer"),
        pl.col("msg_bytes").cast(pl.Int64),
        pl.col("kind").cast(pl.Utf8).alias("comm_kind"),
        pl.col("kernel_event_id").cast(pl.Int64),
    )
    pp = p2p.select(
        pl.col("rank").cast(pl.Int32),
        pl.col("event_id").cast(pl.Int64),
        pl.col("direction").cast(pl.Utf8).alias("node_kind"),
        pl.col("group_id").cast(pl.Int32),
        pl.col("seq").cast(pl.Int64),
        pl.col("peer").cast(pl.Int32),
        pl.col("bytes").cast(pl.Int64).alias("msg_bytes"),
        pl.col("direction").cast(pl.Utf8).alias("comm_kind"),
        pl.col("kernel_event_id").cast(pl.Int64),
    )
    return (
        pl.concat([coll, pp], how="vertical")
        .filter(pl.col("event_id").is_not_null())
        .unique(["rank", "event_id"], keep="first", maintain_order=True)
    )


_EVENT_TYPES: dict[str, pl.DataType] = {
    "rank": pl.Int32(),
    "event_id": pl.Int64(),
    "track_id": pl.Int32(),
    "ts": pl.Int64(),
    "dur": pl.Int64(),
    "correlation": pl.Int64(),
    "parent_id": pl.Int64(),
    "iteration": pl.Int32(),
}


def typed_events(events: pl.DataFrame) -> pl.DataFrame:
    """Events with the store's integer types (hand-built frames may differ)."""
    return events.with_columns(
        [pl.col(c).cast(t) for c, t in _EVENT_TYPES.items() if c in events.columns]
    )


def mint_node_ids(nodes: pl.DataFrame) -> pl.DataFrame:
    """Mint ``node_id`` per rank in ``(track_id, ts, event_id)`` order; return graph_node shape."""
    return (
        nodes.sort(["rank", "track_id", "ts", "event_id"], nulls_last=True)
        .with_columns(pl.int_range(pl.len(), dtype=pl.Int64).over("rank").alias("node_id"))
        .select([pl.col(c).cast(t) for c, t in NODE_SCHEMA.items()])
    )


def node_frame(ev: pl.DataFrame, kind: pl.Expr) -> pl.DataFrame:
    """Rows of ``ev`` (events joined with ``comm_rows``) → graph_node columns less node_id."""
    return ev.select(
        pl.col("rank").cast(pl.Int32),
        kind.alias("kind"),
        pl.col("track_id").cast(pl.Int32),
        pl.col("event_id").cast(pl.Int64),
        pl.col("name"),
        pl.col("ts").cast(pl.Int64),
        pl.col("dur").cast(pl.Int64),
        pl.col("iteration").cast(pl.Int32),
        pl.col("group_id"),
        pl.col("seq"),
        pl.col("peer"),
        pl.col("msg_bytes"),
        pl.col("comm_kind"),
    )


def program_order_edges(
    nodes: pl.DataFrame, kind: str = "program"
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Chain nodes per (rank, track) in (ts, event_id) order; recorded gaps as delays.

    Returns:
        The edges, and the overlapping pairs (``rank`` per row) for the report.
    """
    chain = (
        nodes.filter(pl.col("ts").is_not_null())
        .sort(["rank", "track_id", "ts", "event_id"])
        .with_columns(
            pl.col("node_id").shift(1).over(["rank", "track_id"]).alias("src"),
            pl.col("ts").shift(1).over(["rank", "track_id"]).alias("_pts"),
            (pl.col("ts") + pl.col("dur").fill_null(0))
            .shift(1)
            .over(["rank", "track_id"])
            .alias("_pend"),
        )
        .filter(pl.col("src").is_not_null())
        .with_columns(pl.col("node_id").alias("dst"), (pl.col("ts") < pl.col("_pend")).alias("_ov"))
    )
    edges = edge_frame(
        chain,
        kind,
        pl.when(pl.col("_ov")).then(pl.lit("start")).otherwise(pl.lit("end")),
        pl.when(pl.col("_ov"))
        .then(pl.col("ts") - pl.col("_pts"))
        .otherwise(pl.col("ts") - pl.col("_pend")),
    )
    return edges, chain.filter(pl.col("_ov")).select("rank")

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
  timeline show (``prism_trace.deps_kineto``); delay = the few µs the GPU took to resolve it.
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
``collective``). Edges are Megatron's dependencies (``prism_trace.deps_op_timeline``), each
with the op's own delay: its start minus the latest end of all its dependencies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import polars as pl

from prism_trace.deps_kineto import inferred_stream_waits
from prism_trace.deps_op_timeline import op_timeline_edges
from prism_trace.errors import PrismError
from prism_trace.store import Store

__all__ = [
    "NODE_KINDS",
    "SYNC_CALLS",
    "TIMELINE_SYNC_OPS",
    "GraphFrames",
    "GraphReport",
    "RankGraph",
    "build_graph",
    "chakra_graph",
    "comm_rows",
    "kineto_graph",
    "run_id_of",
    "timeline_graph",
]

Rule = Literal["kineto", "chakra", "op_timeline"]

NODE_KINDS = ("host", "kernel", "memcpy", "memset", "collective", "send", "recv")
EDGE_KINDS = ("program", "launch", "stream", "wait", "sync", "comm", "data", "ctrl")

SYNC_CALLS: dict[str, Literal["device", "stream"]] = {
    "cudaDeviceSynchronize": "device",
    "cuCtxSynchronize": "device",
    "cudaStreamSynchronize": "stream",
    "cuStreamSynchronize": "stream",
    "cudaEventSynchronize": "stream",
    "cuEventSynchronize": "stream",
    "cudaMemcpy": "stream",
    "cudaMemcpy2D": "stream",
    "cudaMemcpy3D": "stream",
    "cudaMemcpyToSymbol": "stream",
    "cudaMemcpyFromSymbol": "stream",
}
"""Synchronising runtime calls (blocking copies included, ``*Async`` ones not) and what they wait
for: every stream of the device, or one stream."""

_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
_DEVICE_CATEGORIES = ("kernel", "memcpy", "memset")

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


def _empty_nodes() -> pl.DataFrame:
    return pl.DataFrame(schema=NODE_SCHEMA)


def _empty_edges() -> pl.DataFrame:
    return pl.DataFrame(schema=EDGE_SCHEMA)


def _stats(ranks: list[int], **counts: pl.DataFrame) -> pl.DataFrame:
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


def _edges(df: pl.DataFrame, kind: str, anchor: str | pl.Expr, delay: pl.Expr) -> pl.DataFrame:
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


def _typed(events: pl.DataFrame) -> pl.DataFrame:
    """Events with the store's integer types (hand-built frames may differ)."""
    return events.with_columns(
        [pl.col(c).cast(t) for c, t in _EVENT_TYPES.items() if c in events.columns]
    )


def _mint(nodes: pl.DataFrame) -> pl.DataFrame:
    """Mint ``node_id`` per rank in ``(track_id, ts, event_id)`` order; return graph_node shape."""
    return (
        nodes.sort(["rank", "track_id", "ts", "event_id"], nulls_last=True)
        .with_columns(pl.int_range(pl.len(), dtype=pl.Int64).over("rank").alias("node_id"))
        .select([pl.col(c).cast(t) for c, t in NODE_SCHEMA.items()])
    )


def _node_frame(ev: pl.DataFrame, kind: pl.Expr) -> pl.DataFrame:
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


def _program_edges(nodes: pl.DataFrame, kind: str = "program") -> tuple[pl.DataFrame, pl.DataFrame]:
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
    edges = _edges(
        chain,
        kind,
        pl.when(pl.col("_ov")).then(pl.lit("start")).otherwise(pl.lit("end")),
        pl.when(pl.col("_ov"))
        .then(pl.col("ts") - pl.col("_pts"))
        .otherwise(pl.col("ts") - pl.col("_pend")),
    )
    return edges, chain.filter(pl.col("_ov")).select("rank")


# -- Kineto ------------------------------------------------------------------------------------


class _RowLookup:
    """Row of ``(rank, event_id)`` in a frame sorted by both: a sorted search, not a join."""

    _SHIFT = 40

    def __init__(self, ranks: np.ndarray, ids: np.ndarray) -> None:
        self.keys = self._key(ranks.astype(np.int64), ids.astype(np.int64))

    def _key(self, ranks: np.ndarray, ids: np.ndarray) -> np.ndarray:
        if ids.size and (ids.min() < 0 or ids.max() >= 1 << self._SHIFT):
            msg = "event ids must lie in [0, 2**40) for the graph's row lookup"
            raise PrismError(msg)
        return (ranks << self._SHIFT) | ids

    def __call__(self, ranks: pl.Series, ids: pl.Series) -> np.ndarray:
        """Row numbers (-1 where ``ids`` is null or absent)."""
        known = ids.is_not_null().to_numpy()
        out = np.full(len(ids), -1, dtype=np.int64)
        if known.any():
            keys = self._key(
                ranks.to_numpy()[known].astype(np.int64), ids.to_numpy()[known].astype(np.int64)
            )
            pos = np.searchsorted(self.keys, keys)
            pos_c = np.minimum(pos, max(len(self.keys) - 1, 0))
            hit = (pos < len(self.keys)) & (self.keys[pos_c] == keys)
            out[np.flatnonzero(known)[hit]] = pos_c[hit]
        return out


def _walk_up(parent: np.ndarray, start: np.ndarray) -> list[np.ndarray]:
    """Ancestors level by level: ``out[k][i]`` is the (k+1)-th ancestor of ``start[i]`` or -1."""
    out: list[np.ndarray] = []
    cur = np.where(start >= 0, parent[np.maximum(start, 0)], -1)
    while (cur >= 0).any():
        out.append(cur)
        cur = np.where(cur >= 0, parent[np.maximum(cur, 0)], -1)
    return out


def kineto_graph(
    events: pl.DataFrame,
    tracks: pl.DataFrame,
    flows: pl.DataFrame,
    collectives: pl.DataFrame,
    p2p: pl.DataFrame,
) -> GraphFrames:
    """The graph of Kineto-derived ranks (see the module docstring for the rules).

    Args:
        events: ``rank, event_id, track_id, category, name, ts, dur, correlation, parent_id,
            iteration`` of the ranks.
        tracks: ``rank, track_id, kind`` (``thread`` | ``stream``).
        flows: ``rank, kind, src_event_id, dst_event_id`` (kinds ``launch`` and ``sync`` used).
        collectives: see ``comm_rows``.
        p2p: see ``comm_rows``.

    Returns:
        Nodes, edges and per-rank counters.
    """
    ranks = sorted({int(r) for r in events["rank"].unique().to_list()})
    if events.is_empty():
        return GraphFrames(_empty_nodes(), _empty_edges(), _stats(ranks))
    comm = comm_rows(collectives, p2p)
    ev = (
        _typed(events)
        .with_columns(pl.col("dur").fill_null(0))
        .join(
            tracks.select(
                pl.col("rank").cast(pl.Int32),
                pl.col("track_id").cast(pl.Int32),
                pl.col("kind").alias("_tkind"),
            ),
            on=["rank", "track_id"],
            how="left",
        )
        .join(comm, on=["rank", "event_id"], how="left")
        .sort(["rank", "event_id"])
        .with_row_index("_i")
        .with_columns(pl.col("_i").cast(pl.Int64))
    )
    lookup = _RowLookup(ev["rank"].to_numpy(), ev["event_id"].to_numpy())

    def rows_of(df: pl.DataFrame, col: str, alias: str) -> pl.DataFrame:
        rows = pl.Series(alias, lookup(df["rank"], df[col]), dtype=pl.Int64)
        return df.with_columns(rows).with_columns(
            pl.when(pl.col(alias) >= 0).then(pl.col(alias)).alias(alias)
        )

    ev = rows_of(ev, "parent_id", "_pi")
    n = ev.height
    idx = np.arange(n, dtype=np.int64)
    parent = ev["_pi"].fill_null(-1).to_numpy().astype(np.int64)
    cat = ev["category"]
    on_thread = (ev["_tkind"] == "thread").fill_null(value=False).to_numpy()
    on_stream = (ev["_tkind"] == "stream").fill_null(value=False).to_numpy()
    is_comm = ev["node_kind"].is_not_null().to_numpy() & on_thread
    is_launchcat = cat.is_in(_LAUNCH_CATEGORIES).to_numpy()
    cand = on_thread & (cat.eq("cpu_op").to_numpy() | is_comm | is_launchcat)

    # Candidates enclosing a communication are dissolved so the communication is its own node.
    has_comm_below = np.zeros(n, dtype=bool)
    for level in _walk_up(parent, idx[is_comm]):
        has_comm_below[level[level >= 0]] = True
    dissolved = cand & ~is_comm & has_comm_below
    eff = cand & ~dissolved
    # Owner: the outermost effective candidate among an event and its ancestors.
    owner = np.where(eff, idx, -1)
    for level in _walk_up(parent, idx):
        hit = level >= 0
        hit[hit] = eff[level[hit]]
        owner[hit] = level[hit]
    is_host = eff & (owner == idx)
    is_dev = on_stream & cat.is_in(_DEVICE_CATEGORIES).to_numpy()

    kind = (
        pl.when(pl.col("node_kind").is_not_null() & pl.col("_host"))
        .then(pl.col("node_kind"))
        .when(pl.col("_host"))
        .then(pl.lit("host"))
        .otherwise(pl.col("category"))
    )
    ev = ev.with_columns(
        pl.Series("_host", is_host),
        pl.Series("_dev", is_dev),
        pl.Series("_launcher", is_launchcat & on_thread),
        pl.Series("_dissolved", dissolved),
    )
    picked = ev.filter(pl.col("_host") | pl.col("_dev"))
    nodes = _mint(
        _node_frame(
            picked.with_columns(
                *[
                    pl.when(pl.col("_host")).then(pl.col(c)).otherwise(None).alias(c)
                    for c in ("group_id", "seq", "peer", "msg_bytes", "comm_kind")
                ]
            ),
            kind,
        )
    )
    node_of_row = np.full(n, -1, dtype=np.int64)
    with_rows = rows_of(nodes.select("rank", "event_id", "node_id"), "event_id", "_i")
    node_of_row[with_rows["_i"].to_numpy()] = with_rows["node_id"].to_numpy()
    owner_node = np.where(owner >= 0, node_of_row[np.maximum(owner, 0)], -1)
    ts = ev["ts"].fill_null(0).to_numpy()
    end = ts + ev["dur"].to_numpy()
    ev = ev.with_columns(
        pl.Series("_node", node_of_row),
        pl.Series("_onode", owner_node),
        pl.Series("_ots", np.where(owner >= 0, ts[np.maximum(owner, 0)], 0)),
        pl.Series("_oend", np.where(owner >= 0, end[np.maximum(owner, 0)], 0)),
    )
    ev = ev.with_columns(pl.when(pl.col("_onode") >= 0).then(pl.col("_onode")).alias("_onode"))
    info = ev.select(
        "_i", "rank", "track_id", "ts", "dur", "_node", "_onode", "_ots", "_oend", "correlation"
    )

    # Launcher of each device node: the launch flow, else a runtime call with its correlation.
    dev = ev.filter(pl.col("_dev")).select("rank", "event_id", "_i", "_node", "track_id", "ts")
    fl = flows.with_columns(
        pl.col("rank").cast(pl.Int32),
        pl.col("src_event_id").cast(pl.Int64),
        pl.col("dst_event_id").cast(pl.Int64),
    )
    by_flow = (
        fl.filter(pl.col("kind") == "launch")
        .group_by("rank", "dst_event_id")
        .agg(pl.col("src_event_id").min())
        .rename({"dst_event_id": "event_id", "src_event_id": "_lev"})
    )
    by_corr = (
        ev.filter(pl.col("_launcher") & pl.col("correlation").is_not_null())
        .group_by("rank", "correlation")
        .agg(pl.col("event_id").min().alias("_cev"))
    )
    dev_corr = ev.filter(pl.col("_dev")).select("rank", "event_id", "correlation")
    dev = (
        dev.join(by_flow, on=["rank", "event_id"], how="left")
        .join(
            dev_corr.join(by_corr, on=["rank", "correlation"], how="inner").drop("correlation"),
            on=["rank", "event_id"],
            how="left",
        )
        .with_columns(pl.coalesce("_lev", "_cev").alias("_lev"))
        .drop("_cev")
    )
    dev = rows_of(dev, "_lev", "_li").join(
        info.select(
            pl.col("_i").alias("_li"),
            pl.col("ts").alias("_lts"),
            pl.col("track_id").alias("_ltrack"),
            pl.col("_onode").alias("_lnode"),
            pl.col("_ots").alias("_lots"),
        ),
        on="_li",
        how="left",
    )
    launched = dev.filter(pl.col("_lnode").is_not_null())
    unlaunched = dev.filter(pl.col("_lnode").is_null()).select("rank")

    # comm: communication node → its kernel.
    comm_nodes = ev.filter(pl.col("_host") & pl.col("node_kind").is_not_null())
    comm_k = comm_nodes.select(
        "rank",
        pl.col("_node").alias("src"),
        pl.col("ts").alias("_cts"),
        pl.col("kernel_event_id").alias("event_id"),
    ).join(launched.select("rank", "event_id", "_lts"), on=["rank", "event_id"], how="left")
    comm_k = comm_k.join(
        dev.select("rank", "event_id", pl.col("_node").alias("dst")),
        on=["rank", "event_id"],
        how="left",
    )
    comm_edges = _edges(
        comm_k,
        "comm",
        "start",
        pl.when(pl.col("_lts").is_not_null())
        .then((pl.col("_lts") - pl.col("_cts")).clip(lower_bound=0))
        .otherwise(0),
    )
    no_kernel = comm_k.filter(pl.col("dst").is_null()).select("rank")

    launch_edges = _edges(
        launched.select(
            "rank",
            pl.col("_lnode").alias("src"),
            pl.col("_node").alias("dst"),
            (pl.col("_lts") - pl.col("_lots")).clip(lower_bound=0).alias("_d"),
        ),
        "launch",
        "start",
        pl.col("_d"),
    ).join(comm_edges.select("rank", "src", "dst"), on=["rank", "src", "dst"], how="anti")

    # stream and program order.
    dev_nodes = nodes.filter(pl.col("kind").is_in(_DEVICE_CATEGORIES))
    stream_edges, _ = _program_edges(dev_nodes, "stream")
    stream_edges = stream_edges.with_columns(
        pl.lit("end").alias("anchor"), pl.lit(0, pl.Int64).alias("delay")
    )
    program_edges, overlaps = _program_edges(
        nodes.filter(~pl.col("kind").is_in(_DEVICE_CATEGORIES))
    )

    wait_edges = _wait_edges(fl, ev, dev_nodes)
    # Ranks without cuda_sync flows: waits recovered from cudaStreamWaitEvent and the timeline.
    with_flows = fl.filter(pl.col("kind") == "sync").select("rank").unique()
    inferred = inferred_stream_waits(
        dev_nodes.select("rank", "node_id", "track_id", "ts", "dur")
        .join(with_flows, on="rank", how="anti")
        .join(
            launched.select(
                "rank", pl.col("_node").cast(pl.Int64).alias("node_id"), pl.col("_lts").alias("lts")
            ).unique(["rank", "node_id"]),
            on=["rank", "node_id"],
            how="left",
        ),
        ev.filter(pl.col("name") == "cudaStreamWaitEvent").select("rank", "ts"),
    )
    wait_edges = pl.concat([wait_edges, inferred.select(wait_edges.columns)], how="vertical")
    sync_edges, guessed = _sync_edges(ev, info, launched)

    edges = pl.concat(
        [program_edges, launch_edges, stream_edges, wait_edges, sync_edges, comm_edges],
        how="vertical",
    )
    stats = _stats(
        ranks,
        unlaunched_device=unlaunched,
        comm_without_kernel=no_kernel,
        dissolved_ops=ev.filter(pl.col("_dissolved")).select("rank"),
        overlaps=overlaps,
        guessed_sync_streams=guessed,
    )
    return GraphFrames(nodes, edges, stats)


def _wait_edges(fl: pl.DataFrame, ev: pl.DataFrame, dev_nodes: pl.DataFrame) -> pl.DataFrame:
    """``sync`` flows → from the recorded device node to the next device node on the waiter."""
    waits = fl.filter(pl.col("kind") == "sync").select("rank", "src_event_id", "dst_event_id")
    if waits.is_empty():
        return _empty_edges()
    src = waits.join(
        ev.select("rank", pl.col("event_id").alias("src_event_id"), pl.col("_node").alias("src")),
        on=["rank", "src_event_id"],
        how="left",
    ).join(
        ev.select(
            "rank",
            pl.col("event_id").alias("dst_event_id"),
            "track_id",
            pl.col("ts").alias("_wts"),
        ),
        on=["rank", "dst_event_id"],
        how="left",
    )
    src = src.filter(pl.col("_wts").is_not_null() & (pl.col("src") >= 0)).sort(
        ["rank", "track_id", "_wts"]
    )
    nxt = dev_nodes.select(
        "rank", "track_id", pl.col("ts").alias("_wts"), pl.col("node_id").alias("dst")
    ).sort(["rank", "track_id", "_wts"])
    joined = src.join_asof(
        nxt, on="_wts", by=["rank", "track_id"], strategy="forward", check_sortedness=False
    )
    return _edges(joined, "wait", "end", pl.lit(0)).unique(maintain_order=True)


def _sync_edges(
    ev: pl.DataFrame, info: pl.DataFrame, launched: pl.DataFrame
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Synchronising calls → edges from the last launched device node of each waited stream."""
    calls = ev.filter(
        pl.col("category").is_in(_LAUNCH_CATEGORIES)
        & (pl.col("_tkind") == "thread")
        & pl.col("name").is_in(list(SYNC_CALLS))
        & pl.col("_onode").is_not_null()
    ).select(
        "rank",
        "_i",
        "correlation",
        pl.col("track_id").alias("_ctrack"),
        pl.col("ts").alias("_cts"),
        pl.col("_onode").alias("dst"),
        (pl.col("_oend") - (pl.col("ts") + pl.col("dur"))).clip(lower_bound=0).alias("_tail"),
        pl.col("name").replace_strict(SYNC_CALLS, default=None).alias("_scope"),
    )
    if calls.is_empty() or launched.is_empty():
        return _empty_edges(), pl.DataFrame(schema={"rank": pl.Int32})
    by_launch = launched.select(
        "rank",
        pl.col("track_id").alias("_stream"),
        pl.col("_lts"),
        pl.col("_ltrack"),
        pl.col("_node").alias("src"),
    )
    # Device-wide: every stream of the rank.
    streams = by_launch.select("rank", "_stream").unique()
    device_wide = calls.filter(pl.col("_scope") == "device").join(streams, on="rank", how="inner")
    one = calls.filter(pl.col("_scope") == "stream")
    # The stream of a cuda_sync device event with the call's correlation...
    marks = (
        ev.filter((pl.col("category") == "cuda_sync") & pl.col("correlation").is_not_null())
        .group_by("rank", "correlation")
        .agg(pl.col("track_id").first().alias("_mstream"))
    )
    one = one.join(marks, on=["rank", "correlation"], how="left")
    # ...else the stream of the last device node this thread launched at or before the call.
    last = by_launch.select(
        "rank", pl.col("_ltrack").alias("_ctrack"), pl.col("_lts").alias("_cts"), "_stream"
    ).sort(["rank", "_ctrack", "_cts"])
    one = one.sort(["rank", "_ctrack", "_cts"]).join_asof(
        last,
        on="_cts",
        by=["rank", "_ctrack"],
        strategy="backward",
        check_sortedness=False,
    )
    guessed = one.filter(pl.col("_mstream").is_null() & pl.col("_stream").is_not_null())
    one = one.with_columns(pl.coalesce("_mstream", "_stream").alias("_stream")).drop("_mstream")
    pairs = pl.concat([device_wide, one.select(device_wide.columns)], how="vertical").filter(
        pl.col("_stream").is_not_null()
    )
    pairs = pairs.sort(["rank", "_stream", "_cts"])
    cand = by_launch.select("rank", "_stream", pl.col("_lts").alias("_cts"), "src").sort(
        ["rank", "_stream", "_cts"]
    )
    joined = pairs.join_asof(
        cand, on="_cts", by=["rank", "_stream"], strategy="backward", check_sortedness=False
    )
    edges = (
        _edges(joined, "sync", "end", pl.col("_tail"))
        .group_by(["rank", "src", "dst", "kind", "anchor"], maintain_order=True)
        .agg(pl.col("delay").max())
        .select(list(EDGE_SCHEMA))
    )
    return edges, guessed.select("rank")


# -- Chakra and op timelines -------------------------------------------------------------------


PRISM_EDGE_CODES = ("program", "launch", "stream", "wait", "sync", "comm", "data", "ctrl")
"""The edge-kind codes of prism's Chakra export (``prism_trace.export.PRISM_EDGE_CODES``)."""


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
    ev = _typed(events).join(comm, on=["rank", "event_id"], how="left")
    kind = (
        pl.when(pl.col("node_kind").is_not_null())
        .then(pl.col("node_kind"))
        .when(pl.col("category") == "memcpy")
        .then(pl.lit("memcpy"))
        .when(pl.col("is_cpu_op").eq(other=False).fill_null(value=False))
        .then(pl.lit("kernel"))
        .otherwise(pl.lit("host"))
    )
    nodes = _mint(_node_frame(ev, kind))
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
        _edges(fl.filter(pl.col("kind") == k), k, "end", pl.lit(0))
        for k in ("data", "ctrl", "sync")  # sync: prism's own export (its ``sync_deps``)
    ]
    dep_edges.append(own)
    ck = comm.join(ids.rename({"node_id": "src"}), on=["rank", "event_id"], how="inner").join(
        ids.rename({"event_id": "kernel_event_id", "node_id": "dst"}),
        on=["rank", "kernel_event_id"],
        how="left",
    )
    comm_edges = _edges(ck, "comm", "start", pl.lit(0))
    no_kernel = ck.filter(pl.col("dst").is_null() | (pl.col("dst") == pl.col("src"))).select("rank")
    edges = pl.concat([*dep_edges, comm_edges], how="vertical")
    return GraphFrames(nodes, edges, _stats(ranks, comm_without_kernel=no_kernel))


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

    The edges and each op's own delay come from ``prism_trace.deps_op_timeline`` (compute and
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
    ev = _typed(events).join(comm, on=["rank", "event_id"], how="left")
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
    nodes = _mint(_node_frame(ev, kind))
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
        nodes, edges, _stats(ranks, overlaps=overlaps, comm_without_kernel=no_kernel)
    )


def _world_group(store: Store, run_id: int, ranks: list[int]) -> tuple[int, list[object] | None]:
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


# -- the store shell ---------------------------------------------------------------------------

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
            raise PrismError(msg)
        if fmt in ("kineto", "chakra", "op_timeline"):
            rules[int(rank)] = fmt
        else:
            rules[int(rank)] = "kineto" if timed else "chakra"
    return rules


def run_id_of(store: Store, run: str) -> int:
    """The id of run ``run`` (``Store.require_run``, fetching all rows so the connection is free).

    Raises:
        PrismError: no such run.
    """
    rows = store.con.execute("SELECT run_id FROM run WHERE name = ?", [run]).fetchall()
    return int(rows[0][0]) if rows else store.require_run(run)


def _frame(store: Store, sql: str, run_id: int, ranks: list[int]) -> pl.DataFrame:
    return store.con.sql(sql, params=[run_id, ranks]).pl()


def _write(con: object, table_name: str, run_id: int, df: pl.DataFrame) -> None:
    if df.is_empty():
        return
    cols = list(df.columns)
    con.register("_graph_frame", df.to_arrow())  # type: ignore[attr-defined]
    try:
        con.execute(  # type: ignore[attr-defined]
            f"INSERT INTO {table_name} (run_id, {', '.join(cols)})"
            f" SELECT {run_id}, {', '.join(cols)} FROM _graph_frame"
        )
    finally:
        con.unregister("_graph_frame")  # type: ignore[attr-defined]


def build_graph(store: Store, run: str) -> GraphReport:
    """Build (or rebuild) the execution graph of every rank of a recorded run.

    The run's ``graph_node`` and ``graph_edge`` rows are replaced in one transaction.

    Args:
        store: an open, writable store.
        run: the run name.

    Returns:
        Node and edge counts per rank and kind, and what was notable.

    Raises:
        PrismError: no such run, or a rank has no timeline (host ET only).
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
                world_group, new_group = _world_group(store, run_id, ranks)
            parts.append(timeline_graph(events, coll, p2p, world_group=world_group))
    nodes = pl.concat([p.nodes for p in parts], how="vertical") if parts else _empty_nodes()
    edges = pl.concat([p.edges for p in parts], how="vertical") if parts else _empty_edges()
    with store.transaction() as con:
        con.execute("DELETE FROM graph_edge WHERE run_id = ?", [run_id])
        con.execute("DELETE FROM graph_node WHERE run_id = ?", [run_id])
        if new_group is not None:
            con.execute(
                "INSERT INTO comm_group (run_id, group_id, name, description, backend, size,"
                " ranks) VALUES (?, ?, 'world', 'default_pg', ?, ?, ?)",
                new_group,
            )
        _write(con, "graph_node", run_id, nodes)
        _write(con, "graph_edge", run_id, edges)
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

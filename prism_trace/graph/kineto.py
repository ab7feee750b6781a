"""The graph rules of Kineto traces (with host ETs): program order, launches, streams, waits and
synchronisations, from the recorded events."""

from __future__ import annotations

import numpy as np
import polars as pl

from prism_trace.errors import PrismError
from prism_trace.formats.device import STREAM_WAIT_CALLS
from prism_trace.graph.base import (
    DEVICE_CATEGORIES,
    EDGE_SCHEMA,
    LAUNCH_CATEGORIES,
    SYNC_CALLS,
    GraphFrames,
    comm_rows,
    edge_frame,
    empty_edges,
    empty_nodes,
    mint_node_ids,
    node_frame,
    program_order_edges,
    rank_stats,
    typed_events,
)
from prism_trace.graph.deps_kineto import inferred_stream_waits

__all__ = ["kineto_graph"]


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
        return GraphFrames(empty_nodes(), empty_edges(), rank_stats(ranks))
    comm = comm_rows(collectives, p2p)
    ev = (
        typed_events(events)
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
    is_launchcat = cat.is_in(LAUNCH_CATEGORIES).to_numpy()
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
    is_dev = on_stream & cat.is_in(DEVICE_CATEGORIES).to_numpy()

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
    nodes = mint_node_ids(
        node_frame(
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
    comm_edges = edge_frame(
        comm_k,
        "comm",
        "start",
        pl.when(pl.col("_lts").is_not_null())
        .then((pl.col("_lts") - pl.col("_cts")).clip(lower_bound=0))
        .otherwise(0),
    )
    no_kernel = comm_k.filter(pl.col("dst").is_null()).select("rank")

    launch_edges = edge_frame(
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
    dev_nodes = nodes.filter(pl.col("kind").is_in(DEVICE_CATEGORIES))
    stream_edges, _ = program_order_edges(dev_nodes, "stream")
    stream_edges = stream_edges.with_columns(
        pl.lit("end").alias("anchor"), pl.lit(0, pl.Int64).alias("delay")
    )
    program_edges, overlaps = program_order_edges(
        nodes.filter(~pl.col("kind").is_in(DEVICE_CATEGORIES))
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
        ev.filter(pl.col("name").is_in(STREAM_WAIT_CALLS)).select("rank", "ts"),
    )
    wait_edges = pl.concat([wait_edges, inferred.select(wait_edges.columns)], how="vertical")
    sync_edges, guessed = _sync_edges(ev, info, launched)

    edges = pl.concat(
        [program_edges, launch_edges, stream_edges, wait_edges, sync_edges, comm_edges],
        how="vertical",
    )
    stats = rank_stats(
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
        return empty_edges()
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
    return edge_frame(joined, "wait", "end", pl.lit(0)).unique(maintain_order=True)


def _sync_edges(
    ev: pl.DataFrame, info: pl.DataFrame, launched: pl.DataFrame
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Synchronising calls → edges from the last launched device node of each waited stream."""
    calls = ev.filter(
        pl.col("category").is_in(LAUNCH_CATEGORIES)
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
        return empty_edges(), pl.DataFrame(schema={"rank": pl.Int32})
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
        edge_frame(joined, "sync", "end", pl.col("_tail"))
        .group_by(["rank", "src", "dst", "kind", "anchor"], maintain_order=True)
        .agg(pl.col("delay").max())
        .select(list(EDGE_SCHEMA))
    )
    return edges, guessed.select("rank")

"""The dependency model of Megatron-style op timelines: which ops each op waits for.

An op timeline records when each op ran, not why. Waiting for another rank hides inside the
gaps, so a graph that chains a rank's ops in time order freezes every wait into a fixed delay.
This module instead gives every op the ops it really depends on in Megatron's schedule (after
StragglerAnalysis's dependency model, written anew here on polars frames):

- **compute** (``program``): forward and backward computes run on one stream, in recorded order.
- **pipeline p2p** (``stream``): each of ``forward-send``, ``forward-recv``, ``backward-send``,
  ``backward-recv`` is its own stream, in recorded order.
- **p2p ↔ compute** (``data``): the k-th send of a direction follows the k-th compute of that
  direction (it sends its output); the k-th receive feeds the compute it precedes (with one
  receive fewer than computes, the first compute needs none) and is posted after the compute
  before that one. The first backward send and receive are posted after the forward compute
  two before the first backward (the fused ``send_forward_recv_backward`` of 1F1B).
- **data-parallel stream** (``stream``): ``params-all-gather`` and ``grads-reduce-scatter`` in
  recorded order; the last all-gather of a model chunk (``mc``) feeds that chunk's first
  forward (``data``); with overlapped DP (a ``separate-grads-all-reduce`` exists) each chunk's
  first reduce-scatter follows its last backward.
- **post-backward chain** (``program``): ``gc`` (or the last compute) → layernorm grads
  all-reduce → embedding grads all-reduce → (overlapped DP: separate grads all-reduce, after the
  last reduce-scatter too | otherwise: the reduce-scatters) → ``optimizer-clip-main-grad`` →
  ``optimizer``.
- **steps** (``program``): an op with no dependency inside its step follows the op of the same
  rank that ended last in the previous step.
- any other op follows the rank's previous op in time (``program``).

Every edge is anchored at the source's end. An op's **own delay** (StragglerAnalysis's launch
delay) is its recorded start minus the latest recorded end of *all* its dependencies, stored on
each of its in-edges. A start before a dependency's end (clock jitter of a few µs; at most 15 µs
on ST) is no own time: the delay is 0, so that a recording whose durations were changed (or a
what-if) moves what depends on them. Waiting for peers is never stored: the emulator recomputes
communication ends from the participants' arrivals.
"""

from __future__ import annotations

import polars as pl

__all__ = ["COMPUTE_OPS", "P2P_OPS", "op_timeline_edges"]

COMPUTE_OPS = ("forward-compute", "backward-compute")
"""Ops on the compute stream."""

P2P_OPS = ("forward-send", "forward-recv", "backward-send", "backward-recv")
"""Pipeline send/receive ops, one stream each."""

_DP_OPS = ("params-all-gather", "grads-reduce-scatter")
_POST = (
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "separate-grads-all-reduce",
    "grads-reduce-scatter",
    "optimizer-clip-main-grad",
    "optimizer",
)
_KNOWN = (*COMPUTE_OPS, *P2P_OPS, *_DP_OPS, *_POST, "gc")
_G = ("rank", "iteration")


def _pairs(df: pl.DataFrame, kind: str) -> pl.DataFrame:
    return df.select(
        pl.col("rank").cast(pl.Int32), pl.col("src"), pl.col("dst"), pl.lit(kind).alias("kind")
    )


def _chain(ops: pl.DataFrame, by: list[str], kind: str) -> pl.DataFrame:
    """Consecutive ops (by recorded start) within each ``by`` group."""
    s = ops.sort([*by, "ts", "node_id"]).with_columns(
        pl.col("node_id").shift(1).over(by).alias("src")
    )
    return _pairs(s.filter(pl.col("src").is_not_null()).rename({"node_id": "dst"}), kind)


def op_timeline_edges(nodes: pl.DataFrame) -> pl.DataFrame:
    """The dependency edges of op-timeline ranks, with each op's own delay.

    Args:
        nodes: ``rank, node_id, name, ts, dur, iteration`` and optionally ``mc`` (model chunk).

    Returns:
        ``rank, src, dst, kind, anchor, delay`` (graph_edge shape), one row per dependency.
    """
    n = nodes.select(
        pl.col("rank").cast(pl.Int32),
        "node_id",
        pl.col("name").cast(pl.Utf8),
        "ts",
        (pl.col("ts") + pl.col("dur").fill_null(0).clip(lower_bound=0)).alias("end"),
        pl.col("iteration").fill_null(-1),
        (pl.col("mc") if "mc" in nodes.columns else pl.lit(0)).fill_null(0).alias("mc"),
    ).filter(pl.col("ts").is_not_null())
    g = list(_G)
    out: list[pl.DataFrame] = []

    comp = (
        n.filter(pl.col("name").is_in(COMPUTE_OPS))
        .sort([*g, "ts", "node_id"])
        .with_columns(
            pl.int_range(pl.len()).over(g).alias("cidx"),
            pl.col("name").str.split("-").list.first().alias("t"),
        )
        .with_columns(pl.int_range(pl.len()).over([*g, "t"]).alias("tidx"))
    )
    out.append(_chain(comp, g, "program"))

    p2p = (
        n.filter(pl.col("name").is_in(P2P_OPS))
        .sort([*g, "name", "ts", "node_id"])
        .with_columns(
            pl.int_range(pl.len()).over([*g, "name"]).alias("pidx"),
            pl.col("name").str.split("-").list.first().alias("t"),
            pl.col("name").str.ends_with("send").alias("is_send"),
        )
    )
    out.append(_chain(p2p, [*g, "name"], "stream"))

    # p2p <-> compute: the k-th send after the k-th compute of its direction; the k-th receive
    # before the compute it feeds (offset by the receives missing at the start of the step).
    n_comp = comp.group_by([*g, "t"]).agg(pl.len().alias("nc"))
    p = p2p.join(n_comp, on=[*g, "t"], how="inner").with_columns(
        pl.len().over([*g, "name"]).alias("np")
    )
    c_key = comp.select(*g, "t", "tidx", pl.col("node_id").alias("c"))
    sends = p.filter(pl.col("is_send") & (pl.col("np") <= pl.col("nc"))).join(
        c_key, left_on=[*g, "t", "pidx"], right_on=[*g, "t", "tidx"]
    )
    out.append(_pairs(sends.rename({"c": "src", "node_id": "dst"}), "data"))
    recvs = p.filter(~pl.col("is_send") & (pl.col("nc") - pl.col("np")).is_in([0, 1])).with_columns(
        (pl.col("pidx") + pl.col("nc") - pl.col("np")).alias("feeds")
    )
    fed = recvs.join(c_key, left_on=[*g, "t", "feeds"], right_on=[*g, "t", "tidx"])
    out.append(_pairs(fed.rename({"node_id": "src", "c": "dst"}), "data"))
    posted = recvs.with_columns((pl.col("feeds") - 1).alias("after")).join(
        c_key, left_on=[*g, "t", "after"], right_on=[*g, "t", "tidx"]
    )
    out.append(_pairs(posted.rename({"c": "src", "node_id": "dst"}), "data"))

    # The first backward send/receive: after the forward two computes before the first backward.
    first_b = (
        comp.filter(pl.col("t") == "backward").group_by(g).agg(pl.col("cidx").min().alias("fb"))
    )
    fwd_before = (
        comp.join(first_b, on=g)
        .filter((pl.col("cidx") >= pl.col("fb") - 2) & (pl.col("cidx") < pl.col("fb")))
        .group_by(g)
        .agg(
            (pl.col("t") == "forward").all().alias("ok"),
            pl.len().alias("k"),
            pl.col("node_id").sort_by("cidx").first().alias("src"),
        )
        .filter(pl.col("ok") & (pl.col("k") == 2))
    )
    first_bp = p2p.filter((pl.col("t") == "backward") & (pl.col("pidx") == 0)).join(
        fwd_before, on=g
    )
    out.append(_pairs(first_bp.rename({"node_id": "dst"}), "data"))

    # Data-parallel stream and its links to the compute of each model chunk.
    dp = n.filter(pl.col("name").is_in(_DP_OPS))
    out.append(_chain(dp, g, "stream"))
    ag_last = (
        dp.filter(pl.col("name") == "params-all-gather")
        .sort("ts", "node_id")
        .group_by([*g, "mc"])
        .agg(pl.col("node_id").last().alias("src"))
    )
    f_first = (
        comp.filter(pl.col("t") == "forward")
        .group_by([*g, "mc"])
        .agg(pl.col("node_id").sort_by("ts").first().alias("dst"))
    )
    out.append(_pairs(ag_last.join(f_first, on=[*g, "mc"]), "data"))
    overlapped = n.filter(pl.col("name") == "separate-grads-all-reduce").select("rank").unique()
    rs = dp.filter(pl.col("name") == "grads-reduce-scatter").join(overlapped, on="rank", how="semi")
    rs_first = (
        rs.sort("ts", "node_id").group_by([*g, "mc"]).agg(pl.col("node_id").first().alias("dst"))
    )
    b_last = (
        comp.filter(pl.col("t") == "backward")
        .group_by([*g, "mc"])
        .agg(pl.col("node_id").sort_by("end").last().alias("src"))
    )
    out.append(_pairs(rs_first.join(b_last, on=[*g, "mc"]), "data"))

    # gc after the last compute; the post-backward chain after gc (or the last compute).
    last_c = comp.group_by(g).agg(pl.col("node_id").sort_by("end").last().alias("src"))
    gc = n.filter(pl.col("name") == "gc")
    out.append(_pairs(gc.rename({"node_id": "dst"}).join(last_c, on=g), "program"))
    tail = pl.concat(
        [
            gc.group_by(g).agg(pl.col("node_id").sort_by("ts").last().alias("src")),
            last_c.join(gc.select(g).unique(), on=g, how="anti"),
        ]
    )
    order = {op: i for i, op in enumerate(_POST)}
    post = (
        n.filter(pl.col("name").is_in(_POST))
        .join(overlapped.with_columns(pl.lit(value=True).alias("ovl")), on="rank", how="left")
        .with_columns(
            pl.col("ovl").fill_null(value=False),
            pl.col("name").replace_strict(order, default=99).alias("pos"),
        )
        .filter(~(pl.col("ovl") & (pl.col("name") == "grads-reduce-scatter")))
        .sort([*g, "pos", "ts", "node_id"])
        .with_columns(pl.col("node_id").shift(1).over(g).alias("src"))
    )
    out.append(
        _pairs(post.filter(pl.col("src").is_not_null()).rename({"node_id": "dst"}), "program")
    )
    head = post.filter(pl.col("src").is_null()).select(*g, pl.col("node_id").alias("dst"))
    out.append(_pairs(head.join(tail, on=g), "program"))
    rs_last = rs.sort("ts", "node_id").group_by(g).agg(pl.col("node_id").last().alias("src"))
    out.append(_pairs(head.join(rs_last, on=g), "program"))

    # Anything else follows the rank's previous op in time.
    prev = n.sort("rank", "ts", "node_id").with_columns(
        pl.col("node_id").shift(1).over("rank").alias("src")
    )
    other = prev.filter(~pl.col("name").is_in(_KNOWN) & pl.col("src").is_not_null())
    out.append(_pairs(other.rename({"node_id": "dst"}), "program"))

    edges = pl.concat(out, how="vertical").unique(["rank", "src", "dst"], keep="first")

    # Steps: an op without a dependency in its step follows the rank's last op of the step before.
    roots = n.join(
        edges.select("rank", pl.col("dst").alias("node_id")), on=["rank", "node_id"], how="anti"
    )
    steps = (
        n.group_by(g)
        .agg(
            pl.col("ts").min().alias("first"), pl.col("node_id").sort_by("end").last().alias("src")
        )
        .sort("rank", "first")
        .with_columns(pl.col("src").shift(1).over("rank"))
        .filter(pl.col("src").is_not_null())
    )
    step_edges = roots.join(steps.select(*g, "src"), on=g).rename({"node_id": "dst"})
    edges = pl.concat([edges, _pairs(step_edges, "program")], how="vertical")

    # Own delay: the recorded start minus the latest recorded end of all dependencies.
    ends = n.select("rank", pl.col("node_id").alias("src"), pl.col("end").alias("src_end"))
    starts = n.select("rank", pl.col("node_id").alias("dst"), "ts")
    e = edges.join(ends, on=["rank", "src"]).join(starts, on=["rank", "dst"])
    return (
        e.with_columns(
            (pl.col("ts") - pl.col("src_end").max().over(["rank", "dst"]))
            .clip(lower_bound=0)
            .alias("delay"),
            pl.lit("end").alias("anchor"),
        )
        .select(
            pl.col("rank").cast(pl.Int32),
            pl.col("src").cast(pl.Int64),
            pl.col("dst").cast(pl.Int64),
            "kind",
            "anchor",
            pl.col("delay").cast(pl.Int64),
        )
        .sort("rank", "dst", "src")
    )

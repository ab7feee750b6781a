"""Every data-parallel replica distinct at the cost of one class graph: a vector per node.

Why a module of its own: a sliced run stores one graph per equivalence class (one per
``(pp, tp, cp, ep)`` role); every data-parallel replica of a class has the same dependency
structure and differs only in its durations (the variance mode, a slow rank). Expanding each
replica into a unit of its own (``replay.whatif.expansion.expand_replicas``) copies the graph
``dp`` times: 8 M nodes at 8192 ranks, about 45 GB at 65,536. Here the class graph is evaluated
once, with a vector over the replicas at every point (``start``, ``end``, instance ``arrival``),
the way StragglerAnalysis's simulator carries a vector of ranks through one op graph:

- an edge ``u → v`` of the class graph is an edge of every replica (same delay), and a node's
  duration is a row ``dur[v, :]`` (one entry per replica);
- a communication instance whose communicator stays inside a replica (tp, pp, p2p) synchronises
  its participants replica by replica (a max over participants, per column);
- an instance whose communicator spans the replicas (``dp``, ``dp-cp``, ``world``:
  ``replay.whatif.expansion.spans_dp``) is the one place where replicas meet: its arrival is
  the max over its participants *and* over the replica axis, the same for every column.

Memory is points x replicas x 8 bytes (one int64 per time); the sweep is the same frontier order
as ``replay.des.core.emulate``, computed once on the class graph, then evaluated level by level
on ``(points, replicas)`` blocks (numpy, no per-replica Python). Column 0 is the representative
replica (the class exemplars): its timeline is what the emulated run's events show. Which
replicas get a column, and their durations, are ``replay.des.replicas``' part.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl
from prism_trace.replay.des.core import CommInstances, EmulatorGraph, emulate

__all__ = ["ReplicaTimeline", "emulate_replicas", "kineto_iterations"]

_BLOCK = 1 << 24
"""Elements of one ``(edges, replicas)`` block: bounds the transient memory of a level (128 MB)."""


@dataclass(frozen=True)
class ReplicaTimeline:
    """What ``emulate_replicas`` returns: one column per replica.

    Attributes:
        start: ``(nodes, replicas)`` emulated starts, ns from the origin.
        end: ``(nodes, replicas)`` emulated ends.
        arrival: ``(instances, replicas)`` last arrival of each instance (equal across the
            columns for an instance shared by the replicas).
        rounds: levels of the class graph's point DAG (its depth).
    """

    start: np.ndarray
    end: np.ndarray
    arrival: np.ndarray
    rounds: int


def _point_edges(
    graph: EmulatorGraph, comm: CommInstances
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The point DAG of ``replay.des.core.emulate``: ``(src, dst, weight, dur_row, part)`` per
    edge.

    ``dur_row`` is the node whose per-replica duration the edge adds (``S → E`` of a non-sync
    node), -1 for an edge with a fixed weight; ``part`` the participation whose transfer the
    edge carries (``A → E``), else -1.
    """
    n = graph.n_nodes
    src = np.asarray(graph.src, dtype=np.int64)
    dst = np.asarray(graph.dst, dtype=np.int64)
    from_end = np.asarray(graph.from_end, dtype=bool)
    holds_end = np.asarray(graph.holds_end, dtype=bool)
    sync = np.asarray(comm.node, dtype=np.int64)
    inst = np.asarray(comm.instance, dtype=np.int64)
    nodes = np.arange(n, dtype=np.int64)
    dur_row = nodes.copy()
    dur_row[sync] = -1  # a sync node lasts at least 0; its end comes from its instance
    p_src = np.concatenate([src + n * from_end, nodes, sync, inst + 2 * n])
    p_dst = np.concatenate([dst + n * holds_end, nodes + n, inst + 2 * n, sync + n])
    w = np.concatenate(
        [
            np.asarray(graph.delay, dtype=np.int64),
            np.zeros(n + sync.size, dtype=np.int64),
            np.asarray(comm.transfer, dtype=np.int64),
        ]
    )
    row = np.concatenate(
        [np.full(src.size, -1, dtype=np.int64), dur_row, np.full(2 * sync.size, -1, np.int64)]
    )
    part = np.concatenate(
        [np.full(src.size + n + sync.size, -1, np.int64), np.arange(sync.size, dtype=np.int64)]
    )
    return p_src, p_dst, w, row, part


def _levels(p_src: np.ndarray, p_dst: np.ndarray, n_points: int) -> np.ndarray:
    """Each point's level in the DAG (0: no predecessor; else 1 + the max of its
    predecessors'), by the frontier sweep; -1 for points on or behind a cycle."""
    order = np.argsort(p_src, kind="stable")
    s_dst = p_dst[order]
    indptr = np.zeros(n_points + 1, dtype=np.int64)
    np.cumsum(np.bincount(p_src, minlength=n_points), out=indptr[1:])
    indeg = np.bincount(p_dst, minlength=n_points).astype(np.int64)
    level = np.full(n_points, -1, dtype=np.int64)
    seen = np.zeros(n_points, dtype=np.int64)  # dedupes a round's ready points without a sort
    frontier = np.flatnonzero(indeg == 0)
    depth = 0
    while frontier.size:
        level[frontier] = depth
        depth += 1
        first = indptr[frontier]
        counts = indptr[frontier + 1] - first
        total = int(counts.sum())
        if total == 0:
            break
        offsets = np.cumsum(counts) - counts
        d = s_dst[np.repeat(first - offsets, counts) + np.arange(total, dtype=np.int64)]
        np.subtract.at(indeg, d, 1)
        ready = d[indeg[d] == 0]
        pos = np.arange(ready.size, dtype=np.int64)
        seen[ready] = pos
        frontier = ready[seen[ready] == pos]
    return level


def emulate_replicas(
    graph: EmulatorGraph,
    comm: CommInstances,
    *,
    dur: np.ndarray,
    shared: np.ndarray,
    label: Callable[[int], str] | None = None,
    transfer: np.ndarray | None = None,
) -> ReplicaTimeline:
    """Emulate the class graph once for every replica (the columns of ``dur``).

    Args:
        graph: the class graph (``graph.dur`` is ignored: ``dur`` holds the durations).
        comm: its communication instances, with per-participation transfer times (the same in
            every replica).
        dur: ``(nodes, replicas)`` int64 durations.
        shared: per instance, whether its communicator spans the replicas (its arrival is the
            max over every replica's participants).
        label: names a node for error messages.
        transfer: ``(participations, replicas)`` per-replica transfer of each participation,
            where a replica's communicators differ (a failed GPU's smaller tp groups); None:
            ``comm.transfer`` in every replica.

    Returns:
        Start/end of every node and arrival of every instance, per replica.

    Raises:
        DeadlockError: the graph and the instances form a cycle (raised by
            ``replay.des.core.emulate`` on the class graph, with its cycle named).
    """
    n = graph.n_nodes
    k = comm.n_instances
    n_points = 2 * n + k
    reps = int(dur.shape[1])
    p_src, p_dst, w, row, part = _point_edges(graph, comm)
    level = _levels(p_src, p_dst, n_points)
    if (level < 0).any():
        emulate(graph, comm, label=label)  # raises DeadlockError naming the cycle
        msg = "emulate_replicas: points left without a level but no deadlock found"
        raise AssertionError(msg)

    # Every point but a root's start has in-edges, all in its level's block: it is written
    # once, there, and its initial value is never read (no fill of the whole matrix).
    val = np.empty((n_points, reps), dtype=np.int64)
    has_start_pred = np.zeros(n, dtype=bool)
    has_start_pred[np.asarray(graph.dst)[~np.asarray(graph.holds_end, dtype=bool)]] = True
    roots = np.flatnonzero(~has_start_pred)
    val[roots] = np.asarray(graph.release, dtype=np.int64)[roots, None]
    is_shared = np.zeros(n_points, dtype=bool)
    is_shared[2 * n + np.flatnonzero(np.asarray(shared, dtype=bool))] = True

    # In-edges grouped by (level of dst, dst): a level's edges are one contiguous block, and so
    # are each destination's.
    order = np.lexsort((p_dst, level[p_dst]))
    e_src, e_dst, e_w, e_row = p_src[order], p_dst[order], w[order], row[order]
    e_part = part[order]
    e_lvl = level[e_dst]
    del order, p_src, p_dst, w, row, part
    # Per-replica transfers, as differences from the weight every replica gets.
    t_diff = None
    if transfer is not None:
        t_diff = transfer - np.asarray(comm.transfer, dtype=np.int64)[:, None]
    n_lvl = int(level.max()) + 1
    bounds = np.searchsorted(e_lvl, np.arange(n_lvl + 1))
    seg = np.flatnonzero(np.diff(e_dst, prepend=-1))  # first edge of each destination
    per_block = max(1, _BLOCK // max(reps, 1))
    for lv in range(1, n_lvl):
        lo, hi = int(bounds[lv]), int(bounds[lv + 1])
        s_lo, s_hi = np.searchsorted(seg, [lo, hi])
        segs = seg[s_lo:s_hi]
        # Split a wide level into blocks of whole destinations (bounded transient memory).
        cut = [0]
        while segs.size and cut[-1] < segs.size:
            nxt = int(np.searchsorted(segs, segs[cut[-1]] + per_block, side="left"))
            cut.append(max(nxt, cut[-1] + 1))
        for a, b in itertools.pairwise(cut):
            b_lo = int(segs[a])
            b_hi = int(segs[b]) if b < segs.size else hi
            cand = val[e_src[b_lo:b_hi]]
            cand += e_w[b_lo:b_hi, None]
            r = e_row[b_lo:b_hi]
            has = np.flatnonzero(r >= 0)
            if has.size:
                cand[has] += dur[r[has]]
            if t_diff is not None:
                pt = e_part[b_lo:b_hi]
                has = np.flatnonzero(pt >= 0)
                if has.size:
                    cand[has] += t_diff[pt[has]]
            red = np.maximum.reduceat(cand, segs[a:b] - b_lo, axis=0)
            d = e_dst[segs[a:b]]
            sh = is_shared[d]
            if sh.any():
                red[sh] = red[sh].max(axis=1, keepdims=True)
            val[d] = red
    return ReplicaTimeline(val[:n], val[n : 2 * n], val[2 * n :], n_lvl - 1)


def kineto_iterations(
    nodes: pl.DataFrame, rec: pl.DataFrame, origin: int, start: np.ndarray, end: np.ndarray
) -> tuple[pl.DataFrame, np.ndarray, np.ndarray]:
    """Per-rank iterations of the replicas, the rules of ``run._iteration_frame`` for
    per-rank step annotations (Kineto ``ProfilerStep#``), on ``(nodes, replicas)`` matrices.

    An iteration keeps its recorded margins around its anchors: it starts as long before its
    first node (by recorded start) as recorded, ends as long after its end anchor (the node that
    ended last inside the recorded iteration) as recorded, and a later one starts where the
    previous ended plus the recorded gap. The anchors are class-graph nodes, found once; only
    their emulated times differ per replica.

    Args:
        nodes: ``unit, iteration, ts, dur`` per class node (row = node index).
        rec: recorded iterations per ``unit, iteration``: ``it_ts, it_end, name`` (ts relative
            to ``origin``).
        origin: the run's clock origin.
        start: ``(nodes, replicas)`` emulated starts.
        end: ``(nodes, replicas)`` emulated ends.

    Returns:
        ``(groups, ts, dur)``: one row ``unit, iteration, name`` per iteration of a class, and
        its start (on the run clock) and duration per replica.
    """
    j = (
        nodes.select("unit", "iteration", "ts", "dur")
        .with_row_index("idx")
        .filter(pl.col("iteration").is_not_null())
        .with_columns(
            (pl.col("ts") - origin).alias("ts"),
            (pl.col("ts") + pl.col("dur").fill_null(0) - origin).alias("rec_end"),
        )
        .join(
            rec.cast({"iteration": nodes.schema["iteration"]}),
            on=["unit", "iteration"],
            how="left",
        )
    )
    inside = pl.col("rec_end") <= pl.col("it_end")
    g = (
        j.group_by("unit", "iteration")
        .agg(
            pl.col("ts").min().alias("first_ts"),
            pl.col("rec_end").filter(inside).max().alias("in_end"),
            pl.col("rec_end").max().alias("all_end"),
            pl.col("it_ts").first(),
            pl.col("it_end").first(),
            pl.col("name").first(),
        )
        .sort("unit", pl.col("it_ts").fill_null(pl.col("first_ts")), "iteration")
        .with_row_index("gid")
        .with_columns(pl.coalesce("in_end", "all_end").alias("a_end"))
    )
    j = j.join(g.select("unit", "iteration", "gid", "first_ts", "a_end"), on=["unit", "iteration"])
    gid = j["gid"].to_numpy().astype(np.int64)
    idx = j["idx"].to_numpy().astype(np.int64)
    ts = j["ts"].to_numpy()
    first_ts = j["first_ts"].to_numpy()
    anchor = (j["rec_end"] == j["a_end"]).fill_null(value=False).to_numpy()
    n_g = g.height
    reps = start.shape[1]

    def reduce(mask: np.ndarray, mat: np.ndarray, op: np.ufunc) -> tuple[np.ndarray, np.ndarray]:
        o = np.lexsort((idx[mask], gid[mask]))
        gg, ii = gid[mask][o], idx[mask][o]
        out = np.zeros((n_g, reps), dtype=np.int64)
        have = np.zeros(n_g, dtype=bool)
        if gg.size:
            first = np.flatnonzero(np.diff(gg, prepend=-1))
            out[gg[first]] = op.reduceat(mat[ii], first, axis=0)
            have[gg[first]] = True
        return out, have

    a_s, has_a = reduce(ts == first_ts, start, np.minimum)
    a_e, has_b = reduce(anchor, end, np.maximum)
    it_ts = g["it_ts"].to_numpy().astype(np.float64)
    it_end = g["it_end"].to_numpy().astype(np.float64)
    rec_ok = ~np.isnan(it_ts)
    end_ok = ~np.isnan(it_end)
    its = np.nan_to_num(it_ts).astype(np.int64)
    ite = np.nan_to_num(it_end).astype(np.int64)
    first = g["first_ts"].to_numpy().astype(np.int64)
    a_end = g["a_end"].fill_null(0).to_numpy().astype(np.int64)
    everything = np.ones(idx.size, dtype=bool)
    s0 = a_s - (first - its)[:, None]
    if not (rec_ok & has_a).all():  # a step without its recorded start spans its nodes
        emu_min, _ = reduce(everything, start, np.minimum)
        s0 = np.where((rec_ok & has_a)[:, None], s0, emu_min)
    e = a_e + (ite - a_end)[:, None]
    if not (end_ok & has_b).all():
        emu_max, _ = reduce(everything, end, np.maximum)
        e = np.where((end_ok & has_b)[:, None], e, emu_max)
    unit = g["unit"].to_numpy()
    prev = np.zeros(n_g, dtype=bool)
    prev[1:] = unit[1:] == unit[:-1]
    chain = prev & rec_ok & np.roll(end_ok, 1)
    s = s0.copy()
    at = np.flatnonzero(chain)
    s[at] = e[at - 1] + (its[at] - ite[at - 1])[:, None]
    return g.select("unit", "iteration", "name"), s + origin, e - s

"""Every data-parallel replica distinct at the cost of one class graph: a vector per node.

Why a module of its own: a sliced run stores one graph per equivalence class (one per
``(pp, tp, cp, ep)`` role); every data-parallel replica of a class has the same dependency
structure and differs only in its durations (the variance mode, a slow rank). Expanding each
replica into a unit of its own (``replay.whatif.expand_replicas``) copies the graph ``dp`` times:
8 M nodes at 8192 ranks, about 45 GB at 65,536. Here the class graph is evaluated once, with a
vector over the replicas at every point (``start``, ``end``, instance ``arrival``), the way
StragglerAnalysis's simulator carries a vector of ranks through one op graph:

- an edge ``u → v`` of the class graph is an edge of every replica (same delay), and a node's
  duration is a row ``dur[v, :]`` (one entry per replica);
- a communication instance whose communicator stays inside a replica (tp, pp, p2p) synchronises
  its participants replica by replica (a max over participants, per column);
- an instance whose communicator spans the replicas (``dp``, ``dp-cp``, ``world``:
  ``replay.whatif.spans_dp``) is the one place where replicas meet: its arrival is the max over
  its participants *and* over the replica axis, the same for every column.

Memory is points x replicas x 8 bytes (one int64 per time); the sweep is the same frontier order
as ``replay.emulator.emulate``, computed once on the class graph, then evaluated level by level
on ``(points, replicas)`` blocks (numpy, no per-replica Python). Column 0 is the representative
replica (the class exemplars): its timeline is what the emulated run's events show.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import polars as pl
from prism_trace.replay.des.core import CommInstances, EmulatorGraph, emulate
from prism_trace.replay.whatif.config import SlowDown, WhatIfConfig, draw_table, spans_dp

from prism_trace.layout.mesh import ParallelAxis

if TYPE_CHECKING:
    from prism_trace.layout.mesh import ParallelLayout

__all__ = [
    "ReplicaTimeline",
    "Replicas",
    "class_groups",
    "emulate_replicas",
    "kineto_iterations",
    "replica_durations",
    "replica_grid",
    "scale_replicas",
    "shared_instances",
    "vector_eligible",
]

_COMM = ("collective", "send", "recv")

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
    """The point DAG of ``replay.emulator.emulate``: ``(src, dst, weight, dur_row, part)`` per
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
            ``replay.emulator.emulate`` on the class graph, with its cycle named).
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


# -- the replicas of a sliced run ----------------------------------------------------------------


def vector_eligible(what_if: WhatIfConfig) -> bool:
    """Whether the what-ifs fit the replica vector: durations differ per replica, the graph does
    not. A removed GPU is its replica's column: more compute, its own (smaller) tp groups'
    transfers (``emulate_replicas``' per-replica transfers). A rank-targeted slow-down of
    communication ops, and a removed GPU under ``no-stragglers`` (typical transfers replace
    the recorded ones per participation), keep the expanded units."""
    if what_if.remove_gpu is not None and what_if.no_stragglers:
        return False
    return all(not s.ranks or (s.ops is None and not s.kinds) for s in what_if.slow)


def class_groups(
    replicas: Replicas, replica: int, groups: pl.DataFrame, sizes: dict[int, int]
) -> dict[int, int]:
    """``sizes`` (per communicator of replica ``replica``) as sizes of the class graph's
    communicators: the ones whose members are the class exemplars standing for the members.

    Args:
        replicas: the replica grid.
        replica: the data-parallel coordinate of the communicators in ``sizes``.
        groups: ``group_id, ranks`` of the run's communicators.
        sizes: a size per communicator of the replica.

    Returns:
        The same sizes keyed by the class graph's (replica 0's) communicators.
    """
    if not sizes:
        return {}
    grid = replicas.grid
    exemplar = dict(zip(grid[:, replica].tolist(), grid[:, 0].tolist(), strict=True))
    members = dict(zip(groups["group_id"].to_list(), groups["ranks"].to_list(), strict=True))
    by_set = {tuple(sorted(m)): int(g) for g, m in members.items() if m}
    out = {}
    for g, size in sizes.items():
        key = tuple(sorted(exemplar.get(int(m), -1) for m in members.get(g) or ()))
        if key in by_set:
            out[by_set[key]] = size
    return out


@dataclass(frozen=True)
class Replicas:
    """The data-parallel replicas of a sliced run, as columns of the vector.

    Attributes:
        grid: ``(units, replicas)``: the rank of each class in each replica (dp coordinate).
        replica: ``(columns,)``: the replica each simulated column stands for; column 0 is
            replica 0 (the class exemplars, whose events the emulated run shows).
        column: ``(replicas,)``: the column each replica follows (replicas with the same
            durations share one: the max over identical replicas is any one of them).
    """

    grid: np.ndarray
    replica: np.ndarray
    column: np.ndarray

    @property
    def n_columns(self) -> int:
        """Number of simulated columns."""
        return int(self.replica.size)

    def column_grid(self) -> np.ndarray:
        """``(units, columns)``: the rank of each class in the replica of each column."""
        return self.grid[:, self.replica]


def replica_grid(
    layout: ParallelLayout, unit_rank: np.ndarray, distinct: set[int] | None = None
) -> Replicas | None:
    """The replicas of a sliced run whose units are its class exemplars (dp coordinate 0).

    Args:
        layout: the sliced run's layout.
        unit_rank: the exemplar of each class.
        distinct: the replicas that differ from the others (None: every one). The others
            share one column: replica 0's, or the smallest undistinguished one's when 0 is
            distinct itself.

    Returns:
        The replicas, or None when the exemplars are not the dp-0 ranks of a grid of classes x
        replicas (the run is not laid out as the vector expects).
    """
    unit_rank = np.asarray(unit_rank, dtype=np.int64)
    if unit_rank.size == 0 or (unit_rank >= layout.world_size).any():
        return None
    coords = layout.coords(unit_rank)
    if (coords[ParallelAxis.DP] != 0).any():
        return None
    n_dp = layout.size(ParallelAxis.DP)
    flat = {a: np.repeat(c, n_dp) for a, c in coords.items()}
    flat[ParallelAxis.DP] = np.tile(np.arange(n_dp, dtype=np.int64), unit_rank.size)
    grid = np.asarray(layout.rank_of(flat), dtype=np.int64).reshape(unit_rank.size, n_dp)
    if np.unique(grid).size != grid.size:
        return None
    if distinct is None:
        cols = np.arange(n_dp, dtype=np.int64)
        return Replicas(grid, cols, cols.copy())
    rest = sorted(set(range(n_dp)) - distinct - {0})
    rep = 0 if 0 not in distinct else (rest[0] if rest else None)
    cols = np.array(sorted(distinct | {0} | ({rep} if rep is not None else set())), np.int64)
    column = np.full(n_dp, -1, dtype=np.int64)
    column[cols] = np.arange(cols.size, dtype=np.int64)
    if rep is not None:
        column[column < 0] = column[rep]
    return Replicas(grid, cols, column)


def replica_durations(
    nodes: pl.DataFrame,
    base: np.ndarray,
    *,
    replicas: int,
    variance: bool,
    seed: int,
    mode: Literal["iteration", "op"] = "iteration",
) -> np.ndarray:
    """``(nodes, replicas)`` durations: ``base`` everywhere, drawn per replica with variance.

    Replica 0 (the exemplars, the recording itself) keeps ``base``; communication nodes keep
    theirs (their time is waiting, recomputed by the emulator). Every other replica's
    computation node of recorded step ``t`` takes the same op's duration in a drawn recorded
    step ``X``, times ``C[class, t] / C[class, X]``, where ``C`` is the class's total
    computation in a step:

    - ``iteration`` mode draws one ``X`` per (replica, step), the same for every class of the
      replica (one uniform, mapped into each class's pool of recorded steps); ``op`` mode
      draws one per (node, replica).
    - The factor keeps step ``t``'s *common mode*: what slowed or sped up the whole job in that
      step (on ST the per-step computation of any two ranks, of one replica or of two,
      correlates at 0.90-0.99), and draws only an op's own deviation. Drawing whole steps
      independently per class and replica (the earlier rule) mixed stages of different steps
      and moved the common mode between replicas: emulated steps slower and faster than any
      recorded one (ST: 2495 ms vs 2382 ms at most, std 63 vs 51 ms); see
      benchmarks/bench_draws.py.

    Columns are filled in blocks, so the transient memory stays a few times ``nodes x block``
    whatever the replica count.
    """
    n = nodes.height
    out = np.empty((n, replicas), dtype=np.int64)
    out[:] = base[:, None]
    if not variance or replicas < 2 or n == 0:
        return out
    t = draw_table(nodes)
    rec = t.node_rec
    ok = t.r_draws[rec] & ~nodes["kind"].is_in(_COMM).to_numpy()
    rows = np.flatnonzero(ok)
    if rows.size == 0:
        return out
    unit = nodes["unit"].to_numpy().astype(np.int64)[rows]
    size = t.r_len[rec][rows]
    off = t.r_off[rec][rows]
    own = t.r_code[rec][rows] - 1  # the node's recorded step, as a column of `table`
    # Per drawing node, its duration in every recorded iteration (its own where the op is
    # missing from one): a draw is then one lookup in this table.
    n_its = int(t.pool.max()) + 1
    cells = t.r_cell[rec][rows, None] + np.arange(n_its, dtype=np.int64)
    table = np.where(t.present[cells], t.recorded[cells], base[rows, None])
    del cells
    # The common mode: each class's total computation per recorded step, and per node the
    # ratio of its own step's total to every step's (1 where a total is 0).
    total = np.zeros((int(unit.max()) + 1, n_its), dtype=np.float64)
    np.add.at(total, unit, table)
    mine = total[unit, own]
    ratio = np.divide(
        mine[:, None], total[unit], out=np.ones((rows.size, n_its)), where=total[unit] > 0
    )
    # What a node takes when step X is drawn: its op's duration in X times the ratio.
    table = np.rint(table * ratio).astype(np.int64).ravel()
    del ratio
    if mode == "iteration":
        # One uniform per (recorded step, replica), shared by the classes of the replica and
        # mapped into each class's pool: drawn per (class, step) pair, looked up per node.
        _, first, pair = np.unique(
            np.stack([unit, own], axis=1), axis=0, return_index=True, return_inverse=True
        )
        pair = pair.ravel()
        codes, step = np.unique(own[first], return_inverse=True)
        step = step.ravel()
        d_size, d_off = size[first], off[first]
    else:
        pair = np.arange(rows.size, dtype=np.int64)
        d_size, d_off = size, off
    base_idx = (np.arange(rows.size, dtype=np.int64) * n_its)[:, None]
    rng = np.random.default_rng(seed)
    block = max(1, (1 << 22) // max(rows.size, 1))
    for c0 in range(1, replicas, block):
        c1 = min(replicas, c0 + block)
        if mode == "iteration":
            u = rng.random((codes.size, c1 - c0))[step]
        else:
            u = rng.random((rows.size, c1 - c0))
        u *= d_size[:, None]
        pick = u.astype(np.int64)
        del u
        np.minimum(pick, (d_size - 1)[:, None], out=pick)
        pick += d_off[:, None]
        it = t.pool[pick]  # the drawn recorded step, per draw
        idx = it[pair] if mode == "iteration" else it
        idx += base_idx
        out[rows, c0:c1] = table[idx]
    return out


def scale_replicas(
    dur: np.ndarray,
    nodes: pl.DataFrame,
    scale: np.ndarray,
    slow: tuple[SlowDown, ...],
    replicas: Replicas,
) -> None:
    """Scale the durations: ``scale`` per node everywhere, the rank-targeted slow-downs in their
    replica's column too (in place; one rounding per cell, as ``replay.whatif.slow_factors``).

    A slow rank is one (class, replica) cell of the grid: its computation nodes (a slow rank
    computes slower, its network is unchanged) in that replica's column take ``factor`` longer
    (the replica must have a column of its own: ``replica_grid``'s ``distinct``).
    """
    grid = replicas.grid
    unit = nodes["unit"].to_numpy().astype(np.int64)
    compute = ~nodes["kind"].is_in(_COMM).to_numpy()
    flat = grid.ravel()
    order = np.argsort(flat)
    cells: dict[tuple[int, int], float] = {}
    for s in slow:
        if not s.ranks:
            continue
        want = np.asarray(s.ranks, dtype=np.int64)
        pos = np.minimum(np.searchsorted(flat[order], want), flat.size - 1)
        hit = order[pos][flat[order][pos] == want]
        for u, rep in zip(*np.divmod(hit, grid.shape[1]), strict=True):
            r = int(replicas.column[rep])
            cells[int(u), r] = cells.get((int(u), r), 1.0) * s.factor
    saved = {c: dur[:, c[1]].copy() for c in cells}
    scale = np.asarray(scale, dtype=np.float64)
    if (scale != 1.0).any():
        rows = np.flatnonzero(scale != 1.0)
        dur[rows] = np.rint(dur[rows] * scale[rows, None]).astype(np.int64)
    for (u, r), f in cells.items():
        rows = np.flatnonzero((unit == u) & compute)
        dur[rows, r] = np.rint(saved[u, r][rows] * (scale[rows] * f)).astype(np.int64)


def shared_instances(
    instance: np.ndarray, kind: pl.Series, group: np.ndarray, axis_of: dict[int, Any], k: int
) -> np.ndarray:
    """Per instance, whether it is a collective on a communicator that spans the replicas."""
    out = np.zeros(k, dtype=bool)
    coll = (kind == "collective").to_numpy() & (group >= 0)
    if coll.any():
        g = np.unique(group[coll])
        spans = {int(x) for x in g if spans_dp(axis_of.get(int(x)))}
        hit = coll & np.isin(group, list(spans))
        out[np.asarray(instance)[hit]] = True
    return out


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

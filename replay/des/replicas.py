"""The replicas of a sliced run as columns of the replica vector: which, and their durations.

Why a module of its own: ``replay.des.vector`` evaluates a class graph for any columns of
durations; here a sliced run's data-parallel replicas become those columns (``replica_grid``:
replicas that do not differ share one), and the what-ifs become their durations (the variance
draws of ``replica_durations``, the slow ranks of ``scale_replicas``) and the instances they
share (``shared_instances``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
from prism_trace.replay.whatif.config import SlowDown, VarianceMode, WhatIfConfig
from prism_trace.replay.whatif.expansion import spans_dp
from prism_trace.replay.whatif.variance import draw_table
from prism_trace.replay.whatif.variance_fit import VarianceFit
from prism_trace.replay.whatif.variance_replica import replica_columns

from prism_trace.layout.mesh import ParallelAxis

if TYPE_CHECKING:
    from prism_trace.layout.mesh import ParallelLayout

__all__ = [
    "Replicas",
    "class_groups",
    "replica_durations",
    "replica_grid",
    "scale_replicas",
    "shared_instances",
    "vector_eligible",
]

_COMM = ("collective", "send", "recv")


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
    mode: VarianceMode = "iteration",
    fit: VarianceFit | None = None,
    held: np.ndarray | None = None,
) -> np.ndarray:
    """``(nodes, replicas)`` durations: ``base`` everywhere, drawn per replica with variance.

    ``replica`` mode draws from ``fit`` (``replay.whatif.variance_replica.replica_columns``:
    every replica but 0 its own rank effect and residuals; ``held``: the nodes a ``sync`` edge
    holds, which keep theirs); the other modes as follows.

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
    if variance and mode == "replica" and fit is not None and n:
        no_held = np.zeros(n, dtype=bool)
        return replica_columns(
            nodes, base, fit, no_held if held is None else held, replicas=replicas, seed=seed
        )
    out = np.empty((n, replicas), dtype=np.int64)
    out[:] = base[:, None]
    if not variance or replicas < 2 or n == 0 or mode == "replica":
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
    replica's column too (in place; one rounding per cell, as ``replay.whatif.slow.slow_factors``).

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

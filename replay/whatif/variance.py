"""Variance draws: each node's recorded distribution across iterations, and durations drawn
from it (seeded).

Why a module of its own: the variance what-if needs, per node, the same op in every recorded
iteration of its representative (``draw_table``); the expanded units (``resample_durations``)
and the replica vector (``replay.des.replicas.replica_durations``) both draw from that table.
No store, no randomness without a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import polars as pl
from prism_trace.replay.whatif.slow import _COMM

__all__ = ["DrawTable", "draw_table", "resample_durations"]


def _op_keys(nodes: pl.DataFrame) -> pl.DataFrame:
    """Each node's place in its recorded iteration: ``(source_rank, iteration, track, name, ord)``.

    ``ord`` numbers the nodes of one name on one track within one iteration by recorded start,
    so the k-th ``forward`` of step 5 corresponds to the k-th ``forward`` of step 9.
    """
    return nodes.select(
        "source_rank", "node_id", "iteration", "track_id", "name", "ts"
    ).with_columns(
        pl.col("ts")
        .rank("ordinal")
        .over("source_rank", "iteration", "track_id", "name")
        .cast(pl.Int64)
        .alias("ord")
    )


def _first_rows(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first row of each distinct ``(a, b)`` pair, and each row's pair.

    Returns ``(first, pair)``: ``first[k]`` is the row where the ``k``-th pair (numbered by
    first appearance) occurs first, ascending; ``pair[i]`` is the number of row ``i``'s pair.
    Without sorting the rows when the pairs fit a dense table (a class graph copied to many
    units: few distinct pairs).
    """
    n = a.size
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    a = a - int(a.min())
    b = b - int(b.min())
    b_span = int(b.max()) + 1
    cells = (int(a.max()) + 1) * b_span
    if cells <= max(4 * n, 1 << 20):
        key = a * b_span + b
        first = np.full(cells, n, dtype=np.int64)
        np.minimum.at(first, key, np.arange(n, dtype=np.int64))
        rows = np.sort(first[first < n])
        number = np.empty(cells, dtype=np.int64)
        number[key[rows]] = np.arange(rows.size, dtype=np.int64)
        return rows, number[key]
    _, idx, inv = np.unique(
        np.stack([a, b], axis=1), axis=0, return_index=True, return_inverse=True
    )
    order = np.argsort(idx, kind="stable")
    number = np.empty(order.size, dtype=np.int64)
    number[order] = np.arange(order.size, dtype=np.int64)
    return idx[order].astype(np.int64), number[inv.ravel()]


def _dense_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """Each row's pair ``(a, b)`` numbered in sorted pair order, and the number of pairs.

    The numbering of ``np.unique(pairs, return_inverse=True)`` for non-negative ``a`` and
    ``b``; without sorting the rows when the pairs fit a dense table.
    """
    if a.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    b_span = int(b.max()) + 1
    cells = (int(a.max()) + 1) * b_span
    key = a * b_span + b
    if cells <= max(4 * a.size, 1 << 20):
        seen = np.zeros(cells, dtype=bool)
        seen[key] = True
        number = np.cumsum(seen) - 1
        return number[key], int(number[-1]) + 1
    uniq, inv = np.unique(key, return_inverse=True)
    return inv.ravel(), int(uniq.size)


@dataclass(frozen=True)
class DrawTable:
    """Each node's recorded distribution, worked out once per recorded node (see
    ``resample_durations``): ``pool[r_off + i]`` for ``i < r_len`` are the iterations a node can
    draw from, ``recorded[cell]`` (where ``present[cell]``) the op's duration in the iteration
    of ``cell = pool[...] + r_cell``; ``r_draws`` whether the node can draw at all; ``r_code`` its
    recorded iteration's code (0: none). ``r_*`` are per recorded node, ``node_rec`` maps each
    node to its recorded node."""

    node_rec: np.ndarray
    r_len: np.ndarray
    r_off: np.ndarray
    r_cell: np.ndarray
    r_draws: np.ndarray
    r_code: np.ndarray
    pool: np.ndarray
    present: np.ndarray
    recorded: np.ndarray
    r_source: np.ndarray


def draw_table(nodes: pl.DataFrame) -> DrawTable:
    """The recorded distribution of every node of ``nodes`` (``source_rank, node_id, iteration,
    track_id, name, ts, dur``): the same op (``_op_keys``) in every recorded iteration of its
    representative."""
    src_all = nodes["source_rank"].to_numpy().astype(np.int64)
    # The recorded nodes (first row of each (source_rank, node_id)) and each node's one.
    rows, node_rec = _first_rows(src_all, nodes["node_id"].to_numpy().astype(np.int64))
    keys = _op_keys(nodes[rows])
    none = -(2**31)
    r_src = keys["source_rank"].to_numpy().astype(np.int64)
    r_it = keys["iteration"].fill_null(none).to_numpy().astype(np.int64)
    r_dur = nodes["dur"][rows]
    # The op of each recorded node, (source_rank, track_id, name, ord) numbered; -1 with a gap.
    gap = (
        keys.select(pl.any_horizontal(pl.col("track_id", "name", "ord").is_null()))
        .to_series()
        .to_numpy()
    )
    op_cols = keys.select(
        "source_rank", "track_id", pl.col("name").rank("dense").alias("name"), "ord"
    ).fill_null(-1)
    _, op = np.unique(op_cols.to_numpy().astype(np.int64), axis=0, return_inverse=True)
    op = np.where(gap, -1, op.ravel())
    n_ops = int(op.max()) + 1 if op.size else 0
    # The recorded iterations (codes into `its`); each representative's, to draw from.
    its = np.unique(r_it[r_it != none])
    n_its = max(its.size, 1)
    sources = np.unique(r_src)
    pools = [np.searchsorted(its, np.unique(r_it[(r_src == s) & (r_it != none)])) for s in sources]
    pool_len = np.array([p.size for p in pools], dtype=np.int64)
    pool_off = np.cumsum(pool_len) - pool_len
    pool = np.concatenate([*pools, np.zeros(1, dtype=np.int64)]).astype(np.int64)
    # The recorded duration of every (op, iteration) present.
    has = (op >= 0) & (r_it != none) & r_dur.is_not_null().to_numpy()
    cell_of = op[has] * n_its + np.searchsorted(its, r_it[has])
    present = np.zeros(max(n_ops, 1) * n_its, dtype=bool)
    present[cell_of] = True
    recorded = np.zeros(present.size, dtype=np.int64)
    recorded[cell_of] = r_dur.fill_null(0).to_numpy().astype(np.int64)[has]

    # Per recorded node: its representative's pool of iterations, its op's first table cell.
    r_pool = np.searchsorted(sources, r_src)
    r_len, r_off = pool_len[r_pool], pool_off[r_pool]
    r_cell = np.maximum(op, 0) * n_its
    r_draws = (op >= 0) & (r_it != none) & (r_len > 0)

    r_code = np.searchsorted(its, r_it) + (r_it != none)
    return DrawTable(
        node_rec, r_len, r_off, r_cell, r_draws, r_code, pool, present, recorded, r_pool
    )


def resample_durations(
    nodes: pl.DataFrame,
    draw: np.ndarray,
    *,
    seed: int,
    mode: Literal["iteration", "op"] = "iteration",
) -> np.ndarray:
    """Durations drawn from each node's recorded distribution across iterations (seeded).

    A node's distribution is the durations of the *same op* (``_op_keys``) in every recorded
    iteration of its representative (``source_rank``). ``iteration`` mode draws, per unit and
    iteration, one recorded iteration ``X`` and takes all its ops' durations from it; ``op``
    mode draws per node. Either way a node of recorded step ``t`` takes its op's duration in
    ``X`` times ``C[t] / C[X]``, ``C`` being its representative's total computation in a step:
    the step's common mode stays, only an op's own deviation is drawn (as the replica vector's
    columns do, ``replay.des.replicas.replica_durations``). Communication nodes keep theirs (their
    duration is waiting, which the emulator recomputes), and so do nodes without an iteration
    or without a counterpart in the drawn iteration.

    The nodes of one ``(source_rank, node_id)`` (a class's graph copied to many units) share
    their op and their distribution: those are worked out once per recorded node, and only the
    draws and the lookups run per node (numpy, no joins or sorts of the expanded graph).

    Args:
        nodes: ``unit, source_rank, node_id, kind, iteration, track_id, name, ts, dur``.
        draw: per unit, whether it draws (False: keeps the recorded durations).
        seed: the seed; the same seed gives the same durations.
        mode: see above.

    Returns:
        int64 durations per node.
    """
    dur = nodes["dur"].fill_null(0).to_numpy().astype(np.int64)
    unit = nodes["unit"].to_numpy().astype(np.int64, copy=False)
    draw = np.asarray(draw, dtype=bool)
    if not draw.any():
        return dur
    t = draw_table(nodes)
    node_rec, r_len, r_off, r_cell, r_draws = t.node_rec, t.r_len, t.r_off, t.r_cell, t.r_draws
    pool, present, recorded = t.pool, t.present, t.recorded

    rng = np.random.default_rng(seed)
    if mode == "iteration":
        # One draw per (unit, iteration), numbered in (unit, iteration) order: a uniform each.
        pair, n_pairs = _dense_pairs(unit, t.r_code[node_rec])
        u = rng.random(n_pairs)[pair]
        del pair
    else:
        u = rng.random(nodes.height)
    # The drawn iteration: pool[offset + min(floor(u * len), len - 1)] (in place: 8 M nodes).
    size = r_len[node_rec]
    u *= size
    pick = u.astype(np.int64)
    del u
    size -= 1
    np.minimum(pick, size, out=pick)
    pick += r_off[node_rec]
    drawn = pool[pick]  # the drawn recorded step (index into the steps)
    cell = drawn + r_cell[node_rec]
    ok = present[cell]
    ok &= r_draws[node_rec]
    ok &= draw[unit]
    comm = nodes["kind"].is_in(_COMM).to_numpy()
    ok &= ~comm
    at = np.flatnonzero(ok)
    ratio = _common_mode(t, comm, node_rec)
    f = ratio[node_rec[at], drawn[at]]
    dur[at] = np.rint(recorded[cell[at]] * f).astype(np.int64)
    return dur


def _common_mode(t: DrawTable, comm: np.ndarray, node_rec: np.ndarray) -> np.ndarray:
    """``(recorded nodes, steps)``: per recorded node, its representative's total computation
    in the node's own step over that in each step (1 where a total is 0 or unknown).

    A total sums the drawing computation nodes of the representative, each at its op's
    duration in the step (its own where the op is missing there).
    """
    n_rec = t.r_len.size
    n_its = int(t.pool.max()) + 1
    rec_comm = np.zeros(n_rec, dtype=bool)
    rec_comm[node_rec] = comm
    use = t.r_draws & ~rec_comm
    rows = np.flatnonzero(use)
    cells = t.r_cell[rows, None] + np.arange(n_its, dtype=np.int64)
    own_step = np.maximum(t.r_code - 1, 0)
    mine = t.recorded[t.r_cell + own_step]  # a node's own recorded duration
    table = np.where(t.present[cells], t.recorded[cells], mine[rows, None]).astype(np.float64)
    total = np.zeros((int(t.r_source.max(initial=0)) + 1, n_its), dtype=np.float64)
    np.add.at(total, t.r_source[rows], table)
    src_total = total[t.r_source]  # (recorded nodes, steps)
    own = src_total[np.arange(n_rec), own_step]
    ok = (src_total > 0) & use[:, None]
    return np.divide(own[:, None], src_total, out=np.ones((n_rec, n_its)), where=ok)

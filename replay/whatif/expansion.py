"""Replica expansion: the data-parallel replicas a what-if touches, given units of their own.

Why a module of its own: the emulator simulates one *unit* per equivalence class, which is exact
only while every member of a class has the same timing (docs/emulator.md). A what-if that touches
some ranks (a slow rank, a failed GPU) or the variance mode (every replica draws its own
durations) breaks that symmetry. Those ranks' data-parallel *replicas* are then expanded into
units of their own before the emulation (``expand_replicas``), while the untouched replicas stay
represented by one replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl
from prism_trace.replay.whatif.config import WhatIfError

from prism_trace.layout.mesh import AXES, ParallelAxis, ParallelLayout

__all__ = ["Expansion", "expand_replicas", "spans_dp"]


def spans_dp(axis: str | None) -> bool:
    """Whether a group of this axis spans data-parallel replicas (and so is shared by them)."""
    if axis is None:
        return True  # unknown: keep it shared, the conservative choice
    return axis == "world" or "dp" in axis.split("-")


def _spans_dp_expr(col: str = "axis") -> pl.Expr:
    """``spans_dp`` as a polars expression."""
    c = pl.col(col)
    return c.is_null() | (c == "world") | c.str.split("-").list.contains("dp")


@dataclass
class Expansion:
    """The graph of a sliced run with some data-parallel replicas expanded into units.

    Attributes:
        nodes: the input node columns, one copy per expanded rank (``rank`` = that rank,
            ``group_id``/``peer`` remapped to its replica); no ``unit``/``idx`` yet.
        edges: ``rank, src, dst, kind, anchor, delay`` per expanded rank.
        rank_unit_rank: for every rank of the world, the rank whose unit it follows (itself when
            expanded, else its counterpart in the representative replica).
        replicas: the replicas that got units of their own (the representative one included).
        representative_replica: the replica that stands for all unexpanded ones (None when every
            replica is expanded).
        edge_rows: each edge's ``src`` and ``dst`` as rows of ``nodes`` (sorted by
            ``(rank, node_id)``), so they need not be looked up again.
    """

    nodes: pl.DataFrame
    edges: pl.DataFrame
    rank_unit_rank: np.ndarray
    replicas: list[int]
    representative_replica: int | None
    notes: list[str] = field(default_factory=list)
    edge_rows: tuple[np.ndarray, np.ndarray] | None = None


def _replicate(
    rank: np.ndarray, cls: np.ndarray, *, within: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a per-class frame to gather so that every target gets its class's rows.

    Args:
        rank: class (exemplar rank) of each row of the frame.
        cls: class of each target, targets in the order wanted.
        within: order of the rows within a class (default: frame order).

    Returns:
        ``(rows, target)``: the rows to gather, target by target, and the target of each.
    """
    rank = rank.astype(np.int64)
    order = (
        np.argsort(rank, kind="stable") if within is None else np.lexsort((within, rank))
    ).astype(np.int64)
    blocks, start, count = np.unique(rank[order], return_index=True, return_counts=True)
    if blocks.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    pos = np.minimum(np.searchsorted(blocks, cls), blocks.size - 1)
    t = np.flatnonzero(blocks[pos] == cls)  # targets whose class has rows (an inner join)
    n = count[pos[t]].astype(np.int64)
    first = np.repeat(start[pos[t]] - (np.cumsum(n) - n), n)
    return order[first + np.arange(first.size, dtype=np.int64)], np.repeat(t, n)


def expand_replicas(
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    *,
    ranks: pl.DataFrame,
    groups: pl.DataFrame,
    layout: ParallelLayout,
    replicas: set[int],
) -> Expansion:
    """Give every rank of the chosen replicas its own copy of its class's graph.

    A sliced run stores one graph per class under its exemplar (dp coordinate 0). A copy for rank
    ``m`` keeps the node ids, takes ``m`` as rank, and points at ``m``'s own communicators: a group
    that spans dp (``dp``, ``dp-cp``, ``world``) is shared by the replicas and kept; any other
    (``tp``, ``pp``, ``embd``, ...) is replaced by the group of the same axis that holds ``m``. A
    p2p peer moves by the same coordinate offset as in slicing. The smallest unexpanded replica
    is expanded too and stands for every other unexpanded one, so no two units ever share a
    communicator copy.

    The copies are one gather of the class graphs (numpy row indices, no joins or sorts of the
    expanded graph): nodes come out sorted by ``(rank, node_id)``, edges by rank.

    Args:
        nodes: the sliced run's graph nodes (exemplar ranks), with ``source_rank``.
        edges: its edges (``rank, src, dst, kind, anchor, delay``).
        ranks: ``rank, class_id`` for every rank of the world.
        groups: ``group_id, axis, ranks`` of the sliced run.
        layout: the sliced run's layout.
        replicas: dp coordinates whose ranks must get units of their own.

    Returns:
        The expanded graph.

    Raises:
        WhatIfError: a replica outside the layout, or communicators that do not partition the
            world along an axis.
    """
    n_dp = layout.size(ParallelAxis.DP)
    bad = [d for d in replicas if not 0 <= d < n_dp]
    if bad:
        msg = f"replica {bad[0]} is outside dp = {n_dp} of {layout}"
        raise WhatIfError(msg)
    rest = sorted(set(range(n_dp)) - replicas)
    rep_replica = rest[0] if rest else None
    chosen = sorted(replicas | ({rep_replica} if rep_replica is not None else set()))

    world = np.arange(layout.world_size, dtype=np.int64)
    coords = layout.coords(world)
    dp = coords[ParallelAxis.DP]
    follow = world.copy()
    if rep_replica is not None:
        other = ~np.isin(dp, chosen)
        c = {a: coords[a][other] for a in AXES}
        c[ParallelAxis.DP] = np.full(int(other.sum()), rep_replica, dtype=np.int64)
        follow[other] = layout.rank_of(c)

    # The ranks that get a copy (ascending), with their class.
    r_all = ranks["rank"].cast(pl.Int64).to_numpy()
    c_all = ranks["class_id"].cast(pl.Int64).to_numpy()
    pick = np.isin(r_all, world[np.isin(dp, chosen)])
    t_rank, t_cls = r_all[pick], c_all[pick]
    order = np.argsort(t_rank, kind="stable")
    t_rank, t_cls = t_rank[order], t_cls[order]

    # Communicators: per axis that does not span dp, the group holding each rank.
    spans = groups.select(_spans_dp_expr().alias("s"))["s"].to_numpy()
    members = (
        groups.filter(~pl.Series(spans))
        .select(pl.col("group_id").cast(pl.Int64).alias("new_group"), "axis", "ranks")
        .explode("ranks")
        .select("new_group", "axis", pl.col("ranks").cast(pl.Int64).alias("new_rank"))
        .drop_nulls("new_rank")
    )
    dup = members.group_by("axis", "new_rank").len().filter(pl.col("len") > 1)
    if not dup.is_empty():
        r = dup.row(0, named=True)
        msg = (
            f"rank {r['new_rank']} is in {r['len']} `{r['axis']}` groups; a replica can only be"
            " expanded when each axis's groups partition the world"
        )
        raise WhatIfError(msg)
    axes = sorted(set(members["axis"].to_list()))
    # (cast: with no per-replica group at all, replace_strict keeps the input's string dtype)
    a_code = (
        members["axis"]
        .replace_strict(axes, list(range(len(axes))), return_dtype=pl.Int64)
        .cast(pl.Int64)
    )
    m_rank = members["new_rank"].to_numpy()
    span = max(
        int(m_rank.max()) + 1 if m_rank.size else 0, int(t_rank.max()) + 1 if t_rank.size else 0
    )
    holder = np.full((max(len(axes), 1), max(span, 1)), -1, dtype=np.int64)
    holder[a_code.to_numpy(), m_rank] = members["new_group"].to_numpy()
    # Per exemplar node: the axis of its group when that group is per replica (-1: keep it).
    g_id = groups["group_id"].cast(pl.Int64).to_numpy()
    g_code = np.full(g_id.size, -1, dtype=np.int64)
    own = np.flatnonzero(~spans)
    axis_of, code_of = groups["axis"].to_list(), {a: i for i, a in enumerate(axes)}
    g_code[own] = [code_of.get(axis_of[i], -1) for i in own]  # no members: keep the group
    g_sort = np.argsort(g_id, kind="stable")
    node_g = nodes["group_id"].cast(pl.Int64)
    gid = node_g.fill_null(-1).to_numpy()
    node_code = np.full(nodes.height, -1, dtype=np.int64)
    if g_id.size:
        pos = np.minimum(np.searchsorted(g_id[g_sort], gid), g_id.size - 1)
        hit = node_g.is_not_null().to_numpy() & (g_id[g_sort][pos] == gid)
        node_code[hit] = g_code[g_sort][pos[hit]]

    ex = nodes["rank"].cast(pl.Int64).to_numpy()
    rows, tgt = _replicate(ex, t_cls, within=nodes["node_id"].to_numpy())
    new_rank = t_rank[tgt]
    copies = nodes[rows]
    cols: list[pl.Series] = [pl.Series("rank", new_rank).cast(nodes.schema["rank"])]
    # Groups: the copy's own communicator of the same axis, where it has one.
    code = node_code[rows]
    remap = np.flatnonzero(code >= 0)
    group = gid[rows]
    new_g = holder[code[remap], new_rank[remap]]
    group[remap] = np.where(new_g >= 0, new_g, group[remap])
    cols.append(
        pl.Series("group_id", group, dtype=pl.Int64).scatter(
            np.flatnonzero(node_g.is_null().to_numpy()[rows]), None
        )
    )
    # p2p peers: the exemplar's peer shifted by (new rank - exemplar) coordinate-wise.
    has_peer = nodes["peer"].is_not_null().to_numpy()[rows]
    if has_peer.any():
        at = np.flatnonzero(has_peer)
        peer = nodes["peer"].fill_null(0).to_numpy().astype(np.int64)[rows[at]]
        cp, ce, cn = layout.coords(peer), layout.coords(ex[rows[at]]), layout.coords(new_rank[at])
        moved = layout.rank_of({a: (cn[a] + cp[a] - ce[a]) % layout.size(a) for a in AXES})
        out = np.zeros(rows.size, dtype=np.int64)
        out[at] = moved
        cols.append(
            pl.Series("peer", out, dtype=pl.Int64)
            .cast(nodes.schema["peer"])
            .scatter(np.flatnonzero(~has_peer), None)
        )
    copies = copies.with_columns(cols)
    e_rank = edges["rank"].cast(pl.Int64).to_numpy()
    e_rows, e_tgt = _replicate(e_rank, t_cls)
    e = edges[e_rows].with_columns(pl.Series("rank", t_rank[e_tgt]).cast(edges.schema["rank"]))
    # Edge endpoints as rows of the copies: where the target's copy starts + the node's place in
    # its class's graph (node_id order); None when an edge names a node that does not exist.
    n_of = np.bincount(tgt, minlength=t_rank.size)
    copy_start = np.cumsum(n_of) - n_of
    places = _places(ex, nodes["node_id"].to_numpy(), e_rank, edges, ("src", "dst"))
    edge_rows = None
    if all((p >= 0).all() for p in places):
        edge_rows = (copy_start[e_tgt] + places[0][e_rows], copy_start[e_tgt] + places[1][e_rows])
    notes = [
        f"{len(replicas)} of {n_dp} data-parallel replicas expanded into units of their own"
        + (
            f"; replica {rep_replica} stands for the other {n_dp - len(chosen)}"
            if rep_replica is not None and n_dp > len(chosen)
            else ""
        )
    ]
    return Expansion(
        nodes=copies.select(nodes.columns),
        edges=e.select(edges.columns),
        rank_unit_rank=follow,
        replicas=chosen,
        representative_replica=rep_replica,
        notes=notes,
        edge_rows=edge_rows,
    )


def _places(
    rank: np.ndarray, node_id: np.ndarray, e_rank: np.ndarray, edges: pl.DataFrame, ends: tuple
) -> list[np.ndarray]:
    """Per edge of the class graphs, the place of each end (``src``, ``dst``) among its rank's
    nodes in ``node_id`` order; -1 for a node that does not exist."""
    if rank.size == 0:
        return [np.full(edges.height, -1, dtype=np.int64) for _ in ends]
    key = rank.astype(np.int64) << 32 | node_id.astype(np.int64)
    key.sort()
    r = key >> 32
    first = np.flatnonzero(np.diff(r, prepend=r[0] - 1))
    place = np.arange(key.size) - np.repeat(first, np.diff(np.append(first, key.size)))
    out = []
    for end in ends:
        want = e_rank << 32 | edges[end].to_numpy().astype(np.int64)
        pos = np.minimum(np.searchsorted(key, want), key.size - 1)
        out.append(np.where(key[pos] == want, place[pos], -1))
    return out

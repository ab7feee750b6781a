"""Rewriting one recorded rank's graph to another number of microbatches per step: whole
microbatches of its recorded schedule repeated or dropped, the rest of the step kept.

Each step's repeatable regions (``schedule.StepShape.runs``: 1F1B's steady forward/backward pairs,
GPipe's forwards and backwards) hold equal *periods* of main-track nodes, one microbatch each.
Every node of the rank belongs to a main-track position (its *slot*): its own, its launcher's for a
device op, else the main-track node running when it started. A period is the nodes whose slots fall
in it; periods of one region must hold the same ops at the same places (on any track: a backend's
worker threads take calls in turn).

A region of ``k`` periods becomes ``k + (m_target - m)``: dropped periods are taken before the last
one, added ones are copies of the recorded periods in turn, inserted before the last one. Nodes
outside the regions keep their ids; the first use of a recorded period keeps its nodes' ids, every
further copy gets new ids after the rank's largest. A copy keeps its recorded ``event_id``, ``ts``
and ``dur``: it replays the same recorded op.

Edges follow their ends. Inside a region an edge joins period ``j`` to period ``j + d`` at given
offsets; it is drawn between every pair of target periods ``d`` apart (with the delay recorded for
that pair when it was recorded, else the first recorded one). An edge between a region and a node
outside it counts periods from the side that node is on (from the start for a node before the
region, from the end for one after), so the step's joints stay as recorded.

Sequence numbers follow the new program order: every communication key (group, peer, direction)
with a node in a region is renumbered from its recorded first number, so neighbouring stages,
rewritten alike, agree on their send/recv pairs, and TP collectives inside microbatches stay
matched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from prism_trace.graph.base import EDGE_SCHEMA, NODE_SCHEMA
from prism_trace.slicing.schedule import Periods

__all__ = ["RankSteps", "rebatch_rank"]


@dataclass
class RankSteps:
    """One rank's recognised steps, in its own numbers.

    Attributes:
        main: node ids of the main track, in program order.
        runs: per step (iteration), its repeatable regions in main-track positions (indices into
            ``main``).
    """

    main: np.ndarray
    runs: dict[int, tuple[Periods, ...]] = field(default_factory=dict)


class RebatchError(ValueError):
    """The rank's microbatches cannot be repeated as recorded (the caller words the refusal)."""


def _plan(k: int, k_new: int) -> list[int]:
    """Which recorded period each target period copies: the first ``k_new - 1`` and the last when
    dropping; every recorded one, then copies in turn, then the last, when adding."""
    if k_new <= k:
        return [0] if k_new == 1 else [*range(k_new - 1), k - 1]
    extra = [i % k for i in range(k_new - k)]
    return [*range(k - 1), *extra, k - 1]


def _slots(nodes: pl.DataFrame, edges: pl.DataFrame, main: np.ndarray) -> np.ndarray:
    """Each node's main-track position: its own, its launcher's, else the main node running when
    it started (-1 before the first)."""
    ids = nodes["node_id"].to_numpy().astype(np.int64)
    order = np.argsort(ids)
    sorted_ids = ids[order]
    ts = nodes["ts"].fill_null(-(1 << 62)).to_numpy().astype(np.int64)
    main_pos = np.searchsorted(sorted_ids, main)
    main_rows = order[main_pos]
    main_ts = ts[main_rows]
    slot = np.searchsorted(main_ts, ts, side="right") - 1
    slot[main_rows] = np.arange(main.size)
    launch = edges.filter(pl.col("kind") == "launch")
    if launch.height:
        src = order[np.searchsorted(sorted_ids, launch["src"].to_numpy().astype(np.int64))]
        dst = order[np.searchsorted(sorted_ids, launch["dst"].to_numpy().astype(np.int64))]
        slot[dst] = slot[src]
    return slot


@dataclass(frozen=True)
class _Region:
    start: int  # main-track position
    length: int
    count: int
    target: int
    plan: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.length * self.count


def rebatch_rank(
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    steps: RankSteps,
    delta: int,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rank's graph with ``delta`` more (or fewer) microbatches in every recognised step.

    Args:
        nodes: the rank's ``graph_node`` rows (``NODE_SCHEMA``).
        edges: the rank's ``graph_edge`` rows (``EDGE_SCHEMA``).
        steps: its recognised steps (``RankSteps``).
        delta: periods to add (negative: to drop) per step (a period is one microbatch but for
            interleaved 1F1B, ``schedule.StepShape.per_period``).

    Returns:
        The rewritten nodes and edges (same columns).

    Raises:
        RebatchError: a region would lose every period, or its periods differ off the main track.
    """
    slot = _slots(nodes, edges, steps.main)
    regions = sorted(
        (
            _Region(
                r.start, r.length, r.count, r.count + delta, tuple(_plan(r.count, r.count + delta))
            )
            for runs in steps.runs.values()
            for r in runs
        ),
        key=lambda g: g.start,
    )
    for g in regions:
        if g.target < 1:
            msg = (
                f"a step has {g.count} repeatable period(s) here; {-delta} fewer leaves"
                " none to keep its schedule's shape"
            )
            raise RebatchError(msg)
    n = nodes.height
    region_of = np.full(n, -1, dtype=np.int64)
    period_of = np.full(n, -1, dtype=np.int64)
    starts = np.array([g.start for g in regions], dtype=np.int64)
    ends = np.array([g.end for g in regions], dtype=np.int64)
    if regions:
        at = np.searchsorted(starts, slot, side="right") - 1
        inside = (at >= 0) & (slot < ends[np.maximum(at, 0)])
        region_of[inside] = at[inside]
        lengths = np.array([g.length for g in regions], dtype=np.int64)
        period_of[inside] = (slot[inside] - starts[at[inside]]) // lengths[at[inside]]
    offset = _offsets(nodes, slot, region_of, period_of, regions)
    return _rewrite(nodes, edges, slot, region_of, period_of, offset, regions)


def _offsets(
    nodes: pl.DataFrame,
    slot: np.ndarray,
    region_of: np.ndarray,
    period_of: np.ndarray,
    regions: list[_Region],
) -> np.ndarray:
    """Each region node's index within its period (by slot, track, time); checks that the periods
    of a region hold the same ops in the same places."""
    n = nodes.height
    off = np.full(n, -1, dtype=np.int64)
    rows = np.flatnonzero(region_of >= 0)
    if rows.size == 0:
        return off
    starts = np.array([g.start for g in regions], dtype=np.int64)
    lengths = np.array([g.length for g in regions], dtype=np.int64)
    rel = slot[rows] - starts[region_of[rows]] - period_of[rows] * lengths[region_of[rows]]
    frame = pl.DataFrame(
        {
            "row": rows,
            "region": region_of[rows],
            "period": period_of[rows],
            "rel": rel,
            "track": nodes["track_id"].fill_null(-1).to_numpy()[rows],
            "ts": nodes["ts"].fill_null(0).to_numpy()[rows],
            "id": nodes["node_id"].to_numpy()[rows],
            "what": _what(nodes)[rows],
        }
    ).sort("region", "period", "rel", "track", "ts", "id")
    frame = frame.with_columns(pl.int_range(pl.len()).over("region", "period").alias("off"))
    off[frame["row"].to_numpy()] = frame["off"].to_numpy()
    # Tracks may differ (a backend's worker threads take calls in turn): the same ops at the same
    # places are enough.
    sigs = frame.group_by("region", "period", maintain_order=True).agg(
        pl.concat_str("rel", "what", separator="/").sort().alias("sig")
    )
    for (region,), part in sigs.group_by(["region"], maintain_order=True):
        first = list(part["sig"][0])
        for p, sig in zip(part["period"].to_list(), part["sig"].to_list(), strict=True):
            if list(sig) != first:
                msg = (
                    f"the microbatches of a step differ in their ops off the main track"
                    f" (region {region}, period {p} against period 0)"
                )
                raise RebatchError(msg)
    return off


def _what(nodes: pl.DataFrame) -> np.ndarray:
    """What a node does, for comparing periods: its kind and name, or for a communication op
    its kind, group, peer and size (its name may carry a sequence number)."""
    comm = pl.col("kind").is_in(["collective", "send", "recv"])
    return (
        nodes.select(
            pl.when(comm)
            .then(
                pl.concat_str(
                    "kind",
                    "comm_kind",
                    "group_id",
                    "peer",
                    "msg_bytes",
                    separator="|",
                    ignore_nulls=True,
                )
            )
            .otherwise(pl.concat_str("kind", pl.col("name").fill_null(""), separator="|"))
        )
        .to_series()
        .to_numpy()
    )


def _rewrite(
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    slot: np.ndarray,
    region_of: np.ndarray,
    period_of: np.ndarray,
    offset: np.ndarray,
    regions: list[_Region],
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Build the target nodes (ids, order, sequence numbers) and edges."""
    ids = nodes["node_id"].to_numpy().astype(np.int64)
    next_id = int(ids.max()) + 1 if ids.size else 0
    # Target main-track position shift after each region.
    grow = np.array([(g.target - g.count) * g.length for g in regions], dtype=np.int64)
    ends = np.array([g.end for g in regions], dtype=np.int64)
    shift_after = np.cumsum(grow) if regions else grow
    fixed = region_of < 0
    fixed_rows = np.flatnonzero(fixed)
    n_before = np.searchsorted(ends, slot[fixed_rows], side="right")
    fixed_pos = slot[fixed_rows] + np.where(
        n_before > 0, shift_after[np.maximum(n_before - 1, 0)], 0
    )
    parts_row = [fixed_rows]
    parts_id = [ids[fixed_rows]]
    parts_pos = [fixed_pos]
    # (region, target period, offset) -> new id, as an array per region.
    target_ids: list[np.ndarray] = []
    for r, g in enumerate(regions):
        members = np.flatnonzero(region_of == r)
        per = members[np.argsort(period_of[members] * (1 << 32) + offset[members], kind="stable")]
        size = per.size // g.count
        table = np.empty((g.target, size), dtype=np.int64)
        used: set[int] = set()
        before = shift_after[r - 1] if r > 0 else 0
        for t, src in enumerate(g.plan):
            rows = per[src * size : (src + 1) * size]
            if src in used:
                new = np.arange(next_id, next_id + size, dtype=np.int64)
                next_id += size
            else:
                new = ids[rows]
                used.add(src)
            table[t] = new
            parts_row.append(rows)
            parts_id.append(new)
            rel = slot[rows] - g.start - src * g.length
            parts_pos.append(g.start + before + t * g.length + rel)
        target_ids.append(table)
    row = np.concatenate(parts_row)
    out = nodes[row].with_columns(
        pl.Series("node_id", np.concatenate(parts_id), dtype=pl.Int64),
        pl.Series("_pos", np.concatenate(parts_pos), dtype=pl.Int64),
    )
    out = _renumber(out, nodes, region_of)
    new_edges = _edges(nodes, edges, slot, region_of, period_of, offset, regions, target_ids)
    return out.select(list(NODE_SCHEMA)).sort("node_id"), new_edges


def _renumber(out: pl.DataFrame, nodes: pl.DataFrame, region_of: np.ndarray) -> pl.DataFrame:
    """Sequence numbers in the new program order for every communication key with a node in a
    region, from the key's recorded first number."""
    key = ["group_id", "peer", "kind"]
    comm = nodes.with_columns(pl.Series("_in", region_of >= 0)).filter(
        pl.col("seq").is_not_null() & pl.col("kind").is_in(["collective", "send", "recv"])
    )
    moved = comm.filter(pl.col("_in")).select(key).unique()
    if moved.is_empty():
        return out
    first = (
        comm.join(moved, on=key, nulls_equal=True)
        .group_by(key)
        .agg(pl.col("seq").min().alias("_s0"))
    )
    out = out.with_row_index("_r")
    ranked = (
        out.filter(pl.col("seq").is_not_null())
        .join(first, on=key, nulls_equal=True)
        .sort("_pos", "track_id", "ts", "node_id")
        .with_columns((pl.col("_s0") + pl.int_range(pl.len()).over(key)).alias("_new"))
        .select("_r", "_new")
    )
    return (
        out.join(ranked, on="_r", how="left")
        .with_columns(pl.coalesce("_new", "seq").alias("seq"))
        .sort("_r")
        .drop("_r", "_new")
    )


def _edges(
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    slot: np.ndarray,
    region_of: np.ndarray,
    period_of: np.ndarray,
    offset: np.ndarray,
    regions: list[_Region],
    target_ids: list[np.ndarray],
) -> pl.DataFrame:
    """The target edges: kept between fixed nodes, drawn between target periods inside regions,
    and counted from the near side between a region and the rest (module docstring)."""
    if edges.is_empty() or not regions:
        return edges.select(list(EDGE_SCHEMA))
    ids = nodes["node_id"].to_numpy().astype(np.int64)
    order = np.argsort(ids)
    look = order[np.searchsorted(ids[order], edges["src"].to_numpy().astype(np.int64))]
    lookd = order[np.searchsorted(ids[order], edges["dst"].to_numpy().astype(np.int64))]
    ru, rv = region_of[look], region_of[lookd]
    keep = (ru < 0) & (rv < 0)
    out = [edges.filter(pl.Series(keep))]
    rank = edges["rank"][0]
    src_new: list[int] = []
    dst_new: list[int] = []
    meta: list[int] = []  # recorded edge row
    patterns: dict[tuple[int, int, int, int, str, str], list[tuple[int, int]]] = {}
    kinds = edges["kind"].to_list()
    anchors = edges["anchor"].to_list()
    track = nodes["track_id"].fill_null(-1).to_numpy().astype(np.int64)
    is_last_before = _last_before(nodes, slot, region_of, regions)
    last_on_track = _last_on_track(nodes, region_of, offset, track)
    joints: list[tuple[int, int, int, int]] = []
    for e in np.flatnonzero(~keep).tolist():
        u, v = int(look[e]), int(lookd[e])
        a, b = int(ru[e]), int(rv[e])
        if a >= 0 and a == b:
            d = int(period_of[v] - period_of[u])
            key = (a, d, int(offset[u]), int(offset[v]), kinds[e], anchors[e])
            patterns.setdefault(key, []).append((int(period_of[u]), e))
            continue
        if a < 0 and b >= 0 and regions[b].count == 1 and is_last_before[u] == b:
            joints.append((b, int(offset[v]), int(track[u]), e))
        iu = _near(regions, a, int(period_of[u]), toward=slot[v], other=b) if a >= 0 else None
        iv = _near(regions, b, int(period_of[v]), toward=slot[u], other=a) if b >= 0 else None
        if (a >= 0 and iu is None) or (b >= 0 and iv is None):
            continue
        s = int(target_ids[a][iu, offset[u]]) if a >= 0 else int(ids[u])
        t = int(target_ids[b][iv, offset[v]]) if b >= 0 else int(ids[v])
        src_new.append(s)
        dst_new.append(t)
        meta.append(e)
    # A region of one recorded period shows no joint between two periods: each copy joins the
    # one before it as the region joins what precedes it (the edge from the last node before it,
    # on that node's track, now from the period's last node on that track).
    for b, ov, tr, e in joints:
        ou = last_on_track.get((b, tr))
        if ou is None:
            continue
        for t in range(1, regions[b].target):
            src_new.append(int(target_ids[b][t - 1, ou]))
            dst_new.append(int(target_ids[b][t, ov]))
            meta.append(e)
    for (a, d, ou, ov, _, _), recorded in patterns.items():
        g = regions[a]
        by_src = dict(recorded)
        for t in range(g.target):
            if not 0 <= t + d < g.target:
                continue
            e = by_src.get(g.plan[t], recorded[0][1])
            src_new.append(int(target_ids[a][t, ou]))
            dst_new.append(int(target_ids[a][t + d, ov]))
            meta.append(e)
    if meta:
        picked = edges[np.asarray(meta, dtype=np.int64)]
        out.append(
            picked.with_columns(
                pl.lit(rank).cast(pl.Int32).alias("rank"),
                pl.Series("src", src_new, dtype=pl.Int64),
                pl.Series("dst", dst_new, dtype=pl.Int64),
            )
        )
    return pl.concat([o.select(list(EDGE_SCHEMA)) for o in out]).unique(
        ["src", "dst", "kind"], keep="first", maintain_order=True
    )


def _last_before(
    nodes: pl.DataFrame, slot: np.ndarray, region_of: np.ndarray, regions: list[_Region]
) -> np.ndarray:
    """Per node: the region it immediately precedes on its track (its last node before the
    region's start), else -1."""
    out = np.full(nodes.height, -1, dtype=np.int64)
    track = nodes["track_id"].fill_null(-1).to_numpy()
    ts = nodes["ts"].fill_null(0).to_numpy()
    ids = nodes["node_id"].to_numpy()
    for r, g in enumerate(regions):
        before = np.flatnonzero((region_of < 0) & (slot < g.start))
        for tr in np.unique(track[before]).tolist():
            rows = before[track[before] == tr]
            last = rows[np.lexsort((ids[rows], ts[rows]))[-1]]
            out[last] = r
    return out


def _last_on_track(
    nodes: pl.DataFrame, region_of: np.ndarray, offset: np.ndarray, track: np.ndarray
) -> dict[tuple[int, int], int]:
    """``(region, track)`` -> offset of the last node of a period on that track (period 0)."""
    out: dict[tuple[int, int], int] = {}
    ts = nodes["ts"].fill_null(0).to_numpy()
    rows = np.flatnonzero(region_of >= 0)
    for i in rows[np.lexsort((offset[rows], ts[rows]))].tolist():
        out[(int(region_of[i]), int(track[i]))] = int(offset[i])
    return out


def _near(regions: list[_Region], r: int, j: int, *, toward: int, other: int) -> int | None:
    """The target period of recorded period ``j`` of region ``r`` for an edge whose other end sits
    at slot ``toward`` (in region ``other``, or -1): counted from the start when that end is
    before the region, from its end otherwise; None when the target has no such period."""
    g = regions[r]
    before = regions[other].start < g.start if other >= 0 else toward < g.start
    t = j if before else g.target - (g.count - j)
    return t if 0 <= t < g.target else None

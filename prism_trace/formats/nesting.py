"""Nesting of timed events on a track: each event's enclosing parent and depth, vectorised.

Events of one track are ordered by ``(ts, -dur, event_id)``, so a parent always precedes its
children. An event is open from ``ts`` until ``ts + dur`` (an event ending exactly when another
starts does not enclose it). The depth of an event is the number of events open when it starts; its
parent is the nearest preceding event of depth ``depth - 1``. This is what a stack walk gives (pop
every ended event, the top is the parent), computed with sorted searches instead of a Python loop
over events.

``innermost_enclosing`` binds time points (flow arrows) to the innermost event of their track
that encloses them, with a sorted search plus a walk up the parents ``nest_events`` found.

A child that overruns its parent (ends after it, which clock rounding can cause) is treated as
ending with its parent, so that the events after the parent's end are not taken for the child's
children.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

__all__ = ["innermost_enclosing", "nest_events"]

_MAX_PASSES = 64


def nest_events(
    events: pl.DataFrame,
    *,
    by: Sequence[str] = ("track_id",),
    id_col: str = "event_id",
) -> pl.DataFrame:
    """Fill ``parent_id`` and ``depth`` for events, nesting per track.

    Args:
        events: a frame with ``id_col``, the ``by`` columns, ``ts`` and ``dur`` (integers; a null
            ``dur`` counts as 0). Rows with a null ``ts`` or a null ``by`` key get null results.
        by: columns naming one track (add ``rank`` when the frame holds several ranks).
        id_col: the unique event id column; ``parent_id`` refers to it.

    Returns:
        ``events`` in its original row order, with ``parent_id`` (Int64, null at depth 0) and
        ``depth`` (Int32, 0 at the top) added or replaced.
    """
    base = events.drop([c for c in ("parent_id", "depth") if c in events.columns])
    if base.height == 0:
        return base.with_columns(
            pl.lit(None, pl.Int64).alias("parent_id"), pl.lit(None, pl.Int32).alias("depth")
        )
    group = (
        pl.col(by[0]).rank("dense")
        if len(by) == 1
        else pl.struct([pl.col(c) for c in by]).rank("dense")
    )
    work = (
        base.select(
            pl.col(id_col).cast(pl.Int64).alias("_id"),
            group.cast(pl.Int64).alias("_g"),
            pl.col("ts").cast(pl.Int64).alias("_ts"),
            pl.col("dur").cast(pl.Int64).fill_null(0).clip(lower_bound=0).alias("_dur"),
            pl.any_horizontal([pl.col(c).is_null() for c in by]).alias("_nokey"),
        )
        .with_row_index("_row")
        .filter(pl.col("_ts").is_not_null() & ~pl.col("_nokey"))
        .sort(["_g", "_ts", "_dur", "_id"], descending=[False, False, True, False])
    )
    g = work["_g"].to_numpy()
    ts = work["_ts"].to_numpy()
    end = ts + work["_dur"].to_numpy()
    depth, parent = _nest_sorted(g, ts, end)
    ids = work["_id"].to_numpy()
    # Scatter back to the input's row order; rows left out stay null.
    rows = work["_row"].to_numpy()
    has = np.zeros(base.height, dtype=bool)
    has[rows] = True
    out_depth = np.zeros(base.height, dtype=np.int32)
    out_depth[rows] = depth
    out_parent = np.zeros(base.height, dtype=np.int64)
    out_parent[rows] = np.where(parent >= 0, ids[np.maximum(parent, 0)], 0)
    has_parent = np.zeros(base.height, dtype=bool)
    has_parent[rows] = parent >= 0
    return base.with_columns(
        pl.Series("parent_id", out_parent, dtype=pl.Int64).scatter(
            np.flatnonzero(~has_parent), None
        ),
        pl.Series("depth", out_depth, dtype=pl.Int32).scatter(np.flatnonzero(~has), None),
    )


def _nest_sorted(g: np.ndarray, ts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth and parent position for events sorted by (group, ts, -dur); ends clamped to parents."""
    end = end.copy()
    for _ in range(_MAX_PASSES):
        depth, parent = _one_pass(g, ts, end)
        has = parent >= 0
        has[has] = end[parent[has]] > ts[has]  # clamp to a parent only if it encloses the start
        clamped = end.copy()
        clamped[has] = np.minimum(end[has], end[parent[has]])
        if np.array_equal(clamped, end):
            break
        end = clamped
    return depth, parent


def _pack(g: np.ndarray, ts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack (group, time) into int64 keys ordered like the pairs (times made relative first)."""
    lo = int(ts.min())
    span = int(end.max()) - lo + 1
    if (int(g.max()) + 1) * span < 2**62:
        return g * span + (ts - lo), g * span + (end - lo)
    n = len(ts)
    uniq, inv = np.unique(np.concatenate([ts, end]), return_inverse=True)
    m = np.int64(len(uniq) + 1)
    return g * m + inv[:n].astype(np.int64), g * m + inv[n:].astype(np.int64)


def _one_pass(g: np.ndarray, ts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = len(ts)
    pos = np.arange(n, dtype=np.int64)
    gstart = np.searchsorted(g, g, side="left")
    opened = pos - gstart  # events before this one on its track
    k_ts, k_end = _pack(g, ts, end)  # (group, time) as one sortable int64 key
    k_end = np.sort(k_end)
    # Events of the track that have ended by ts (end <= ts), counted over the whole track...
    ended = np.searchsorted(k_end, k_ts, side="right") - gstart
    # ...minus those at or after this one: zero-length events starting at the same ts.
    is_zero = (end == ts).astype(np.int64)
    cz = np.concatenate([[0], np.cumsum(is_zero)])
    run_start = np.searchsorted(k_ts, k_ts, side="left")
    run_end = np.searchsorted(k_ts, k_ts, side="right")
    first_zero = run_end - (cz[run_end] - cz[run_start])
    ended -= run_end - np.maximum(pos, first_zero)
    depth = (opened - ended).astype(np.int64)
    # Parent: the nearest preceding event of the same track with depth - 1, by a sorted search
    # over (track, depth, position) keys.
    levels = np.int64(int(depth.max()) + 2)
    key = (g * levels + depth) * n + pos
    sorted_key = np.sort(key)
    want = (g * levels + (depth - 1)) * n + pos
    at = np.searchsorted(sorted_key, want, side="left") - 1
    found = sorted_key[np.maximum(at, 0)]
    same = (at >= 0) & (found // n == want // n)
    parent = np.where(same, found % n, -1).astype(np.int64)
    parent[depth == 0] = -1
    return depth, parent


def innermost_enclosing(
    events: pl.DataFrame, points: pl.DataFrame, *, id_col: str = "event_id"
) -> pl.Series:
    """For each point, the innermost event of its track with ``ts <= point.ts <= ts + dur``.

    The candidate is the last event (in ``(track, ts, -dur, id)`` order) starting at or before the
    point; while it ends before the point, the candidate becomes its parent. For properly nested
    events this is the enclosing event that started last (ties: the shortest), in
    O((n + m) log n) for n events and m points, instead of a range join.

    Args:
        events: the output of ``nest_events`` for one set of tracks: ``id_col``, ``track_id``,
            ``ts``, ``dur`` and ``parent_id`` (ids of the same frame). Null ``ts`` rows are ignored.
        points: a frame with ``track_id`` and ``ts``.
        id_col: the event id column.

    Returns:
        An Int64 series ``id_col``, one row per point in order; null where no event encloses it.
    """
    m = points.height
    if m == 0 or events.height == 0:
        return pl.Series(id_col, [None] * m, dtype=pl.Int64)
    ev = (
        events.select(
            pl.col(id_col).cast(pl.Int64).alias("_id"),
            pl.col("track_id").cast(pl.Int64).alias("_track"),
            pl.col("ts").cast(pl.Int64).alias("_ts"),
            pl.col("dur").cast(pl.Int64).fill_null(0).clip(lower_bound=0).alias("_dur"),
            pl.col("parent_id").cast(pl.Int64).alias("_parent"),
        )
        .filter(pl.col("_ts").is_not_null() & pl.col("_track").is_not_null())
        .sort(["_track", "_ts", "_dur", "_id"], descending=[False, False, True, False])
    )
    ids = ev["_id"].to_numpy()
    track = ev["_track"].to_numpy()
    ts = ev["_ts"].to_numpy()
    end = ts + ev["_dur"].to_numpy()
    # Parent positions in the sorted arrays (-1 at the top).
    order = np.argsort(ids, kind="stable")
    parent_id = ev["_parent"].fill_null(-1).to_numpy()
    at = np.searchsorted(ids, parent_id, sorter=order)
    at = np.minimum(at, len(ids) - 1)
    parent = np.where((parent_id >= 0) & (ids[order[at]] == parent_id), order[at], -1).astype(
        np.int64
    )
    p_track = points["track_id"].cast(pl.Int64).fill_null(-1).to_numpy()
    p_ts = points["ts"].cast(pl.Int64).to_numpy()
    p_ok = points["ts"].is_not_null().to_numpy() & (p_track >= 0)
    p_ts = np.where(p_ok, p_ts, ts.min())  # any in-range value; never used
    # Position of the last event with (track, ts) <= (point track, point ts).
    tracks = np.unique(np.concatenate([track, p_track]))
    g_ev = np.searchsorted(tracks, track).astype(np.int64)
    g_pt = np.searchsorted(tracks, p_track).astype(np.int64)
    k_ev, k_pt = _pack_two(g_ev, ts, g_pt, p_ts)
    cand = np.searchsorted(k_ev, k_pt, side="right") - 1
    ok = p_ok & (cand >= 0)
    cand = np.where(ok, cand, 0)
    ok &= track[cand] == p_track
    while True:
        walk = ok & (end[cand] < p_ts)
        if not walk.any():
            break
        cand[walk] = parent[cand[walk]]
        ok &= cand >= 0
        cand = np.maximum(cand, 0)
    out = pl.Series(id_col, np.where(ok, ids[cand], 0), dtype=pl.Int64)
    return out.scatter(np.flatnonzero(~ok), None)


def _pack_two(
    g_a: np.ndarray, t_a: np.ndarray, g_b: np.ndarray, t_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Int64 keys ordered like the pairs (group, time), for two sets of pairs on one scale."""
    t = np.concatenate([t_a, t_b])
    k_ts, _ = _pack(np.concatenate([g_a, g_b]), t, t)
    return k_ts[: len(t_a)], k_ts[len(t_a) :]

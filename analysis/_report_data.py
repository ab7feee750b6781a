"""The report's queries: run facts, lane groups, capped timeline events, memory and iterations.

Every function reads the store and returns small polars frames or dicts; the figures are built in
``analysis._report_figures``. Nothing here knows about plotly or HTML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import polars as pl

if TYPE_CHECKING:
    from prism_trace.store import Store

__all__ = [
    "LaneGroup",
    "RunFacts",
    "host_ops",
    "iteration_ancestor",
    "iteration_times",
    "lane_groups",
    "memory_series",
    "rank_ranges",
    "run_facts",
    "timeline_events",
    "timeline_tracks",
]


@dataclass(frozen=True)
class RunFacts:
    """The ``run`` row of a run, with its lineage and a few counts."""

    run_id: int
    name: str
    kind: str
    parent: str | None
    world_size: int | None
    source_format: str | None
    created_at: str | None
    config: dict[str, Any] | None
    ranks: int
    classes: int
    events: int
    iterations: int


@dataclass(frozen=True)
class LaneGroup:
    """One lane group of the timeline: a rank, or an equivalence class drawn from its exemplar."""

    key: int
    rank: int
    members: tuple[int, ...]
    is_class: bool

    @property
    def label(self) -> str:
        """``rank 3``, or ``class 0: ranks 0..4094 step 2 (2048)``."""
        if not self.is_class:
            return f"rank {self.rank}"
        return f"class {self.key}: ranks {rank_ranges(self.members)} ({len(self.members)})"

    @property
    def short(self) -> str:
        """Prefix of the group's lane labels: ``r3`` or ``c0``."""
        return f"c{self.key}" if self.is_class else f"r{self.rank}"


def _rows(store: Store, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    return store.con.execute(sql, params).fetchall()


def _frame(store: Store, sql: str, params: list[Any]) -> pl.DataFrame:
    return store.con.sql(sql, params=params).pl()


def rank_ranges(ranks: tuple[int, ...] | list[int], *, limit: int = 4) -> str:
    """Sorted ranks as compact arithmetic runs: ``0..4094 step 2``, ``1, 3, 8..11``.

    Args:
        ranks: the ranks (any order).
        limit: runs shown before ``...``.

    Returns:
        The text.
    """
    rs = sorted(set(ranks))
    runs: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        step = rs[i + 1] - rs[i] if i + 1 < len(rs) else 1
        while j + 1 < len(rs) and rs[j + 1] - rs[j] == step:
            j += 1
        if j - i >= 2:
            tail = "" if step == 1 else f" step {step}"
            runs.append(f"{rs[i]}..{rs[j]}{tail}")
            i = j + 1
        else:
            runs.append(str(rs[i]))
            i += 1
    if len(runs) > limit:
        runs = [*runs[:limit], "..."]
    return ", ".join(runs)


def run_facts(store: Store, run_id: int) -> RunFacts:
    """The facts of run ``run_id`` shown at the top of the report."""
    row = _rows(
        store,
        "SELECT r.run_id, r.name, r.kind, p.name, r.world_size, r.source_format,"
        " CAST(r.created_at AS VARCHAR), CAST(r.config_json AS VARCHAR),"
        " (SELECT count(*) FROM rank WHERE run_id = $1),"
        " (SELECT count(DISTINCT class_id) FROM rank WHERE run_id = $1),"
        " (SELECT count(*) FROM event WHERE run_id = $1),"
        " (SELECT count(DISTINCT iteration) FROM iteration WHERE run_id = $1)"
        " FROM run r LEFT JOIN run p ON p.run_id = r.parent_run_id WHERE r.run_id = $1",
        [run_id],
    )[0]
    config = json.loads(row[7]) if row[7] else None
    return RunFacts(
        run_id=row[0],
        name=row[1],
        kind=row[2],
        parent=row[3],
        world_size=row[4],
        source_format=row[5],
        created_at=row[6],
        config=config if isinstance(config, dict) else None,
        ranks=row[8],
        classes=row[9],
        events=row[10],
        iterations=row[11],
    )


def iteration_ancestor(store: Store, run_id: int) -> int | None:
    """The nearest ancestor of ``run_id`` (parent, grandparent, ...) that has iteration rows."""
    rows = _rows(
        store,
        "WITH RECURSIVE up(run_id, depth) AS ("
        " SELECT parent_run_id, 1 FROM run WHERE run_id = $1"
        " UNION ALL SELECT r.parent_run_id, u.depth + 1 FROM run r JOIN up u USING (run_id)"
        " WHERE u.depth < 16)"
        " SELECT u.run_id FROM up u WHERE u.run_id IS NOT NULL"
        " AND EXISTS (SELECT 1 FROM iteration i WHERE i.run_id = u.run_id)"
        " ORDER BY u.depth LIMIT 1",
        [run_id],
    )
    return rows[0][0] if rows else None


def lane_groups(store: Store, run_id: int) -> list[LaneGroup]:
    """The run's lane groups, in rank order: one per equivalence class, else one per rank.

    Only groups with at least one timed event are returned; a class is drawn from its lowest
    member that has events (the exemplar of a sliced or emulated run).
    """
    df = _frame(
        store,
        "WITH ev AS (SELECT DISTINCT rank FROM event WHERE run_id = $1 AND ts IS NOT NULL)"
        " SELECT coalesce(r.class_id, r.rank) AS key, r.class_id IS NOT NULL AS is_class,"
        " list(r.rank ORDER BY r.rank) AS members,"
        " min(r.rank) FILTER (WHERE ev.rank IS NOT NULL) AS exemplar"
        " FROM rank r LEFT JOIN ev ON ev.rank = r.rank WHERE r.run_id = $1"
        " GROUP BY ALL HAVING exemplar IS NOT NULL ORDER BY min(r.rank)",
        [run_id],
    )
    return [
        LaneGroup(
            key=int(row["key"]),
            rank=int(row["exemplar"]),
            members=tuple(row["members"]),
            is_class=bool(row["is_class"]),
        )
        for row in df.iter_rows(named=True)
    ]


def timeline_tracks(store: Store, run_id: int, ranks: list[int]) -> pl.DataFrame:
    """Tracks of ``ranks`` that carry timed events: threads first, then streams."""
    return _frame(
        store,
        "SELECT t.rank, t.track_id, t.kind, coalesce(t.name, t.kind || ' ' || t.tid) AS name"
        " FROM track t WHERE t.run_id = $1 AND list_contains($2, t.rank)"
        " AND EXISTS (SELECT 1 FROM event e WHERE e.run_id = t.run_id AND e.rank = t.rank"
        "  AND e.track_id = t.track_id AND e.ts IS NOT NULL)"
        " ORDER BY t.rank, t.kind = 'stream', t.track_id",
        [run_id, ranks],
    )


def timeline_events(
    store: Store, run_id: int, ranks: list[int], *, per_rank: int
) -> tuple[pl.DataFrame, int]:
    """The events drawn for ``ranks``: per rank the shallowest, then longest, ``per_rank``.

    Top-level events always come first, so a capped lane still covers the whole timeline; within
    the deepest level that fits, the longest events are kept.

    Returns:
        The drawn events (rank, track_id, category, name, ts, dur, depth, iteration), ordered by
        depth so nested events draw on top, and the number of timed events of those ranks.
    """
    total = _rows(
        store,
        "SELECT count(*) FROM event WHERE run_id = $1 AND list_contains($2, rank)"
        " AND ts IS NOT NULL",
        [run_id, ranks],
    )[0][0]
    df = _frame(
        store,
        "SELECT rank, track_id, category, name, ts, coalesce(dur, 0) AS dur,"
        " coalesce(depth, 0) AS depth, iteration"
        " FROM event WHERE run_id = $1 AND list_contains($2, rank) AND ts IS NOT NULL"
        " QUALIFY row_number() OVER (PARTITION BY rank"
        "  ORDER BY coalesce(depth, 0), dur DESC NULLS LAST, ts) <= $3"
        " ORDER BY rank, depth, ts",
        [run_id, ranks, per_rank],
    )
    return df, int(total)


def host_ops(store: Store, run_id: int, *, top: int) -> pl.DataFrame:
    """The ``top`` host ops (``cpu_op``) by self time: duration minus their nested events'."""
    return _frame(
        store,
        "WITH child AS (SELECT rank, parent_id, sum(dur) AS ns FROM event"
        "  WHERE run_id = $1 AND parent_id IS NOT NULL GROUP BY ALL)"
        " SELECT e.name, count(*) AS calls, count(DISTINCT e.rank) AS ranks,"
        " sum(e.dur - coalesce(c.ns, 0)) AS self_ns, sum(e.dur) AS total_ns"
        " FROM event e LEFT JOIN child c ON c.rank = e.rank AND c.parent_id = e.event_id"
        " WHERE e.run_id = $1 AND e.category = 'cpu_op' AND e.dur IS NOT NULL"
        " GROUP BY e.name ORDER BY self_ns DESC, e.name LIMIT $2",
        [run_id, top],
    )


def iteration_times(store: Store, run_id: int) -> pl.DataFrame:
    """Per iteration: ranks, min/mean/max duration over ranks and the slowest rank."""
    return _frame(
        store,
        "SELECT iteration, count(*) AS ranks, min(dur) AS min_ns, avg(dur) AS mean_ns,"
        " max(dur) AS max_ns, arg_max(rank, dur) AS slowest_rank"
        " FROM iteration WHERE run_id = $1 GROUP BY iteration ORDER BY iteration",
        [run_id],
    )


def memory_series(
    store: Store, run_id: int, *, max_lines: int, points: int
) -> tuple[pl.DataFrame, pl.DataFrame, int]:
    """Allocated bytes over time per (rank, device), bucketed, and each line's exact peak.

    The ``max_lines`` (rank, device) pairs with the highest peaks are kept. Each is cut into
    ``points`` equal time buckets, and a bucket keeps its largest ``total_allocated`` (an envelope
    that never hides the peak).

    Returns:
        The series (rank, device, ts, bytes), the peaks (rank, device, ts, bytes) and the number
        of (rank, device) pairs with allocator events.
    """
    peaks = _frame(
        store,
        "SELECT rank, coalesce(device_type, '?') || ':' || coalesce(device_id, -1) AS device,"
        " arg_max(ts, total_allocated) AS ts, max(total_allocated) AS bytes,"
        " min(ts) AS t0, max(ts) AS t1"
        " FROM memory WHERE run_id = $1 AND total_allocated IS NOT NULL GROUP BY ALL"
        " ORDER BY bytes DESC, rank",
        [run_id],
    )
    lines = peaks.height
    peaks = peaks.head(max_lines)
    if peaks.is_empty():
        return pl.DataFrame(), peaks, 0
    series = _frame(
        store,
        "WITH p AS (SELECT * FROM (SELECT unnest($2) AS rank, unnest($3) AS device,"
        "  unnest($4) AS t0, unnest($5) AS t1)),"
        " m AS (SELECT m.rank, coalesce(m.device_type, '?') || ':' || coalesce(m.device_id, -1)"
        "  AS device, m.ts, m.total_allocated FROM memory m"
        "  WHERE m.run_id = $1 AND m.total_allocated IS NOT NULL)"
        " SELECT m.rank, m.device,"
        " least(floor((m.ts - p.t0) * $6 / greatest(p.t1 - p.t0, 1)), $6 - 1) AS bucket,"
        " arg_max(m.ts, m.total_allocated) AS ts, max(m.total_allocated) AS bytes"
        " FROM m JOIN p USING (rank, device) GROUP BY ALL ORDER BY m.rank, m.device, ts",
        [
            run_id,
            peaks["rank"].to_list(),
            peaks["device"].to_list(),
            peaks["t0"].to_list(),
            peaks["t1"].to_list(),
            points,
        ],
    )
    return series.drop("bucket"), peaks.drop("t0", "t1"), lines

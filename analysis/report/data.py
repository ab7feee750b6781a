"""The report's queries: run facts, lane groups, capped timeline events, memory and iterations.

Every function reads the store and returns small polars frames or dicts; the figures are built in
``analysis._report_figures``. Nothing here knows about plotly or HTML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import polars as pl

from prism_trace.ranks import format_ranks

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = [
    "LaneGroup",
    "RunFacts",
    "host_ops",
    "iteration_ancestor",
    "iteration_times",
    "lane_groups",
    "lane_quotas",
    "memory_series",
    "memory_source",
    "rank_ranges",
    "run_facts",
    "sample_groups",
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
    """Sorted ranks as compact arithmetic runs: ``0..4094 step 2``, ``1, 3, 8..11``."""
    return format_ranks(ranks, stride=" step ", sep=", ", limit=limit)


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
    for link in store.run_ancestry(run_id)[1:]:
        if _rows(store, "SELECT 1 FROM iteration WHERE run_id = $1 LIMIT 1", [link.run_id]):
            return link.run_id
    return None


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


def sample_groups(store: Store, run_id: int, groups: list[LaneGroup], k: int) -> list[LaneGroup]:
    """At most ``k`` lane groups spread over the pipeline stages and the rank range.

    Taking the first ``k`` in rank order draws one stage only (a 256-group variance run showed 32
    groups of stage 0). Groups are split by their exemplar's stage (``rank.pp``; 0 when
    unknown), each stage gets an equal share (a stage with fewer groups gives its spare share to
    the others), and within a stage the picks are evenly spaced in rank order.

    Returns:
        The chosen groups, in rank order.
    """
    if len(groups) <= k:
        return groups
    stage = dict(
        _rows(
            store,
            "SELECT rank, coalesce(pp, 0) FROM rank WHERE run_id = $1 AND list_contains($2, rank)",
            [run_id, [g.rank for g in groups]],
        )
    )
    by_stage: dict[int, list[LaneGroup]] = {}
    for g in groups:
        by_stage.setdefault(int(stage.get(g.rank, 0)), []).append(g)
    stages = sorted(by_stage, key=lambda st: len(by_stage[st]))
    chosen: list[LaneGroup] = []
    left = k
    for i, st in enumerate(stages):
        members = by_stage[st]
        take = min(len(members), left // (len(stages) - i))
        if take:
            idx = {round(j * (len(members) - 1) / max(take - 1, 1)) for j in range(take)}
            chosen += [members[j] for j in sorted(idx)]
        left -= take
    return sorted(chosen, key=lambda g: g.rank)


def timeline_tracks(store: Store, run_id: int, ranks: list[int]) -> pl.DataFrame:
    """Tracks of ``ranks`` that carry timed events: threads first, then streams.

    A lane is named after its thread name or stream id: ``stream 7``, ``thread 8583 (python)``.
    Kineto writes some thread ids as negative 32-bit numbers; they are shown unsigned, as the OS
    reports them.
    """
    return _frame(
        store,
        "SELECT t.rank, t.track_id, t.kind,"
        " CASE WHEN t.kind = 'stream' THEN 'stream ' || t.tid"
        "  || coalesce(' · ' || nullif(regexp_replace(t.name, '^stream -?[0-9]+ ?', ''), ''), '')"
        "  WHEN t.tid < 0 THEN 'thread ' || (t.tid + 4294967296)"
        "  || coalesce(' (' || nullif(regexp_extract(t.name, '\\(([^)]*)\\)$', 1), '') || ')', '')"
        "  ELSE coalesce(t.name, t.kind || ' ' || t.tid) END AS name"
        " FROM track t WHERE t.run_id = $1 AND list_contains($2, t.rank)"
        " AND EXISTS (SELECT 1 FROM event e WHERE e.run_id = t.run_id AND e.rank = t.rank"
        "  AND e.track_id = t.track_id AND e.ts IS NOT NULL)"
        " ORDER BY t.rank, t.kind = 'stream', t.track_id",
        [run_id, ranks],
    )


def lane_quotas(counts: pl.DataFrame, per_rank: int) -> pl.DataFrame:
    """Events kept per lane so that no lane vanishes: ``per_rank`` shared by water-filling.

    Each lane of a rank gets the same quota ``q`` (or all its events, if fewer), with ``q`` the
    largest value whose total fits ``per_rank``; a lane always keeps at least one event.

    Args:
        counts: ``rank, track_id, n`` (events per lane).
        per_rank: events drawn per rank.

    Returns:
        ``rank, track_id, quota``.
    """
    out: list[tuple[int, int, int]] = []
    for (rank,), part in counts.sort("n").partition_by("rank", as_dict=True).items():
        ns = part["n"].to_list()
        left, lanes = per_rank, len(ns)
        q = 0
        for i, n in enumerate(ns):
            fair = left // (lanes - i)
            if n <= fair:
                left -= n
                continue
            q = max(fair, 1)
            break
        else:
            q = max(ns, default=1)
        out += [
            (int(rank), int(t), int(min(n, q))) for t, n in zip(part["track_id"], ns, strict=True)
        ]  # type: ignore[arg-type]
    return pl.DataFrame(
        out, schema={"rank": pl.Int32, "track_id": pl.Int32, "quota": pl.Int64}, orient="row"
    )


def timeline_events(
    store: Store, run_id: int, ranks: list[int], *, per_rank: int
) -> tuple[pl.DataFrame, int]:
    """The events drawn for ``ranks``: per rank ``per_rank``, shared fairly among its lanes.

    Within a lane, top-level events come first, so a capped lane still covers the whole
    timeline; within the deepest level that fits, the longest events are kept. Every lane
    (thread or stream) keeps events (``lane_quotas``): a busy host thread cannot crowd a stream
    of short kernels out. NCCL kernels get the category ``comm kernel`` so that they are drawn
    apart from compute kernels.

    Returns:
        The drawn events (rank, track_id, category, name, ts, dur, depth, iteration), ordered by
        depth so nested events draw on top, and the number of timed events of those ranks.
    """
    counts = _frame(
        store,
        "SELECT rank, track_id, count(*) AS n FROM event WHERE run_id = $1"
        " AND list_contains($2, rank) AND ts IS NOT NULL GROUP BY ALL",
        [run_id, ranks],
    )
    total = int(counts["n"].sum()) if counts.height else 0
    quotas = lane_quotas(counts.drop_nulls("track_id"), per_rank)
    df = _frame(
        store,
        "WITH q AS (SELECT unnest($3) AS rank, unnest($4) AS track_id, unnest($5) AS quota)"
        " SELECT e.rank, e.track_id,"
        " CASE WHEN e.category = 'kernel' AND regexp_matches(e.name, '^nccl')"
        "  THEN 'comm kernel' ELSE e.category END AS category,"
        " e.name, e.ts, coalesce(e.dur, 0) AS dur, coalesce(e.depth, 0) AS depth, e.iteration"
        " FROM event e JOIN q ON q.rank = e.rank AND q.track_id = e.track_id"
        " WHERE e.run_id = $1 AND list_contains($2, e.rank) AND e.ts IS NOT NULL"
        " QUALIFY row_number() OVER (PARTITION BY e.rank, e.track_id"
        "  ORDER BY coalesce(e.depth, 0), e.dur DESC NULLS LAST, e.ts) <= any_value(q.quota)"
        "  OVER (PARTITION BY e.rank, e.track_id)"
        " ORDER BY e.rank, depth, e.ts",
        [
            run_id,
            ranks,
            quotas["rank"].to_list(),
            quotas["track_id"].to_list(),
            quotas["quota"].to_list(),
        ],
    )
    return df, total


def host_ops(store: Store, run_id: int, *, top: int) -> pl.DataFrame:
    """The ``top`` host ops by self time: duration minus their nested events'.

    Host ops are ``cpu_op`` events and, on op timelines, the timeline's ops (categories
    ``compute`` and ``comm``), so a Megatron-style run lists its forward/backward and p2p ops.
    A class exemplar's ops count once per rank of its class (the job's total, as the kernels).
    """
    return _frame(
        store,
        "WITH child AS (SELECT rank, parent_id, sum(dur) AS ns FROM event"
        "  WHERE run_id = $1 AND parent_id IS NOT NULL GROUP BY ALL),"
        " w AS (SELECT r.rank, CASE WHEN r.class_id IS NULL THEN 1 ELSE count(*) OVER"
        "  (PARTITION BY r.class_id) END AS weight FROM rank r WHERE r.run_id = $1)"
        " SELECT e.name, sum(coalesce(w.weight, 1)) AS calls,"
        " count(DISTINCT e.rank) AS ranks,"
        " sum((e.dur - coalesce(c.ns, 0)) * coalesce(w.weight, 1)) AS self_ns,"
        " sum(e.dur * coalesce(w.weight, 1)) AS total_ns"
        " FROM event e LEFT JOIN child c ON c.rank = e.rank AND c.parent_id = e.event_id"
        " LEFT JOIN w ON w.rank = e.rank"
        " WHERE e.run_id = $1 AND e.category IN ('cpu_op', 'compute', 'comm')"
        " AND e.dur IS NOT NULL"
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


def memory_source(store: Store, run_id: int, ranks: list[int]) -> tuple[str, pl.DataFrame | None]:
    """Where the memory chart's rows come from: the allocator events, or the host ET.

    A rank recorded without ``profile_memory`` has no ``[memory]`` rows, but its host ET names
    every tensor, so ``replay.et_memory`` rebuilds its allocations (the emulator does the same).

    Args:
        store: the store.
        run_id: the run.
        ranks: ranks to derive from the host ET when the run has no allocator events.

    Returns:
        ``("allocator", None)`` when the run has ``memory`` rows; ``("host ET", rows)`` when they
        were derived (rows with ``memory``'s columns); ``("none", None)`` otherwise.
    """
    if _rows(store, "SELECT count(*) > 0 FROM memory WHERE run_id = $1", [run_id])[0][0]:
        return "allocator", None
    has_et = _rows(store, "SELECT count(*) > 0 FROM et_op WHERE run_id = $1", [run_id])[0][0]
    if not has_et or not ranks:
        return "none", None
    from prism_trace.replay.memory.host_et import et_memory

    rows = et_memory(store.con, run_id, ranks)
    return ("host ET", rows) if rows.height else ("none", None)


def memory_series(
    store: Store,
    run_id: int,
    *,
    max_lines: int,
    points: int,
    derived: pl.DataFrame | None = None,
) -> tuple[pl.DataFrame, pl.DataFrame, int]:
    """Allocated bytes over time per lane group (rank, or equivalence class) and device.

    A run of thousands of ranks is drawn per class: a class's line is the largest allocation
    of its members that have rows (the exemplar of a sliced or emulated run) in each bucket, so a
    class reads as one line instead of a tangle. The ``max_lines`` (group, device) lines with the
    highest peaks are kept, each cut into ``points`` equal time buckets where a bucket keeps its
    largest ``total_allocated`` (an envelope that never hides the peak).

    Args:
        store: the store.
        run_id: the run.
        max_lines: lines kept.
        points: buckets per line.
        derived: rows with ``memory``'s columns to use instead of the ``memory`` table (the host
            ET's, ``memory_source``).

    Returns:
        The series (group, label, device, ts, bytes), the peaks (group, label, device, ts, bytes,
        rank: the member at the peak) and the number of (group, device) lines.
    """
    if derived is not None:
        store.con.register("_prism_report_memory", derived)
        source = "(SELECT $1 AS run_id, * FROM _prism_report_memory)"
    else:
        source = "memory"
    try:
        peaks = _frame(
            store,
            f"WITH m AS (SELECT m.rank, coalesce(r.class_id, m.rank) AS grp,"
            " r.class_id IS NOT NULL AS is_class,"
            " coalesce(m.device_type, '?') || ':' || coalesce(m.device_id, -1) AS device,"
            f" m.ts, m.total_allocated FROM {source} m"
            " LEFT JOIN rank r ON r.run_id = m.run_id AND r.rank = m.rank"
            " WHERE m.run_id = $1 AND m.total_allocated IS NOT NULL)"
            " SELECT grp, any_value(is_class) AS is_class, device,"
            " arg_max(ts, total_allocated) AS ts, max(total_allocated) AS bytes,"
            " arg_max(rank, total_allocated) AS rank, min(ts) AS t0, max(ts) AS t1"
            " FROM m GROUP BY ALL ORDER BY bytes DESC, grp",
            [run_id],
        )
        lines = peaks.height
        peaks = peaks.head(max_lines)
        if peaks.is_empty():
            return pl.DataFrame(), peaks, 0
        series = _frame(
            store,
            "WITH p AS (SELECT * FROM (SELECT unnest($2) AS grp, unnest($3) AS device,"
            "  unnest($4) AS t0, unnest($5) AS t1)),"
            " m AS (SELECT coalesce(r.class_id, m.rank) AS grp,"
            "  coalesce(m.device_type, '?') || ':' || coalesce(m.device_id, -1) AS device,"
            f"  m.ts, m.total_allocated FROM {source} m"
            "  LEFT JOIN rank r ON r.run_id = m.run_id AND r.rank = m.rank"
            "  WHERE m.run_id = $1 AND m.total_allocated IS NOT NULL)"
            " SELECT m.grp, m.device,"
            " least(floor((m.ts - p.t0) * $6 / greatest(p.t1 - p.t0, 1)), $6 - 1) AS bucket,"
            " arg_max(m.ts, m.total_allocated) AS ts, max(m.total_allocated) AS bytes"
            " FROM m JOIN p USING (grp, device) GROUP BY ALL ORDER BY m.grp, m.device, ts",
            [
                run_id,
                peaks["grp"].to_list(),
                peaks["device"].to_list(),
                peaks["t0"].to_list(),
                peaks["t1"].to_list(),
                points,
            ],
        )
    finally:
        if derived is not None:
            store.con.unregister("_prism_report_memory")
    return series.drop("bucket"), peaks.drop("t0", "t1"), lines

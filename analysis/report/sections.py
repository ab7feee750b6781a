"""The report's sections: each queries the store and builds its figures, text and notes.

One function per section of the page (timeline, temporal breakdown, top ops, collective waits,
iteration time, run diff, memory), each capped by ``ReportLimits`` so a report stays small for
any run size; ``html.write_report`` lays them out in a page.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
import polars as pl
from prism_trace.analysis.breakdown import kernels, temporal
from prism_trace.analysis.diff import run_diff
from prism_trace.analysis.report import data
from prism_trace.analysis.report import figures as figs
from prism_trace.analysis.stragglers import collective_waits, nothing_to_rank

from prism_trace.errors import PrismError

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = [
    "ReportLimits",
    "Section",
    "breakdown_section",
    "diff_section",
    "iterations_section",
    "memory_section",
    "timeline_section",
    "top_ops_section",
    "waits_section",
]


@dataclass(frozen=True, kw_only=True)
class ReportLimits:
    """Caps that keep a report small and fast for any run size.

    Attributes:
        timeline_events: events drawn in the timeline over all lane groups; each group gets an
            equal share, filled shallowest first, then longest (so top-level ops always show).
        timeline_groups: lane groups (ranks or classes) drawn; the rest are listed as omitted.
        top_ops: bars in the top-kernels and top-host-ops charts.
        breakdown_rows: ranks (or classes) in the temporal breakdown.
        heatmap_cells: ranks x instances in the wait heatmap; the instances with the largest
            total wait are kept first.
        memory_lines: (rank, device) lines in the memory chart, highest peak first.
        memory_points: time buckets per memory line (a bucket keeps its maximum).
    """

    timeline_events: int = 30_000
    timeline_groups: int = 32
    top_ops: int = 15
    breakdown_rows: int = 1024
    heatmap_cells: int = 100_000
    memory_lines: int = 16
    memory_points: int = 1500


@dataclass
class Section:
    """One section of the page: its anchor, heading and one-line explanation, then its figures
    (drawn in order) and any HTML below them (a table, or why there is nothing to draw)."""

    key: str
    title: str
    what: str
    figs: list[go.Figure] = field(default_factory=list)
    html: str = ""


def timeline_section(
    store: Store, run_id: int, t0: int, limits: ReportLimits, notes: list[str]
) -> tuple[Section, int, int, int]:
    """The timeline: at most ``limits.timeline_groups`` lane groups, their events shared out
    under ``limits.timeline_events``; times are drawn relative to ``t0``.

    Returns:
        The section, the events of the drawn groups, the events drawn, and the groups drawn
        (what ``ReportSummary`` reports).
    """
    groups_all = data.lane_groups(store, run_id)
    groups = data.sample_groups(store, run_id, groups_all, limits.timeline_groups)
    sec = Section(
        "timeline",
        "Timeline",
        "One lane per host thread and device stream; nested events are drawn narrower on top of"
        " their parents. Zoom with the mouse, hover a bar for the op. The menu at the top right"
        " shows one rank (or class) alone.",
    )
    if not groups:
        sec.html = "<p class='what'>No timed events in this run.</p>"
        return sec, 0, 0, 0
    if len(groups_all) > len(groups):
        drawn = {g.rank for g in groups}
        omitted = [g for g in groups_all if g.rank not in drawn]
        notes.append(
            f"timeline: {len(groups)} of {len(groups_all)} lane groups drawn, spread over the"
            " stages and ranks; omitted "
            + ", ".join(g.label for g in omitted[:8])
            + (" ..." if len(omitted) > 8 else "")
        )
    if any(g.is_class for g in groups):
        members = sum(len(g.members) for g in groups_all)
        notes.append(
            f"timeline: {len(groups_all)} equivalence classes stand for {members} ranks; each"
            " class is drawn from its exemplar's events"
        )
    ranks = [g.rank for g in groups]
    per_rank = max(limits.timeline_events // len(ranks), 1)
    events, total = data.timeline_events(store, run_id, ranks, per_rank=per_rank)
    if events.height < total:
        notes.append(
            f"timeline: {events.height} of {total} events drawn (per rank at most {per_rank},"
            " shared among its lanes so that every lane keeps events; shallowest first, then"
            " longest)"
        )
    tracks = data.timeline_tracks(store, run_id, ranks)
    sec.figs = [figs.timeline_figure(groups, tracks, events, t0)]
    return sec, total, events.height, len(groups)


def breakdown_section(
    store: Store, run: str, groups: dict[int, data.LaneGroup], limits: ReportLimits
) -> Section:
    """The temporal breakdown per rank, or per class exemplar (labelled by its class) when the
    run has classes."""
    sec = Section(
        "temporal",
        "Temporal breakdown",
        "Where each rank's iteration windows go (analysis.temporal): computation, exposed"
        " communication, memory copies, other device ops and idle time.",
    )
    df = temporal(store, run)
    if groups and any(g.is_class for g in groups.values()):
        df = df.filter(pl.col("rank").is_in(list(groups)))
        labels = [groups[r].label for r in df["rank"].to_list()]
    else:
        labels = [f"rank {r}" for r in df["rank"].to_list()]
    if df.is_empty():
        sec.html = "<p class='what'>No iteration windows.</p>"
        return sec
    df, labels = df.head(limits.breakdown_rows), labels[: limits.breakdown_rows]
    sec.figs = [figs.temporal_figure(df, [figs.esc(x, limit=60) for x in labels])]
    return sec


def _weighted_kernels(
    store: Store, run: str, groups: dict[int, data.LaneGroup], top: int
) -> tuple[pl.DataFrame, int]:
    """Kernel totals over the whole job: each stored rank's kernels weighted by the ranks it
    stands for (its class size; 1 for a rank without a class), the ``top`` largest.

    Returns:
        ``kernel_type, name, calls, total_ns`` largest first, and the ranks represented.
    """
    per_rank = kernels(store, run, per_rank=True)
    if per_rank.is_empty():
        return per_rank, 0
    weight = pl.DataFrame(
        {
            "rank": list(groups),
            "weight": [len(g.members) if g.is_class else 1 for g in groups.values()],
        },
        schema={"rank": per_rank.schema["rank"], "weight": pl.Int64},
    )
    df = per_rank.join(weight, on="rank", how="left").with_columns(pl.col("weight").fill_null(1))
    represented = int(df.group_by("rank").agg(pl.col("weight").first())["weight"].sum())
    out = (
        df.group_by("kernel_type", "name")
        .agg(
            (pl.col("calls") * pl.col("weight")).sum().alias("calls"),
            (pl.col("total_ns") * pl.col("weight")).sum().alias("total_ns"),
        )
        .sort("total_ns", "name", descending=[True, False])
        .head(top)
    )
    return out, represented


def top_ops_section(
    store: Store,
    run: str,
    run_id: int,
    groups: dict[int, data.LaneGroup],
    limits: ReportLimits,
    scope: str,
) -> Section:
    """Top device kernels, weighted by class size, and top host ops by self time; ``scope``
    says in the host chart's title which ranks the totals cover."""
    sec = Section(
        "ops",
        "Top kernels and ops",
        "Device kernels by total time over the job (analysis.kernels; a class exemplar counts"
        " once per rank of its class), and host ops by self time (their duration minus the"
        " events nested in them).",
    )
    parts: list[go.Figure] = []
    kdf, represented = _weighted_kernels(store, run, groups, limits.top_ops)
    if kdf.height:
        weighted = any(g.is_class for g in groups.values())
        title = (
            f"Top device kernels (total time over {represented} ranks, class exemplars weighted"
            " by class size)"
            if weighted
            else "Top device kernels (total time over all ranks)"
        )
        parts.append(figs.kernels_figure(kdf, title=title))
    hdf = data.host_ops(store, run_id, top=limits.top_ops)
    if hdf.height:
        parts.append(figs.host_ops_figure(hdf, scope=scope))
    if not parts:
        sec.html = "<p class='what'>No kernels or host ops.</p>"
        return sec
    sec.figs = parts
    return sec


def waits_section(
    store: Store,
    run: str,
    groups: dict[int, data.LaneGroup],
    limits: ReportLimits,
    notes: list[str],
) -> Section:
    """Collective waits per instance and participant as a heatmap, then, for an emulated
    run, every rank of the world per step (``rank_step``)."""
    sec = Section(
        "waits",
        "Collective waits",
        "For every communication instance (collective: group and sequence number; p2p: also"
        " the link) and participant, the time it waited for the last rank to arrive"
        " (analysis.collective_waits; an arrival is the kernel's start when there is one). A"
        " sliced or emulated run has one row per class.",
    )
    df = collective_waits(store, run)
    if df.is_empty():
        sec.html = "<p class='what'>No collectives.</p>"
        return sec
    unranked = nothing_to_rank(store, run)
    if unranked is not None:
        # Every cell would be 0 (no instance has a second participant to wait for): a blank
        # map that reads as "no waiting". Say why there is nothing to draw instead.
        sec.html = f"<p class='what'>No waits to show: {html.escape(unranked)}.</p>"
        notes.append(f"collective waits: none to show ({unranked})")
        every = _rank_step_heatmap(store, run, limits, notes)
        if every is not None:
            sec.figs = [every]
        return sec
    keys = ["group_id", "seq", "link"]
    inst = (
        df.group_by(keys)
        .agg(pl.col("kind").first(), pl.col("wait_ns").sum().alias("total"))
        .sort(keys)
    )
    ranks = sorted(set(df["rank"].to_list()))
    max_inst = max(limits.heatmap_cells // max(len(ranks), 1), 1)
    if inst.height > max_inst:
        notes.append(
            f"collective waits: {max_inst} of {inst.height} instances shown (largest total wait)"
        )
        inst = inst.sort("total", descending=True).head(max_inst).sort(keys)
    inst = inst.with_row_index("col")
    cells = df.join(inst.select(*keys, "col"), on=keys)
    row_of = {r: i for i, r in enumerate(ranks)}
    z = np.full((len(ranks), inst.height), np.nan)
    z[
        np.array([row_of[r] for r in cells["rank"].to_list()], dtype=np.int64),
        cells["col"].to_numpy().astype(np.int64),
    ] = cells["wait_ns"].cast(pl.Float64).to_numpy() / 1e3
    labels = [
        f"g{g}#{s}{' ' + figs.esc(lk) if lk else ''} {figs.esc(k)}"
        for g, s, lk, k in zip(
            inst["group_id"], inst["seq"], inst["link"], inst["kind"], strict=True
        )
    ]

    def rank_label(r: int) -> str:
        g = groups.get(r)
        return figs.esc(g.label, limit=60) if g is not None and g.is_class else f"rank {r}"

    sec.figs = [figs.wait_heatmap(z, [rank_label(r) for r in ranks], labels)]
    every = _rank_step_heatmap(store, run, limits, notes)
    if every is not None:
        sec.what += (
            " Below, every rank of the world per step, from the rank_step table (an emulated"
            " run: the distinct replicas included): its waits summed over its calls of the step."
        )
        sec.figs.append(every)
    return sec


def _rank_step_heatmap(
    store: Store, run: str, limits: ReportLimits, notes: list[str]
) -> go.Figure | None:
    """Ranks x steps of an emulated run's ``rank_step`` waits (None without rows); the ranks
    that waited longest in all are kept first when the cells exceed the limit."""
    run_id = store.require_run(run)
    df = store.con.sql(
        "SELECT rank, iteration, wait_ns FROM rank_step WHERE run_id = $1",
        params=[run_id],
    ).pl()
    if df.is_empty():
        return None
    steps = sorted(set(df["iteration"].to_list()))
    per_rank = df.group_by("rank").agg(pl.col("wait_ns").sum().alias("total"))
    max_ranks = max(limits.heatmap_cells // max(len(steps), 1), 1)
    if per_rank.height > max_ranks:
        notes.append(
            f"waits per rank (rank_step): {max_ranks} of {per_rank.height} ranks shown"
            " (largest total wait)"
        )
        per_rank = per_rank.sort("total", "rank", descending=[True, False]).head(max_ranks)
    ranks = sorted(per_rank["rank"].to_list())
    df = df.filter(pl.col("rank").is_in(ranks))
    row_of = {r: i for i, r in enumerate(ranks)}
    col_of = {it: i for i, it in enumerate(steps)}
    z = np.full((len(ranks), len(steps)), np.nan)
    z[
        np.array([row_of[r] for r in df["rank"].to_list()], dtype=np.int64),
        np.array([col_of[i] for i in df["iteration"].to_list()], dtype=np.int64),
    ] = df["wait_ns"].cast(pl.Float64).to_numpy() / 1e3
    return figs.wait_heatmap(z, [f"rank {r}" for r in ranks], [f"step {i}" for i in steps])


def iterations_section(
    store: Store, facts: data.RunFacts, compare: str | None, notes: list[str]
) -> tuple[Section, str | None]:
    """Iteration times of this run next to the compared one, with a table of their difference.

    Returns:
        The section and the run compared with: ``compare``, or by default an emulated or
        replayed run's nearest ancestor with iterations (None when there is none).
    """
    sec = Section(
        "iterations",
        "Iteration time",
        "Per iteration, the slowest rank's step time (bars) and the mean over ranks (diamonds),"
        " next to the compared run (the recorded run an emulated run came from, or --compare).",
    )
    runs: list[tuple[str, pl.DataFrame]] = []
    other: str | None = compare
    if other is None and facts.kind in ("emulated", "replayed"):
        anc = data.iteration_ancestor(store, facts.run_id)
        if anc is not None:
            other = store.con.execute("SELECT name FROM run WHERE run_id = $1", [anc]).fetchall()[
                0
            ][0]
    mine = data.iteration_times(store, facts.run_id)
    if other is not None:
        theirs = data.iteration_times(store, store.require_run(other))
        runs.append((other, theirs))
    runs.append((facts.name, mine))
    runs = [(n, d) for n, d in runs if d.height]
    if not runs:
        sec.html = "<p class='what'>No iterations.</p>"
        return sec, other
    sec.figs = [figs.iteration_figure(runs)]
    if other is not None and len(runs) == 2:
        joined = runs[0][1].join(runs[1][1], on="iteration", suffix="_b")
        rows = []
        for r in joined.iter_rows(named=True):
            a, b = r["max_ns"], r["max_ns_b"]
            err = (b - a) / a * 100 if a else float("nan")
            rows.append(
                f"<tr><td>{r['iteration']}</td><td>{a / 1e6:.3g}</td><td>{b / 1e6:.3g}</td>"
                f"<td>{err:+.3g} %</td></tr>"
            )
        if rows:
            sec.html = (
                "<table class='facts'><tr><th>iteration</th>"
                f"<th>{html.escape(other)} max ms</th><th>{html.escape(facts.name)} max ms</th>"
                "<th>difference</th></tr>" + "".join(rows) + "</table>"
            )
        else:
            notes.append(f"iterations: no iteration numbers in common with {other!r}")
    return sec, other


def _frame_table(df: pl.DataFrame, columns: list[str], max_rows: int = 10) -> str:
    """A small HTML table of ``columns`` of ``df``, every cell escaped; ``*_ns`` columns are
    shown in ms with 3 significant digits."""
    cols = [c for c in columns if c in df.columns]
    head = "".join(
        f"<th>{html.escape(c[:-3] + ' (ms)' if c.endswith('_ns') else c)}</th>" for c in cols
    )

    def cell(col: str, v: object) -> str:
        if col.endswith("_ns") and isinstance(v, int | float):
            return figs.ms_text(float(v)).removesuffix(" ms")
        return str(v)

    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(cell(c, v))}</td>" for c, v in zip(cols, row, strict=True))
        + "</tr>"
        for row in df.select(cols).head(max_rows).iter_rows()
    )
    return f"<table class='facts'><tr>{head}</tr>{body}</table>"


def diff_section(store: Store, other: str, run: str, notes: list[str]) -> Section:
    """Run diff against the compared run: where the timelines diverge and which ops explain it."""
    sec = Section(
        "diff",
        "Run diff",
        f"This run minus {other!r}: the first op per iteration whose start shifted beyond 1 % of"
        " its iteration, and the ops that contribute most to the difference.",
    )
    try:
        d = run_diff(store, other, run)
    except PrismError as exc:
        notes.append(f"run diff with {other!r}: {exc}")
        sec.html = "<p class='what'>No rank-iteration in common with the compared run.</p>"
        return sec
    sec.html = (
        f"<p class='what'>{d.matched_ops} ops aligned ({html.escape(d.alignment)}).</p>"
        "<h3>First divergence per iteration</h3>"
        + _frame_table(
            d.divergence, ["iteration", "rank", "name", "ordinal", "shift_ns", "threshold_ns"]
        )
        + "<h3>Top contributors</h3>"
        + _frame_table(
            d.contributors, ["name", "ops", "a_ns", "b_ns", "dur_diff_ns", "mean_shift_ns"]
        )
    )
    return sec


def memory_section(
    store: Store,
    run_id: int,
    t0: int,
    groups: dict[int, data.LaneGroup],
    limits: ReportLimits,
    notes: list[str],
) -> Section:
    """Allocated bytes over time per (rank or class, device), at most ``limits.memory_lines``
    lines, from allocator events or else derived from the host ET."""
    sec = Section(
        "memory",
        "Memory",
        "Allocated bytes over time per rank (or class) and device, the peak of each line"
        " marked: from the allocator events, or, for ranks recorded without them, derived from"
        " the host execution trace's tensors (replay.et_memory).",
    )
    source, derived = data.memory_source(store, run_id, sorted(groups)[: limits.memory_lines])
    if source == "none":
        sec.html = "<p class='what'>No allocator events and no host ET in this run.</p>"
        return sec
    series, peaks, lines = data.memory_series(
        store, run_id, max_lines=limits.memory_lines, points=limits.memory_points, derived=derived
    )
    if peaks.is_empty():
        sec.html = "<p class='what'>No allocator events in this run.</p>"
        return sec
    if source == "host ET":
        notes.append("memory: derived from the host execution trace (no allocator events)")
    if lines > peaks.height:
        notes.append(f"memory: {peaks.height} of {lines} (rank or class, device) lines shown")

    class_label = {g.key: g.label for g in groups.values() if g.is_class}
    peaks = peaks.with_columns(
        pl.Series(
            "label",
            [
                class_label.get(g, f"class {g}") if c else f"rank {g}"
                for g, c in zip(peaks["grp"], peaks["is_class"], strict=True)
            ],
            dtype=pl.Utf8,
        )
    )
    sec.figs = [figs.memory_figure(series, peaks, t0)]
    return sec

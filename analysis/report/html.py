"""The HTML report of one run: timeline, breakdowns, collective waits, iteration times, memory.

``write_report`` writes one self-contained file (plotly.js embedded once, no network) that opens
in any browser. It works on every run kind: a sliced or emulated run of thousands of ranks is
drawn one lane group per equivalence class (``rank.class_id``), from its exemplar's events, with
a drop-down to show one group alone. See docs/report.md.
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go
import polars as pl
from prism_trace.analysis.breakdown import kernels, temporal
from prism_trace.analysis.report import data
from prism_trace.analysis.report import figures as figs
from prism_trace.analysis.stragglers import collective_waits

from prism_trace.errors import PrismError
from prism_trace.outputs import output_file

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["DRAWN_JS", "ReportLimits", "ReportSummary", "write_report"]

DRAWN_JS = (
    "() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
    ".every(gd => gd._fullLayout && gd.querySelector('svg.main-svg'))"
)
"""A browser predicate, true once every figure of a written report has drawn: what the report's
browser tests and ``benchmarks/bench_report.py`` wait on (one definition of "rendered")."""


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
class ReportSummary:
    """What ``write_report`` wrote: the file, its size, the time it took and what was capped."""

    run: str
    out: Path
    bytes: int
    seconds: float
    figures: list[str]
    events: int
    events_drawn: int
    lane_groups: int
    compare: str | None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        d = asdict(self)
        d["out"] = str(self.out)
        return d

    def summary(self) -> str:
        """One line for the CLI, then the notes."""
        vs = f" vs {self.compare!r}" if self.compare else ""
        head = (
            f"report of run {self.run!r}{vs}: {self.out} ({self.bytes / 2**20:.1f} MiB,"
            f" {len(self.figures)} charts, {self.events_drawn}/{self.events} events drawn"
            f" in {self.lane_groups} lane groups) in {self.seconds:.2f} s"
        )
        return "\n".join([head, *(f"  {n}" for n in self.notes)])


_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 0 24px 40px;
       color: #222; }
h1 { font-size: 1.5em; margin: 18px 0 6px; }
h2 { font-size: 1.15em; margin: 28px 0 4px; border-bottom: 1px solid #ddd; }
p.what { margin: 2px 0 6px; color: #555; font-size: 0.92em; }
table.facts { border-collapse: collapse; font-size: 0.9em; }
table.facts td, table.facts th { padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }
table.facts th { color: #666; font-weight: normal; }
ul.notes { color: #7a4b00; font-size: 0.9em; }
pre.config { font-size: 0.8em; background: #f6f6f6; padding: 6px; max-height: 200px;
             overflow: auto; }
"""


@dataclass
class _Section:
    key: str
    title: str
    what: str
    figs: list[go.Figure] = field(default_factory=list)
    html: str = ""


def _id(store: Store, run: str) -> int:
    return store.require_run(run)


def _t0(store: Store, run_id: int) -> int:
    row = store.con.execute(
        "SELECT least((SELECT min(ts) FROM event WHERE run_id = $1),"
        " (SELECT min(ts) FROM iteration WHERE run_id = $1))",
        [run_id],
    ).fetchall()
    return int(row[0][0] or 0)


def _timeline(
    store: Store, run_id: int, t0: int, limits: ReportLimits, notes: list[str]
) -> tuple[_Section, int, int, int]:
    groups_all = data.lane_groups(store, run_id)
    groups = data.sample_groups(store, run_id, groups_all, limits.timeline_groups)
    sec = _Section(
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


def _breakdown(
    store: Store, run: str, groups: dict[int, data.LaneGroup], limits: ReportLimits
) -> _Section:
    sec = _Section(
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


def _top_ops(
    store: Store,
    run: str,
    run_id: int,
    groups: dict[int, data.LaneGroup],
    limits: ReportLimits,
    scope: str,
) -> _Section:
    sec = _Section(
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


def _waits(
    store: Store,
    run: str,
    groups: dict[int, data.LaneGroup],
    limits: ReportLimits,
    notes: list[str],
) -> _Section:
    sec = _Section(
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


def _iterations(
    store: Store, facts: data.RunFacts, compare: str | None, notes: list[str]
) -> tuple[_Section, str | None]:
    sec = _Section(
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
        theirs = data.iteration_times(store, _id(store, other))
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


def _diff(store: Store, other: str, run: str, notes: list[str]) -> _Section:
    """Run diff against the compared run: where the timelines diverge and which ops explain it."""
    from prism_trace.analysis.diff import run_diff

    sec = _Section(
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


def _memory(
    store: Store,
    run_id: int,
    t0: int,
    groups: dict[int, data.LaneGroup],
    limits: ReportLimits,
    notes: list[str],
) -> _Section:
    sec = _Section(
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


def _facts_html(facts: data.RunFacts, compare: str | None) -> str:
    rows = [
        ("run", facts.name),
        ("kind", facts.kind),
        ("derived from", facts.parent or "—"),
        ("world size", facts.world_size),
        ("ranks stored", facts.ranks),
        ("equivalence classes", facts.classes or "—"),
        ("events", facts.events),
        ("iterations", facts.iterations),
        ("source format", facts.source_format or "—"),
        ("created", facts.created_at or "—"),
        ("compared with", compare or "—"),
    ]
    body = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows
    )
    return f"<table class='facts'>{body}</table>"


def write_report(
    store: Store,
    *,
    run: str,
    out: Path | str,
    compare: str | None = None,
    limits: ReportLimits | None = None,
) -> ReportSummary:
    """Write the HTML report of ``run`` to ``out``.

    Args:
        store: an open store (read-only is fine).
        run: the run's name (any kind).
        out: the HTML file to write.
        compare: a run whose iteration times are shown next to this run's. By default an
            emulated or replayed run is compared with its nearest ancestor that has iterations
            (the recorded run it came from).
        limits: caps on what is drawn (``ReportLimits``).

    Returns:
        The file written, its size, the time taken and notes on what was capped.

    Raises:
        PrismError: no run of that name (``run`` or ``compare``).
    """
    started = time.perf_counter()
    limits = limits or ReportLimits()
    run_id = _id(store, run)
    if compare is not None:
        _id(store, compare)
    out = output_file(Path(out), create=False)  # a bad path is refused before the work
    facts = data.run_facts(store, run_id)
    notes: list[str] = []
    t0 = _t0(store, run_id)
    timeline, total, drawn, n_groups = _timeline(store, run_id, t0, limits, notes)
    groups = {g.rank: g for g in data.lane_groups(store, run_id)}
    scope = (
        f"over {facts.world_size or facts.ranks} ranks, class exemplars weighted by class size"
        if facts.classes
        else "all ranks"
    )
    sections = [
        timeline,
        _breakdown(store, run, groups, limits),
        _top_ops(store, run, run_id, groups, limits, scope),
        _waits(store, run, groups, limits, notes),
    ]
    it_sec, other = _iterations(store, facts, compare, notes)
    sections.append(it_sec)
    if other is not None:
        sections.append(_diff(store, other, run, notes))
    sections.append(_memory(store, run_id, t0, groups, limits, notes))
    page = _render(facts, other, sections, notes)
    output_file(out)  # a folder, or a parent that is a file, is one line naming `out`
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        msg = f"{out}: cannot write the report: {exc.strerror}"
        raise PrismError(msg) from exc
    figures = [s.key for s in sections if s.figs]
    return ReportSummary(
        run=run,
        out=out,
        bytes=out.stat().st_size,
        seconds=time.perf_counter() - started,
        figures=figures,
        events=total,
        events_drawn=drawn,
        lane_groups=n_groups,
        compare=other,
        notes=notes,
    )


def _render(
    facts: data.RunFacts, compare: str | None, sections: list[_Section], notes: list[str]
) -> str:
    plotly_js = True
    config = {"displaylogo": False, "responsive": True, "scrollZoom": False}
    body: list[str] = []
    for sec in sections:
        body.append(f"<section id='{sec.key}'><h2>{html.escape(sec.title)}</h2>")
        body.append(f"<p class='what'>{html.escape(sec.what)}</p>")
        for fig in sec.figs:
            body.append(
                fig.to_html(
                    full_html=False,
                    include_plotlyjs=plotly_js,
                    config=config,
                    default_width="100%",
                )
            )
            plotly_js = False
        if sec.html:
            body.append(sec.html)
        body.append("</section>")
    notes_html = (
        "<ul class='notes'>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>"
        if notes
        else ""
    )
    config_html = ""
    if facts.config:
        config_html = (
            "<details><summary>configuration</summary><pre class='config'>"
            + html.escape(json.dumps(facts.config, indent=1, default=str))
            + "</pre></details>"
        )
    title = html.escape(f"prism report: {facts.name}")
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{title}</title><style>{_CSS}</style></head><body>"
        f"<h1>{title}</h1>{_facts_html(facts, compare)}{config_html}{notes_html}"
        + "".join(body)
        + "</body></html>\n"
    )

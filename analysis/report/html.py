"""The HTML report of one run: timeline, breakdowns, collective waits, iteration times, memory.

``write_report`` writes one self-contained file (plotly.js and the figures packed once, no network)
that opens in any browser. It works on every run kind: a sliced or emulated run of thousands of
ranks is drawn one lane group per equivalence class (``rank.class_id``), from its exemplar's events,
with a drop-down to show one group alone. See docs/report.md.
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prism_trace.analysis.report import data
from prism_trace.analysis.report.packed import unpack_script
from prism_trace.analysis.report.prediction_section import prediction_section
from prism_trace.analysis.report.sections import (
    ReportLimits,
    Section,
    breakdown_section,
    diff_section,
    iterations_section,
    memory_section,
    timeline_section,
    top_ops_section,
    waits_section,
)

from prism_trace.outputs import atomic_file, output_file

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["DRAWN_JS", "ReportSummary", "write_report"]

DRAWN_JS = (
    "() => document.body.dataset.prismDrawn === '1'"
    " && Array.from(document.querySelectorAll('.js-plotly-plot'))"
    ".every(gd => gd._fullLayout && gd.querySelector('svg.main-svg'))"
)
"""A browser predicate, true once every figure of a written report has drawn: what the report's
browser tests and ``benchmarks/bench_report.py`` wait on (one definition of "rendered")."""


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


def _t0(store: Store, run_id: int) -> int:
    """The run's first timestamp (events or iterations): the zero of every time axis."""
    row = store.con.execute(
        "SELECT least((SELECT min(ts) FROM event WHERE run_id = $1),"
        " (SELECT min(ts) FROM iteration WHERE run_id = $1))",
        [run_id],
    ).fetchall()
    return int(row[0][0] or 0)


def _facts_html(facts: data.RunFacts, compare: str | None) -> str:
    """The table of run facts at the top of the page."""
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
    follow_symlinks: bool = False,
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
        follow_symlinks: write where a symbolic link at ``out`` points, even out of its folder
            (``prism_trace.outputs``).

    Returns:
        The file written, its size, the time taken and notes on what was capped.

    Raises:
        RunNotFoundError: no run of that name (``run`` or ``compare``).
    """
    started = time.perf_counter()
    limits = limits or ReportLimits()
    run_id = store.require_run(run)
    if compare is not None:
        store.require_run(compare)
    # a bad path is refused before the work
    out = output_file(Path(out), create=False, follow_symlinks=follow_symlinks)
    facts = data.run_facts(store, run_id)
    notes: list[str] = []
    t0 = _t0(store, run_id)
    timeline, total, drawn, n_groups = timeline_section(store, run_id, t0, limits, notes)
    groups = {g.rank: g for g in data.lane_groups(store, run_id)}
    scope = (
        f"over {facts.world_size or facts.ranks} ranks, class exemplars weighted by class size"
        if facts.classes
        else "all ranks"
    )
    sections = [
        timeline,
        breakdown_section(store, run, groups, limits),
        top_ops_section(store, run, run_id, groups, limits, scope),
        waits_section(store, run, groups, limits, notes),
    ]
    it_sec, other = iterations_section(store, facts, compare, notes)
    sections.append(it_sec)
    if other is not None:
        sections.append(diff_section(store, other, run, notes))
        predicted = prediction_section(store, run, other, notes, explicit=compare is not None)
        if predicted is not None:
            sections.append(predicted)
    sections.append(memory_section(store, run_id, t0, groups, limits, notes))
    page = _render(facts, other, sections, notes)
    # written beside `out` and renamed into place: a failed write leaves the old report
    with atomic_file(out) as tmp:
        tmp.write_text(page, encoding="utf-8")
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
    facts: data.RunFacts, compare: str | None, sections: list[Section], notes: list[str]
) -> str:
    """The whole page: facts, configuration, notes, then each section; plotly.js and the
    figures are packed once, at the end (``packed``), so the file opens without a network."""
    config = {"displaylogo": False, "responsive": True, "scrollZoom": False}
    body: list[str] = []
    figures: list[dict[str, Any]] = []
    for sec in sections:
        body.append(f"<section id='{sec.key}'><h2>{html.escape(sec.title)}</h2>")
        body.append(f"<p class='what'>{html.escape(sec.what)}</p>")
        for fig in sec.figs:
            height = fig.layout.height or 450
            body.append(
                f"<div class='prism-fig' data-fig='{len(figures)}'"
                f" style='width:100%;height:{int(height)}px'></div>"
            )
            # plotly's JSON: numeric arrays as base-64 typed arrays, which plotly.js decodes
            figures.append(json.loads(fig.to_json()))
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
        + (unpack_script(figures, config) if figures else "")
        + "</body></html>\n"
    )

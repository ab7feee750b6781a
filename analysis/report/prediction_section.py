"""The report's prediction section: the run against a recording of its world, as `prism predict`
compares them (``analysis.prediction``): step times, the structure of a step, waits, per rank."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from prism_trace.analysis.prediction.compare import RunComparison, compare_runs
from prism_trace.analysis.prediction.structure import SECTIONS
from prism_trace.analysis.report.sections import Section

from prism_trace.errors import PrismError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from prism_trace.store.connection import Store

__all__ = ["prediction_section"]

_MAX_RANK_ROWS = 64
"""Ranks listed in the per-rank table (`prism predict --json` lists every one)."""


_RANK_HEADER = [
    "rank",
    *("comm ms", "recorded", "error"),
    *("wait ms", "recorded", "error"),
    *("peak B", "recorded", "error"),
]


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table class='facts'><tr>{head}</tr>{body}</table>"


def _ms(ns: float | None) -> str:
    return "n/a" if ns is None else f"{ns / 1e6:.3f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.2f} %"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def _html(c: RunComparison) -> str:
    """The comparison's tables."""
    s, st = c.steps, c.structure
    parts = [
        f"<h3>Step time</h3><p class='what'>Per-rank step times over steps {s.iterations}"
        f" (warm-up left out: {s.warmup or 'none'}), {s.ranks} ranks; samples: predicted"
        f" {s.predicted_n}, recorded {s.recorded_n}.</p>",
        _table(
            ["", "predicted ms", "recorded ms", "error"],
            [
                ["mean", _ms(s.predicted_mean_ns), _ms(s.recorded_mean_ns), _pct(s.mean_error_pct)],
                ["p90", _ms(s.predicted_p90_ns), _ms(s.recorded_p90_ns), _pct(s.p90_error_pct)],
                [
                    "KS D",
                    "n/a" if s.ks_d is None else f"{s.ks_d:.3f}",
                    "5 % critical: "
                    + ("n/a" if s.ks_critical_5pct is None else f"{s.ks_critical_5pct:.3f}"),
                    "",
                ],
            ],
        ),
    ]
    if st.iteration is not None:
        diffs = st.differences
        parts.append(
            f"<h3>Structure of step {st.iteration}</h3><p class='what'>Per class, predicted /"
            " recorded counts of ops (graph nodes), collectives and p2p transfers;"
            f" {sum(diffs.values())} differences"
            f" ({', '.join(f'{k} {v}' for k, v in diffs.items())}).</p>"
        )
        parts.append(
            _table(
                ["class", "ranks", *SECTIONS, "differences"],
                [
                    [
                        k.label,
                        f"{k.predicted_rank} / {k.recorded_rank}",
                        *(
                            f"{k.counts.get(x, (0, 0))[0]} / {k.counts.get(x, (0, 0))[1]}"
                            for x in SECTIONS
                        ),
                        sum(k.differences.values()),
                    ]
                    for k in st.classes
                ],
            )
        )
        listed = [t for k in st.classes for t in k.listed]
        if listed:
            parts.append("<ul>" + "".join(f"<li>{html.escape(t)}</li>" for t in listed) + "</ul>")
    if c.waits:
        parts.append("<h3>Wait per communication call</h3>")
        parts.append(
            _table(
                ["kind", "axis", "predicted ms", "recorded ms", "error", "calls"],
                [
                    [
                        w.kind,
                        w.axis,
                        _ms(w.predicted_ns),
                        _ms(w.recorded_ns),
                        _pct(w.error_pct),
                        f"{w.predicted_calls} / {w.recorded_calls}",
                    ]
                    for w in c.waits
                ],
            )
        )
    if c.ranks:
        e = c.rank_errors
        parts.append(
            "<h3>Per rank</h3><p class='what'>Communication time and wait per step, peak"
            " memory; mean |error| over ranks: communication"
            f" {_pct(e['comm_mean_abs_error_pct'])}, wait {_pct(e['wait_mean_abs_error_pct'])},"
            f" peak memory {_pct(e['peak_mean_abs_error_pct'])}.</p>"
        )
        parts.append(
            _table(
                _RANK_HEADER,
                [
                    [
                        r.rank,
                        _ms(r.comm_predicted_ns),
                        _ms(r.comm_recorded_ns),
                        _pct(r.comm_error_pct),
                        _ms(r.wait_predicted_ns),
                        _ms(r.wait_recorded_ns),
                        _pct(r.wait_error_pct),
                        _num(r.peak_predicted),
                        _num(r.peak_recorded),
                        _pct(r.peak_error_pct),
                    ]
                    for r in c.ranks[:_MAX_RANK_ROWS]
                ],
            )
        )
    return "".join(parts)


def prediction_section(
    store: Store, run: str, other: str, notes: list[str], *, explicit: bool
) -> Section | None:
    """The comparison of ``run`` with the recording ``other``, or None where it does not apply:
    ``other`` is no recording, or has another world size (a prediction is checked at its own
    scale), or ``run`` holds no timing.

    Args:
        store: an open store (read-only is fine).
        run: the report's run (a prediction: an emulated or replayed run).
        other: the compared run.
        notes: the report's notes; why a comparison that applies failed is added when
            ``explicit``.
        explicit: ``other`` was named by the user (``--compare``), not found as an ancestor.
    """
    rows = store.con.execute(
        "SELECT name, kind, world_size FROM run WHERE list_contains(?, name)", [[run, other]]
    ).fetchall()
    facts = {name: (kind, world) for name, kind, world in rows}
    if run == other or facts.get(other, ("", 0))[0] != "recorded":
        return None
    if facts.get(run, ("", -1))[1] != facts[other][1]:
        return None
    try:
        comparison = compare_runs(store, run, other)
    except PrismError as exc:
        if explicit:
            notes.append(f"prediction check against {other!r} not shown: {exc}")
        return None
    notes.extend(f"prediction check: {n}" for n in comparison.notes + comparison.structure.notes)
    return Section(
        "prediction",
        "Prediction check",
        f"This run against the recording {other!r} of its world, as `prism predict` compares"
        " them (docs/predict.md): step-time distribution, the structure of one step per class,"
        " waits per collective kind, and per rank communication and memory.",
        html=_html(comparison),
    )

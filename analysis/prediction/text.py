"""The readable form of a prediction's comparison: a few fixed-width tables."""

from __future__ import annotations

from collections.abc import Sequence

from prism_trace.analysis.prediction.ranks import PEAK_TARGET_PCT, KindWait, RankFigures
from prism_trace.analysis.prediction.steps import StepTimes
from prism_trace.analysis.prediction.structure import SECTIONS, StructureComparison

__all__ = ["ranks_text", "steps_text", "structure_text", "table_text", "waits_text"]


def table_text(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Columns padded to their widest cell; the first column left-aligned, the others right."""
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append(indent + "  ".join(parts).rstrip())
    return "\n".join(lines)


def _ms(ns: float | None) -> str:
    return "n/a" if ns is None else f"{ns / 1e6:.3f} ms"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.2f} %"


def _bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n:,.0f} B"


def steps_text(s: StepTimes, runs: int) -> list[str]:
    """The step-time table and the KS distance."""
    if not s.iterations:
        return ["step time: no step in common"]
    warm = f", warm-up left out: {s.warmup}" if s.warmup else ""
    pooled = f" x {runs} runs" if runs > 1 else ""
    lines = [
        f"step time over steps {s.iterations}{warm}; {s.ranks} ranks{pooled}"
        f" (samples: predicted {s.predicted_n}, recorded {s.recorded_n}):",
        table_text(
            ["", "predicted", "recorded", "error"],
            [
                ["mean", _ms(s.predicted_mean_ns), _ms(s.recorded_mean_ns), _pct(s.mean_error_pct)],
                ["p90", _ms(s.predicted_p90_ns), _ms(s.recorded_p90_ns), _pct(s.p90_error_pct)],
            ],
        ),
    ]
    if s.ks_d is not None:
        steps = (
            ""
            if s.ks_critical_steps_5pct is None
            else f", {s.ks_critical_steps_5pct:.3f} counting each step's ranks as one sample"
        )
        lines.append(
            f"  KS D = {s.ks_d:.3f} (5 % critical value {s.ks_critical_5pct:.3f} for these"
            f" sizes{steps})"
        )
    return lines


def structure_text(st: StructureComparison) -> list[str]:
    """The per-class counts and the differences listed."""
    if st.iteration is None:
        return [f"structure: {n}" for n in st.notes] or ["structure: not compared"]
    diffs = st.differences
    total = sum(diffs.values())
    what = "ops, collectives and p2p" if st.ops_compared else "collectives and p2p"
    lines = [
        f"structure of step {st.iteration} ({what}; predicted/recorded per class):",
        table_text(
            ["class", "ranks", *SECTIONS, "differences"],
            [
                [
                    k.label,
                    f"{k.predicted_rank}/{k.recorded_rank}",
                    *(
                        f"{k.counts.get(s, (0, 0))[0]}/{k.counts.get(s, (0, 0))[1]}"
                        for s in SECTIONS
                    ),
                    str(sum(k.differences.values())),
                ]
                for k in st.classes
            ],
        ),
        f"  {total} differences (" + ", ".join(f"{k} {v}" for k, v in diffs.items()) + ")",
    ]
    lines += [f"  {t}" for k in st.classes for t in k.listed]
    return lines


def waits_text(waits: Sequence[KindWait]) -> list[str]:
    """The mean wait per collective kind and axis."""
    if not waits:
        return []
    return [
        "wait per communication call (mean over the calls of the compared steps):",
        table_text(
            ["kind", "axis", "predicted", "recorded", "error", "calls"],
            [
                [
                    w.kind,
                    w.axis,
                    _ms(w.predicted_ns),
                    _ms(w.recorded_ns),
                    _pct(w.error_pct),
                    f"{w.predicted_calls}/{w.recorded_calls}",
                ]
                for w in waits
            ],
        ),
    ]


_RANK_HEADER = [
    "rank",
    *("comm", "recorded", "error"),
    *("wait", "recorded", "error"),
    *("peak", "recorded", "error"),
]


def ranks_text(
    ranks: Sequence[RankFigures], e: dict[str, float | None], max_rows: int = 32
) -> list[str]:
    """The per-rank table (at most ``max_rows``) and the mean errors ``e``."""
    if not ranks:
        return []
    rows = [
        [
            str(r.rank),
            _ms(r.comm_predicted_ns),
            _ms(r.comm_recorded_ns),
            _pct(r.comm_error_pct),
            _ms(r.wait_predicted_ns),
            _ms(r.wait_recorded_ns),
            _pct(r.wait_error_pct),
            _bytes(r.peak_predicted),
            _bytes(r.peak_recorded),
            _pct(r.peak_error_pct),
        ]
        for r in ranks[:max_rows]
    ]
    lines = [
        "per rank (communication time and wait per step, peak memory):",
        table_text(_RANK_HEADER, rows),
    ]
    if len(ranks) > max_rows:
        lines.append(f"  ... {len(ranks) - max_rows} more ranks (--json lists every one)")
    lines.append(
        "  mean |error| over ranks: communication "
        + _abs(e["comm_mean_abs_error_pct"])
        + ", wait "
        + _abs(e["wait_mean_abs_error_pct"])
        + ", peak memory "
        + _abs(e["peak_mean_abs_error_pct"])
        + f" (largest: {_abs(e['comm_max_abs_error_pct'])}, {_abs(e['wait_max_abs_error_pct'])},"
        f" {_abs(e['peak_max_abs_error_pct'])})"
    )
    if e.get("peak_ranks"):
        lines.append(
            f"  peak memory within {PEAK_TARGET_PCT} %: {e['peak_ranks_within_target']} of"
            f" {e['peak_ranks']} ranks"
        )
    return lines


def _abs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} %"

"""Analyses of a stored run: documented SQL views plus thin polars functions (HTA parity).

``ANALYSES`` maps each single-run ``prism analyze`` word to a function ``(store, run) ->
DataFrame``; ``COMPARISONS`` the words that compare two runs. ``analyze`` runs any word with its
options and returns named frames.
"""

from __future__ import annotations

from collections.abc import Callable

import polars as pl
from prism_trace.analysis.breakdown import WINDOWS, Window, idle, kernels, overlap, temporal
from prism_trace.analysis.bubbles import bubble_summary, bubbles
from prism_trace.analysis.critical_path import (
    critical_path,
    critical_path_shares,
    critical_path_summary,
)
from prism_trace.analysis.diff import RunDiff, run_diff
from prism_trace.analysis.selection import check_selection, describe_selection
from prism_trace.analysis.stragglers import (
    collective_skew,
    collective_waits,
    nothing_to_rank,
    rank_step_waits,
    skew,
    straggler_ops,
)
from prism_trace.analysis.views import load_views, names_in

from prism_trace.errors import UsageError
from prism_trace.store.connection import Store

__all__ = [
    "ANALYSES",
    "COMPARISONS",
    "GRAPH_ANALYSES",
    "WINDOWS",
    "WORDS",
    "RunDiff",
    "Window",
    "analyze",
    "bubble_summary",
    "bubbles",
    "check_selection",
    "collective_skew",
    "collective_waits",
    "critical_path",
    "critical_path_shares",
    "critical_path_summary",
    "describe_selection",
    "idle",
    "kernels",
    "load_views",
    "names_in",
    "nothing_to_rank",
    "overlap",
    "rank_step_waits",
    "run_diff",
    "skew",
    "straggler_ops",
    "temporal",
]

ANALYSES: dict[str, Callable[[Store, str], pl.DataFrame]] = {
    "temporal": temporal,
    "kernels": kernels,
    "overlap": overlap,
    "idle": idle,
    "skew": skew,
    "bubbles": bubble_summary,
    "bubble-windows": bubbles,
}
"""The `prism analyze DB --run NAME WHAT` words and their functions."""

GRAPH_ANALYSES: dict[str, Callable[[Store, str], pl.DataFrame]] = {
    "critical-path": critical_path,
    "critical-path-summary": critical_path_summary,
}
"""Words that walk the execution graph: the run (or, emulated, its parent) needs one
(`prism graph`)."""

COMPARISONS: dict[str, Callable[..., RunDiff]] = {"diff": run_diff}
"""Words that compare the run with another (`--compare OTHER`)."""

WORDS: tuple[str, ...] = (*ANALYSES, *GRAPH_ANALYSES, *COMPARISONS)
"""Every `prism analyze` word."""


def _by_ranks(frames: dict[str, pl.DataFrame], ranks: list[int] | None) -> dict[str, pl.DataFrame]:
    """Keep only the rows of ``ranks`` in frames that have a ``rank`` column."""
    if ranks is None:
        return frames
    return {
        k: v.filter(pl.col("rank").is_in(ranks)) if "rank" in v.columns else v
        for k, v in frames.items()
    }


def analyze(
    store: Store,
    what: str,
    run: str,
    *,
    compare: str | None = None,
    iteration: int | None = None,
    ranks: list[int] | None = None,
    window: Window = "step",
    threshold_pct: float = 1.0,
    min_ns: int = 0,
    rank_map: dict[int, int] | None = None,
    iteration_map: dict[int, int] | None = None,
) -> dict[str, pl.DataFrame]:
    """Run the analysis ``what`` with its options; the result as named frames.

    Args:
        store: an open store (read-only is fine).
        what: one of ``WORDS``.
        run: the run (for ``diff``: the reference, ``a``).
        compare: the other run of a comparison (``b``).
        iteration: only this iteration.
        ranks: only these ranks (frames with a ``rank`` column; per-stage or per-iteration
            summaries are not per rank and stay whole).
        window: the breakdowns' window semantics, ``step`` or ``hta`` (docs/analysis.md).
        threshold_pct: divergence threshold of ``diff`` (% of the rank's iteration).
        min_ns: shortest bubble counted.
        rank_map: ``diff``: rank of ``run`` -> rank of ``compare`` to compare (``--map``).
        iteration_map: ``diff``: iteration of ``run`` -> iteration of ``compare``.

    Returns:
        One frame named ``what``, or a comparison's sections.

    Raises:
        PrismError: unknown word, a comparison without ``compare``, a selection that names no
            rank or iteration of the run, or what the analysis raises.
    """
    if what not in WORDS:
        msg = f"unknown analysis {what!r}; one of {', '.join(WORDS)}"
        raise UsageError(msg)
    check_selection(store, run, ranks=ranks, iteration=iteration)
    if what in COMPARISONS:
        if compare is None:
            msg = f"`{what}` compares two runs: give the other with --compare"
            raise UsageError(msg)
        check_selection(
            store,
            compare,
            ranks=None if rank_map else ranks,
            iteration=None if iteration_map else iteration,
        )
        diff = COMPARISONS[what](
            store,
            run,
            compare,
            threshold_pct=threshold_pct,
            iteration=iteration,
            rank_map=rank_map,
            iteration_map=iteration_map,
        )
        return _by_ranks(diff.frames(), ranks)
    if what in ("temporal", "overlap", "kernels", "idle"):
        breakdowns: dict[str, Callable[..., pl.DataFrame]] = {
            "temporal": temporal,
            "overlap": overlap,
            "kernels": kernels,
            "idle": idle,
        }
        fn = breakdowns[what]
        return {what: fn(store, run, window=window, iteration=iteration, ranks=ranks)}
    if what == "skew":
        # An emulated run also ranks every rank of the world (rank_step), not only its
        # exemplars' collective rows.
        every = rank_step_waits(store, run, iteration=iteration, ranks=ranks)
        frames = {what: skew(store, run, iteration=iteration, ranks=ranks)}
        return {**frames, **({"rank_step": every} if every.height else {})}
    if what == "bubbles":
        return {what: bubble_summary(store, run, iteration=iteration, min_ns=min_ns)}
    if what == "bubble-windows":
        return _by_ranks({what: bubbles(store, run, iteration=iteration, min_ns=min_ns)}, ranks)
    if what == "critical-path":
        return _by_ranks(
            {
                "summary": critical_path_summary(store, run, iteration=iteration),
                "ranks": critical_path_shares(store, run, by="rank", iteration=iteration),
                "kinds": critical_path_shares(store, run, by="kind", iteration=iteration),
                "path": critical_path(store, run, iteration=iteration),
            },
            ranks,
        )
    return {what: critical_path_summary(store, run, iteration=iteration)}

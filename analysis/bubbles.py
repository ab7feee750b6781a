"""Pipeline bubbles: the idle windows of each stage's compute lane, and a summary per stage.

Thin polars shells over ``analysis/sql/pipeline.sql`` (definitions there and in
docs/analysis.md): what a bubble-filling scheduler needs — when each rank's compute lane is free,
for how long, what it waits on, and how much memory is free then.
"""

from __future__ import annotations

from typing import Literal

import polars as pl
from prism_trace.analysis.views import run_view

from prism_trace.store.connection import Store

__all__ = ["bubble_summary", "bubbles"]


def bubbles(
    store: Store, run: str, *, iteration: int | None = None, min_ns: int = 0
) -> pl.DataFrame:
    """Every idle window of every rank's compute lane of at least ``min_ns`` ns.

    Args:
        store: an open store (read-only is fine).
        run: the run's name (any kind).
        iteration: only this iteration.
        min_ns: drop shorter windows (launch gaps, Python overhead between host ops).

    Returns:
        ``pipeline_bubble_at(min_ns)`` rows of the run, by rank and start.

    Raises:
        RunNotFoundError: no run of that name.
    """
    df = run_view(store, f"pipeline_bubble_at({int(min_ns)})", run, order_by="rank, ts")
    if iteration is not None:
        df = df.filter(pl.col("iteration") == iteration)
    return df


def bubble_summary(
    store: Store,
    run: str,
    *,
    by: Literal["stage", "iteration"] = "stage",
    iteration: int | None = None,
    min_ns: int = 0,
) -> pl.DataFrame:
    """Bubbles per pipeline stage: count, total, mean and longest window, bubble fraction.

    Args:
        store: an open store (read-only is fine).
        run: the run's name (any kind).
        by: one row per stage (iterations summed) or per stage and iteration.
        iteration: only this iteration (implies ``by="iteration"``).
        min_ns: count only windows of at least this many ns.

    Returns:
        ``pipeline_stage_at`` or ``pipeline_stage_iteration_at`` rows of the run.

    Raises:
        RunNotFoundError: no run of that name.
    """
    if by == "iteration" or iteration is not None:
        df = run_view(
            store,
            f"pipeline_stage_iteration_at({int(min_ns)})",
            run,
            order_by="stage, iteration",
        )
        return df if iteration is None else df.filter(pl.col("iteration") == iteration)
    return run_view(store, f"pipeline_stage_at({int(min_ns)})", run, order_by="stage")

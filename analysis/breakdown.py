"""Where each rank's time goes: temporal, kernel, overlap and idle breakdowns (HTA parity).

Thin polars shells over the views of ``analysis/sql/breakdown.sql``; the definitions live there
and in docs/analysis.md. Every function takes the same selection: ``window`` (``"step"``,
prism's default: device work launched in a step counts to that step; ``"hta"``: HTA's one window
per rank over the ops it keeps), ``iteration`` and ``ranks``.
"""

from __future__ import annotations

from typing import Literal

import polars as pl
from prism_trace.analysis.views import run_view

from prism_trace.errors import UsageError
from prism_trace.store.connection import Store

__all__ = ["WINDOWS", "Window", "idle", "kernels", "overlap", "temporal"]

Window = Literal["step", "hta"]
WINDOWS: tuple[str, ...] = ("step", "hta")
"""The window semantics (docs/analysis.md, "Windows")."""

_PARTS = ("compute", "comm", "memory", "other", "idle")


def _check_window(window: str, iteration: int | None) -> None:
    if window not in WINDOWS:
        msg = f"unknown window {window!r}; one of {', '.join(WINDOWS)}"
        raise UsageError(msg)
    if window == "hta" and iteration is not None:
        msg = "--window hta is HTA's one window per rank over all kept steps: no --iteration"
        raise UsageError(msg)


def temporal(
    store: Store,
    run: str,
    *,
    by: Literal["rank", "iteration"] = "rank",
    window: Window = "step",
    iteration: int | None = None,
    ranks: list[int] | None = None,
) -> pl.DataFrame:
    """Temporal breakdown: compute, communication, memory, other and idle time of each rank.

    Every instant of each window goes to exactly one part (see docs/analysis.md), so the five
    ``*_pct`` columns of a row sum to 100.

    Args:
        store: an open store.
        run: the run's name.
        by: one row per rank (windows summed), or per rank and iteration.
        window: ``step`` (per iteration; device work counts to the step that launched it) or
            ``hta`` (HTA's single window per rank; ``by`` is then ignored).
        iteration: only this iteration (one row per rank).
        ranks: only these ranks.

    Returns:
        ``breakdown_temporal``, ``breakdown_temporal_iteration`` or ``breakdown_temporal_hta``
        rows of the run.

    Raises:
        RunNotFoundError: no run of that name.
        UsageError: ``window="hta"`` with an iteration.
    """
    return _windowed(store, "breakdown_temporal", run, window, by, iteration, ranks)


def _windowed(
    store: Store,
    view: str,
    run: str,
    window: Window,
    by: str | None,
    iteration: int | None,
    ranks: list[int] | None,
) -> pl.DataFrame:
    """``view`` (whole run), ``view_iteration`` (per iteration) or ``view_hta`` (HTA's window)."""
    _check_window(window, iteration)
    if window == "hta":
        return run_view(store, f"{view}_hta", run, order_by="rank", ranks=ranks)
    if by == "iteration" or iteration is not None:
        return run_view(
            store,
            f"{view}_iteration",
            run,
            order_by="rank, iteration",
            ranks=ranks,
            iteration=iteration,
        )
    return run_view(store, view, run, order_by="rank", ranks=ranks)


def kernels(
    store: Store,
    run: str,
    *,
    top_k: int = 10,
    per_rank: bool = False,
    window: Window = "step",
    iteration: int | None = None,
    ranks: list[int] | None = None,
) -> pl.DataFrame:
    """Kernel breakdown: the top ``top_k`` kernels of each kernel type by total time.

    Args:
        store: an open store.
        run: the run's name.
        top_k: kernels kept per kernel type; the rest are summed into one ``others`` row per type
            (whose spread columns are null).
        per_rank: return every kernel on every rank (``breakdown_kernel_rank_at``) instead.
        window: ``step`` counts the ops launched in a step, ``hta`` those HTA keeps.
        iteration: only the ops launched in this iteration.
        ranks: only these ranks.

    Returns:
        ``breakdown_kernel_at`` rows of the run, largest first within each kernel type.

    Raises:
        RunNotFoundError: no run of that name.
        UsageError: ``window="hta"`` with an iteration.
    """
    _check_window(window, iteration)
    if per_rank:
        return run_view(
            store,
            "breakdown_kernel_rank_at(window_kind := ?, it := ?)",
            run,
            order_by="kernel_type, total_ns DESC, name, rank",
            params=[window, iteration],
            ranks=ranks,
        )
    df = run_view(
        store,
        "breakdown_kernel_at(window_kind := ?, it := ?, rank_list := ?::INTEGER[])",
        run,
        order_by="kernel_type, type_rank",
        params=[window, iteration, ranks],
    )
    rest = df.filter(pl.col("type_rank") > top_k)
    if rest.is_empty():
        return df
    others = (
        rest.group_by("kernel_type")
        .agg(
            pl.lit("others").alias("name"),
            pl.lit(top_k + 1, dtype=df.schema["type_rank"]).alias("type_rank"),
            pl.col("calls").sum(),
            pl.col("total_ns").sum(),
            pl.col("type_pct").sum(),
            pl.col("ranks").max(),
        )
        .with_columns(pl.col(c).cast(df.schema[c]) for c in ("calls", "total_ns", "ranks"))
    )
    kept = df.filter(pl.col("type_rank") <= top_k)
    return pl.concat([kept, others], how="diagonal_relaxed").sort("kernel_type", "type_rank")


def overlap(
    store: Store,
    run: str,
    *,
    by: Literal["rank", "iteration"] = "rank",
    window: Window = "step",
    iteration: int | None = None,
    ranks: list[int] | None = None,
) -> pl.DataFrame:
    """Communication/computation overlap: the share of communication time hidden by computation.

    Args:
        store: an open store.
        run: the run's name.
        by: one row per rank (windows summed), or per rank and iteration.
        window: ``step`` or ``hta`` (as `temporal`).
        iteration: only this iteration (one row per rank).
        ranks: only these ranks.

    Returns:
        ``breakdown_overlap``, ``breakdown_overlap_iteration`` or ``breakdown_overlap_hta``
        rows of the run.

    Raises:
        RunNotFoundError: no run of that name.
        UsageError: ``window="hta"`` with an iteration.
    """
    return _windowed(store, "breakdown_overlap", run, window, by, iteration, ranks)


def idle(
    store: Store,
    run: str,
    *,
    consecutive_kernel_delay: int = 30_000,
    window: Window = "step",
    iteration: int | None = None,
    ranks: list[int] | None = None,
) -> pl.DataFrame:
    """Idle-time breakdown per rank and stream: host_wait, kernel_wait and other (as HTA).

    Ranks without device ops (CPU-only runs, op timelines) have no streams and no rows.

    Args:
        store: an open store.
        run: the run's name.
        consecutive_kernel_delay: gaps shorter than this many ns between back-to-back kernels
            that were launched in time count as ``kernel_wait``. HTA's default is 30 in its
            trace unit (µs), i.e. 30000 ns.
        window: ``step`` counts the ops launched in a step, ``hta`` those HTA keeps.
        iteration: only the ops launched in this iteration.
        ranks: only these ranks.

    Returns:
        ``breakdown_idle_at(consecutive_kernel_delay, window_kind, it)`` rows of the run.

    Raises:
        RunNotFoundError: no run of that name.
        UsageError: ``window="hta"`` with an iteration.
    """
    _check_window(window, iteration)
    source = f"breakdown_idle_at({int(consecutive_kernel_delay)}, window_kind := ?, it := ?)"
    return run_view(
        store,
        source,
        run,
        order_by="rank, stream, idle_category",
        params=[window, iteration],
        ranks=ranks,
    )

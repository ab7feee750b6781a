"""Where each rank's time goes: temporal, kernel, overlap and idle breakdowns (HTA parity).

Thin polars shells over the views of ``analysis/sql/breakdown.sql``; the definitions live there
and in docs/analysis.md.
"""

from __future__ import annotations

from typing import Literal

import polars as pl
from prism_trace.analysis.views import run_view

from prism_trace.store import Store

__all__ = ["idle", "kernels", "overlap", "temporal"]


def temporal(store: Store, run: str, *, by: Literal["rank", "iteration"] = "rank") -> pl.DataFrame:
    """Temporal breakdown: compute, communication, memory, other and idle time of each rank.

    Every instant of each iteration window goes to exactly one part (see docs/analysis.md), so
    the five ``*_pct`` columns of a row sum to 100.

    Args:
        store: an open store.
        run: the run's name.
        by: one row per rank (windows summed), or per rank and iteration.

    Returns:
        ``breakdown_temporal`` or ``breakdown_temporal_iteration`` rows of the run.

    Raises:
        PrismError: no run of that name.
    """
    if by == "iteration":
        return run_view(store, "breakdown_temporal_iteration", run, order_by="rank, iteration")
    return run_view(store, "breakdown_temporal", run, order_by="rank")


def kernels(store: Store, run: str, *, top_k: int = 10, per_rank: bool = False) -> pl.DataFrame:
    """Kernel breakdown: the top ``top_k`` kernels of each kernel type by total time.

    Args:
        store: an open store.
        run: the run's name.
        top_k: kernels kept per kernel type; the rest are summed into one ``others`` row per type
            (whose spread columns are null).
        per_rank: return ``breakdown_kernel_rank`` (every kernel on every rank) instead.

    Returns:
        ``breakdown_kernel`` rows of the run, largest first within each kernel type.

    Raises:
        PrismError: no run of that name.
    """
    if per_rank:
        return run_view(
            store, "breakdown_kernel_rank", run, order_by="kernel_type, total_ns DESC, name, rank"
        )
    df = run_view(store, "breakdown_kernel", run, order_by="kernel_type, type_rank")
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


def overlap(store: Store, run: str, *, by: Literal["rank", "iteration"] = "rank") -> pl.DataFrame:
    """Communication/computation overlap: the share of communication time hidden by computation.

    Args:
        store: an open store.
        run: the run's name.
        by: one row per rank (windows summed), or per rank and iteration.

    Returns:
        ``breakdown_overlap`` or ``breakdown_overlap_iteration`` rows of the run.

    Raises:
        PrismError: no run of that name.
    """
    if by == "iteration":
        return run_view(store, "breakdown_overlap_iteration", run, order_by="rank, iteration")
    return run_view(store, "breakdown_overlap", run, order_by="rank")


def idle(store: Store, run: str, *, consecutive_kernel_delay: int = 30_000) -> pl.DataFrame:
    """Idle-time breakdown per rank and stream: host_wait, kernel_wait and other (as HTA).

    Ranks without device ops (CPU-only runs) have no streams and no rows.

    Args:
        store: an open store.
        run: the run's name.
        consecutive_kernel_delay: gaps shorter than this many ns between back-to-back kernels
            that were launched in time count as ``kernel_wait``. HTA's default is 30 in its
            trace unit (µs), i.e. 30000 ns.

    Returns:
        ``breakdown_idle_at(consecutive_kernel_delay)`` rows of the run.

    Raises:
        PrismError: no run of that name.
    """
    source = f"breakdown_idle_at({int(consecutive_kernel_delay)})"
    return run_view(store, source, run, order_by="rank, stream, idle_category")

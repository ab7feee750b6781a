"""Collective skew across ranks: arrival spread, per-rank waits and the straggler ranking.

Thin polars shells over the views of ``analysis/sql/comm.sql``; the definitions live there and
in docs/analysis.md.
"""

from __future__ import annotations

import polars as pl
from prism_trace.analysis.views import run_view

from prism_trace.store import Store

__all__ = ["collective_skew", "collective_waits", "skew", "straggler_ops"]


def skew(store: Store, run: str) -> pl.DataFrame:
    """Straggler ranking: per rank, the time others waited for it and how often it was last.

    Args:
        store: an open store.
        run: the run's name.

    Returns:
        ``comm_straggler`` rows of the run, worst straggler first.

    Raises:
        PrismError: no run of that name.
    """
    return run_view(store, "comm_straggler", run, order_by="straggler_rank")


def collective_skew(store: Store, run: str) -> pl.DataFrame:
    """Per collective instance: arrival spread, total wait and the last rank.

    Raises:
        PrismError: no run of that name.
    """
    return run_view(store, "comm_collective_skew", run, order_by="group_id, seq")


def collective_waits(store: Store, run: str) -> pl.DataFrame:
    """Per rank and collective instance: arrival, lateness, wait and whether it was last.

    Raises:
        PrismError: no run of that name.
    """
    return run_view(store, "comm_collective_wait", run, order_by="group_id, seq, rank")


def straggler_ops(store: Store, run: str) -> pl.DataFrame:
    """Late arrivals attributed to the host op that preceded them, per rank.

    Raises:
        PrismError: no run of that name.
    """
    return run_view(
        store, "comm_straggler_op", run, order_by="caused_wait_ns DESC, rank, preceding_op"
    )

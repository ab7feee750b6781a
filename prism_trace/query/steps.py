"""A run's steps, or the whole trace as one window per rank when it has none.

A trace recorded without ``torch.profiler.schedule`` (no ``ProfilerStep#N`` spans: a plain
single-GPU trace, PARAM's linear model) has no ``iteration`` rows. HTA's rule for such a trace is
to take the whole trace as one window; so do the step comparisons (``prism validate``, the
emulated run's iterations, ``analyze diff``): each rank's window runs from the start of its
first op to the end of its last one, numbered ``WHOLE_TRACE``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:
    import duckdb

__all__ = ["WHOLE_TRACE", "WHOLE_TRACE_NAME", "step_windows", "whole_trace_windows"]

WHOLE_TRACE = -2
"""The ``iteration`` of a window that is a whole trace without steps (-1 is HTA's "no step")."""

WHOLE_TRACE_NAME = "whole trace"
"""The ``iteration.name`` of such a window."""


def whole_trace_windows(con: duckdb.DuckDBPyConnection, run_id: int) -> pl.DataFrame:
    """Per rank, one window over its graph's nodes (the ops an emulation replays), or over its
    timed events when the run has no graph: ``rank, iteration, ts, dur, name``."""
    ((graphed,),) = con.execute(
        "SELECT count(*) > 0 FROM graph_node WHERE run_id = ? AND ts IS NOT NULL", [run_id]
    ).fetchall()
    table = "graph_node" if graphed else "event"
    return con.sql(
        f"SELECT rank::INTEGER AS rank, {WHOLE_TRACE}::INTEGER AS iteration,"
        " min(ts)::BIGINT AS ts, (max(ts + coalesce(dur, 0)) - min(ts))::BIGINT AS dur,"
        f" '{WHOLE_TRACE_NAME}' AS name FROM {table} WHERE run_id = $1 AND ts IS NOT NULL"
        " GROUP BY rank ORDER BY rank",
        params=[run_id],
    ).pl()


def step_windows(con: duckdb.DuckDBPyConnection, run_id: int) -> pl.DataFrame:
    """The run's ``iteration`` rows (``rank, iteration, ts, dur, name``), or, when it has none,
    ``whole_trace_windows``."""
    steps = con.sql(
        "SELECT rank, iteration, ts, dur, name FROM iteration WHERE run_id = $1"
        " ORDER BY rank, iteration",
        params=[run_id],
    ).pl()
    return steps if steps.height else whole_trace_windows(con, run_id)

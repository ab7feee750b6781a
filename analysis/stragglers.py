"""Collective skew across ranks: arrival spread, per-rank waits and the straggler ranking.

Thin polars shells over the views of ``analysis/sql/comm.sql``; the definitions live there and
in docs/analysis.md. An arrival is the device-side start of the call's kernel when it has one.
"""

from __future__ import annotations

import polars as pl
from prism_trace.analysis.views import load_views, run_view

from prism_trace.store.connection import Store

__all__ = [
    "collective_skew",
    "collective_waits",
    "nothing_to_rank",
    "rank_step_waits",
    "skew",
    "straggler_ops",
]


def skew(
    store: Store, run: str, *, iteration: int | None = None, ranks: list[int] | None = None
) -> pl.DataFrame:
    """Straggler ranking: per rank, the waiting its own work caused and how often it was last.

    Args:
        store: an open store.
        run: the run's name.
        iteration: only the calls of this iteration (the ranking is over them).
        ranks: only these ranks' rows (the waits are still measured against every participant).

    Returns:
        ``comm_straggler_at`` rows of the run, worst straggler first.

    Raises:
        RunNotFoundError: no run of that name.
    """
    return run_view(
        store,
        "comm_straggler_at(it := ?)",
        run,
        order_by="straggler_place NULLS LAST, rank",
        params=[iteration],
        ranks=ranks,
    )


def collective_skew(store: Store, run: str, *, iteration: int | None = None) -> pl.DataFrame:
    """Per communication instance: arrival spread, total and blamed wait and the last rank.

    Raises:
        RunNotFoundError: no run of that name.
    """
    return run_view(
        store, "comm_collective_skew", run, order_by="group_id, seq, link", iteration=iteration
    )


def collective_waits(
    store: Store, run: str, *, iteration: int | None = None, ranks: list[int] | None = None
) -> pl.DataFrame:
    """Per rank and communication instance: arrival, lateness, wait and whether it was last.

    Raises:
        RunNotFoundError: no run of that name.
    """
    return run_view(
        store,
        "comm_collective_wait",
        run,
        order_by="group_id, seq, link, rank",
        iteration=iteration,
        ranks=ranks,
    )


def straggler_ops(store: Store, run: str, *, iteration: int | None = None) -> pl.DataFrame:
    """Late arrivals attributed to the host op that preceded them, per rank.

    Raises:
        RunNotFoundError: no run of that name.
    """
    return run_view(
        store,
        "comm_straggler_op_at(it := ?)",
        run,
        order_by="caused_wait_ns DESC, rank, preceding_op",
        params=[iteration],
    )


def rank_step_waits(
    store: Store, run: str, *, iteration: int | None = None, ranks: list[int] | None = None
) -> pl.DataFrame:
    """Per rank of an emulated run, from the ``rank_step`` table: every rank of the world.

    An emulated run at scale writes per-op rows for its class exemplars only, so ``skew`` (over
    the ``collective`` rows) ranks classes; ``rank_step`` holds every rank's waits and
    lateness per step (``replay.rank_step``), the distinct replicas included. Empty for a run
    without ``rank_step`` rows (recorded, sliced, replayed).

    Returns:
        ``rank, steps, comm_calls, wait_ns, late_ns, peak_allocated``, the latest arriver (most
        lateness) first.

    Raises:
        RunNotFoundError: no run of that name.
    """
    run_id = store.require_run(run)
    where, values = ["run_id = ?"], [run_id]
    if iteration is not None:
        where.append("iteration = ?")
        values.append(int(iteration))
    if ranks is not None:
        where.append("list_contains(?, rank)")
        values.append(list(ranks))  # type: ignore[arg-type]
    return store.con.sql(
        "SELECT rank, count(*) AS steps, sum(comm_calls)::BIGINT AS comm_calls,"
        " sum(wait_ns)::BIGINT AS wait_ns, sum(late_ns)::BIGINT AS late_ns,"
        " max(peak_allocated) AS peak_allocated"
        f" FROM rank_step WHERE {' AND '.join(where)}"
        " GROUP BY rank ORDER BY late_ns DESC, rank",
        params=values,
    ).pl()


def nothing_to_rank(store: Store, run: str, *, iteration: int | None = None) -> str | None:
    """Why ``skew`` ranks no rank of ``run``, or None when some rank was last somewhere.

    A straggler is a rank the others waited for: that needs an instance recorded by two or more
    ranks. A one-rank recording of a larger job, or calls no two ranks' records agree on (no
    group or sequence in the trace), have none, and all-zero rows ordered by rank id would read
    as a ranking.

    Raises:
        RunNotFoundError: no run of that name.
    """
    run_id = store.require_run(run)
    load_views(store.con, names=["comm_collective_wait"])
    rows = store.con.execute(
        "SELECT count(*), count(*) FILTER (WHERE participants > 1),"
        " count(*) FILTER (WHERE is_last), count(DISTINCT rank),"
        " (SELECT count(DISTINCT rank) FROM event WHERE run_id = $1)"
        " FROM comm_collective_wait WHERE run_id = $1 AND ($2 IS NULL OR iteration = $2)",
        [run_id, iteration],
    ).fetchall()
    calls, shared, last, comm_ranks, ranks = (int(x or 0) for x in rows[0])
    if last > 0:
        return None
    if calls == 0:
        return "no communication calls"
    if ranks == 1:
        return (
            f"the run has one rank, so no call of its {calls} has another participant to wait"
            " for it; ingest the other ranks' traces into the run to rank stragglers"
        )
    if shared == 0:
        return (
            f"none of its {calls} communication calls on {comm_ranks} ranks is matched with"
            " another rank's (the traces give no common group and sequence); see"
            " `prism graph` for how the collectives matched"
        )
    return f"no rank arrived last at any of the {shared} calls recorded by two or more ranks"

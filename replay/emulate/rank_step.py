"""Per rank and step of an emulated run: time waiting in communication, lateness, peak memory.

Why a module of its own: an emulated run at scale writes per-op events for its class exemplars
(and ``--keep-events`` ranks) only, so the ``collective`` rows, and the analysis views over them,
hold one row per class, not per rank. The ``rank_step`` table keeps what per-rank questions need
(who waited, who was late, who peaked) for *every* rank of the world, at a few numbers per rank
and step. One function fills it from any emulation path: the units of the scalar core (a recorded
run's ranks, a sliced run's classes, expanded replicas: one column) and the replica vector
(``replay.vector``: one column per simulated replica).

Definitions (those of the ``comm_collective_wait`` view, on emulated times): a participant's
*arrival* is the start of its sync node (the device kernel of a collective when it has one, else
the communication node); the instance's last arrival ``A`` is the max over its participants (and
over the replicas for a communicator that spans them); ``wait = A - arrival`` and ``late =
arrival - first arrival``. A rank's row sums them over its communication calls of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

__all__ = ["RankSteps", "rank_step_rows", "rank_steps"]

_BLOCK = 1 << 21
"""Elements of one gathered ``(participations, columns)`` block: 16 MB of int64, below the
allocator's mmap threshold, so the blocks reuse heap pages instead of faulting in new ones."""


@dataclass(frozen=True)
class RankSteps:
    """Per (unit, step) group and simulated column: communication calls, waits and lateness.

    Attributes:
        unit: ``(groups,)`` unit of each group.
        iteration: ``(groups,)`` recorded step of each group.
        calls: ``(groups,)`` communication calls of the unit in the step.
        wait: ``(groups, columns)`` summed wait, ns.
        late: ``(groups, columns)`` summed lateness, ns.
    """

    unit: np.ndarray
    iteration: np.ndarray
    calls: np.ndarray
    wait: np.ndarray
    late: np.ndarray


def rank_steps(
    start: np.ndarray,
    arrival: np.ndarray,
    *,
    sync_node: np.ndarray,
    instance: np.ndarray,
    unit: np.ndarray,
    iteration: np.ndarray,
    shared: np.ndarray | None = None,
) -> RankSteps:
    """Sum each participation's wait and lateness per (unit, step) and column.

    Args:
        start: ``(nodes, columns)`` emulated starts (one column for the scalar core).
        arrival: ``(instances, columns)`` last arrival of each instance.
        sync_node: per participation, its sync node (node index).
        instance: per participation, its instance.
        unit: per participation, its unit.
        iteration: per participation, its step (negative: none; left out).
        shared: per instance, whether it spans the columns (its first arrival is then the
            earliest over every column too); None: no instance does.

    Returns:
        The sums, one group per (unit, step) with a communication call.
    """
    # The column count comes from ``start`` alone: a run without collectives has no instance,
    # and an empty ``arrival`` cannot say how many columns it has (``reshape(0, -1)`` fails).
    cols = start.shape[1] if start.ndim == 2 else 1
    start = start.reshape(start.shape[0], cols)
    arrival = arrival.reshape(arrival.shape[0], cols)
    node = np.asarray(sync_node, dtype=np.int64)
    inst = np.asarray(instance, dtype=np.int64)
    # Columns in blocks: the gathered (participations, block) matrices stay ~16 MB each.
    blocks = range(0, cols, max(1, _BLOCK // max(node.size, 1)))
    # First arrival per instance and column: a min over its participants, gathered in instance
    # order (every participation counts, with a step or not).
    by_inst = np.argsort(inst, kind="stable")
    first = np.zeros((arrival.shape[0], cols), dtype=np.int64)
    if by_inst.size:
        seg = np.flatnonzero(np.diff(inst[by_inst], prepend=-1))
        rows, at = node[by_inst], inst[by_inst][seg]
        for c0 in blocks:
            c1 = min(cols, c0 + blocks.step)
            first[at, c0:c1] = np.minimum.reduceat(start[rows, c0:c1], seg, axis=0)
    if shared is not None and shared.any():
        first[shared] = first[shared].min(axis=1, keepdims=True)
    # The participations with a step, in (unit, step) order: one gather of each matrix, the
    # differences in place, one sum per group.
    u_all = np.asarray(unit, dtype=np.int64)
    it_all = np.asarray(iteration, dtype=np.int64)
    order = np.lexsort((it_all, u_all))
    order = order[it_all[order] >= 0]
    if order.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return RankSteps(z, z, z, np.zeros((0, cols), np.int64), np.zeros((0, cols), np.int64))
    u, it = u_all[order], it_all[order]
    seg = np.flatnonzero((np.diff(u, prepend=-1) != 0) | (np.diff(it, prepend=it[0] - 1) != 0))
    wait_sum = np.empty((seg.size, cols), dtype=np.int64)
    late_sum = np.empty((seg.size, cols), dtype=np.int64)
    rows, inst_o = node[order], inst[order]
    for c0 in blocks:
        c1 = min(cols, c0 + blocks.step)
        s = start[rows, c0:c1]
        wait = arrival[inst_o, c0:c1]
        wait -= s
        wait_sum[:, c0:c1] = np.add.reduceat(wait, seg, axis=0)
        del wait
        s -= first[inst_o, c0:c1]
        late_sum[:, c0:c1] = np.add.reduceat(s, seg, axis=0)
    return RankSteps(
        unit=u[seg],
        iteration=it[seg],
        calls=np.diff(np.append(seg, u.size)),
        wait=wait_sum,
        late=late_sum,
    )


def rank_step_rows(
    steps: RankSteps,
    *,
    rank_of: np.ndarray,
    column_of: np.ndarray,
    peaks: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """``rank_step`` rows (less ``run_id``) of every rank of the world.

    Args:
        steps: ``rank_steps``' sums.
        rank_of: ``(units, replicas)`` the rank of each unit in each replica (one replica column
            per unit for the scalar core: its class members, -1 padded).
        column_of: ``(replicas,)`` the simulated column each replica follows.
        peaks: ``unit, iteration, peak`` peak ``total_allocated`` per unit and step (a class
            member allocates what its exemplar does: only its timing differs); None or empty:
            ``peak_allocated`` is NULL.

    Returns:
        ``rank, iteration, comm_calls, wait_ns, late_ns, peak_allocated`` in (unit, step,
        replica) order (not sorted by rank: 2 M rows at 65,536 ranks).
    """
    reps = rank_of.shape[1]
    g = np.repeat(np.arange(steps.unit.size), reps)
    rep = np.tile(np.arange(reps), steps.unit.size)
    rank = rank_of[steps.unit][:, :].ravel()
    col = column_of[rep]
    ok = rank >= 0
    g, col, rank = g[ok], col[ok], rank[ok]
    out = pl.DataFrame(
        {
            "rank": rank.astype(np.int32),
            "iteration": steps.iteration[g].astype(np.int32),
            "comm_calls": steps.calls[g].astype(np.int32),
            "wait_ns": steps.wait[g, col],
            "late_ns": steps.late[g, col],
            "_unit": steps.unit[g],
        }
    )
    if peaks is not None and not peaks.is_empty():
        p = peaks.select(
            pl.col("unit").cast(pl.Int64).alias("_unit"),
            pl.col("iteration").cast(pl.Int32),
            pl.col("peak").cast(pl.Int64).alias("peak_allocated"),
        )
        out = out.join(p, on=["_unit", "iteration"], how="left")
    else:
        out = out.with_columns(pl.lit(None, pl.Int64).alias("peak_allocated"))
    return out.drop("_unit")

"""Declaring a recorded run's layout: check it against the trace, store it, widen the world.

The user's word wins over inference (a TP8 job whose trace shows only ``default_pg`` looks like
8-way data parallelism), but only once the recording agrees with it: the coordinates its trace
headers give and every group with members must fit. ``choice`` reads the declared layout back.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from prism_trace.errors import PrismError
from prism_trace.layout.assign import write_axes
from prism_trace.layout.choice import LayoutChoice, run_config
from prism_trace.layout.infer import misfit, read_groups
from prism_trace.layout.mesh import AXES, LayoutError, ParallelAxis, ParallelLayout
from prism_trace.store.connection import Store
from prism_trace.store.write import drop_run, set_run_config, set_run_world_size

__all__ = ["declare_layout", "declare_layout_of_new_run"]


def declare_layout(store: Store, run: str, layout: ParallelLayout) -> LayoutChoice:
    """Declare the recorded layout of ``run``: check it against the run, store it, assign axes.

    A layout larger than the run's world (a recording of some ranks of a larger job, or of one
    rank per TP group) widens the world, and the default group with it.

    Args:
        store: an open, writable store.
        run: a recorded run.
        layout: what the user says the job was.

    Returns:
        The choice (source ``declared``).

    Raises:
        LayoutError: a recorded rank lies outside the layout, the layout is smaller than the
            recorded world, or a group or a rank's recorded coordinates do not fit it (the
            message names which).
    """
    run_id = store.require_run(run)
    con = store.con
    ((kind, world),) = con.execute(
        "SELECT kind, world_size FROM run WHERE run_id = ?", [run_id]
    ).fetchall()
    if kind != "recorded":
        msg = f"run {run!r} is {kind}; a layout is declared for a recorded run"
        raise LayoutError(msg)
    ranks, coords = _trace_coords(store, run_id)
    world = int(world or 0)
    config = run_config(store, run_id)
    # The world the trace recorded, before any declaration widened it.
    traced = int(config.get("recorded_world") or world)
    if layout.world_size < traced:
        msg = (
            f"run {run!r}: layout {layout.spec} has {layout.world_size} ranks, but the trace"
            f" records a world of {traced}"
        )
        raise LayoutError(msg)
    groups = read_groups(con, run_id)
    grown = layout.world_size != world
    if grown:  # the default group spans the world: widen it with the world
        old = list(range(world))
        groups = [g if list(g.ranks) != old else dataclasses.replace(g, ranks=()) for g in groups]
    reason = misfit(layout, groups, ranks, coords)
    if reason is not None:
        msg = f"run {run!r}: declared layout {layout} does not fit: {reason}"
        raise LayoutError(msg)
    config["recorded_world"] = traced
    config["layout"] = {"spec": layout.spec, "order": layout.order_spec, "source": "declared"}
    with store.transaction() as tx:
        if grown:
            new = list(range(layout.world_size))
            tx.execute(
                "UPDATE comm_group SET ranks = ?, size = ? WHERE run_id = ? AND ranks = ?",
                [new, len(new), run_id, list(range(world))],
            )
            set_run_world_size(tx, run_id, layout.world_size)
        set_run_config(tx, run_id, config)
        write_axes(tx, run_id, layout, run=run)
    return LayoutChoice(layout, "declared", [f"declared {layout.spec}"])


def declare_layout_of_new_run(
    store: Store, run: str, layout: ParallelLayout, *, run_id: int
) -> LayoutChoice:
    """`ingest --layout`: declare the layout of a run just ingested, or drop the run.

    All or nothing, like the ingest itself: a layout the recording contradicts leaves no run
    behind (the store is as before the command).
    """
    try:
        return declare_layout(store, run, layout)
    except PrismError:
        with store.transaction() as con:
            drop_run(con, run_id)
        raise


def _trace_coords(store: Store, run_id: int) -> tuple[np.ndarray, dict[ParallelAxis, np.ndarray]]:
    """The ranks and the coordinates their trace headers give (``rank.args``), -1 where none.

    Not the ``rank`` table's ``tp..pp`` columns: an earlier layout (inferred, or declared and
    now corrected) overwrote those.
    """
    cols = ", ".join(
        f"coalesce(TRY_CAST(args->>'{a}' AS INTEGER),"
        f" TRY_CAST(args->'prism_layout'->>'{a}_rank' AS INTEGER), -1)"
        for a in AXES
    )
    rows = store.con.execute(
        f"SELECT rank, {cols} FROM rank WHERE run_id = ? ORDER BY rank", [run_id]
    ).fetchall()
    ranks = np.array([r[0] for r in rows], dtype=np.int64)
    return ranks, {
        a: np.array([r[i + 1] for r in rows], dtype=np.int64) for i, a in enumerate(AXES)
    }

"""Writing a layout onto a run's rows: each group's ``comm_group.axis`` and each rank's ``tp..pp``.

Used for a layout that is declared (``declare``), inferred (``prism graph``) or read back before
slicing. Every check comes before the first write, so a refused layout leaves the rows as they
were even inside a larger transaction (DuckDB has no savepoints to undo half of it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from prism_trace.layout.infer import read_groups
from prism_trace.layout.mesh import AXES, LayoutError, ParallelLayout
from prism_trace.layout.roles import group_axis

if TYPE_CHECKING:
    import duckdb

    from prism_trace.store.connection import Store

__all__ = ["assign_axes", "write_axes"]


def write_axes(
    con: duckdb.DuckDBPyConnection, run_id: int, layout: ParallelLayout, *, run: str
) -> dict[int, str]:
    """Fill ``comm_group.axis`` and the ranks' coordinates of one run, inside the caller's
    transaction (``assign_axes`` opens one; declaring and slicing call this inside theirs).

    Args:
        con: the connection of the open transaction.
        run_id: the run's id.
        layout: its layout.
        run: the run's name, for messages.

    Returns:
        The axis value written per group id (groups without member lists are left NULL).

    Raises:
        LayoutError: a group fits no axis combination (the message names it), or a rank lies
            outside the layout's world; nothing is written then.
    """
    axes: dict[int, str] = {}
    for g in read_groups(con, run_id):
        if not g.ranks:
            continue
        axes[g.group_id] = group_axis(layout, g.ranks, g.description, name=g.name)
    ranks = np.array(
        [r[0] for r in con.execute("SELECT rank FROM rank WHERE run_id = ?", [run_id]).fetchall()],
        dtype=np.int64,
    )
    if ranks.size and ranks.max() >= layout.world_size:
        msg = f"run {run!r}: rank {int(ranks.max())} is outside the {layout.world_size} of {layout}"
        raise LayoutError(msg)
    c = layout.coords(ranks)
    if axes:
        con.executemany(
            "UPDATE comm_group SET axis = ? WHERE run_id = ? AND group_id = ?",
            [[v, run_id, k] for k, v in axes.items()],
        )
    con.executemany(
        "UPDATE rank SET tp = ?, cp = ?, ep = ?, dp = ?, pp = ? WHERE run_id = ? AND rank = ?",
        [[*(int(c[a][i]) for a in AXES), run_id, int(r)] for i, r in enumerate(ranks)],
    )
    return axes


def assign_axes(store: Store, run: str, layout: ParallelLayout) -> dict[int, str]:
    """Write ``comm_group.axis`` and ``rank.tp..pp`` of a run under ``layout``, atomically.

    Args:
        store: an open, writable store.
        run: the run name.
        layout: its layout (e.g. from ``choice.infer_layout``).

    Returns:
        The axis value written per group id (groups without member lists are left NULL).

    Raises:
        LayoutError: a group fits no axis combination (the message names it); nothing is written.
    """
    run_id = store.require_run(run)
    with store.transaction() as con:
        return write_axes(con, run_id, layout, run=run)

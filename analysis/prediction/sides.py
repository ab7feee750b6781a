"""The two sides of a prediction check: each run's ranks and roles, one rank per role, the steps.

A *role* is a rank's coordinates on the axes that do not replicate work: ``(pp, tp, cp, ep)``.
Ranks of one role differ only in their data-parallel coordinate, so they run the same program;
one rank per role (the lowest that holds events: a sliced or emulated run's class exemplar, a
recording's dp-0 rank) stands for all of them in the structure comparison. Roles come from the
``rank`` table's coordinate columns; a run whose ranks have none gets them from its layout
(``layout.choice.infer_layout``, read only), else every rank has role ``(0, 0, 0, 0)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from prism_trace.errors import PrismError, RunStateError
from prism_trace.layout.mesh import ParallelAxis
from prism_trace.store.connection import Store

__all__ = [
    "COORDS",
    "ROLE_AXES",
    "RunSide",
    "common_iterations",
    "group_axes",
    "role_label",
    "run_side",
]

ROLE_AXES = ("pp", "tp", "cp", "ep")
"""The coordinates that make a role (every axis but dp), in the order labels name them."""
COORDS = ("tp", "cp", "ep", "dp", "pp")
"""The coordinate columns of the ``rank`` table."""


@dataclass(frozen=True)
class RunSide:
    """One run of the comparison: what every query about it needs.

    Attributes:
        name: the run's name.
        run_id: its id.
        kind: ``run.kind``.
        world_size: ranks in its world.
        ranks: every rank of the run with its coordinates (``rank, tp, cp, ep, dp, pp``, no
            nulls) and ``class_id`` (null when the run has no classes).
        with_events: the ranks that hold events of their own.
    """

    name: str
    run_id: int
    kind: str
    world_size: int
    ranks: pl.DataFrame
    with_events: frozenset[int]

    def representatives(self) -> dict[tuple[int, ...], int]:
        """Role ``(pp, tp, cp, ep)`` -> the lowest rank of that role with events of its own."""
        out: dict[tuple[int, ...], int] = {}
        for row in self.ranks.sort("rank").iter_rows(named=True):
            role = tuple(int(row[a]) for a in ROLE_AXES)
            if role not in out and int(row["rank"]) in self.with_events:
                out[role] = int(row["rank"])
        return out

    def coords_of(self) -> dict[int, tuple[int, ...]]:
        """Rank -> its coordinates in ``COORDS`` order (for peer offsets)."""
        return {
            int(r["rank"]): tuple(int(r[c]) for c in COORDS)
            for r in self.ranks.iter_rows(named=True)
        }


def run_side(store: Store, name: str) -> RunSide:
    """The run ``name`` as one side of a comparison.

    Raises:
        PrismError: no such run, or a run without ranks.
    """
    run_id = store.require_run(name)
    ((kind, world),) = store.con.execute(
        "SELECT kind, world_size FROM run WHERE run_id = ?", [run_id]
    ).fetchall()
    ranks = store.con.sql(
        "SELECT rank, tp, cp, ep, dp, pp, class_id FROM rank WHERE run_id = $1 ORDER BY rank",
        params=[run_id],
    ).pl()
    if ranks.is_empty():
        msg = f"{store.path}: run {name!r} has no ranks"
        raise RunStateError(msg)
    if all(ranks[c].null_count() == ranks.height for c in COORDS):
        ranks = _coords_from_layout(store, name, ranks)
    ranks = ranks.with_columns(pl.col(c).fill_null(0).cast(pl.Int64) for c in COORDS)
    with_events = frozenset(
        int(r)
        for (r,) in store.con.execute(
            "SELECT DISTINCT rank FROM event WHERE run_id = ?", [run_id]
        ).fetchall()
    )
    return RunSide(
        name=name,
        run_id=run_id,
        kind=str(kind),
        world_size=int(world or ranks.height),
        ranks=ranks,
        with_events=with_events,
    )


def _coords_from_layout(store: Store, name: str, ranks: pl.DataFrame) -> pl.DataFrame:
    """``ranks`` with coordinates from the run's layout (unchanged when it has none)."""
    from prism_trace.layout.choice import infer_layout

    try:
        layout = infer_layout(store, name)
    except PrismError:
        return ranks
    members = ranks["rank"].to_numpy().astype(np.int64)
    if members.size and members.max() >= layout.world_size:
        return ranks
    c = layout.coords(members)
    return ranks.with_columns(
        pl.Series(a, c[ParallelAxis(a)].astype(np.int64), dtype=pl.Int64) for a in COORDS
    )


def role_label(role: tuple[int, ...], varying: Sequence[str]) -> str:
    """A role as text, naming the axes that vary among the roles compared: ``pp=1``."""
    named = [f"{a}={v}" for a, v in zip(ROLE_AXES, role, strict=True) if a in varying]
    return ",".join(named) if named else "all ranks"


def group_axes(store: Store, side: RunSide) -> dict[int, str]:
    """``group_id`` -> its parallel axis (``comm_group.axis``; for a run whose groups have
    none yet, a recording before `prism graph`, worked out from its layout; else the
    group's description, else ``?``)."""
    rows = store.con.execute(
        "SELECT group_id, name, description, ranks, axis FROM comm_group WHERE run_id = ?",
        [side.run_id],
    ).fetchall()
    out: dict[int, str] = {}
    layout = None
    if any(axis is None for *_, axis in rows):
        from prism_trace.layout.choice import infer_layout
        from prism_trace.layout.roles import group_axis

        try:
            layout = infer_layout(store, side.name)
        except PrismError:
            layout = None
    for gid, name, desc, members, axis in rows:
        if axis is None and layout is not None and members:
            try:
                axis = group_axis(layout, members, desc, name=name)
            except PrismError:
                axis = None
        out[int(gid)] = str(axis or desc or "?")
    return out


def common_iterations(
    store: Store, predicted: Sequence[RunSide], recorded: RunSide, warmup: int
) -> tuple[list[int], list[int]]:
    """The steps compared and the warm-up steps left out.

    The steps every predicted run and the recording hold (in the ``iteration`` table), in order;
    the first ``warmup`` of them are left out while at least one remains (a first profiled step
    often carries one-off work: allocator growth, lazy initialisation, the profiler starting).

    Returns:
        ``(compared, left_out)``.
    """
    common: set[int] | None = None
    for side in (*predicted, recorded):
        steps = {
            int(i)
            for (i,) in store.con.execute(
                "SELECT DISTINCT iteration FROM iteration WHERE run_id = ?", [side.run_id]
            ).fetchall()
        }
        common = steps if common is None else common & steps
    ordered = sorted(common or ())
    cut = min(max(warmup, 0), max(len(ordered) - 1, 0))
    return ordered[cut:], ordered[:cut]

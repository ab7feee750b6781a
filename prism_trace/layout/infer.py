"""Inferring a recorded run's layout from its groups and rank coordinates: sizes, then rank order.

The rules (``choice`` adds the reasons and the declared layout on top): sizes come from groups
whose description names one axis, else from the largest recorded coordinate, and dp takes what no
other axis explains; the order is the first permutation under which every recorded coordinate and
every group fits.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prism_trace.layout.mesh import (
    AXES,
    DEFAULT_ORDER,
    EMBD,
    WORLD,
    LayoutError,
    ParallelAxis,
    ParallelLayout,
    parse_axes,
    parse_order,
)
from prism_trace.layout.roles import AXIS_TOKENS, described_axis, group_axis

if TYPE_CHECKING:
    import duckdb

__all__ = [
    "RecordedGroup",
    "axis_sizes",
    "fit_layout",
    "misfit",
    "orderings",
    "read_coords",
    "read_groups",
]


@dataclass(frozen=True)
class RecordedGroup:
    """A communicator of a run as the store holds it (``ranks`` empty without a member list)."""

    group_id: int
    name: str | None
    description: str | None
    ranks: tuple[int, ...]


def read_groups(con: duckdb.DuckDBPyConnection, run_id: int) -> list[RecordedGroup]:
    """The run's communicators, by group id."""
    rows = con.execute(
        "SELECT group_id, name, description, ranks FROM comm_group WHERE run_id = ?"
        " ORDER BY group_id",
        [run_id],
    ).fetchall()
    return [RecordedGroup(int(g), n, d, tuple(int(x) for x in r or ())) for g, n, d, r in rows]


def read_coords(
    con: duckdb.DuckDBPyConnection, run_id: int
) -> tuple[np.ndarray, dict[ParallelAxis, np.ndarray]]:
    """The run's ranks and their ``rank.tp..pp`` coordinates (-1 where NULL), by rank."""
    rows = con.execute(
        "SELECT rank, tp, cp, ep, dp, pp FROM rank WHERE run_id = ? ORDER BY rank", [run_id]
    ).fetchall()
    ranks = np.array([r[0] for r in rows], dtype=np.int64)
    coords = {
        a: np.array([-1 if r[i + 1] is None else r[i + 1] for r in rows], dtype=np.int64)
        for i, a in enumerate(AXES)
    }
    return ranks, coords


def axis_sizes(
    world: int, groups: list[RecordedGroup], coords: dict[ParallelAxis, np.ndarray], run: str
) -> dict[ParallelAxis, int]:
    """Axis sizes of a run, from its described groups and recorded coordinates.

    Exact from described groups, else bounds from coordinates; data parallelism takes the ranks
    no other axis explains.

    Raises:
        LayoutError: groups described as one axis have different sizes, or the sizes do not
            multiply to ``world`` (the message names ``run``).
    """
    exact: dict[ParallelAxis, int] = {}
    for g in groups:
        described = described_axis(g.description)
        if described in AXIS_TOKENS and g.ranks:
            a = ParallelAxis(described)
            if exact.setdefault(a, len(g.ranks)) != len(g.ranks):
                msg = (
                    f"run {run!r}: {a} groups have different sizes ({exact[a]} and"
                    f" {len(g.ranks)} in group {g.name!r})"
                )
                raise LayoutError(msg)
    # Multi-axis descriptions (`dp-cp`) give one size more when the others are known.
    for g in groups:
        described = described_axis(g.description)
        if described in (None, WORLD, EMBD) or described in AXIS_TOKENS or not g.ranks:
            continue
        axes = parse_axes(described)  # type: ignore[arg-type]
        unknown = [a for a in axes if a not in exact]
        known = int(np.prod([exact[a] for a in axes if a in exact]))
        if len(unknown) == 1 and len(g.ranks) % known == 0:
            exact[unknown[0]] = len(g.ranks) // known
    sizes = {a: exact.get(a, max(1, int(coords[a].max(initial=-1)) + 1)) for a in AXES}
    if ParallelAxis.DP not in exact:
        rest = int(np.prod([sizes[a] for a in AXES if a != ParallelAxis.DP]))
        if world % rest == 0 and world // rest >= sizes[ParallelAxis.DP]:
            sizes[ParallelAxis.DP] = world // rest
    total = int(np.prod(list(sizes.values())))
    if total != world:
        got = ",".join(f"{a}={s}" for a, s in sizes.items())
        msg = (
            f"run {run!r}: axis sizes {got} from its groups and rank coordinates make"
            f" {total} ranks, but its world has {world}"
        )
        raise LayoutError(msg)
    return sizes


def misfit(
    layout: ParallelLayout,
    groups: list[RecordedGroup],
    ranks: np.ndarray,
    coords: dict[ParallelAxis, np.ndarray],
) -> str | None:
    """Why ``layout`` does not fit the run (None when it does)."""
    if ranks.size:
        if ranks.max() >= layout.world_size:
            return f"rank {int(ranks.max())} is outside the world of {layout.world_size}"
        mine = layout.coords(ranks)
        for a in AXES:
            known = coords[a] >= 0
            bad = known & (coords[a] != mine[a])
            if bad.any():
                r = int(ranks[bad][0])
                return (
                    f"rank {r} has {a}={int(coords[a][bad][0])} in the rank table,"
                    f" but {a}={int(mine[a][bad][0])} under {layout}"
                )
    for g in groups:
        if not g.ranks:
            continue
        try:
            group_axis(layout, g.ranks, g.description, name=g.name)
        except LayoutError as exc:
            return str(exc)
    return None


def orderings(
    sizes: Mapping[ParallelAxis, int], order: str | None = None
) -> Iterator[ParallelLayout]:
    """The layouts of these sizes under every rank order of the axes of size > 1.

    The first is ``order`` (default Megatron's); axes of size 1 keep their default slots, since
    they cannot change any rank.
    """
    big = [a for a in parse_order(order) if sizes[a] > 1]
    for perm in itertools.permutations(big):
        it = iter(perm)
        full = tuple(next(it) if sizes[a] > 1 else a for a in DEFAULT_ORDER)
        yield ParallelLayout(**{a.value: sizes[a] for a in AXES}, order=full)


def fit_layout(
    world: int,
    groups: list[RecordedGroup],
    ranks: np.ndarray,
    coords: dict[ParallelAxis, np.ndarray],
    *,
    run: str,
    order: str | None = None,
) -> ParallelLayout:
    """The layout of a run: ``axis_sizes``, under the first of its ``orderings`` that fits.

    Raises:
        LayoutError: the sizes do not fit the world, or no order fits every recorded coordinate
            and group (the message gives the first order's reason).
    """
    sizes = axis_sizes(world, groups, coords, run)
    first_reason = None
    for layout in orderings(sizes, order):
        reason = misfit(layout, groups, ranks, coords)
        if reason is None:
            return layout
        first_reason = first_reason or reason
    msg = f"run {run!r}: no rank order of the axes fits its groups and coordinates: {first_reason}"
    raise LayoutError(msg)

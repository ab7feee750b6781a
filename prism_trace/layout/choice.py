"""Where a run's parallel layout comes from: declared by the user, or inferred with its reasons.

Read only: declaring a layout lives in ``declare``, writing its axes onto the run in ``assign``.

A trace often does not say its layout. A Megatron TP8 job whose NCCL trace shows only
``default_pg`` looks exactly like an 8-way data-parallel one; only the user knows. So a layout
can be *declared* (``prism ingest --layout``, ``prism graph --layout``): it is stored in
``run.config_json`` (``layout``: spec, order, source) and every later step (``infer_layout``, so
slicing, emulation, validation) takes it as it is, after checking that the run's groups and
rank coordinates fit it. Otherwise the layout is *inferred* (``infer``'s rules: group
descriptions of Megatron, torchtitan and DeepSpeed, the ranks' coordinates in the trace
headers), and ``choose_layout`` says why and when the answer is ambiguous:

- several rank orders fit the groups;
- the run has no group but the default one: then the sizes come from *when* its collectives
  run. Tensor-parallel all-reduces run inside the forward compute (every layer, one activation
  size again and again); data-parallel gradient all-reduces run in the backward pass and after
  it. At least a quarter of the all-reduces in the first third of their step, and at least half
  of one size, read as ``tp=world``; otherwise ``dp=world``. Either way the answer is
  ambiguous and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prism_trace.layout.infer import (
    RecordedGroup,
    axis_sizes,
    fit_layout,
    misfit,
    orderings,
    read_coords,
    read_groups,
)
from prism_trace.layout.mesh import AXES, LayoutError, ParallelAxis, ParallelLayout
from prism_trace.layout.roles import described_axis
from prism_trace.store.connection import Store

__all__ = ["LayoutChoice", "choose_layout", "declared_layout", "infer_layout", "run_config"]

_FORWARD_SHARE = 1 / 3
"""All-reduces starting in this first share of their step run inside the forward compute."""
_TP_LIKE = 0.25
"""Share of a default group's all-reduces that must run in the forward for a tp reading."""
_ONE_SIZE = 0.5
"""Share of them that must have one size (the activations') for a tp reading; gradient buckets
vary."""


@dataclass
class LayoutChoice:
    """A run's layout and where it came from.

    Attributes:
        layout: the layout (None when none fits; ``error`` says why).
        source: ``declared`` (by the user) or ``inferred`` (from the trace).
        reasons: one line per size or order decision.
        ambiguous: why another layout would fit the trace as well, or None.
        error: why no layout fits, or None.
    """

    layout: ParallelLayout | None
    source: str
    reasons: list[str] = field(default_factory=list)
    ambiguous: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``prism info --json``, ``prism graph --json``)."""
        return {
            "spec": None if self.layout is None else self.layout.spec,
            "order": None if self.layout is None else self.layout.order_spec,
            "source": self.source,
            "reasons": self.reasons,
            "ambiguous": self.ambiguous,
            "error": self.error,
        }

    def text(self) -> str:
        """One line for the CLI."""
        if self.layout is None:
            return f"layout not inferred: {self.error}"
        out = f"layout {self.layout.spec} (order {self.layout.order_spec}), {self.source}"
        if self.reasons:
            out += f": {'; '.join(self.reasons)}"
        if self.ambiguous:
            out += f" [ambiguous: {self.ambiguous}]"
        return out


def run_config(store: Store, run_id: int) -> dict[str, Any]:
    """The run's ``config_json`` as a dict (empty when unset or not an object): where a declared
    layout is kept."""
    rows = store.con.execute("SELECT config_json FROM run WHERE run_id = ?", [run_id]).fetchall()
    try:
        data = json.loads(rows[0][0] or "{}") if rows else {}
    except ValueError:
        data = {}
    return data if isinstance(data, dict) else {}


def declared_layout(store: Store, run: str) -> ParallelLayout | None:
    """The layout declared for ``run`` (``declare_layout``), or None."""
    run_id = store.require_run(run)
    got = run_config(store, run_id).get("layout")
    if not isinstance(got, dict) or got.get("source") != "declared":
        return None
    return ParallelLayout.parse(str(got["spec"]), got.get("order"))


def _phase_reading(store: Store, run_id: int) -> tuple[float, int, float] | None:
    """For the all-reduces of the run: share in the forward third of their step, count, and the
    share of the most common size; None without any."""
    rows = store.con.execute(
        f"""WITH ar AS (
                SELECT c.msg_bytes, (c.host_ts - i.ts) / greatest(i.dur, 1) AS pos
                FROM collective c JOIN iteration i
                  ON i.run_id = c.run_id AND i.rank = c.rank AND i.iteration = c.iteration
                WHERE c.run_id = ? AND c.kind = 'all_reduce')
            SELECT avg((pos < {_FORWARD_SHARE})::INTEGER), count(*),
                   (SELECT count(*) FROM ar GROUP BY msg_bytes ORDER BY 1 DESC LIMIT 1)
            FROM ar""",
        [run_id],
    ).fetchall()
    share, n, top = rows[0]
    if not n:
        return None
    return float(share), int(n), float(top or 0) / int(n)


def choose_layout(store: Store, run: str, *, order: str | None = None) -> LayoutChoice:
    """The layout of ``run``: the declared one, else inferred from the trace, with reasons.

    Args:
        store: the store.
        run: a run name.
        order: the rank order to try first (inference only).

    Returns:
        The choice; ``layout`` is None (and ``error`` set) when no layout fits.
    """
    run_id = store.require_run(run)
    declared = declared_layout(store, run)
    if declared is not None:
        return LayoutChoice(declared, "declared", [f"declared {declared.spec}"])
    con = store.con
    (row,) = con.execute("SELECT world_size FROM run WHERE run_id = ?", [run_id]).fetchall()
    groups = read_groups(con, run_id)
    ranks, coords = read_coords(con, run_id)
    world = int(row[0] if row and row[0] else (int(ranks.max()) + 1 if ranks.size else 1))
    try:
        sizes = axis_sizes(world, groups, coords, run)
        layout = fit_layout(world, groups, ranks, coords, run=run, order=order)
    except LayoutError as exc:
        return LayoutChoice(None, "inferred", error=str(exc).splitlines()[0])
    reasons = _size_reasons(groups, coords, sizes, world)
    ambiguous = _other_orders(layout, groups, ranks, coords)
    described = {described_axis(g.description) for g in groups if g.ranks}
    only_world = described <= {"world", None} and all(len(g.ranks) in (0, 1, world) for g in groups)
    if only_world and world > 1 and not (coords[ParallelAxis.TP] > 0).any():
        reading = _phase_reading(store, run_id)
        if reading is not None and reading[0] >= _TP_LIKE and reading[2] >= _ONE_SIZE:
            share, n, top = reading
            layout = ParallelLayout(tp=world)
            reasons = [
                f"tp={world}: the default group is the only one, and {share:.0%} of its {n}"
                f" all-reduces run inside the forward compute ({top:.0%} of one size), as"
                " tensor-parallel ones do"
            ]
        elif reading is not None:
            reasons = [
                f"dp={world}: the default group is the only one, and its {reading[1]}"
                " all-reduces run in the backward pass or after it, as gradient reductions do"
            ]
        ambiguous = (
            "the trace shows only the default group, so the axes are read from when its"
            " collectives run; declare the layout (--layout) if the job was otherwise"
        )
    return LayoutChoice(layout, "inferred", reasons, ambiguous)


def _size_reasons(
    groups: list[RecordedGroup],
    coords: dict[ParallelAxis, np.ndarray],
    sizes: dict[ParallelAxis, int],
    world: int,
) -> list[str]:
    """Why each axis of size > 1 has its size."""
    out: list[str] = []
    for a in AXES:
        if sizes[a] <= 1:
            continue
        g = next((g for g in groups if described_axis(g.description) == a.value and g.ranks), None)
        if g is not None:
            out.append(f"{a}={sizes[a]}: group {g.name!r} is described {g.description!r}")
        elif int(coords[a].max(initial=-1)) + 1 == sizes[a]:
            out.append(f"{a}={sizes[a]}: the ranks' coordinates in the trace")
        elif a == ParallelAxis.DP:
            out.append(f"dp={sizes[a]}: the part of the world of {world} no other axis explains")
        else:
            out.append(f"{a}={sizes[a]}")
    return out


def _other_orders(
    layout: ParallelLayout,
    groups: list[RecordedGroup],
    ranks: np.ndarray,
    coords: dict[ParallelAxis, np.ndarray],
) -> str | None:
    """Another rank order that fits as well, in words, or None."""
    if sum(layout.size(a) > 1 for a in AXES) < 2:
        return None
    fits = [
        other.order_spec
        for other in orderings(layout.sizes)
        if misfit(other, groups, ranks, coords) is None
    ]
    if len(fits) > 1:
        return f"rank orders {', '.join(fits)} all fit the groups"
    return None


def infer_layout(store: Store, run: str, *, order: str | None = None) -> ParallelLayout:
    """The parallel layout of a recorded run: the declared one, else from its groups and ranks.

    ``choose_layout`` without the reasons, for the steps that only need the layout (slicing,
    emulation, validation). Sizes come from groups whose description names one axis (``tp``,
    ``data``, ``dp_stage0``, ...), else from the largest coordinate in the ``rank`` table; ``dp``
    takes whatever part of the world no other axis explains (so a plain data-parallel job with
    only ``default_pg`` is ``dp=world``). The order is the first permutation (starting from
    ``order``, default Megatron's) under which every rank's recorded coordinates and every group
    fit.

    Args:
        store: the store.
        run: a run name.
        order: the order to try first (``tp-cp-ep-dp-pp`` by default).

    Returns:
        The layout.

    Raises:
        LayoutError: sizes that do not multiply to the world, or a group that fits no axis
            combination under any order (the message names the group).
        RunNotFoundError: no such run.
    """
    choice = choose_layout(store, run, order=order)
    if choice.layout is None:
        raise LayoutError(choice.error or f"run {run!r}: no layout fits")
    return choice.layout

"""Where a run's parallel layout comes from: declared by the user, or inferred with its reasons.

A trace often does not say its layout. A Megatron TP8 job whose NCCL trace shows only
``default_pg`` looks exactly like an 8-way data-parallel one; only the user knows. So a layout
can be *declared* (``prism ingest --layout``, ``prism graph --layout``): it is stored in
``run.config_json`` (``layout``: spec, order, source) and every later step (``infer_layout``, so
slicing, emulation, validation) takes it as it is, after checking that the run's groups and
rank coordinates fit it. Otherwise the layout is *inferred* (``parallel``'s rules: group
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

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prism_trace.errors import PrismError
from prism_trace.layout.parallel import (
    AXES,
    DEFAULT_ORDER,
    LayoutError,
    ParallelAxis,
    ParallelLayout,
    _check,
    _described_axis,
    _infer,
    _parse_order,
    _read_coords,
    _read_groups,
    _sizes,
    _write_axes,
)
from prism_trace.store.connection import Store
from prism_trace.store.write import drop_run

__all__ = ["LayoutChoice", "choose_layout", "declare_layout", "declared_layout"]

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


def _config(store: Store, run_id: int) -> dict[str, Any]:
    rows = store.con.execute("SELECT config_json FROM run WHERE run_id = ?", [run_id]).fetchall()
    try:
        data = json.loads(rows[0][0] or "{}") if rows else {}
    except ValueError:
        data = {}
    return data if isinstance(data, dict) else {}


def declared_layout(store: Store, run: str) -> ParallelLayout | None:
    """The layout declared for ``run`` (``declare_layout``), or None."""
    run_id = store.require_run(run)
    got = _config(store, run_id).get("layout")
    if not isinstance(got, dict) or got.get("source") != "declared":
        return None
    return ParallelLayout.parse(str(got["spec"]), got.get("order"))


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
    config = _config(store, run_id)
    # The world the trace recorded, before any declaration widened it.
    traced = int(config.get("recorded_world") or world)
    if layout.world_size < traced:
        msg = (
            f"run {run!r}: layout {layout.spec} has {layout.world_size} ranks, but the trace"
            f" records a world of {traced}"
        )
        raise LayoutError(msg)
    groups = _read_groups(con, run_id)
    grown = layout.world_size != world
    if grown:  # the default group spans the world: widen it with the world
        old = list(range(world))
        groups = [
            g if list(g.ranks) != old else type(g)(g.group_id, g.name, g.description, ())
            for g in groups
        ]
    reason = _check(layout, groups, ranks, coords)
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
            tx.execute(
                "UPDATE run SET world_size = ? WHERE run_id = ?", [layout.world_size, run_id]
            )
        tx.execute("UPDATE run SET config_json = ? WHERE run_id = ?", [json.dumps(config), run_id])
        _write_axes(tx, run_id, layout, run=run)
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
    got = _config(store, run_id).get("layout")
    if isinstance(got, dict) and got.get("source") == "declared":
        layout = ParallelLayout.parse(str(got["spec"]), got.get("order"))
        return LayoutChoice(layout, "declared", [f"declared {layout.spec}"])
    con = store.con
    (row,) = con.execute("SELECT world_size FROM run WHERE run_id = ?", [run_id]).fetchall()
    groups = _read_groups(con, run_id)
    ranks, coords = _read_coords(con, run_id)
    world = int(row[0] if row and row[0] else (int(ranks.max()) + 1 if ranks.size else 1))
    try:
        sizes = _sizes(world, groups, coords, run)
        layout = _infer(world, groups, ranks, coords, run=run, order=order)
    except LayoutError as exc:
        return LayoutChoice(None, "inferred", error=str(exc).splitlines()[0])
    reasons = _size_reasons(groups, coords, sizes, world)
    ambiguous = _other_orders(layout, groups, ranks, coords)
    described = {_described_axis(g.description) for g in groups if g.ranks}
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
    groups: list[Any],
    coords: dict[ParallelAxis, np.ndarray],
    sizes: dict[ParallelAxis, int],
    world: int,
) -> list[str]:
    """Why each axis of size > 1 has its size."""
    out: list[str] = []
    for a in AXES:
        if sizes[a] <= 1:
            continue
        g = next((g for g in groups if _described_axis(g.description) == a.value and g.ranks), None)
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
    layout: ParallelLayout, groups: list[Any], ranks: np.ndarray, coords: dict[Any, np.ndarray]
) -> str | None:
    """Another rank order that fits as well, in words, or None."""
    big = [a for a in _parse_order(None) if layout.size(a) > 1]
    if len(big) < 2:
        return None
    fits: list[str] = []
    for perm in itertools.permutations(big):
        it = iter(perm)
        full = tuple(next(it) if layout.size(a) > 1 else a for a in DEFAULT_ORDER)
        other = ParallelLayout(**{a.value: layout.size(a) for a in AXES}, order=full)
        if _check(other, groups, ranks, coords) is None:
            fits.append(other.order_spec)
    if len(fits) > 1:
        return f"rank orders {', '.join(fits)} all fit the groups"
    return None

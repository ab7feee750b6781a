"""Which host-ET nodes a replay executes: the outermost ops, not their children or containers."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prism_trace.replay.kernels.schema import COMM_OP_PREFIXES, SKIPPED_NAMESPACES

if TYPE_CHECKING:
    import polars as pl

__all__ = ["Unit", "select_units"]


@dataclass(frozen=True)
class Unit:
    """One step of a rank's replay: a compute op or a communication call.

    Attributes:
        index: position in the rank's program.
        kind: ``compute`` or ``comm``.
        node_id: the ET node (``et_op.node_id``).
        name: its name.
        iteration: training step (the ``ProfilerStep#`` it ran under), None when unknown.
        event_id: the linked Kineto event, None when unlinked.
    """

    index: int
    kind: str
    node_id: int
    name: str
    iteration: int | None
    event_id: int | None


_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def select_units(
    ops: pl.DataFrame, comm_event_ids: Iterable[int]
) -> tuple[list[Unit], Counter[str]]:
    """The units a replay executes, in recorded order, and what it leaves out.

    Args:
        ops: ``et_op`` rows of one rank (``node_id``, ``parent_node_id``, ``name``, ``op_schema``,
            ``event_id``; optional ``iteration`` from the linked events).
        comm_event_ids: recorded events that are communication nodes of the run's graph.

    Returns:
        The units and the counts of skipped ops per reason: ``inside_op`` (an ancestor op runs
        it), ``inside_comm`` (part of a communication unit), ``profiler`` and ``uncovered_comm``
        (a communication op no graph node covers).
    """
    comm = set(comm_event_ids)
    rows = ops.sort("node_id").select(
        "node_id",
        "parent_node_id",
        "name",
        "op_schema",
        "event_id",
        *(["iteration"] if "iteration" in ops.columns else []),
    )
    state: dict[int, str] = {}
    iteration: dict[int, int | None] = {}
    units: list[Unit] = []
    skipped: Counter[str] = Counter()
    has_it = "iteration" in rows.columns
    for r in rows.iter_rows(named=True):
        nid, parent, name = r["node_id"], r["parent_node_id"], r["name"]
        pstate = state.get(parent, "container") if parent is not None else "container"
        step = _STEP.match(name)
        it = int(step.group(1)) if step else iteration.get(parent) if parent is not None else None
        if it is None and has_it and r["iteration"] is not None:
            it = int(r["iteration"])
        iteration[nid] = it
        if pstate in ("op", "comm"):
            state[nid] = pstate
            skipped["inside_op" if pstate == "op" else "inside_comm"] += int(
                r["op_schema"] is not None
            )
            continue
        ev = r["event_id"]
        if ev is not None and ev in comm:
            state[nid] = "comm"
            units.append(Unit(len(units), "comm", nid, name, it, ev))
        elif r["op_schema"] is not None:
            state[nid] = "op"
            if name.startswith(SKIPPED_NAMESPACES):
                skipped["profiler"] += 1
            elif name.startswith(COMM_OP_PREFIXES):
                skipped["uncovered_comm"] += 1
            else:
                units.append(Unit(len(units), "compute", nid, name, it, ev))
        else:
            state[nid] = "container"
    return units, skipped

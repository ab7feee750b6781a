"""The structure of one step, predicted against recorded: ops, collectives and p2p per role.

For each role (``sides``), one rank of each run over one step: the ops it ran (by name and
kind), its collectives (kind, bytes, group size and axis) and its point-to-point transfers
(direction, bytes, and the peer's offset in the layout, ``pp+1``), as counts. Where the counts
differ, the difference is listed in words.

What counts as an op: the nodes of the execution graph, the unit the emulator runs. An emulated
run's events are exactly its graph's nodes; a recording's events are many more (nested ops,
annotations), so its ops are the events its graph made nodes of (``graph_node.event_id``). A
recording without a graph has no op comparison (`prism graph` builds one; `prism predict`
builds it inside its transaction). An op's kind is ``collective``, ``send`` or ``recv`` for a
communication call, else its event category.

Names that carry per-run ids (a process group's number, a sequence number, a step number, an
address) would make every op of two runs differ. So names are compared with every number that
does not continue a word replaced by ``N`` (``pg=7;seq=16`` and ``pg=12;seq=16`` both read
``pg=N;seq=N``, ``ProfilerStep#3`` reads ``ProfilerStep#N``), hexadecimal addresses included,
while ``conv2d`` or ``fp16`` stay as they are. The rule knows no framework's names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl
from prism_trace.analysis.prediction.sides import (
    COORDS,
    ROLE_AXES,
    RunSide,
    group_axes,
    role_label,
)

from prism_trace.store.connection import Store

__all__ = [
    "NUMBER_RULE",
    "SECTIONS",
    "ClassStructure",
    "StructureComparison",
    "compare_structure",
    "first_differences",
    "structure_table",
]

NUMBER_RULE = r"(^|[^A-Za-z0-9])(0x[0-9A-Fa-f]+|[0-9]+)"
"""A number that does not continue a word (with the character before it): replaced by ``N``
in op names before they are compared."""

SECTIONS = ("collectives", "p2p", "ops")
"""The parts of a step compared, in the order their differences are listed."""


@dataclass(frozen=True)
class ClassStructure:
    """One role's step, predicted against recorded.

    Attributes:
        label: the role (``pp=1``).
        predicted_rank: the predicted run's rank for it (None: the role is missing).
        recorded_rank: the recording's rank for it (None: the role is missing).
        counts: per section, ``(predicted, recorded)`` totals (ops, calls).
        differences: per section, how many keys (an op name and kind; a collective's kind,
            size, group size and axis; a transfer's direction, size and peer) differ in count.
        listed: the first differences, in words.
    """

    label: str
    predicted_rank: int | None
    recorded_rank: int | None
    counts: dict[str, tuple[int, int]]
    differences: dict[str, int]
    listed: list[str]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "class": self.label,
            "predicted_rank": self.predicted_rank,
            "recorded_rank": self.recorded_rank,
            **{
                f"{s}_{w}": self.counts.get(s, (0, 0))[i]
                for s in SECTIONS
                for i, w in enumerate(("predicted", "recorded"))
            },
            **{f"{s}_differences": self.differences.get(s, 0) for s in SECTIONS},
            "first_differences": self.listed,
        }


@dataclass(frozen=True)
class StructureComparison:
    """The step's structure for every role.

    Attributes:
        iteration: the step compared (None: no step in common).
        classes: one entry per role of either run.
        ops_compared: whether ops were compared (the recording has a graph).
        notes: what was not compared, and why.
    """

    iteration: int | None
    classes: list[ClassStructure]
    ops_compared: bool
    notes: list[str] = field(default_factory=list)

    @property
    def differences(self) -> dict[str, int]:
        """Per section, the differing keys summed over the roles; ``classes``: roles only one
        run has."""
        out = {s: sum(c.differences.get(s, 0) for c in self.classes) for s in SECTIONS}
        out["classes"] = sum(
            1 for c in self.classes if c.predicted_rank is None or c.recorded_rank is None
        )
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "iteration": self.iteration,
            "ops_compared": self.ops_compared,
            "differences": self.differences,
            "classes": [c.as_dict() for c in self.classes],
            "notes": self.notes,
        }


def _ops(store: Store, side: RunSide, rank: int, iteration: int) -> dict[tuple[Any, ...], int]:
    """``(name, kind)`` -> count of the rank's ops in the step (names with numbers as ``N``)."""
    graph_only = side.kind == "recorded"
    rows = store.con.execute(
        "WITH comm AS (SELECT event_id, min(kind) AS kind FROM ("
        "  SELECT event_id, 'collective' AS kind FROM collective WHERE run_id = $1 AND rank = $2"
        "  UNION ALL SELECT event_id, direction FROM p2p WHERE run_id = $1 AND rank = $2)"
        " WHERE event_id IS NOT NULL GROUP BY event_id)"
        " SELECT regexp_replace(e.name, $4, '\\1N', 'g') AS name,"
        " coalesce(c.kind, e.category) AS kind, count(*)::BIGINT"
        " FROM event e LEFT JOIN comm c USING (event_id)"
        " WHERE e.run_id = $1 AND e.rank = $2 AND e.iteration = $3"
        " AND (NOT $5 OR e.event_id IN (SELECT event_id FROM graph_node"
        "  WHERE run_id = $1 AND rank = $2 AND event_id IS NOT NULL))"
        " GROUP BY ALL",
        [side.run_id, rank, iteration, NUMBER_RULE, graph_only],
    ).fetchall()
    return {(n, k): int(c) for n, k, c in rows}


def _collectives(
    store: Store, side: RunSide, rank: int, iteration: int, axes: dict[int, str]
) -> dict[tuple[Any, ...], int]:
    """``(kind, bytes, group size, axis)`` -> count of the rank's collectives in the step."""
    rows = store.con.execute(
        "SELECT c.kind, c.msg_bytes, coalesce(c.group_size, g.size), c.group_id, count(*)::BIGINT"
        " FROM collective c LEFT JOIN comm_group g"
        " ON g.run_id = c.run_id AND g.group_id = c.group_id"
        " WHERE c.run_id = ? AND c.rank = ? AND c.iteration = ? GROUP BY ALL",
        [side.run_id, rank, iteration],
    ).fetchall()
    out: dict[tuple[Any, ...], int] = {}
    for kind, size, members, gid, n in rows:
        key = (kind, size, members, axes.get(int(gid), "?") if gid is not None else "?")
        out[key] = out.get(key, 0) + int(n)
    return out


def _offset(mine: tuple[int, ...] | None, theirs: tuple[int, ...] | None) -> str:
    """The peer's place relative to the rank, per coordinate: ``pp+1``, ``dp-1,pp+1``."""
    if mine is None or theirs is None:
        return "?"
    parts = [f"{a}{t - m:+d}" for a, m, t in zip(COORDS, mine, theirs, strict=True) if t != m]
    return ",".join(parts) or "itself"


def _p2p(
    store: Store, side: RunSide, rank: int, iteration: int, coords: dict[int, tuple[int, ...]]
) -> dict[tuple[Any, ...], int]:
    """``(direction, bytes, peer offset)`` -> count of the rank's transfers in the step."""
    rows = store.con.execute(
        "SELECT direction, bytes, peer, count(*)::BIGINT FROM p2p"
        " WHERE run_id = ? AND rank = ? AND iteration = ? GROUP BY ALL",
        [side.run_id, rank, iteration],
    ).fetchall()
    out: dict[tuple[Any, ...], int] = {}
    for direction, size, peer, n in rows:
        key = (direction, size, _offset(coords.get(rank), coords.get(peer)))
        out[key] = out.get(key, 0) + int(n)
    return out


def _words(section: str, key: tuple[Any, ...]) -> str:
    """A key as readable text."""
    if section == "collectives":
        kind, size, members, axis = key
        return f"{kind} {size} B over {members} ranks ({axis})"
    if section == "p2p":
        direction, size, offset = key
        return f"{direction} {size} B to {offset}"
    name, kind = key
    return f"op {name} ({kind})"


def _differ(
    label: str,
    section: str,
    predicted: dict[tuple[Any, ...], int],
    recorded: dict[tuple[Any, ...], int],
) -> list[tuple[int, str]]:
    """``(|difference|, text)`` of every key whose counts differ, largest first."""
    out = []
    for key in set(predicted) | set(recorded):
        a, b = predicted.get(key, 0), recorded.get(key, 0)
        if a != b:
            out.append(
                (abs(a - b), f"class {label}: {_words(section, key)}: predicted {a}, recorded {b}")
            )
    return sorted(out, key=lambda t: (-t[0], t[1]))


def compare_structure(
    store: Store,
    predicted: RunSide,
    recorded: RunSide,
    iteration: int | None,
    *,
    listed: int = 3,
) -> StructureComparison:
    """Compare one step's ops, collectives and p2p per role.

    Args:
        store: an open store (read-only is fine).
        predicted: the prediction (its classes' exemplars hold the events).
        recorded: the recording at the same scale.
        iteration: the step to compare (None: nothing is compared).
        listed: differences listed in words per role.

    Returns:
        Per role, the counts and the first differences.
    """
    notes: list[str] = []
    if iteration is None:
        return StructureComparison(
            None, [], ops_compared=False, notes=["structure: no step in common"]
        )
    pred_reps, rec_reps = predicted.representatives(), recorded.representatives()
    ops_compared = bool(
        store.con.execute(
            "SELECT count(*) FROM graph_node WHERE run_id = ?", [recorded.run_id]
        ).fetchall()[0][0]
    )
    if not ops_compared:
        notes.append(
            f"ops not compared: the recording {recorded.name!r} has no execution graph"
            f" (`prism graph DB --run {recorded.name}` builds it)"
        )
    roles = sorted(set(pred_reps) | set(rec_reps))
    varying = [a for i, a in enumerate(ROLE_AXES) if len({r[i] for r in roles}) > 1]
    sides = (predicted, recorded)
    axes = [group_axes(store, s) for s in sides]
    coords = [s.coords_of() for s in sides]
    classes = []
    for role in roles:
        label = role_label(role, varying)
        ranks = (pred_reps.get(role), rec_reps.get(role))
        if None in ranks:
            missing = "prediction" if ranks[0] is None else "recording"
            classes.append(
                ClassStructure(
                    label, ranks[0], ranks[1], {}, {}, [f"class {label}: no rank in the {missing}"]
                )
            )
            continue
        found: dict[str, list[dict[tuple[Any, ...], int]]] = {s: [] for s in SECTIONS}
        for side, rank, ax, co in zip(sides, ranks, axes, coords, strict=True):
            assert rank is not None
            found["collectives"].append(_collectives(store, side, rank, iteration, ax))
            found["p2p"].append(_p2p(store, side, rank, iteration, co))
            found["ops"].append(_ops(store, side, rank, iteration) if ops_compared else {})
        diffs = {s: _differ(label, s, *found[s]) for s in SECTIONS}
        classes.append(
            ClassStructure(
                label,
                ranks[0],
                ranks[1],
                {s: (sum(found[s][0].values()), sum(found[s][1].values())) for s in SECTIONS},
                {s: len(diffs[s]) for s in SECTIONS},
                [text for s in SECTIONS for _, text in diffs[s]][:listed],
            )
        )
    return StructureComparison(iteration, classes, ops_compared, notes)


def structure_table(structure: StructureComparison) -> pl.DataFrame:
    """One row per role: its ranks, each section's counts (predicted/recorded) and differences."""
    rows = []
    for c in structure.classes:
        row: dict[str, Any] = {
            "class": c.label,
            "ranks": f"{c.predicted_rank}/{c.recorded_rank}",
        }
        for s in SECTIONS:
            a, b = c.counts.get(s, (0, 0))
            row[s] = f"{a}/{b}"
            row[f"{s} diff"] = c.differences.get(s, 0)
        rows.append(row)
    return pl.DataFrame(rows)


def first_differences(structure: StructureComparison, limit: int = 12) -> Sequence[str]:
    """The listed differences of every role, at most ``limit``."""
    return [t for c in structure.classes for t in c.listed][:limit]

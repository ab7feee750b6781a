"""Planning a slice, without the store: the classes of target ranks and who represents each, the
target communicators, and where every comm op's group and peer go.

A class is the data-parallel replicas of one (pp, tp, cp, ep) role of the target; it replays the
graph of one recorded *representative*, stored once under its *exemplar* (its lowest target
rank). See docs/slicing.md for the rules, with formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from prism_trace.errors import PrismError
from prism_trace.layout.mesh import AXES, ParallelAxis, ParallelLayout

__all__ = [
    "RULES",
    "CommMapping",
    "SliceClass",
    "SliceError",
    "TargetGroups",
    "check_layouts",
    "map_comm_ops",
    "plan_classes",
    "target_groups",
]


class SliceError(PrismError, ValueError):
    """A run cannot be sliced to the asked layout.

    An axis other than dp differs, a role has no representative, or an op cannot be mapped to
    the target world.
    """


# Axes slicing must keep: only data parallelism (hence the world) may change.
_KEPT = (ParallelAxis.TP, ParallelAxis.CP, ParallelAxis.EP, ParallelAxis.PP)
_COMM_KINDS = ("collective", "send", "recv")

RULES: dict[str, str] = {
    "same_size": "group size unchanged (axis without dp, or dp unchanged): msg_bytes copied",
    "all_reduce": "all_reduce on a resized dp group: msg_bytes (the full buffer) unchanged",
    "reduce_scatter_all_gather": (
        "reduce_scatter / all_gather on a resized dp group: msg_bytes = full buffer unchanged;"
        " the per-rank shard is msg_bytes / n_target"
    ),
    "all_to_all": "all_to_all on a resized group: per-rank buffer (msg_bytes) unchanged",
    "p2p": "send / recv: msg_bytes unchanged, peer remapped",
    "other": "another collective kind on a resized group: msg_bytes unchanged (names listed)",
}
"""How each comm node's size was treated; the keys of ``SliceReport.rescaled``."""


def _ranges(first: int, count: int, step: int) -> str:
    """``count`` ranks from ``first``, ``step`` apart, compactly: ``first..last step s``."""
    if count == 1:
        return str(first)
    last = first + (count - 1) * step
    return f"{first}..{last}" + ("" if step == 1 else f" step {step}")


@dataclass(frozen=True)
class SliceClass:
    """One equivalence class: the target ranks that replay one recorded rank's graph."""

    exemplar: int
    representative: int
    count: int
    pp: int
    tp: int
    cp: int
    ep: int
    step: int
    """Rank distance between successive members (the dp stride)."""
    symmetric: bool = False
    """The representative has another TP/CP coordinate than the class (a symmetric peer)."""

    @property
    def ranks(self) -> str:
        """The members, compactly: ``first..last step s``."""
        return _ranges(self.exemplar, self.count, self.step)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "exemplar": self.exemplar,
            "representative": self.representative,
            "count": self.count,
            "pp": self.pp,
            "tp": self.tp,
            "cp": self.cp,
            "ep": self.ep,
            "ranks": self.ranks,
            "symmetric": self.symmetric,
        }


def _kept_target(recorded: ParallelLayout, target: ParallelLayout) -> str:
    """A slice a refused target can become: the recorded layout with the dp that makes the
    target's world (the target's dp when the world does not divide), and that world."""
    rest = recorded.world_size // recorded.size("dp")
    dp = target.world_size // rest if target.world_size % rest == 0 else target.size("dp")
    spec = ",".join(f"dp={dp}" if p.startswith("dp=") else p for p in recorded.spec.split(","))
    return f"--layout {spec} --world {dp * rest}"


def check_layouts(recorded: ParallelLayout, target: ParallelLayout, world: int) -> None:
    """Refuse a target that changes more than dp, or whose sizes do not make ``world``.

    Raises:
        SliceError: the message names the axis that differs, or the world and the layout.
    """
    if world != target.world_size:
        msg = (
            f"--world {world} does not match the layout {target.spec}, whose sizes multiply"
            f" to {target.world_size}"
        )
        raise SliceError(msg)
    for a in _KEPT:
        if recorded.size(a) != target.size(a):
            msg = (
                f"axis `{a}` differs: recorded {a}={recorded.size(a)}, target {a}={target.size(a)};"
                f" slicing only changes dp (hence the world), and no what-if changes {a}: keep"
                f" {a}={recorded.size(a)} ({_kept_target(recorded, target)}), or record"
                f" the job at {a}={target.size(a)} (recorded layout {recorded.spec})"
            )
            raise SliceError(msg)


def plan_classes(
    recorded: ParallelLayout,
    target: ParallelLayout,
    recorded_ranks: np.ndarray,
    from_ranks: list[int] | None,
) -> list[SliceClass]:
    """One class per (pp, tp, cp, ep) role of the target, with its representative.

    The representative is a candidate of the same role, dp coordinate 0 preferred, then the
    lowest rank.
    """
    if from_ranks is not None:
        cand = np.asarray(sorted(set(from_ranks)), dtype=np.int64)
        unknown = sorted(set(cand.tolist()) - set(recorded_ranks.tolist()))
        if unknown:
            msg = (
                f"--from-ranks {unknown} are not recorded ranks of the run"
                f" (recorded: {_compact(recorded_ranks)})"
            )
            raise SliceError(msg)
    else:
        cand = np.sort(recorded_ranks)
    cc = recorded.coords(cand)
    # Sort key: role, then dp != 0, then rank → the first of each role is its representative.
    best: dict[tuple[int, ...], int] = {}
    order = np.lexsort((cand, cc[ParallelAxis.DP] != 0))
    # Of another TP/CP coordinate, by (ep, pp): TP and CP peers run one program (symmetry).
    peer: dict[tuple[int, int], int] = {}
    sym_order = np.lexsort(
        (cand, cc[ParallelAxis.DP] != 0, cc[ParallelAxis.CP], cc[ParallelAxis.TP])
    )
    for i in order:
        key = tuple(int(cc[a][i]) for a in _KEPT)
        best.setdefault(key, int(cand[i]))
    for i in sym_order:
        peer.setdefault((int(cc[ParallelAxis.EP][i]), int(cc[ParallelAxis.PP][i])), int(cand[i]))
    dp_groups = target.groups((ParallelAxis.DP,))
    exemplars = dp_groups[:, 0]
    ec = target.coords(exemplars)
    step = target.strides[ParallelAxis.DP]
    classes: list[SliceClass] = []
    missing: list[str] = []
    for i, ex in enumerate(exemplars):
        key = tuple(int(ec[a][i]) for a in _KEPT)
        role = dict(zip((a.value for a in _KEPT), key, strict=True))
        rep = best.get(key)
        symmetric = rep is None
        if rep is None:
            rep = peer.get((role["ep"], role["pp"]))
        if rep is None:
            missing.append(",".join(f"{a}={v}" for a, v in role.items()))
            continue
        classes.append(
            SliceClass(
                int(ex),
                rep,
                target.dp,
                role["pp"],
                role["tp"],
                role["cp"],
                role["ep"],
                step,
                symmetric=symmetric,
            )
        )
    if missing:
        where = "the recorded ranks" if from_ranks is None else f"--from-ranks {_compact(cand)}"
        msg = (
            f"no representative for the roles {'; '.join(missing)}"
            f" among {where}"
            f" (recorded layout {recorded})"
        )
        raise SliceError(msg)
    return classes


def _compact(ranks: np.ndarray | list[int]) -> str:
    """Ranks as ``0-3,8`` (``none`` when empty), for messages."""
    values = sorted(int(r) for r in ranks)
    parts: list[str] = []
    start = prev = None
    for v in values:
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts) or "none"


def _rule(axis: str, kind: str, comm_kind: str | None, n_rec: int, n_tgt: int) -> str:
    """The ``RULES`` key of a comm op whose group has ``n_rec`` recorded and ``n_tgt`` members."""
    if kind in ("send", "recv"):
        return "p2p"
    if n_rec == n_tgt:
        return "same_size"
    if comm_kind == "all_reduce":
        return "all_reduce"
    if comm_kind in ("reduce_scatter", "all_gather"):
        return "reduce_scatter_all_gather"
    if comm_kind == "all_to_all":
        return "all_to_all"
    return "other"


@dataclass(frozen=True)
class TargetGroups:
    """The target run's communicators: for each axis value, a contiguous block of group ids."""

    base: dict[str, int]
    members: dict[str, np.ndarray]

    def group_id(self, layout: ParallelLayout, axis: str, rank: int) -> int:
        """The id of ``rank``'s ``axis`` group in the target (-1 outside every ``embd`` group)."""
        index = int(layout.group_index(axis, [rank])[0])
        return -1 if index < 0 else self.base[axis] + index


def target_groups(target: ParallelLayout, axes: list[str]) -> TargetGroups:
    """Every group of each axis value the recording uses, at target scale, ids in ``axes`` order."""
    base: dict[str, int] = {}
    members: dict[str, np.ndarray] = {}
    next_id = 0
    for axis in axes:
        groups = target.groups(axis)
        base[axis] = next_id
        members[axis] = groups
        next_id += groups.shape[0]
    return TargetGroups(base, members)


def _map_peer(
    recorded: ParallelLayout, target: ParallelLayout, rep: int, exemplar: int, peer: int, where: str
) -> int:
    """The exemplar's counterpart of ``rep``'s peer.

    The same coordinate offset on every axis, taken modulo the target axis size (only dp can
    differ in size).
    """
    if not 0 <= peer < recorded.world_size:
        msg = (
            f"{where}: peer {peer} is outside the recorded world of"
            f" {recorded.world_size} ranks ({recorded})"
        )
        raise SliceError(msg)
    rc = recorded.coords([rep, peer])
    ec = target.coords([exemplar])
    new = {a: (int(ec[a][0]) + int(rc[a][1]) - int(rc[a][0])) % target.size(a) for a in AXES}
    return int(target.rank_of(new))


def _op_label(row: dict[str, Any]) -> str:
    """A comm node in words, for messages: kind, name, node and event."""
    return f"{row['kind']} {row['name']!r} (node {row['node_id']}, event {row['event_id']})"


@dataclass
class CommMapping:
    """Where the representatives' comm ops go in the target world, and how their sizes were
    treated.

    Attributes:
        group_rows: ``(exemplar, recorded group id)`` → the target group id.
        peer_rows: ``(exemplar, recorded peer)`` → the target peer rank.
        rescaled: comm ops per size rule (the keys of ``RULES``), counted once per
            representative.
        other_ops: comm ops that fell under the ``other`` rule, in words.
    """

    group_rows: dict[tuple[int, int], int] = field(default_factory=dict)
    peer_rows: dict[tuple[int, int], int] = field(default_factory=dict)
    rescaled: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    other_ops: set[str] = field(default_factory=set)


def map_comm_ops(
    comm: pl.DataFrame,
    classes: list[SliceClass],
    rec_groups: dict[int, tuple[Any, ...]],
    rec_axes: dict[int, str],
    tgt: TargetGroups,
    recorded: ParallelLayout,
    layout: ParallelLayout,
) -> CommMapping:
    """Map every distinct (rank, group, peer, kind) of the representatives' comm nodes.

    Comm nodes point at the exemplar's group of the same axis, and p2p peers at the exemplar's
    neighbour at the same coordinate offset.

    Args:
        comm: one row per distinct ``(rank, group_id, peer, kind, comm_kind)`` of the
            representatives' graph nodes, with a count ``n`` and the first node's ``node_id``,
            ``name`` and ``event_id`` (for messages).
        classes: the classes (``plan_classes``).
        rec_groups: recorded group id → (name, description, backend, member ranks).
        rec_axes: recorded group id → its axis value (groups with members only).
        tgt: the target communicators (``target_groups``).
        recorded: the recorded layout.
        layout: the target layout.

    Raises:
        SliceError: an op's group or peer cannot be mapped; the message names the op, its group
            and rank.
    """
    out = CommMapping()
    by_rep: dict[int, list[SliceClass]] = {}
    for c in classes:
        by_rep.setdefault(c.representative, []).append(c)
    for row in comm.iter_rows(named=True):
        rep = int(row["rank"])
        # One representative may stand for several classes (symmetric TP/CP peers).
        for k, cls in enumerate(by_rep[rep]):
            first = k == 0
            where = f"{_op_label(row)} on recorded rank {rep}"
            gid = row["group_id"]
            axis = None
            n_rec = n_tgt = 1
            if gid is None:
                if row["kind"] == "collective":
                    msg = f"{where}: a collective without a communicator cannot be sliced"
                    raise SliceError(msg)
            else:
                gid = int(gid)
                name, desc, _, members = rec_groups.get(gid, (None, None, None, []))
                axis = rec_axes.get(gid)
                if axis is None:
                    msg = (
                        f"{where}: group {gid} ({name!r}, description {desc!r}) has no axis"
                        " (no member list); it cannot be mapped to the target world"
                    )
                    raise SliceError(msg)
                if rep not in members:
                    msg = f"{where}: rank {rep} is not a member of its group {name!r} {members}"
                    raise SliceError(msg)
                new = tgt.group_id(layout, axis, cls.exemplar)
                if new < 0:
                    ex = cls.exemplar
                    msg = f"{where}: exemplar {ex} is in no `{axis}` group of {layout}"
                    raise SliceError(msg)
                out.group_rows[(cls.exemplar, gid)] = new
                n_rec = len(members)
                n_tgt = tgt.members[axis].shape[1]
            if row["peer"] is not None:
                old_peer = int(row["peer"])
                new_peer = _map_peer(recorded, layout, rep, cls.exemplar, old_peer, where)
                if axis is not None:
                    at = out.group_rows[(cls.exemplar, gid)] - tgt.base[axis]
                    row_members = tgt.members[axis][at]
                    if new_peer not in row_members:
                        msg = (
                            f"{where}: peer {row['peer']} maps to {new_peer}, outside the"
                            f" exemplar's `{axis}` group {row_members.tolist()}"
                        )
                        raise SliceError(msg)
                out.peer_rows[(cls.exemplar, int(row["peer"]))] = new_peer
            if row["kind"] in _COMM_KINDS and first:
                rule = _rule(axis or "", row["kind"], row["comm_kind"], n_rec, n_tgt)
                out.rescaled[rule] += int(row["n"])
                if rule == "other":
                    out.other_ops.add(f"{row['comm_kind']} {row['name']!r} on `{axis}`")
    return out

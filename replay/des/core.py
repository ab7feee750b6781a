"""The discrete-event core: per-unit execution graphs joined by communication instances → times.

A *unit* is what the emulator simulates once: a rank of a recorded run, or the exemplar of an
equivalence class of a sliced run (every member of a class has the same timing, so it is
simulated once; see docs/emulator.md). Everything here is numpy on arrays: no store, no files, no
torch, no printing, no randomness (seeded models come later through ``replay.model.timing``).

The model is max-plus: every node ``v`` has a start ``S[v]`` and an end ``E[v]``.

- A graph edge ``u → v`` anchored at ``u``'s end (start) with delay ``d`` gives
  ``S[v] >= E[u] + d`` (``S[u] + d``); a ``holds_end`` (``sync``) edge gives ``E[v] >= E[u] + d``.
- A node with no start constraint starts at its ``release`` (its recorded offset from the run's
  origin), every other node as soon as its constraints allow.
- A computation node ends ``dur`` after its start.
- A communication *instance* (a collective's ``(group, seq)``, or a send with its receive) has one
  *sync node* per participating unit. Its last arrival is ``A = max(S over participants)``; each
  participant ``p`` ends at ``max(S[p], A + transfer[p])`` (or later, if a ``sync`` edge holds it
  back), where ``transfer[p]`` is the instance's transfer time plus ``p``'s completion skew
  (``replay.model.timing``: 0 when all participants complete together).

All constraints are "max of predecessors plus a weight", so the times are the longest paths in one
DAG over the points ``S``, ``E`` and ``A``, evaluated by a frontier-by-frontier (Kahn) sweep with
``np.maximum.at``. A cycle in that DAG is a deadlock (e.g. two ranks issuing two collectives in
opposite orders): the sweep stops with points left and ``DeadlockError`` names who waits for whom.
Missing participants are found before the sweep (``collective_instances``, ``p2p_instances``),
so the emulator never waits for something that cannot happen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from prism_trace.errors import CollectiveMismatchError, PrismError

__all__ = [
    "CommInstances",
    "DeadlockError",
    "EmulatorGraph",
    "MissingParticipantError",
    "Timeline",
    "collective_instances",
    "emulate",
    "p2p_instances",
]

_NEG = np.int64(-(2**62))
"""Minus infinity for the max-plus sweep (far from overflow when weights are added)."""


class MissingParticipantError(PrismError, ValueError):
    """A collective or send/recv some participant never issues: emulating it would hang.

    Attributes:
        group: the communicator (``group_id``) of the instance.
        seq: its sequence number.
        ranks: the ranks (class exemplars in a sliced run) that never issue it.
    """

    def __init__(self, msg: str, *, group: int, seq: int, ranks: list[int]) -> None:
        super().__init__(msg)
        self.group = group
        self.seq = seq
        self.ranks = ranks


class DeadlockError(PrismError, RuntimeError):
    """No progress is possible while nodes are pending (a cycle through communication).

    Attributes:
        pending: number of graph nodes that never complete.
        waiting: one line per blocked instance: who waits, for whom.
        cycle: the waits around one cycle, in order: each line names a node (rank, node, name)
            or instance and what it waits for; the last waits for the first.
    """

    def __init__(
        self, msg: str, *, pending: int, waiting: list[str], cycle: list[str] | None = None
    ) -> None:
        super().__init__(msg)
        self.pending = pending
        self.waiting = waiting
        self.cycle = cycle or []


@dataclass(frozen=True)
class EmulatorGraph:
    """The nodes and edges of every unit, concatenated (node index = row).

    Attributes:
        unit: unit of each node (int64, 0..U-1).
        dur: recorded duration of each node, ns (used for non-sync nodes).
        release: earliest start of a node with no start constraint, ns from the origin.
        src: edge sources (node index).
        dst: edge destinations (node index).
        delay: edge delays, ns (>= 0).
        from_end: the edge counts from ``src``'s end (else its start).
        holds_end: the edge holds back ``dst``'s end (``sync``), not its start.
    """

    unit: np.ndarray
    dur: np.ndarray
    release: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    delay: np.ndarray
    from_end: np.ndarray
    holds_end: np.ndarray

    @property
    def n_nodes(self) -> int:
        """Number of nodes."""
        return int(self.unit.shape[0])


@dataclass(frozen=True)
class CommInstances:
    """Communication instances: which nodes synchronise, and how long each transfer takes.

    Attributes:
        node: the sync node of each participation (node index).
        instance: the instance of each participation (0..K-1, every one used).
        transfer: per participation, ns from the instance's last arrival to this participant's
            completion (may be negative: a participant that completed before the last arrival,
            e.g. an eager send; it then ends at ``max(its start, last arrival + transfer)``).
    """

    node: np.ndarray
    instance: np.ndarray
    transfer: np.ndarray

    @property
    def n_instances(self) -> int:
        """Number of instances."""
        return int(self.instance.max()) + 1 if self.instance.size else 0

    @staticmethod
    def empty() -> CommInstances:
        """No communication."""
        z = np.zeros(0, dtype=np.int64)
        return CommInstances(z, z, z)


@dataclass(frozen=True)
class Timeline:
    """What ``emulate`` returns.

    Attributes:
        start: emulated start of each node, ns from the origin.
        end: emulated end of each node.
        arrival: per instance, the last participant's arrival.
        rounds: frontier sweeps the evaluation took (the DAG's depth).
    """

    start: np.ndarray
    end: np.ndarray
    arrival: np.ndarray
    rounds: int


def _i64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


def emulate(
    graph: EmulatorGraph,
    comm: CommInstances,
    *,
    label: Callable[[int], str] | None = None,
) -> Timeline:
    """Emulate every unit's graph with its communication instances.

    Args:
        graph: nodes and edges of every unit.
        comm: the communication instances (from ``collective_instances``/``p2p_instances``)
            with their transfer times.
        label: names a node for error messages (e.g. ``rank 3 node 12 'all_reduce'``).

    Returns:
        Start and end of every node, arrival and completion of every instance.

    Raises:
        DeadlockError: the graph and the instances form a cycle (no progress possible).
    """
    n = graph.n_nodes
    k = comm.n_instances
    n_points = 2 * n + k
    src, dst = _i64(graph.src), _i64(graph.dst)
    from_end = np.asarray(graph.from_end, dtype=bool)
    holds_end = np.asarray(graph.holds_end, dtype=bool)
    sync_node, inst = _i64(comm.node), _i64(comm.instance)
    transfer = _i64(comm.transfer)

    # Point-space edges, built in place: graph edges; S->E (dur); S->A (0) and A->E (transfer)
    # for sync nodes. Point indices of a big graph are int32 where they fit (half the memory to
    # fill); a small one keeps int64 (no index casts in the rounds).
    m, s = src.size, sync_node.size
    e0, e1, e2 = m, m + n, m + n + s
    idx_t = np.int32 if 1 << 22 <= n_points < 2**31 - 1 else np.int64
    p_src: np.ndarray = np.empty(e2 + s, dtype=idx_t)
    p_dst: np.ndarray = np.empty(e2 + s, dtype=idx_t)
    p_w = np.empty(e2 + s, dtype=np.int64)
    p_src[:e0] = src
    np.add(p_src[:e0], n, out=p_src[:e0], where=from_end)
    p_src[e0:e1] = np.arange(n, dtype=idx_t)
    p_src[e1:e2] = sync_node
    p_src[e2:] = inst
    p_src[e2:] += 2 * n
    p_dst[:e0] = dst
    np.add(p_dst[:e0], n, out=p_dst[:e0], where=holds_end)
    p_dst[e0:e1] = np.arange(n, 2 * n, dtype=idx_t)
    p_dst[e1:e2] = inst
    p_dst[e1:e2] += 2 * n
    p_dst[e2:] = sync_node
    p_dst[e2:] += n
    p_w[:e0] = _i64(graph.delay)
    p_w[e0:e1] = _i64(graph.dur)
    p_w[e0 + sync_node] = 0  # a sync node lasts at least 0; its end comes from its instance
    p_w[e1:e2] = 0
    p_w[e2:] = transfer

    val = np.full(n_points, _NEG, dtype=np.int64)
    has_start_pred = np.zeros(n, dtype=bool)
    has_start_pred[dst[~holds_end]] = True
    roots = np.flatnonzero(~has_start_pred)
    val[roots] = _i64(graph.release)[roots]

    # Out-edges of each point, contiguous (CSR): the edges of point p are indptr[p]:indptr[p + 1].
    order = np.argsort(p_src, kind="stable")
    s_dst, s_w = p_dst[order], p_w[order]
    del order, p_dst, p_w
    indptr = np.zeros(n_points + 1, dtype=np.int64)
    np.cumsum(np.bincount(p_src, minlength=n_points), out=indptr[1:])
    del p_src
    indeg = np.bincount(s_dst, minlength=n_points).astype(np.int64, copy=False)

    # `seen` dedupes a round's newly ready points without sorting them (their order does not
    # matter: every update is a max or a count).
    seen = np.zeros(n_points, dtype=idx_t)
    frontier = np.flatnonzero(indeg == 0)
    done_points = 0
    rounds = 0
    while frontier.size:
        rounds += 1
        done_points += frontier.size
        first = indptr[frontier]
        counts = indptr[frontier + 1] - first
        total = int(counts.sum())
        if total == 0:
            break
        offsets = np.cumsum(counts) - counts
        idx = np.repeat(first - offsets, counts) + np.arange(total, dtype=np.int64)
        d = s_dst[idx]
        np.maximum.at(val, d, np.repeat(val[frontier], counts) + s_w[idx])
        np.subtract.at(indeg, d, 1)
        ready = d[indeg[d] == 0]
        pos = np.arange(ready.size, dtype=idx_t)
        seen[ready] = pos  # one of a point's positions wins: keep that one
        frontier = ready[seen[ready] == pos]

    if done_points < n_points:
        _raise_deadlock(graph, comm, indeg, n, label)

    return Timeline(val[:n], val[n : 2 * n], val[2 * n :], rounds)


def _raise_deadlock(
    graph: EmulatorGraph,
    comm: CommInstances,
    indeg: np.ndarray,
    n: int,
    label: Callable[[int], str] | None,
) -> None:
    pending_nodes = int(np.count_nonzero(indeg[n : 2 * n] > 0))
    started = indeg[:n] == 0  # the node's start is known: it arrived
    inst_pending = indeg[2 * n :] > 0
    name = label or (lambda v: f"unit {int(graph.unit[v])} node {v}")
    waiting: list[str] = []
    for i in np.flatnonzero(inst_pending):
        members = comm.node[comm.instance == i]
        arrived = members[started[members]]
        absent = members[~started[members]]
        if arrived.size and absent.size:
            who = ", ".join(name(int(v)) for v in arrived[:3])
            never = ", ".join(name(int(v)) for v in absent[:3])
            waiting.append(f"{who} waits for {never}")
        if len(waiting) >= 3:
            break
    units = np.unique(graph.unit[np.flatnonzero(indeg[n : 2 * n] > 0)])
    cycle = _cycle(graph, comm, indeg > 0, n, name)
    shown = cycle if len(cycle) <= 8 else [*cycle[:8], f"... {len(cycle) - 8} more"]
    msg = (
        f"deadlock: no progress with {pending_nodes} nodes pending on {units.size} units"
        + (f"; cycle: {'; '.join(shown)}" if cycle else "")
        + (f"; {'; '.join(waiting)}" if waiting and not cycle else "")
        + " [a dependency cycle, or communication issued in a different order on different"
        " ranks]"
    )
    raise DeadlockError(msg, pending=pending_nodes, waiting=waiting, cycle=cycle)


def _cycle(
    graph: EmulatorGraph,
    comm: CommInstances,
    stuck: np.ndarray,
    n: int,
    name: Callable[[int], str],
) -> list[str]:
    """One cycle among the points that never became ready, as "X waits for Y" lines.

    Every stuck point has a stuck predecessor (else it would have become ready), so walking
    from one stuck point to a stuck predecessor, again and again, must come back to a point
    already seen: those points form a cycle. Only the error path pays for this.
    """
    src, dst = _i64(graph.src), _i64(graph.dst)
    from_end = np.asarray(graph.from_end, dtype=bool)
    holds_end = np.asarray(graph.holds_end, dtype=bool)
    sync_node, inst = _i64(comm.node), _i64(comm.instance)
    nodes = np.arange(n, dtype=np.int64)
    p_src = np.concatenate([src + n * from_end, nodes, sync_node, inst + 2 * n])
    p_dst = np.concatenate([dst + n * holds_end, nodes + n, inst + 2 * n, sync_node + n])
    keep = stuck[p_src] & stuck[p_dst]
    pred = np.full(stuck.size, -1, dtype=np.int64)
    pred[p_dst[keep]] = p_src[keep]
    start = np.flatnonzero(stuck)
    if start.size == 0:
        return []
    seen: dict[int, int] = {}
    walk: list[int] = []
    p = int(start[0])
    while p >= 0 and p not in seen:
        seen[p] = len(walk)
        walk.append(p)
        p = int(pred[p])
    if p < 0:
        return []
    ring = walk[seen[p] :]

    def point(q: int) -> str:
        if q < n:
            return f"the start of {name(q)}"
        if q < 2 * n:
            return f"the end of {name(q - n)}"
        members = sync_node[inst == q - 2 * n]
        who = ", ".join(name(int(v)) for v in members[:4])
        more = f" and {members.size - 4} more" if members.size > 4 else ""
        return f"communication instance {q - 2 * n} (all of {who}{more} arriving)"

    after = ring[1:] + ring[:1]
    return [f"{point(a)} waits for {point(b)}" for a, b in zip(ring, after, strict=True)]


# -- instance matching ---------------------------------------------------------------------------


def _key(*cols: np.ndarray) -> np.ndarray:
    """Rows of small non-negative integer columns → one sortable structured key array."""
    dt = np.dtype([(f"f{i}", np.int64) for i in range(len(cols))])
    out = np.empty(cols[0].shape[0], dtype=dt)
    for i, c in enumerate(cols):
        out[f"f{i}"] = c
    return out


def _unique_rows(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique`` over the rows of integer columns, as ``(keys, inverse, counts)``.

    ``keys`` are the distinct rows (structured, like ``_key``) in lexicographic order. Sorts one
    int64 per row when the columns' ranges fit (a structured sort is many times slower).
    """
    lo = [int(c.min()) for c in cols]
    spans = [int(c.max()) - low + 1 for c, low in zip(cols, lo, strict=True)]
    if np.prod(np.array(spans, dtype=np.float64)) >= 2.0**62:
        keys, inv, counts = np.unique(_key(*cols), return_inverse=True, return_counts=True)
        return keys, inv.ravel(), counts
    packed = cols[0] - lo[0]
    for c, low, span in zip(cols[1:], lo[1:], spans[1:], strict=True):
        packed = packed * span + (c - low)
    _, first, inv, counts = np.unique(
        packed, return_index=True, return_inverse=True, return_counts=True
    )
    return _key(*(c[first] for c in cols)), inv.ravel(), counts


def collective_instances(
    node: np.ndarray,
    unit: np.ndarray,
    group: np.ndarray,
    seq: np.ndarray,
    *,
    expected: Mapping[int, np.ndarray],
    unit_rank: np.ndarray,
    allow_partial: bool = False,
) -> tuple[np.ndarray, int]:
    """Group collective sync nodes into instances by ``(group, seq)`` and check who is there.

    Args:
        node: the sync nodes (node index).
        unit: unit of each.
        group: ``group_id`` of each.
        seq: ``seq`` of each.
        expected: per group, the units that must take part (in a sliced run, the classes present
            in the group; -1 marks a member with no unit: a rank not recorded).
        unit_rank: the rank (or class exemplar) of each unit, for messages.
        allow_partial: resolve an instance over the units present instead of raising.

    Returns:
        The instance of each sync node, and the number of instances; instances are numbered in
        ``(group, seq)`` order.

    Raises:
        MissingParticipantError: an expected unit never issues an instance (the first such
            instance, by group and seq, is named with the missing ranks).
        CollectiveMismatchError: a unit issues the same ``(group, seq)`` twice.
    """
    node, unit, group, seq = _i64(node), _i64(unit), _i64(group), _i64(seq)
    if node.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    keys, inst, _ = _unique_rows(group, seq)
    uniq, _, counts = _unique_rows(inst, unit)
    if (counts > 1).any():
        bad = uniq[np.argmax(counts > 1)]
        i, u = int(bad["f0"]), int(bad["f1"])
        msg = (
            f"rank {int(unit_rank[u])} issues collective (group {int(keys[i]['f0'])},"
            f" seq {int(keys[i]['f1'])}) twice"
        )
        raise CollectiveMismatchError(msg)
    if allow_partial:
        return inst, int(keys.size)
    present = np.bincount(inst, minlength=keys.size)
    groups, g_of = np.unique(keys["f0"], return_inverse=True)  # per group, not per instance
    per_group = [np.unique(expected[int(g)]).size for g in groups]
    need = np.asarray(per_group, dtype=np.int64)[g_of.ravel()]
    short = np.flatnonzero(present < need)
    if short.size:
        i = int(short[0])
        g, s = int(keys[i]["f0"]), int(keys[i]["f1"])
        have = set(unit[inst == i].tolist())
        missing_units = [int(u) for u in np.unique(expected[g]) if int(u) not in have]
        ranks = [int(unit_rank[u]) if u >= 0 else -1 for u in missing_units]
        shown = [r for r in ranks if r >= 0]
        unrecorded = len(ranks) - len(shown)
        absent = []
        if shown:
            absent.append(f"is never issued by recorded rank(s) {', '.join(map(str, shown))}")
        if unrecorded:
            absent.append(
                f"waits for {unrecorded} member rank(s) of its group that the run does not hold"
                " (not recorded)"
            )
        msg = (
            f"collective (group {g}, seq {s}) {' and '.join(absent)}; {short.size} incomplete"
            " instance(s) in all, which would wait forever"
            " [ingest the missing ranks' traces into the run, or pass --partial"
            " (`prism emulate`, `prism validate`) to complete each collective over the ranks"
            " present]"
        )
        raise MissingParticipantError(msg, group=g, seq=s, ranks=shown)
    return inst, int(keys.size)


def p2p_instances(
    node: np.ndarray,
    unit: np.ndarray,
    peer_unit: np.ndarray,
    is_send: np.ndarray,
    group: np.ndarray,
    seq: np.ndarray,
    *,
    unit_rank: np.ndarray,
    peer_rank: np.ndarray,
    allow_partial: bool = False,
) -> tuple[np.ndarray, int]:
    """Pair each send with its receive: send(a → b, group, seq) ↔ recv(b ← a, group, seq).

    Args:
        node: the sync nodes of sends and receives.
        unit: unit of each.
        peer_unit: the unit of the other side (-1 when it has none: peer not recorded/unknown).
        is_send: true for a send.
        group: a group key of each (``group_id``, or an id of the group's axis in a sliced run).
        seq: sequence number within (rank, peer, direction).
        unit_rank: the rank of each unit, for messages.
        peer_rank: the peer rank of each node, for messages.
        allow_partial: a side without its partner completes alone instead of raising.

    Returns:
        The instance of each node and the number of instances.

    Raises:
        MissingParticipantError: a send or receive whose other side never issues it.
        CollectiveMismatchError: two sends (or two receives) claim one pair.
    """
    node, unit, peer_unit = _i64(node), _i64(unit), _i64(peer_unit)
    is_send = np.asarray(is_send, dtype=bool)
    group, seq = _i64(group), _i64(seq)
    if node.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    sender = np.where(is_send, unit, peer_unit)
    receiver = np.where(is_send, peer_unit, unit)
    keys, inst, _ = _unique_rows(group, sender, receiver, seq)
    sends = np.bincount(inst, weights=is_send, minlength=keys.size).astype(np.int64)
    recvs = np.bincount(inst, weights=~is_send, minlength=keys.size).astype(np.int64)
    if ((sends > 1) | (recvs > 1)).any():
        i = int(np.argmax((sends > 1) | (recvs > 1)))
        msg = (
            f"send/recv pair (group {int(keys[i]['f0'])}, seq {int(keys[i]['f3'])}) between"
            f" {int(keys[i]['f1'])} and {int(keys[i]['f2'])} is claimed twice"
        )
        raise CollectiveMismatchError(msg)
    if not allow_partial:
        single = np.flatnonzero((sends + recvs) < 2)
        if single.size:
            i = int(single[0])
            j = int(np.flatnonzero(inst == i)[0])
            side = "receive" if is_send[j] else "send"
            me = int(unit_rank[unit[j]])
            msg = (
                f"{'send' if is_send[j] else 'recv'} of rank {me} (group {int(group[j])},"
                f" seq {int(seq[j])}) has no matching {side} on rank {int(peer_rank[j])};"
                f" {single.size} unpaired p2p op(s) in all; emulating it would hang"
            )
            raise MissingParticipantError(
                msg, group=int(group[j]), seq=int(seq[j]), ranks=[int(peer_rank[j])]
            )
    return inst, int(keys.size)

"""Real-to-real communication when several replayed ranks run together as processes.

``prism replay --ranks 0,1`` runs each selected rank in a process of its own (``replay.hybrid``).
The traffic between two *real* ranks then goes through ``torch.distributed`` (gloo on CPU, NCCL on
CUDA), so that their synchronisation and transfer are measured, not emulated. A call whose
communicator also holds *virtual* peers does both: the real members run the collective among
themselves, and the call completes no earlier than the virtual peers allow
(``PeerSchedule.completion_ns``).

This module has two halves:

- **Planning** (no torch): every rank lists its communication units that involve another real
  rank (``RealSpec``); ``agree`` checks the lists against each other *before* any process
  communicates: the members of each real communicator must issue the same collectives in the
  same order, and every real send must meet a real receive. A mismatch is one
  ``CollectiveMismatchError`` naming the group, the sequence number and the ranks, instead of a
  hang. It also fixes the message size all members use (the largest one recorded: ranks may
  record different sizes, e.g. uneven all-to-all splits) and where pending sends and receives
  are waited for.
- **Execution** (``RealComm``): the subgroups of real members, created in the same order in
  every process, reusable buffers, and one call per unit.

What moves. The collective kinds run as themselves on the real subgroup of ``m`` members out of
the communicator's ``n``: all-reduce, broadcast and reduce move the recorded message; all-gather
and all-to-all exchange ``m`` shards of ``msg_bytes / n``; reduce-scatter reduces ``m`` shards.
Other kinds (gather, scatter, coalesced or unknown ones) run as an all-reduce of the message. The
data is float32 and meaningless: replay times communication, it does not compute the model.
Sends and receives are posted (``isend``/``irecv``) and waited for once the run of consecutive
point-to-point units they belong to is posted, as ``batch_isend_irecv`` does: two ranks that
exchange in opposite recorded orders cannot deadlock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prism_trace.errors import CollectiveMismatchError

__all__ = ["RealComm", "RealOp", "RealSpec", "agree", "specs_for_rank"]

_F32 = 4


@dataclass(frozen=True)
class RealSpec:
    """One communication unit of a rank that involves another real rank.

    Attributes:
        unit: index of the unit in the rank's program.
        kind: collective kind (``all_reduce``, ...) or ``send`` / ``recv``.
        group: the communicator's global member ranks (p2p: sender, receiver).
        seq: sequence number within the group (p2p: within the pair).
        msg_bytes: the recorded message size, bytes (0 when unknown).
        mixed: the communicator also holds virtual peers.
    """

    unit: int
    kind: str
    group: tuple[int, ...]
    seq: int
    msg_bytes: int
    mixed: bool

    @property
    def is_p2p(self) -> bool:
        """A send or a receive."""
        return self.kind in ("send", "recv")


@dataclass(frozen=True)
class RealOp:
    """A ``RealSpec`` as every member agreed to run it.

    Attributes:
        spec: what the rank recorded.
        members: the real members (global ranks, ascending); p2p: the peer only.
        nbytes: message size all members use.
        wait_after: p2p only: wait for every pending send/receive after posting this one (the
            next unit is not a real send/receive).
    """

    spec: RealSpec
    members: tuple[int, ...]
    nbytes: int
    wait_after: bool = True


def specs_for_rank(
    calls: Iterable[tuple[int, Any]], rank: int, real: Sequence[int]
) -> list[RealSpec]:
    """The units of ``rank`` whose call (a ``PeerCall``) has another real participant.

    Args:
        calls: ``(unit index, PeerCall)`` of the rank's communication units, in program order.
        rank: the rank.
        real: every rank replayed for real.
    """
    others = set(real) - {rank}
    out = []
    for unit, call in calls:
        group = tuple(call.group_ranks)
        if call.is_p2p:
            if call.peer is None or call.peer not in others:
                continue
            mixed = False
        else:
            if not others.intersection(group) or rank not in group:
                continue
            mixed = not set(group) <= set(real)
        out.append(RealSpec(unit, call.kind, group, int(call.seq), int(call.msg_bytes or 0), mixed))
    return out


def agree(
    specs: Mapping[int, Sequence[RealSpec]],
) -> tuple[dict[int, dict[int, RealOp]], list[tuple[int, ...]]]:
    """Check the ranks' real communication against each other and fix how it runs.

    Args:
        specs: per real rank, its ``RealSpec`` list in program order (``specs_for_rank``).

    Returns:
        Per rank ``unit -> RealOp``, and the real subgroups (member tuples with at least two
        ranks) in the order every process creates them.

    Raises:
        CollectiveMismatchError: members of a real communicator that issue different
            collectives (count, sequence numbers or kinds), or a send without its receive.
    """
    real = set(specs)
    # Collectives: per real-member tuple, each member's list of (group, seq, kind, bytes).
    coll: dict[tuple[int, ...], dict[int, list[RealSpec]]] = defaultdict(lambda: defaultdict(list))
    sends: dict[tuple[int, int], list[RealSpec]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[RealSpec]] = defaultdict(list)
    for rank, lst in specs.items():
        for s in lst:
            if s.kind == "send":
                sends[(rank, s.group[1] if s.group[0] == rank else s.group[0])].append(s)
            elif s.kind == "recv":
                recvs[(s.group[0] if s.group[1] == rank else s.group[1], rank)].append(s)
            else:
                coll_members = tuple(sorted(real.intersection(s.group)))
                coll[coll_members][rank].append(s)

    nbytes: dict[tuple[int, int], int] = {}  # (rank, unit) -> agreed size
    for coll_members, per_rank in coll.items():
        _check_collectives(coll_members, per_rank)
        for row in zip(*(per_rank[r] for r in coll_members), strict=True):
            n = max(spec.msg_bytes for spec in row)
            for r, spec in zip(coll_members, row, strict=True):
                nbytes[(r, spec.unit)] = n
    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        out, inc = sends.get(pair, []), recvs.get(pair, [])
        if len(out) != len(inc):
            msg = (
                f"real ranks {src} -> {dst}: {len(out)} sends but {len(inc)} receives in the"
                f" replayed iterations; their send/recv calls do not match"
            )
            raise CollectiveMismatchError(msg)
        for sent, received in zip(out, inc, strict=True):
            n = max(sent.msg_bytes, received.msg_bytes)
            nbytes[(src, sent.unit)] = n
            nbytes[(dst, received.unit)] = n

    ops: dict[int, dict[int, RealOp]] = {}
    for rank, lst in specs.items():
        mine: dict[int, RealOp] = {}
        for s in lst:
            if s.is_p2p:
                peer = s.group[1] if s.group[0] == rank else s.group[0]
                members: tuple[int, ...] = (peer,)
            else:
                members = tuple(sorted(real.intersection(s.group)))
            mine[s.unit] = RealOp(s, members, nbytes[(rank, s.unit)])
        units = sorted(mine)
        for u in units:  # wait for posted p2p when the next unit is not a real p2p
            op = mine[u]
            if op.spec.is_p2p:
                nxt = mine.get(u + 1)
                mine[u] = replace(op, wait_after=not (nxt is not None and nxt.spec.is_p2p))
        ops[rank] = mine
    return ops, sorted(coll)


def _check_collectives(members: tuple[int, ...], per_rank: Mapping[int, list[RealSpec]]) -> None:
    lists = {r: per_rank.get(r, []) for r in members}
    ref_rank = members[0]
    ref = lists[ref_rank]
    for r in members[1:]:
        other = lists[r]
        for a, b in zip(ref, other, strict=False):
            if (a.group, a.seq, a.kind) != (b.group, b.seq, b.kind):
                msg = (
                    f"real ranks {ref_rank} and {r} issue different collectives on their"
                    f" shared communicator: {a.kind} seq {a.seq} of group {list(a.group)} vs"
                    f" {b.kind} seq {b.seq} of group {list(b.group)}"
                )
                raise CollectiveMismatchError(msg)
        if len(ref) != len(other):
            longer, shorter = (ref_rank, r) if len(ref) > len(other) else (r, ref_rank)
            extra = (ref if len(ref) > len(other) else other)[min(len(ref), len(other))]
            msg = (
                f"collective {extra.kind} seq {extra.seq} of group {list(extra.group)}: real rank"
                f" {longer} issues it, real rank {shorter} never does (missing ranks:"
                f" [{shorter}])"
            )
            raise CollectiveMismatchError(msg)


class RealComm:
    """Runs one process's real communication units (``torch.distributed`` already initialised).

    Args:
        rank: this process's global rank in the replayed run.
        real: every real rank, ascending; the process of ``real[i]`` has distributed rank ``i``.
        ops: this rank's ``unit -> RealOp`` (``agree``).
        subgroups: every real subgroup, in the agreed order (``agree``).
        device: where the buffers live (``cpu`` / ``cuda``).
    """

    def __init__(
        self,
        rank: int,
        real: Sequence[int],
        ops: Mapping[int, RealOp],
        subgroups: Sequence[tuple[int, ...]],
        device: str,
    ) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.rank = rank
        self.pos = {r: i for i, r in enumerate(real)}
        self.ops = dict(ops)
        self.device = torch.device(device)
        self.groups: dict[tuple[int, ...], Any] = {}
        for members in subgroups:  # every process creates every subgroup, in one order
            pg = dist.new_group([self.pos[r] for r in members])
            if rank in members:
                self.groups[members] = pg
        # torch >= 2.12 names them *_single and deprecates the *_tensor names.
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = (
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        )
        self._buffers: dict[tuple[str, int, int], Any] = {}
        self._pending: list[Any] = []

    def has(self, unit: int) -> bool:
        """Whether ``unit`` involves another real rank."""
        return unit in self.ops

    def mixed(self, unit: int) -> bool:
        """Whether the communicator of ``unit`` also holds virtual peers."""
        return self.ops[unit].spec.mixed

    def _buf(self, tag: str, nbytes: int, slot: int = 0) -> Any:
        n = max(1, -(-nbytes // _F32))
        key = (tag, n, slot)
        b = self._buffers.get(key)
        if b is None:
            b = self._torch.zeros(n, dtype=self._torch.float32, device=self.device)
            self._buffers[key] = b
        return b

    def run(self, unit: int) -> None:
        """Execute ``unit``'s communication with the other real ranks."""
        op = self.ops[unit]
        s = op.spec
        dist = self._dist
        if s.is_p2p:
            peer = self.pos[op.members[0]]
            buf = self._buf(s.kind, op.nbytes, len(self._pending))
            work = dist.isend(buf, peer) if s.kind == "send" else dist.irecv(buf, peer)
            self._pending.append(work)
            if op.wait_after:
                self.wait_pending()
            return
        pg = self.groups[op.members]
        m, n = len(op.members), max(len(s.group), 1)
        shard = max(_F32, op.nbytes // n)
        root = self.pos[op.members[0]]
        if s.kind == "all_gather":
            self._all_gather(self._buf("ag_out", shard * m), self._buf("ag_in", shard), group=pg)
        elif s.kind == "reduce_scatter":
            self._reduce_scatter(
                self._buf("rs_out", shard), self._buf("rs_in", shard * m), group=pg
            )
        elif s.kind == "all_to_all":
            dist.all_to_all_single(
                self._buf("a2a_out", shard * m), self._buf("a2a_in", shard * m), group=pg
            )
        elif s.kind == "broadcast":
            dist.broadcast(self._buf("msg", op.nbytes), root, group=pg)
        elif s.kind == "reduce":
            dist.reduce(self._buf("msg", op.nbytes), root, group=pg)
        elif s.kind == "barrier":
            dist.barrier(group=pg)
        else:
            dist.all_reduce(self._buf("msg", op.nbytes), group=pg)

    def wait_pending(self) -> None:
        """Wait for every posted send and receive."""
        for w in self._pending:
            w.wait()
        self._pending.clear()

    def barrier(self) -> None:
        """All real ranks: a pass starts together."""
        self.wait_pending()
        self._dist.barrier()

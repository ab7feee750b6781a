"""The `prism` torch.distributed backend: some ranks of a job run for real, the rest are virtual.

An unmodified training script runs as rank ``r`` of a world of ``N`` although only the *selected*
ranks exist as processes. Every collective and point-to-point call returns what the real one
would return in shape and dtype, with values from one rule ("virtual members mirror real ones",
see `docs/process-group.md`), and completes (its `Work` is done) at the time the virtual peers of
a recorded run would let it complete, so that the script's own timers see faithful step times.

Use it through `prism run` (`replay.pg.launch`), or directly::

    import prism_trace.replay.pg.backend as ppg
    ppg.register()  # idempotent; configure() registers too
    ppg.configure(world_size=8, real_ranks=(0,), schedule=schedule)   # optional
    torch.distributed.init_process_group("prism", store=store, rank=0, world_size=8)

Importing this module registers nothing: torch's backend table is changed only by the code that
is about to make a `prism` group (``register()``, ``configure()``, the `prism run` shim), so
importing the package for anything else leaves torch.distributed as it was.

The backend is split: ``pg.base`` (name, switches, error, clock), ``pg.timeline`` (timing),
``pg.session`` (what the groups of a process share, ``reset``), ``pg.work`` (completion),
``pg.data`` (the values of calls with virtual members); this module is the process group and its
registration.

Timing follows `replay.peers.PeerSchedule`: a call is looked up by the member ranks of its group
and its per-group sequence number (point-to-point: by sender, receiver and the sequence number of
the pair), and waits until ``PeerSchedule.completion_ns(call, own_arrival)``. Without a schedule
the virtual peers never hold anyone back.
"""

from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from prism_trace.replay.pg import session as pg_session
from prism_trace.replay.pg.base import BACKEND
from prism_trace.replay.pg.data import _Members, _post, _pre, _real_op
from prism_trace.replay.pg.session import PrismSession, _session_from_env, session
from prism_trace.replay.pg.work import PrismWork

from prism_trace.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from prism_trace.replay.peers import PeerSchedule


__all__ = ["PrismProcessGroup", "configure", "register"]


class PrismProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
    """One communicator of the emulated job, as seen by one real rank.

    Created by torch through the registered creator for the default group and for every
    `new_group` (DeviceMesh and Megatron-style subgroups included) that this rank belongs to.
    Among several real members, a gloo group over just them moves the real data.
    """

    def __init__(
        self,
        *,
        store: dist.Store,
        group_rank: int,
        group_size: int,
        ranks: tuple[int, ...],
        session: PrismSession,
        timeout: timedelta,
    ) -> None:
        """Build the group; the real members (if more than one) connect a gloo group now.

        Args:
            store: The group's store (prefixed by torch with the group name).
            group_rank: This rank in the group.
            group_size: Members.
            ranks: Global ranks of the members, in group order.
            session: The world this group belongs to.
            timeout: The group's timeout (also bounds waits for virtual peers).
        """
        # torch's stub lists only the (store, rank, size) constructor; c10d also binds (rank, size).
        super().__init__(group_rank, group_size)  # type: ignore[call-arg]
        self._session = session
        self._members = _Members.build(ranks, group_rank, session.real_ranks)
        self._timeout = timeout
        self._seq = 0
        self._name = ""
        self._desc = ""
        self._real: Any = None
        if len(self._members.real_pos) > 1:
            self._real = dist.ProcessGroupGloo(
                dist.PrefixStore("prism_real/", store),
                self._members.real_index(group_rank),
                len(self._members.real_pos),
                timeout,
            )
            # Shut the real ranks' gloo group down while the interpreter is alive: left to the
            # interpreter's teardown, gloo's worker threads can still hold work whose tensors
            # need the GIL, and the process aborts ("terminate called without an active
            # exception", exit -6) after the script is done (pytorch/pytorch#179291).
            atexit.register(_shutdown_real, weakref.ref(self))

    def shutdown(self) -> None:
        """Shut the real ranks' gloo group down (``destroy_process_group``, or at exit)."""
        real, self._real = self._real, None
        if real is not None:
            real.shutdown()

    def abort(self) -> None:
        """As ``shutdown``: the virtual peers hold nothing to abort."""
        self.shutdown()

    # -- identity (torch asks for these) --

    def getBackendName(self) -> str:
        return BACKEND

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def __repr__(self) -> str:
        return f"PrismProcessGroup(ranks={list(self._members.ranks)}, rank={self._members.me})"

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """Global ranks of the members, in group order."""
        return self._members.ranks

    # -- timing --

    def _collective(self, kind: str) -> int | None:
        m = self._members
        seq = self._seq
        self._seq += 1
        if len(m.real_pos) == m.n:
            return None  # everyone is real: the real exchange is the timing
        return self._session.timeline.collective(m.ranks, self._name, seq, kind, m.ranks[m.me])

    def _p2p(self, kind: str, peer: int) -> int | None:
        m = self._members
        if m.is_real(peer):
            return None
        me = m.ranks[m.me]
        src, dst = (me, m.ranks[peer]) if kind == "send" else (m.ranks[peer], me)
        return self._session.timeline.p2p(kind, src, dst, me)

    def _work(
        self,
        result: Any,
        target: int | None,
        real: Sequence[Any] = (),
        epilogue: Callable[[], None] | None = None,
    ) -> PrismWork:
        return PrismWork(
            result, target_ns=target, real=real, epilogue=epilogue, timeout=self._timeout
        )

    # -- reductions --

    def _reduce_into(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        """The all-reduce result of ``t`` over the group (all members' data by the mirror rule)."""
        m = self._members
        out = _pre(t, op, m.count(m.me))
        if self._real is not None:
            self._real.allreduce([out], _all_reduce_opts(_real_op(op))).wait()
        return _post(out, op, m.n)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> PrismWork:
        target = self._collective("all_reduce")
        for t in tensors:
            t.copy_(self._reduce_into(t, opts.reduceOp))
        return self._work(tensors, target)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> PrismWork:
        target = self._collective("all_reduce")
        for t in tensors:
            t.copy_(self._reduce_into(t, opts.reduceOp))
        return self._work(tensors, target)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> PrismWork:
        target = self._collective("reduce")
        for t in tensors:
            r = self._reduce_into(t, opts.reduceOp)
            if self._members.me == opts.rootRank:
                t.copy_(r)
        return self._work(tensors, target)

    # -- gathers --

    def _gather_list(self, inp: torch.Tensor) -> list[torch.Tensor]:
        """Each member's tensor, group order (virtual members: their mirror's)."""
        m = self._members
        if self._real is None:
            return [inp] * m.n
        got = [torch.empty_like(inp) for _ in m.real_pos]
        self._real.allgather([got], [inp.contiguous()]).wait()
        return [got[m.real_index(m.mirror[j])] for j in range(m.n)]

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        target = self._collective("all_gather")
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            for o, src in zip(outs, self._gather_list(inp), strict=True):
                o.copy_(src)
        return self._work(output_tensors, target)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        return self.allgather(output_lists, input_list, opts)

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> PrismWork:
        target = self._collective("all_gather")
        self._gather_flat(output, inp)
        return self._work(output, target)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> PrismWork:
        return self._allgather_base(output, inp, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        target = self._collective("all_gather")
        for o, i in zip(outputs, inputs, strict=True):
            self._gather_flat(o, i)
        return self._work(outputs, target)

    def _gather_flat(self, output: torch.Tensor, inp: torch.Tensor) -> None:
        chunks = output.view(-1).split(inp.numel())
        for o, src in zip(chunks, self._gather_list(inp), strict=True):
            o.copy_(src.reshape(-1))

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        target = self._collective("gather")
        got = self._gather_list(input_tensors[0])
        if self._members.me == opts.rootRank:
            for o, src in zip(output_tensors[0], got, strict=True):
                o.copy_(src)
        return self._work(output_tensors, target)

    # -- scatters --

    def _reduce_scatter_one(
        self, out: torch.Tensor, chunks: Sequence[torch.Tensor], op: Any
    ) -> None:
        """``out`` = op over members j of chunk ``me`` of member j's input (mirror rule)."""
        m = self._members
        if self._real is None:
            out.copy_(_post(_pre(chunks[m.me], op, m.n), op, m.n).reshape(out.shape))
            return
        mine = m.real_index(m.me)
        parts = [chunks[p].reshape(-1) for p in m.real_pos]
        flat = self._reduce_into(torch.cat(parts), op)
        out.copy_(flat.split([p.numel() for p in parts])[mine].reshape(out.shape))

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any,
    ) -> PrismWork:
        target = self._collective("reduce_scatter")
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            self._reduce_scatter_one(out, ins, opts.reduceOp)
        return self._work(output_tensors, target)

    def _reduce_scatter_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        opts: Any,
    ) -> PrismWork:
        target = self._collective("reduce_scatter")
        chunks = inp.reshape(-1).split(output.numel())
        self._reduce_scatter_one(output, chunks, opts.reduceOp)
        return self._work(output, target)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        opts: Any,
    ) -> PrismWork:
        return self._reduce_scatter_base(output, inp, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        target = self._collective("reduce_scatter")
        for o, i in zip(outputs, inputs, strict=True):
            self._reduce_scatter_one(o, i.reshape(-1).split(o.numel()), opts.reduceOp)
        return self._work(outputs, target)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any,
    ) -> PrismWork:
        target = self._collective("scatter")
        m, root = self._members, opts.rootRank
        out = output_tensors[0]
        if m.is_real(root):
            if self._real is None:
                out.copy_(input_tensors[0][m.me])
            else:
                ins = [[input_tensors[0][p] for p in m.real_pos]] if m.me == root else []
                so = dist.ScatterOptions()
                so.rootRank = m.real_index(root)
                self._real.scatter([out], ins, so).wait()
        # A virtual root holds nothing this rank could know: the output is left as it was.
        return self._work(output_tensors, target)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> PrismWork:
        target = self._collective("broadcast")
        m = self._members
        if self._real is not None:
            bo = dist.BroadcastOptions()
            bo.rootRank = m.real_index(m.mirror[opts.rootRank])
            self._real.broadcast(tensors, bo).wait()
        # One real member: from a virtual root it keeps its own tensor (the root mirrors it).
        return self._work(tensors, target)

    # -- all-to-all --

    def _all_to_all_lists(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        """``outs[j]`` = what member j sends to me (its mirror's chunk for me, when shapes fit)."""
        m = self._members
        if self._real is None:
            got = {m.me: ins[m.me]}
        else:
            send = torch.cat([ins[p].reshape(-1) for p in m.real_pos])
            recv_sizes = [outs[p].numel() for p in m.real_pos]
            recv = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
            self._real.alltoall_base(
                recv, send, recv_sizes, [ins[p].numel() for p in m.real_pos], dist.AllToAllOptions()
            ).wait()
            got = dict(zip(m.real_pos, recv.split(recv_sizes), strict=True))
        for j, o in enumerate(outs):
            src = got[m.mirror[j]]
            if src.numel() == o.numel():  # uneven splits that do not fit: left as they were
                o.copy_(src.reshape(o.shape))

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        target = self._collective("all_to_all")
        self._all_to_all_lists(output_tensors, input_tensors)
        return self._work(output_tensors, target)

    def alltoall_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any,
    ) -> PrismWork:
        target = self._collective("all_to_all")
        n = self._members.n
        outs = output.split(list(output_split_sizes) or output.shape[0] // n)
        ins = inp.split(list(input_split_sizes) or inp.shape[0] // n)
        self._all_to_all_lists(outs, ins)
        return self._work(output, target)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any,
    ) -> PrismWork:
        return self.alltoall_base(output, inp, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts: Any) -> PrismWork:
        target = self._collective("barrier")
        if self._real is not None:
            self._real.barrier().wait()
        return self._work(None, target)

    # -- point to point --

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> PrismWork:
        target = self._p2p("send", dst)
        real = []
        if self._members.is_real(dst):
            real.append(self._real.send(tensors, self._members.real_index(dst), tag))
        return self._work(tensors, target, real)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> PrismWork:
        target = self._p2p("recv", src)
        real = []
        if self._members.is_real(src):
            real.append(self._real.recv(tensors, self._members.real_index(src), tag))
        else:
            for t in tensors:  # a virtual sender's data is unknown: zeros (never NaN, no denormals)
                t.zero_()
        return self._work(tensors, target, real)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> PrismWork:
        # No sequence number can be known for "any source": not timed, from a real member if any.
        if self._real is not None:
            return self._work(tensors, None, [self._real.recv_anysource(tensors, tag)])
        for t in tensors:
            t.zero_()
        return self._work(tensors, None)


def _all_reduce_opts(op: Any) -> Any:
    o = dist.AllreduceOptions()
    o.reduceOp = op
    return o


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


def _shutdown_real(ref: weakref.ReferenceType[PrismProcessGroup]) -> None:
    group = ref()
    if group is not None:
        group.shutdown()


def _create(opts: Any, pg_options: Any) -> PrismProcessGroup:
    """The creator torch calls for every `prism` group this rank belongs to (extended API)."""
    ranks = tuple(int(r) for r in opts.global_ranks_in_group) or tuple(range(opts.group_size))
    rank = ranks[opts.group_rank]
    s = session()
    if s is None:
        s = _session_from_env(rank, opts.group_size)
    if max(ranks) >= s.world_size or (
        not opts.global_ranks_in_group and opts.group_size != s.world_size
    ):
        msg = (
            f"`prism` group of {opts.group_size} ranks does not fit the configured world of "
            f"{s.world_size}; call configure(world_size=...) with the job's world size"
        )
        raise ConfigError(msg)
    if rank not in s.real_ranks:
        msg = (
            f"rank {rank} is not one of the real ranks {sorted(s.real_ranks)}; "
            "pass it in configure(real_ranks=...) or PRISM_RANKS"
        )
        raise ConfigError(msg)
    timeout = opts.timeout if opts.timeout.total_seconds() > 0 else timedelta(minutes=30)
    return PrismProcessGroup(
        store=opts.store,
        group_rank=opts.group_rank,
        group_size=opts.group_size,
        ranks=ranks,
        session=s,
        timeout=timeout,
    )


def register() -> None:
    """Register the `prism` backend with torch.distributed (idempotent).

    ``devices=["cpu", "cuda"]`` only declares what it accepts: torch's defaults for ``cpu``
    (gloo) and ``cuda`` (nccl) are not replaced.
    """
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def configure(
    *,
    world_size: int,
    real_ranks: Sequence[int],
    schedule: PeerSchedule | None = None,
    groups: Mapping[int, tuple[str, Sequence[int]]] | None = None,
) -> PrismSession:
    """Register the backend and set the world the next `init_process_group("prism", ...)` joins.

    The arguments are those of `pg_session.start_session`; registering here means a caller that
    configures a session never has to remember ``register()`` as well.
    """
    register()
    return pg_session.start_session(
        world_size=world_size, real_ranks=real_ranks, schedule=schedule, groups=groups
    )

"""Virtual peers: when each communication call of one selected rank may complete.

A hybrid replay runs a few ranks for real and leaves every other rank *virtual*. A virtual peer
moves no data; what the real rank needs from it is *when* it arrives at each collective or
send/recv. That comes from the emulator's timeline of the same run
(``replay.emulate.driver.emulate_in_memory``): for every communication node of the rank (its
*sync* node: the kernel of an NCCL collective, else the host op), its emulated arrival, the last
arrival among the other participants of the instance, and the emulated end.

The replay rule (docs/replay.md): the replay clock is aligned with the emulated clock at each
iteration start; a call whose real arrival is ``t`` ns after the replay's iteration start
completes at ``max(t, peers_arrival_ns) + transfer_ns`` (``PeerSchedule.completion_ns``), the
emulator's own rule with the real arrival in place of the emulated one. ``transfer_ns`` is
taken from the emulated end (``end - max(own, peers)``), so it already holds the instance's
transfer time and this rank's completion skew (``replay.model.timing``).

Nothing here imports torch: a schedule is plain data, shared by ``replay.hybrid`` and the timed
process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from prism_trace.errors import SelectionError

if TYPE_CHECKING:
    from prism_trace.replay.emulate.config import EmulationConfig

    from prism_trace.store.connection import Store

__all__ = ["PeerCall", "PeerSchedule", "rank_schedule", "schedules_from_store"]


@dataclass(frozen=True)
class PeerCall:
    """One communication call of the rank, with what its virtual peers do.

    Times are ns from the rank's *emulated* start of ``iteration`` (``PeerSchedule``).

    Attributes:
        index: position in the rank's emulated order of communication calls.
        kind: ``all_reduce``, ``all_gather``, ... for collectives; ``send`` or ``recv``.
        group_id: communicator of the run (``comm_group.group_id``), None when unknown.
        group_ranks: global member ranks of the communicator, in group-rank order (p2p: the
            two ranks, sender first).
        seq: sequence number within the group (collective) or pair (p2p).
        peer: the other side of a send/recv (None for collectives).
        msg_bytes: message size, bytes.
        iteration: training step of the call.
        own_arrival_ns: this rank's emulated arrival.
        peers_arrival_ns: last arrival among the *other* participants that are virtual; equal to
            ``own_arrival_ns`` when there are none (the other participants are real ranks that
            synchronise for real, or the same class unit in a sliced run).
        transfer_ns: what the call takes once everyone has arrived: the instance's transfer plus
            this rank's completion skew (emulated end minus the last arrival).
        end_ns: emulated completion of this rank.
        node_id: the rank's ``graph_node.node_id`` of the call (its host node).
        event_id: the recorded event of the host node (``graph_node.event_id``): joins the call
            to ``collective``/``p2p`` rows and to ``et_op.event_id``.
    """

    index: int
    kind: str
    group_id: int | None
    group_ranks: tuple[int, ...]
    seq: int
    peer: int | None
    msg_bytes: int | None
    iteration: int | None
    own_arrival_ns: int
    peers_arrival_ns: int
    transfer_ns: int
    end_ns: int
    node_id: int | None = None
    event_id: int | None = None

    @property
    def is_p2p(self) -> bool:
        """A send or a receive (not a collective)."""
        return self.kind in ("send", "recv")


@dataclass
class PeerSchedule:
    """Every communication call of one rank with its virtual peers' timing.

    Attributes:
        run: the run whose emulation this comes from (empty for ``instant``).
        rank: the rank (global).
        world_size: ranks in the run's world.
        iteration_start_ns: emulated start of each iteration, ns on the run clock.
        iteration_dur_ns: emulated duration of each iteration.
        calls: the rank's calls in emulated order (``PeerCall.index``).
        real_ranks: ranks that run for real alongside this one; their arrivals are not in
            ``peers_arrival_ns`` (they synchronise for real).
    """

    run: str
    rank: int
    world_size: int
    iteration_start_ns: dict[int, int]
    iteration_dur_ns: dict[int, int]
    calls: list[PeerCall]
    real_ranks: tuple[int, ...] = ()
    _by_event: dict[int, PeerCall] = field(
        init=False, default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self._by_event = {c.event_id: c for c in self.calls if c.event_id is not None}

    def completion_ns(self, call: PeerCall, own_arrival_ns: int) -> int:
        """When ``call`` completes if this rank arrives at ``own_arrival_ns``.

        ``max(own_arrival_ns, call.peers_arrival_ns) + call.transfer_ns``: the emulator's rule,
        with the real arrival in place of the emulated one.
        """
        return max(own_arrival_ns, call.peers_arrival_ns) + call.transfer_ns

    def by_group(self) -> dict[tuple[int, ...], list[PeerCall]]:
        """Collective calls per communicator member tuple, each list in ``seq`` order."""
        out: dict[tuple[int, ...], list[PeerCall]] = {}
        for c in self.calls:
            if not c.is_p2p:
                out.setdefault(c.group_ranks, []).append(c)
        for calls in out.values():
            calls.sort(key=lambda c: c.seq)
        return out

    def by_event(self, event_id: int) -> PeerCall | None:
        """The call whose recorded host event is ``event_id`` (None when there is none)."""
        return self._by_event.get(event_id)

    def for_iteration(self, iteration: int) -> list[PeerCall]:
        """The calls of one iteration, in emulated order."""
        return [c for c in self.calls if c.iteration == iteration]

    @classmethod
    def from_store(
        cls,
        store: Store,
        *,
        run: str,
        rank: int,
        config: EmulationConfig | None = None,
        real_ranks: Iterable[int] = (),
    ) -> PeerSchedule:
        """Emulate ``run`` (recorded or sliced) and take ``rank``'s schedule from it.

        Args:
            store: an open store (writable when a recorded run has no graph yet).
            run: the recorded or sliced run.
            rank: a rank of its world.
            config: the emulation config (default ``EmulationConfig()``).
            real_ranks: other ranks replayed for real at the same time (excluded from
                ``peers_arrival_ns``).

        Returns:
            The rank's schedule.
        """
        return schedules_from_store(
            store, run=run, ranks=[rank], config=config, real_ranks=real_ranks
        )[rank]

    @classmethod
    def instant(cls, rank: int, world_size: int) -> PeerSchedule:
        """No recorded run: peers never hold anyone back (every call takes no time)."""
        return cls(
            run="",
            rank=rank,
            world_size=world_size,
            iteration_start_ns={},
            iteration_dur_ns={},
            calls=[],
        )


def schedules_from_store(
    store: Store,
    *,
    run: str,
    ranks: Sequence[int],
    config: EmulationConfig | None = None,
    real_ranks: Iterable[int] = (),
) -> dict[int, PeerSchedule]:
    """The schedules of several ranks from one emulation of ``run``.

    Args:
        store: an open store.
        run: the recorded or sliced run.
        ranks: the ranks to build schedules for.
        config: the emulation config.
        real_ranks: ranks replayed for real (besides each rank itself); ``ranks`` are always
            counted as real.

    Returns:
        ``rank -> PeerSchedule``.

    Raises:
        PrismError: a rank that is not in the run's world.
    """
    from prism_trace.replay.emulate.driver import emulate_in_memory

    res, iters = emulate_in_memory(store, run=run, config=config)
    real = sorted({int(r) for r in (*ranks, *real_ranks)})
    return {
        int(r): rank_schedule(store, res, iters, run=run, rank=int(r), real=real) for r in ranks
    }


def rank_schedule(
    store: Store, res: object, iters: pl.DataFrame, *, run: str, rank: int, real: list[int]
) -> PeerSchedule:
    """The schedule of one rank from an emulation already run (``emulate_in_memory``'s pair).

    One emulation serves every rank a caller replays: ``schedules_from_store`` emulates once and
    calls this per rank, and so does the hybrid replay, which also needs the emulation itself.

    Args:
        store: the store the emulation read (for the run's communicators).
        res: the emulation result (its inputs, timeline and sync frame).
        iters: its per-rank iterations (``rank, iteration, ts, dur``).
        run: the emulated run's name (for messages and the schedule).
        rank: the rank whose calls are scheduled.
        real: ranks replayed for real, left out of the virtual peers' arrival (they arrive by
            themselves).

    Returns:
        The rank's schedule.

    Raises:
        SelectionError: ``rank`` is not a rank of the run with a graph.
    """
    inputs = res.inputs  # type: ignore[attr-defined]
    tl = res.timeline  # type: ignore[attr-defined]
    sync: pl.DataFrame = res.sync  # type: ignore[attr-defined]
    ru = inputs.rank_unit.filter(pl.col("rank") == rank)
    if ru.is_empty() or int(ru["unit"][0]) < 0:
        msg = f"{store.path}: rank {rank} is not a rank of run {run!r} with a graph"
        raise SelectionError(msg)
    unit = int(ru["unit"][0])
    real_units = set(inputs.rank_unit.filter(pl.col("rank").is_in(real))["unit"].to_list()) - {unit}

    it = iters.filter(pl.col("rank") == rank).sort("iteration")
    it_start = {int(i): int(t) for i, t in zip(it["iteration"], it["ts"], strict=True)}
    it_dur = {int(i): int(d) for i, d in zip(it["iteration"], it["dur"], strict=True)}

    origin = int(inputs.origin)
    start = tl.start.astype(np.int64) + origin
    end = tl.end.astype(np.int64) + origin
    s_idx = sync["sync_idx"].to_numpy().astype(np.int64)
    s_unit = sync["unit"].to_numpy().astype(np.int64)
    inst = sync["instance"].to_numpy().astype(np.int64)
    arrive = start[s_idx]
    # Last arrival per instance over the participants that are virtual for this rank.
    virtual = (s_unit != unit) & ~np.isin(s_unit, list(real_units))
    n_inst = int(inst.max()) + 1 if inst.size else 0
    peers = np.full(n_inst, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(peers, inst[virtual], arrive[virtual])

    groups = store.con.sql(
        "SELECT group_id, ranks FROM comm_group WHERE run_id = $1", params=[inputs.run_id]
    ).fetchall()
    members = {int(g): tuple(int(x) for x in (r or ())) for g, r in groups}

    mine = np.flatnonzero(s_unit == unit)
    host = sync["host_idx"].to_numpy().astype(np.int64)
    order = mine[np.argsort(start[host[mine]], kind="stable")]
    ev = inputs.nodes["event_id"].to_numpy()
    ev_null = inputs.nodes["event_id"].is_null().to_numpy()
    calls: list[PeerCall] = []
    kinds = sync["kind"].to_list()
    comm_kinds = sync["comm_kind"].to_list()
    gids = sync["group_id"].to_list()
    seqs = sync["seq"].to_list()
    peers_col = sync["peer"].to_list()
    sizes = sync["msg_bytes"].to_list()
    its = sync["iteration"].to_list()
    node_ids = sync["node_id"].to_list()
    starts_sorted = sorted(it_start.items(), key=lambda kv: kv[1])
    for k, i in enumerate(order.tolist()):
        own = int(arrive[i])
        p = int(peers[inst[i]])
        p = own if p == np.iinfo(np.int64).min else p
        e = int(end[s_idx[i]])
        iteration = its[i]
        base = it_start.get(int(iteration)) if iteration is not None else None
        if base is None:  # outside any iteration: the latest iteration start before it
            before = [t for _, t in starts_sorted if t <= own]
            base = before[-1] if before else origin
        kind = kinds[i]
        g = gids[i]
        peer = peers_col[i]
        if kind == "collective":
            ckind = comm_kinds[i] or "collective"
            group_ranks = members.get(int(g), ()) if g is not None else ()
        else:
            ckind = kind
            pair = (rank, peer) if kind == "send" else (peer, rank)
            group_ranks = tuple(int(x) for x in pair if x is not None)
        h = host[i]
        calls.append(
            PeerCall(
                index=k,
                kind=ckind,
                group_id=None if g is None else int(g),
                group_ranks=group_ranks,
                seq=-1 if seqs[i] is None else int(seqs[i]),
                peer=None if peer is None or kind == "collective" else int(peer),
                msg_bytes=None if sizes[i] is None else int(sizes[i]),
                iteration=None if iteration is None else int(iteration),
                own_arrival_ns=own - base,
                peers_arrival_ns=p - base,
                transfer_ns=max(0, e - max(own, p)),
                end_ns=e - base,
                node_id=int(node_ids[i]),
                event_id=None if ev_null[h] else int(ev[h]),
            )
        )
    return PeerSchedule(
        run=run,
        rank=rank,
        world_size=int(inputs.world_size),
        iteration_start_ns=it_start,
        iteration_dur_ns=it_dur,
        calls=calls,
        real_ranks=tuple(r for r in real if r != rank),
    )

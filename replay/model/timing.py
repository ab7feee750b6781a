"""Transfer times of communication instances: replayed from the recording, scaled, or modelled.

A communication node's recorded duration includes the time it waited for the other side, so it is
not a transfer time. The pure transfer time of an instance is the duration recorded by its *last
arriver* (the participant that started last did not wait): ``recorded_transfer``. That is exact at
the recorded scale and is the default (``TimingConfig.model = "recorded"``).

At another scale the transfer comes from ``collective_cost``: NCCL's algorithms (ring, double
binary tree, pairwise all-to-all, p2p) as alpha-beta costs on the two link classes of
``replay.topology``, with nccl-tests bus-bandwidth conventions, the algorithm NCCL's tuner would
pick (least time), and a group's nodes and ranks per node. Three models use it:

- ``recorded``: the recorded transfer; with a bandwidth what-if, times the model's ratio.
- ``scaled``: the recorded transfer times ``model(emulated) / model(recorded)`` (keeps each
  instance's own deviation from the model); the pure model where nothing was recorded.
- ``alpha_beta``: the pure model.

Formulas, presets and calibration (``replay.calibrate``): ``docs/network.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
from prism_trace.replay.model.topology import Topology

from prism_trace.errors import PrismError

__all__ = [
    "MAX_CHUNKS",
    "AlphaBetaTransfer",
    "CollectiveCost",
    "RecordedTransfer",
    "ScaledTransfer",
    "TimingConfig",
    "TransferModel",
    "TransferQuery",
    "bus_factor",
    "collective_cost",
    "recorded_completion",
    "recorded_transfer",
    "transfer_model",
]

Algorithm = Literal["auto", "ring", "tree"]
AllToAll = Literal["pairwise", "ring"]
"""All-to-all algorithm of the alpha-beta model: NCCL's pairwise exchange, or ASTRA-sim's ring."""


def recorded_completion(
    instance: np.ndarray, start: np.ndarray, dur: np.ndarray, n_instances: int
) -> tuple[np.ndarray, np.ndarray]:
    """Transfer per instance and each participant's completion skew, from the recording.

    The skew of a participant is how much later (or earlier) than the last arriver's completion
    it completed: ``end - (last_arrival + transfer)``; 0 for the last arriver, and 0 for all when
    an instance completes everywhere at once (NCCL kernels, roughly). gloo's CPU collectives and
    eager sends do not: their ranks leave the call at different times.

    Args:
        instance: instance of each participation.
        start: recorded start of each participation.
        dur: recorded duration of each participation (waiting included).
        n_instances: number of instances.

    Returns:
        ``(transfer per instance, skew per participation)``, ns.
    """
    instance = np.asarray(instance, dtype=np.int64)
    start = np.asarray(start, dtype=np.int64)
    transfer = recorded_transfer(instance, start, dur, n_instances)
    last = np.full(n_instances, np.iinfo(np.int64).min, dtype=np.int64)
    if instance.size:
        np.maximum.at(last, instance, start)
    end = start + np.asarray(dur, dtype=np.int64)
    skew = end - (last[instance] + transfer[instance]) if instance.size else instance
    return transfer, skew


def recorded_transfer(
    instance: np.ndarray, start: np.ndarray, dur: np.ndarray, n_instances: int
) -> np.ndarray:
    """The pure transfer time of each instance: the duration of its last arriver.

    Of participants arriving at the same instant, the shortest duration wins.

    Args:
        instance: instance of each participation.
        start: recorded start of each participation (ns; any common origin).
        dur: recorded duration of each participation (ns, waiting included).
        n_instances: number of instances.

    Returns:
        Per instance, ns (0 for an instance without participants).
    """
    instance = np.asarray(instance, dtype=np.int64)
    out = np.zeros(n_instances, dtype=np.int64)
    if instance.size == 0:
        return out
    order = np.lexsort((-np.asarray(dur), np.asarray(start), instance))
    last = np.ones(order.size, dtype=bool)
    last[:-1] = instance[order][1:] != instance[order][:-1]
    pick = order[last]
    out[instance[pick]] = np.asarray(dur, dtype=np.int64)[pick]
    return out


# -- the cost model ------------------------------------------------------------------------------

_ALL_REDUCE = ("all_reduce", "barrier")  # barrier: an all_reduce of one element in torch
_RING_ONCE = ("all_gather", "reduce_scatter", "gather", "scatter")
_P2P = ("send", "recv")


def bus_factor(kind: np.ndarray, group_size: np.ndarray) -> np.ndarray:
    """nccl-tests' ``busbw / algbw`` per collective kind (doc/PERFORMANCE.md in nccl-tests).

    all_reduce ``2(n-1)/n``; all_gather, reduce_scatter, all_to_all (and gather, scatter)
    ``(n-1)/n``; broadcast, reduce, send, recv (and unknown kinds) 1.

    Args:
        kind: collective kind per instance.
        group_size: participants per instance.

    Returns:
        Float array.
    """
    kinds = np.asarray(kind, dtype=object)
    n = np.maximum(np.asarray(group_size, dtype=np.float64), 1.0)
    out = np.ones(n.size)
    ar = np.isin(kinds, _ALL_REDUCE)
    out[ar] = 2.0 * (n[ar] - 1.0) / n[ar]
    once = np.isin(kinds, (*_RING_ONCE, "all_to_all"))
    out[once] = (n[once] - 1.0) / n[once]
    return out


@dataclass(frozen=True)
class CollectiveCost:
    """The alpha-beta terms of each instance, split by link class (arrays of one length).

    ``time = intra_steps * alpha_intra + inter_steps * alpha_inter
    + max(intra_bytes / bw_intra, inter_bytes / bw_inter)``: latency adds up hop by hop, while the
    two link classes move data at the same time, so the slower one bounds the bandwidth term.

    Attributes:
        algorithm: ``ring``, ``tree``, ``pairwise`` (all_to_all), ``p2p`` or ``none`` (one rank).
        intra_steps: latency steps on intra-node links.
        inter_steps: latency steps on inter-node links.
        intra_bytes: bytes one GPU moves over NVLink on the critical path, in bus-bandwidth units.
        inter_bytes: bytes one GPU's NIC moves, in the same units.
    """

    algorithm: np.ndarray
    intra_steps: np.ndarray
    inter_steps: np.ndarray
    intra_bytes: np.ndarray
    inter_bytes: np.ndarray

    def latency_ns(self, topology: Topology) -> np.ndarray:
        """The latency term, ns (independent of the bandwidth what-if)."""
        return self.intra_steps * float(topology.intra_node_latency_ns) + self.inter_steps * float(
            topology.inter_node_latency_ns
        )

    def bandwidth_ns(self, topology: Topology) -> np.ndarray:
        """The bandwidth term, ns, at the topology's effective (what-if) bandwidths."""
        return np.maximum(
            self.intra_bytes / topology.intra_bytes_per_ns,
            self.inter_bytes / topology.inter_bytes_per_ns,
        )

    def time_ns(self, topology: Topology) -> np.ndarray:
        """Latency plus bandwidth term, ns (float)."""
        return self.latency_ns(topology) + self.bandwidth_ns(topology)


def collective_cost(
    kind: np.ndarray,
    msg_bytes: np.ndarray,
    group_size: np.ndarray,
    n_nodes: np.ndarray,
    topology: Topology,
    *,
    algorithm: Algorithm = "auto",
    chunks: int = 1,
    all_to_all: AllToAll = "pairwise",
) -> CollectiveCost:
    """Alpha-beta terms of instances under NCCL's algorithms (vectorised).

    With ``n`` ranks on ``N`` nodes, ``g = ceil(n / N)`` per node and ``S = msg_bytes``
    (nccl-tests size), steps and critical-path bytes are:

    | kind | algorithm | intra / inter steps | intra / inter bytes |
    |---|---|---|---|
    | all_reduce | ring | ``2(n-N)`` / ``2(N-1)`` | ``X = 2(n-1)/n S`` / ``X/g`` (0 if N = 1) |
    | all_reduce | tree (``N > 1``) | ``2(g-1)`` / ``2 ceil(log2 N)`` | ``X = 2S/eff`` / ``X/g`` |
    | all_gather, reduce_scatter | ring | ``n-N`` / ``N-1`` | ``(n-1)/n S`` / that ``/g`` |
    | broadcast, reduce | ring (pipelined) | ``n-N`` / ``N-1`` | ``S`` / ``S/g`` |
    | all_to_all | pairwise | ``g-1`` / ``n-g`` | ``(g-1)/n S`` / ``(n-g)/n S`` |
    | send, recv | p2p | 1 / 0 (``N = 1``) or 0 / 1 | ``S`` on the one link class |

    Step counts are NCCL's tuner's (``nsteps``, ``nInterSteps``; tree: intra-node chain plus an
    inter-node double binary tree). A ring crossing nodes leaves each node through the NICs of the
    group's ``g`` GPUs there, so its inter-node bandwidth is ``g`` times one GPU's NIC (capped by
    NVLink through the max in ``CollectiveCost``). ``eff`` is ``topology.tree_efficiency``. With
    ``algorithm="auto"``, an all_reduce over several nodes takes whichever of ring and tree is
    faster (NCCL's tuner); ``"ring"``/``"tree"`` force one (like ``NCCL_ALGO``).

    Args:
        kind: collective kind (``all_reduce``, ...) or ``send``/``recv`` per instance.
        msg_bytes: nccl-tests size per instance (negative: unknown, treated as 0).
        group_size: participants per instance.
        n_nodes: nodes the group spans (clipped to ``[1, group_size]``).
        topology: link parameters (used to choose ring vs tree).
        algorithm: ``auto``, ``ring`` or ``tree`` (all_reduce only).
        chunks: a collective runs as ``chunks`` pieces one after another, each paying every
            step's latency (ASTRA-sim's ``preferred-dataset-splits`` with one active chunk);
            the bytes are the same. Sends and receives are not split.
        all_to_all: ``pairwise`` (NCCL: each rank sends to every other directly) or ``ring``
            (ASTRA-sim's ring: every piece is relayed hop by hop, ``n(n-1)/2`` steps moving
            ``(n-1)/2 S``).

    Returns:
        The terms per instance.
    """
    kinds = np.asarray(kind, dtype=object)
    n = np.maximum(np.asarray(group_size, dtype=np.float64), 1.0)
    nodes = np.clip(np.asarray(n_nodes, dtype=np.float64), 1.0, n)
    g = np.ceil(n / nodes)
    size = np.maximum(np.asarray(msg_bytes, dtype=np.float64), 0.0)
    multi = nodes > 1
    factor = bus_factor(kinds, n)

    # ring (every collective but all_to_all and p2p), pipelined chain for broadcast/reduce
    ar = np.isin(kinds, _ALL_REDUCE)
    steps = np.where(ar, 2.0, 1.0)
    intra_steps = steps * (n - nodes)
    inter_steps = steps * (nodes - 1.0)
    intra_bytes = factor * size
    inter_bytes = np.where(multi, intra_bytes / g, 0.0)
    algo = np.full(n.size, "ring", dtype=object)

    a2a = kinds == "all_to_all"
    intra_steps[a2a] = g[a2a] - 1.0
    inter_steps[a2a] = n[a2a] - g[a2a]
    intra_bytes[a2a] = (g[a2a] - 1.0) / n[a2a] * size[a2a]
    inter_bytes[a2a] = (n[a2a] - g[a2a]) / n[a2a] * size[a2a]
    algo[a2a] = "pairwise"
    if all_to_all == "ring" and a2a.any():
        # Relayed around the ring: n(n-1)/2 steps of S/n, split across link classes as a ring's.
        relay = n[a2a] / 2.0
        intra_steps[a2a] = relay * (n[a2a] - nodes[a2a])
        inter_steps[a2a] = relay * (nodes[a2a] - 1.0)
        intra_bytes[a2a] = (n[a2a] - 1.0) / 2.0 * size[a2a]
        inter_bytes[a2a] = np.where(multi[a2a], intra_bytes[a2a] / g[a2a], 0.0)
        algo[a2a] = "ring"

    p2p = np.isin(kinds, _P2P)
    intra_steps[p2p] = np.where(multi[p2p], 0.0, 1.0)
    inter_steps[p2p] = np.where(multi[p2p], 1.0, 0.0)
    intra_bytes[p2p] = np.where(multi[p2p], 0.0, size[p2p])
    inter_bytes[p2p] = np.where(multi[p2p], size[p2p], 0.0)
    algo[p2p] = "p2p"

    ring = CollectiveCost(algo, intra_steps, inter_steps, intra_bytes, inter_bytes)
    if algorithm != "ring" and ar.any():
        t_bytes = 2.0 * size / float(topology.tree_efficiency)
        tree = CollectiveCost(
            np.full(n.size, "tree", dtype=object),
            2.0 * (g - 1.0),
            2.0 * np.ceil(np.log2(nodes)),
            t_bytes,
            np.where(multi, t_bytes / g, 0.0),
        )
        if algorithm == "tree":
            use = ar
        else:
            use = ar & multi & (tree.time_ns(topology) < ring.time_ns(topology))
        ring = CollectiveCost(*(np.where(use, getattr(tree, f), getattr(ring, f)) for f in _F))
    if chunks > 1:
        split = ~np.isin(kinds, _P2P)
        ring = CollectiveCost(
            ring.algorithm,
            np.where(split, ring.intra_steps * chunks, ring.intra_steps),
            np.where(split, ring.inter_steps * chunks, ring.inter_steps),
            ring.intra_bytes,
            ring.inter_bytes,
        )
    lone = n <= 1  # a group of one moves nothing
    if lone.any():
        ring = CollectiveCost(
            np.where(lone, "none", ring.algorithm).astype(object),
            *(np.where(lone, 0.0, getattr(ring, f)) for f in _F[1:]),
        )
    return ring


_F = ("algorithm", "intra_steps", "inter_steps", "intra_bytes", "inter_bytes")

_REDUCING = ("all_reduce", "reduce_scatter", "reduce")


def reduction_ns(
    kind: np.ndarray, msg_bytes: np.ndarray, group_size: np.ndarray, gbps: float | None
) -> np.ndarray:
    """Local reduction time per instance, ns: ``3 (n-1)/n S / gbps`` (0 where ``gbps`` is None).

    A reducing ring (all_reduce, reduce_scatter, reduce) adds ``(n-1)/n S`` received bytes into
    its own, reading two operands and writing one at the memory bandwidth ``gbps``, after each
    step's transfer instead of during it. NCCL fuses the reduction into the copy (no extra
    time: the default); ASTRA-sim charges it (``PacketBundle::call``: three passes at its
    ``local-mem-bw``), which the reduce-scatter's few bytes per step make visible
    (docs/network.md).
    """
    kinds = np.asarray(kind, dtype=object)
    out = np.zeros(kinds.size, dtype=np.float64)
    if gbps is None:
        return out
    n = np.maximum(np.asarray(group_size, dtype=np.float64), 1.0)
    size = np.maximum(np.asarray(msg_bytes, dtype=np.float64), 0.0)
    red = np.isin(kinds, _REDUCING)
    out[red] = 3.0 * (n[red] - 1.0) / n[red] * size[red] / float(gbps)
    return out


# -- what a model is told --------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferQuery:
    """What a transfer model is told about each instance (arrays of one length).

    Attributes:
        kind: collective kind (``all_reduce``, ...) or ``send``/``recv``.
        msg_bytes: nccl-tests size (``max(in, out)``) at the emulated scale; -1 when unknown.
        group_size: participants of the group at the emulated scale.
        spans_nodes: the group crosses a node boundary (at the emulated scale).
        recorded_ns: the recorded transfer of the representative instance (0: none recorded).
        n_nodes: nodes the group spans at the emulated scale (``Topology.group_nodes``); None:
            1 where it does not span nodes, else ``max(2, ceil(group_size / ranks_per_node))``.
        recorded_group_size: participants of the recorded instance; None: ``group_size``.
        recorded_msg_bytes: size of the recorded instance; None: ``msg_bytes``.
        recorded_n_nodes: nodes of the recorded instance; None: ``n_nodes`` where the group size
            is unchanged, else the group's ranks per node are kept
            (``ceil(recorded_group_size / ceil(group_size / n_nodes))``).
    """

    kind: np.ndarray
    msg_bytes: np.ndarray
    group_size: np.ndarray
    spans_nodes: np.ndarray
    recorded_ns: np.ndarray
    n_nodes: np.ndarray | None = None
    recorded_group_size: np.ndarray | None = None
    recorded_msg_bytes: np.ndarray | None = None
    recorded_n_nodes: np.ndarray | None = None

    def shapes(self, topology: Topology) -> tuple[np.ndarray, ...]:
        """``(size, n, nodes, rec_size, rec_n, rec_nodes)``, defaults filled in (int64)."""
        n = np.maximum(np.asarray(self.group_size, dtype=np.int64), 1)
        size = np.asarray(self.msg_bytes, dtype=np.int64)
        if self.n_nodes is None:
            spread = np.maximum(-(-n // topology.ranks_per_node), 2)
            nodes = np.where(np.asarray(self.spans_nodes, dtype=bool), spread, 1)
        else:
            nodes = np.asarray(self.n_nodes, dtype=np.int64)
        nodes = np.clip(nodes, 1, n)
        rec_n = n if self.recorded_group_size is None else self.recorded_group_size
        rec_n = np.maximum(np.asarray(rec_n, dtype=np.int64), 1)
        rec_size = size if self.recorded_msg_bytes is None else self.recorded_msg_bytes
        rec_size = np.asarray(rec_size, dtype=np.int64)
        if self.recorded_n_nodes is None:
            per = -(-n // nodes)
            rec_nodes = np.where(rec_n == n, nodes, -(-rec_n // per))
        else:
            rec_nodes = np.asarray(self.recorded_n_nodes, dtype=np.int64)
        rec_nodes = np.clip(rec_nodes, 1, rec_n)
        return size, n, nodes, rec_size, rec_n, rec_nodes


class TransferModel(Protocol):
    """Maps instances to the transfer time to emulate."""

    def transfer(self, query: TransferQuery) -> np.ndarray:
        """Per instance, ns (int64)."""
        ...


def _ratio_scaled(
    query: TransferQuery, topology: Topology, algorithm: Algorithm, *, rescale: bool
) -> np.ndarray:
    """``recorded * model(emulated) / model(recorded)``; pure model where nothing was recorded.

    ``rescale=False`` (the ``recorded`` model) evaluates both sides at the recorded shape, so only
    a bandwidth what-if changes anything.
    """
    size, n, nodes, rec_size, rec_n, rec_nodes = query.shapes(topology)
    if not rescale:
        size, n, nodes = rec_size, rec_n, rec_nodes
    recorded = np.asarray(query.recorded_ns, dtype=np.int64)
    kinds = np.asarray(query.kind, dtype=object)
    base = topology.unscaled()
    new = collective_cost(kinds, size, n, nodes, topology, algorithm=algorithm).time_ns(topology)
    old = collective_cost(kinds, rec_size, rec_n, rec_nodes, base, algorithm=algorithm).time_ns(
        base
    )
    same = (size == rec_size) & (n == rec_n) & (nodes == rec_nodes) & (not topology.scaled)
    known = (size >= 0) & (rec_size >= 0)
    has = recorded > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(old > 0, recorded * (new / old), new)
    unknown = recorded.astype(np.float64)
    if topology.scaled:
        # No message size (e.g. op timelines): all of the recording beyond the modelled latency
        # is taken as bandwidth time, so a bandwidth what-if still acts on it.
        zero = np.zeros_like(rec_size)
        lat = collective_cost(kinds, zero, rec_n, rec_nodes, base, algorithm=algorithm).time_ns(
            base
        )
        lat = np.minimum(lat, unknown)
        s_eff = np.where(
            rec_nodes > 1,
            topology.inter_bytes_per_ns / base.inter_bytes_per_ns,
            topology.intra_bytes_per_ns / base.intra_bytes_per_ns,
        )
        unknown = lat + (unknown - lat) / s_eff
    out = np.where(same, recorded, np.where(known, scaled, unknown))  # something recorded
    out = np.where(has, out, np.where(size >= 0, new, recorded))  # nothing: the pure model
    return _as_ns(out, topology)


_MAX_TRANSFER_NS = 2.0**61
"""The longest transfer the models may give, ns (73 years): an eighth of int64's range, so the
transfers of a whole iteration still add up inside it beside the recorded durations."""


class TransferOverflowError(PrismError, ValueError):
    """The network model gives a transfer no int64 ns can hold (an absurd bandwidth)."""


def _as_ns(times: np.ndarray, topology: Topology) -> np.ndarray:
    """Modelled transfer times as int64 ns, refused when any is not finite or too long.

    ``astype(np.int64)`` of 1e300 gives -2**63 without a word: a topology of 1e-300 GB/s made
    every transfer wrap, and the emulated iterations came out *shorter* than the recorded ones.

    Raises:
        TransferOverflowError: naming the longest transfer and the bandwidths in force.
    """
    times = np.asarray(times, dtype=np.float64)
    bad = ~np.isfinite(times) | (np.abs(times) > _MAX_TRANSFER_NS)
    if bad.any():
        worst = float(np.nanmax(np.where(np.isnan(times), np.inf, np.abs(times))))
        msg = (
            f"the network model gives a transfer of {worst:.3g} ns, past {_MAX_TRANSFER_NS:.3g}"
            f" (bandwidth {topology.intra_bytes_per_ns:.3g} B/ns in a node,"
            f" {topology.inter_bytes_per_ns:.3g} B/ns across nodes): check the topology's"
            " bandwidths and latencies"
        )
        raise TransferOverflowError(msg)
    return np.rint(times).astype(np.int64)


@dataclass(frozen=True)
class RecordedTransfer:
    """Replay the recorded transfer time (exact at the recorded scale).

    Group and message sizes of the emulation are ignored. A bandwidth what-if
    (``Topology.bandwidth_scale`` ...) still applies: the transfer becomes
    ``recorded * model(what-if) / model(recorded network)`` at the recorded shape, i.e. the
    modelled bandwidth term is rescaled and the latency term kept.
    """

    topology: Topology = field(default_factory=Topology)
    algorithm: Algorithm = "auto"

    def transfer(self, query: TransferQuery) -> np.ndarray:
        """The recorded transfer (rescaled only by a bandwidth what-if)."""
        recorded = np.asarray(query.recorded_ns, dtype=np.int64)
        if not self.topology.scaled:
            return recorded
        out = _ratio_scaled(query, self.topology, self.algorithm, rescale=False)
        return np.where(recorded > 0, out, recorded)


@dataclass(frozen=True)
class ScaledTransfer:
    """The recorded transfer carried to another scale by the model's ratio.

    ``recorded * model(emulated group, size, network) / model(recorded group, size, network)``:
    exactly the recording where nothing changed, and each instance keeps its own deviation from
    the model (contention, protocol effects) as a factor. Where nothing was recorded
    (``recorded_ns <= 0``) the pure model; where the size is unknown, the recording.
    """

    topology: Topology = field(default_factory=Topology)
    algorithm: Algorithm = "auto"

    def transfer(self, query: TransferQuery) -> np.ndarray:
        """Scaled transfer per instance, ns."""
        return _ratio_scaled(query, self.topology, self.algorithm, rescale=True)


@dataclass(frozen=True)
class AlphaBetaTransfer:
    """The pure model: ``collective_cost(...).time_ns`` at the emulated shape.

    Instances without a message size keep the recorded time.
    """

    topology: Topology = field(default_factory=Topology)
    algorithm: Algorithm = "auto"
    chunks: int = 1
    all_to_all: AllToAll = "pairwise"
    reduction_gbps: float | None = None

    def cost(self, query: TransferQuery) -> CollectiveCost:
        """The terms per instance (which algorithm, steps, bytes): for reports and tests."""
        size, n, nodes, *_ = query.shapes(self.topology)
        return collective_cost(
            query.kind,
            size,
            n,
            nodes,
            self.topology,
            algorithm=self.algorithm,
            chunks=self.chunks,
            all_to_all=self.all_to_all,
        )

    def transfer(self, query: TransferQuery) -> np.ndarray:
        """Modelled transfer per instance, ns."""
        size = np.asarray(query.msg_bytes, dtype=np.int64)
        model = self.cost(query).time_ns(self.topology)
        if self.reduction_gbps is not None:
            _, n, *_ = query.shapes(self.topology)
            model = model + reduction_ns(query.kind, size, n, self.reduction_gbps)
        return _as_ns(np.where(size >= 0, model, query.recorded_ns), self.topology)


MAX_CHUNKS = 1024
"""The most pieces ``chunks`` may split a collective into. Each piece pays every step's latency
again, so the count multiplies the latency term: ASTRA-sim's configs use 1-64 (4 by default),
while ``chunks = 1000000000`` made a 0.3 s iteration 15 hours and larger counts overflow int64
ns. 1024 leaves room for any real splitting."""


@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    """The ``timing`` section of ``EmulationConfig`` (JSON-serialisable).

    Attributes:
        model: ``scaled`` (default: the recorded transfer, times the model's ratio where the
            group size, message size, node span or bandwidth changed), ``recorded`` (the last
            arriver's recorded transfer, ignoring scale) or ``alpha_beta`` (the pure model).
        calibrate: fit the topology's latencies and bandwidths to the recorded run before
            modelling (``replay.calibrate.calibrate_run``; link classes without data keep the
            preset's values).
        algorithm: all_reduce algorithm: ``auto`` (least modelled time, as NCCL's tuner),
            ``ring`` or ``tree`` (as ``NCCL_ALGO``).
        chunks: ``alpha_beta`` only: collectives run as this many pieces in sequence, each
            paying the latency (4 matches ASTRA-sim's default system config; docs/network.md);
            at most ``MAX_CHUNKS``.
        all_to_all: ``alpha_beta`` only: ``pairwise`` (NCCL) or ``ring`` (ASTRA-sim).
        reduction_gbps: ``alpha_beta`` only: a reducing collective also spends
            ``3 (n-1)/n S / reduction_gbps`` ns on its local reduction (`reduction_ns`;
            ASTRA-sim's ``local-mem-bw``, 1600 in its default config). None: fused, free (NCCL).
    """

    model: Literal["recorded", "scaled", "alpha_beta"] = "scaled"
    calibrate: bool = False
    algorithm: Algorithm = "auto"
    chunks: int = 1
    all_to_all: AllToAll = "pairwise"
    reduction_gbps: float | None = None

    def __post_init__(self) -> None:
        if self.model not in ("recorded", "scaled", "alpha_beta"):
            msg = f"timing `model` must be recorded, scaled or alpha_beta, got {self.model!r}"
            raise ValueError(msg)
        if self.algorithm not in ("auto", "ring", "tree"):
            msg = f"timing `algorithm` must be auto, ring or tree, got {self.algorithm!r}"
            raise ValueError(msg)
        if not isinstance(self.chunks, int) or not 1 <= self.chunks <= MAX_CHUNKS:
            msg = (
                f"timing `chunks` must be a whole number in [1, {MAX_CHUNKS}], got {self.chunks!r}"
            )
            raise ValueError(msg)
        if self.all_to_all not in ("pairwise", "ring"):
            msg = f"timing `all_to_all` must be pairwise or ring, got {self.all_to_all!r}"
            raise ValueError(msg)
        r = self.reduction_gbps
        if r is not None and (
            isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0 or r == float("inf")
        ):
            msg = f"timing `reduction_gbps` must be a number > 0 (GB/s), got {r!r}"
            raise ValueError(msg)


def transfer_model(config: TimingConfig, topology: Topology) -> TransferModel:
    """The transfer model a config asks for.

    Args:
        config: the timing section.
        topology: the topology section (calibrated already when ``config.calibrate``).

    Returns:
        The model.
    """
    if config.model == "alpha_beta":
        return AlphaBetaTransfer(
            topology, config.algorithm, config.chunks, config.all_to_all, config.reduction_gbps
        )
    if config.model == "scaled":
        return ScaledTransfer(topology, config.algorithm)
    return RecordedTransfer(topology, config.algorithm)

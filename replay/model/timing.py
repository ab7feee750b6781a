"""Transfer times of communication instances: replayed from the recording, scaled, or modelled.

A communication node's recorded duration includes the time it waited for the other side, so it is
not a transfer time. The pure transfer time of an instance is the duration recorded by its *last
arriver* (the participant that started last did not wait): ``recorded_transfer``. That is exact at
the recorded scale and is the default (``TimingConfig.model = "recorded"``).

At another scale the transfer comes from ``replay.model.cost.collective_cost``: NCCL's
algorithms as alpha-beta costs on the two link classes of ``replay.model.topology``. Three models
use it:

- ``recorded``: the recorded transfer; with a bandwidth what-if, times the model's ratio.
- ``scaled``: the recorded transfer times ``model(emulated) / model(recorded)`` (keeps each
  instance's own deviation from the model); the pure model where nothing was recorded.
- ``alpha_beta``: the pure model.

Formulas, presets and calibration (``replay.model.calibrate``): ``docs/network.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
from prism_trace.replay.model.cost import (
    Algorithm,
    AllToAll,
    CollectiveCost,
    collective_cost,
    reduction_ns,
)
from prism_trace.replay.model.topology import Topology

from prism_trace.errors import ConfigError, PrismError

__all__ = [
    "MAX_CHUNKS",
    "AlphaBetaTransfer",
    "RecordedTransfer",
    "ScaledTransfer",
    "TimingConfig",
    "TransferModel",
    "TransferOverflowError",
    "TransferQuery",
    "recorded_completion",
    "recorded_transfer",
    "transfer_model",
]


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
            modelling (``replay.model.calibrate.calibrate_run``; link classes without data keep the
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
            raise ConfigError(msg)
        if self.algorithm not in ("auto", "ring", "tree"):
            msg = f"timing `algorithm` must be auto, ring or tree, got {self.algorithm!r}"
            raise ConfigError(msg)
        if not isinstance(self.chunks, int) or not 1 <= self.chunks <= MAX_CHUNKS:
            msg = (
                f"timing `chunks` must be a whole number in [1, {MAX_CHUNKS}], got {self.chunks!r}"
            )
            raise ConfigError(msg)
        if self.all_to_all not in ("pairwise", "ring"):
            msg = f"timing `all_to_all` must be pairwise or ring, got {self.all_to_all!r}"
            raise ConfigError(msg)
        r = self.reduction_gbps
        if r is not None and (
            isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0 or r == float("inf")
        ):
            msg = f"timing `reduction_gbps` must be a number > 0 (GB/s), got {r!r}"
            raise ConfigError(msg)


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

"""Transfer times of communication instances: replayed from the recording, or modelled.

A communication node's recorded duration includes the time it waited for the other side, so it is
not a transfer time. The pure transfer time of an instance is the duration recorded by its *last
arriver* (the participant that started last did not wait): ``recorded_transfer``. That is exact at
the recorded scale and is the default (``TimingConfig.model = "recorded"``).

The hook for changed scales is ``TransferModel``: given each instance's kind, message size,
group size, whether it spans nodes and its recorded transfer, it returns the transfer to emulate.
``AlphaBetaTransfer`` is a first topology-aware model (ring algorithms on ``replay.topology``);
it is not calibrated and not the default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from replay.topology import Topology

__all__ = [
    "AlphaBetaTransfer",
    "RecordedTransfer",
    "TimingConfig",
    "TransferModel",
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


@dataclass(frozen=True)
class TransferQuery:
    """What a transfer model is told about each instance (arrays of one length).

    Attributes:
        kind: collective kind (``all_reduce``, ...) or ``send``/``recv``.
        msg_bytes: nccl-tests size (``max(in, out)``); -1 when unknown.
        group_size: participants of the group (at the emulated scale).
        spans_nodes: the group crosses a node boundary.
        recorded_ns: the recorded transfer of the representative instance.
    """

    kind: np.ndarray
    msg_bytes: np.ndarray
    group_size: np.ndarray
    spans_nodes: np.ndarray
    recorded_ns: np.ndarray


class TransferModel(Protocol):
    """Maps instances to the transfer time to emulate."""

    def transfer(self, query: TransferQuery) -> np.ndarray:
        """Per instance, ns (int64)."""
        ...


class RecordedTransfer:
    """Replay the recorded transfer time (exact at the recorded scale)."""

    def transfer(self, query: TransferQuery) -> np.ndarray:
        """The recorded transfer, unchanged."""
        return np.asarray(query.recorded_ns, dtype=np.int64)


_BUS_FACTOR = {  # bytes each rank moves, as a multiple of msg_bytes, for ring algorithms
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
_STEPS = {"all_reduce": lambda n: 2.0 * (n - 1)}


@dataclass(frozen=True)
class AlphaBetaTransfer:
    """Ring alpha-beta model: ``steps * alpha + factor(n) * msg_bytes / bandwidth``.

    ``factor`` is the nccl-tests bus factor (all_reduce ``2(n-1)/n``, all_gather/reduce_scatter/
    all_to_all ``(n-1)/n``, send/recv/broadcast 1), steps ``2(n-1)`` for all_reduce, ``n-1`` for
    the other collectives, 1 for p2p. Instances without a message size keep the recorded time.
    """

    topology: Topology = field(default_factory=Topology)

    def transfer(self, query: TransferQuery) -> np.ndarray:
        """Modelled transfer per instance, ns."""
        n = np.maximum(np.asarray(query.group_size, dtype=np.float64), 1.0)
        kinds = np.asarray(query.kind, dtype=object)
        factor = np.ones(n.size)
        steps = np.maximum(n - 1.0, 1.0)
        for kind, f in _BUS_FACTOR.items():
            m = kinds == kind
            factor[m] = f(n[m])
        for kind, f in _STEPS.items():
            m = kinds == kind
            steps[m] = f(n[m])
        p2p = (kinds == "send") | (kinds == "recv")
        steps[p2p] = 1.0
        alpha, beta = self.topology.alpha_beta(query.spans_nodes)
        size = np.asarray(query.msg_bytes, dtype=np.float64)
        model = steps * alpha + factor * np.maximum(size, 0.0) / beta
        known = size >= 0
        return np.where(known, np.rint(model), query.recorded_ns).astype(np.int64)


@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    """The ``timing`` section of ``EmulationConfig``.

    Attributes:
        model: ``recorded`` (the last arriver's recorded transfer) or ``alpha_beta``.
    """

    model: Literal["recorded", "alpha_beta"] = "recorded"


def transfer_model(config: TimingConfig, topology: Topology) -> TransferModel:
    """The transfer model a config asks for.

    Args:
        config: the timing section.
        topology: the topology section (used by ``alpha_beta``).

    Returns:
        The model.
    """
    if config.model == "alpha_beta":
        return AlphaBetaTransfer(topology)
    return RecordedTransfer()

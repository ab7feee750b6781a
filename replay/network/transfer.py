"""The emulator's transfer times from a fitted network model (``[network]``, ``--network``).

The same three modes as ``replay.model.timing`` (``TimingConfig.model``), with the fitted model
in place of the topology's alpha-beta cost:

- ``scaled`` (default): the recorded transfer times ``network(emulated) / network(recorded)``,
  so each collective keeps its own deviation from the model and only what the scale changed
  (group size, node span, message size) moves it; the pure model where nothing was recorded;
- ``alpha_beta``: the pure model (``network_time_us``) at the emulated shape;
- ``recorded``: the recording, rescaled only by a bandwidth what-if.

A group's nodes and ranks per node come from the topology (``Topology.group_nodes``), as for the
other models; the network model prices them. Kinds NCCL implements with another one are priced
as that one: a barrier as a one-element all_reduce, gather/scatter as all_gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from prism_trace.replay.model.timing import TransferOverflowError, TransferQuery
from prism_trace.replay.model.topology import Topology
from prism_trace.replay.network.model import NetworkModel, network_time_us

__all__ = ["NetworkTransfer", "network_kinds"]

_AS = {"barrier": "all_reduce", "gather": "all_gather", "scatter": "all_gather"}
_KNOWN = {
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "send",
    "recv",
}
_MAX_NS = 2.0**61  # as replay.model.timing: an eighth of int64, room to add a step's transfers


def network_kinds(kind: np.ndarray) -> np.ndarray:
    """The kind the network model prices each instance as (unknown kinds: all_gather)."""
    kinds = np.asarray(kind, dtype=object)
    out = np.array([_AS.get(k, k) for k in kinds.tolist()], dtype=object)
    out[~np.isin(out, list(_KNOWN))] = "all_gather"
    return out


@dataclass(frozen=True)
class NetworkTransfer:
    """A `TransferModel` (``replay.model.timing``) backed by a `NetworkModel`.

    Attributes:
        network: the fitted model (enabled).
        topology: where groups lie (ranks per node) and the bandwidth what-ifs.
        mode: ``scaled``, ``alpha_beta`` or ``recorded`` (``TimingConfig.model``).
    """

    network: NetworkModel
    topology: Topology
    mode: Literal["recorded", "scaled", "alpha_beta"] = "scaled"

    @staticmethod
    def _ns(
        net: NetworkModel, kinds: np.ndarray, size: np.ndarray, n: np.ndarray, nodes: np.ndarray
    ) -> np.ndarray:
        t, _ = network_time_us(net, kinds, size, n, nodes)
        return t * 1e3

    def transfer(self, query: TransferQuery) -> np.ndarray:
        """Transfer per instance, ns (int64)."""
        topo = self.topology
        size, n, nodes, rec_size, rec_n, rec_nodes = query.shapes(topo)
        recorded = np.asarray(query.recorded_ns, dtype=np.int64)
        kinds = network_kinds(query.kind)
        base = self.network
        net = base
        if topo.scaled:
            net = base.scaled(
                intra=topo.bandwidth_scale * topo.intra_bandwidth_scale,
                inter=topo.bandwidth_scale * topo.inter_bandwidth_scale,
            )
        if self.mode == "recorded":
            size, n, nodes = rec_size, rec_n, rec_nodes
        new = self._ns(net, kinds, size, n, nodes)
        if self.mode == "alpha_beta":
            out = np.where(size >= 0, new, recorded.astype(np.float64))
            return _as_ns(out)
        old = self._ns(base, kinds, rec_size, rec_n, rec_nodes)
        same = (size == rec_size) & (n == rec_n) & (nodes == rec_nodes) & (not topo.scaled)
        known = (size >= 0) & (rec_size >= 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(old > 0, recorded * (new / old), new)
        out = np.where(same | ~known, recorded, scaled)
        out = np.where(recorded > 0, out, np.where(size >= 0, new, recorded))
        return _as_ns(out)


def _as_ns(times: np.ndarray) -> np.ndarray:
    """Int64 ns, refusing a transfer no int64 holds (a network of 1e-300 GB/s)."""
    times = np.asarray(times, dtype=np.float64)
    bad = ~np.isfinite(times) | (np.abs(times) > _MAX_NS)
    if bad.any():
        msg = (
            f"the network model gives a transfer of {float(np.nanmax(np.abs(times))):.3g} ns,"
            f" past {_MAX_NS:.3g}: check the [network] bandwidths"
        )
        raise TransferOverflowError(msg)
    return np.rint(times).astype(np.int64)

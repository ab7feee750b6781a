"""The alpha-beta cost of a collective under NCCL's algorithms, on the two link classes.

NCCL's algorithms (ring, double binary tree, pairwise all-to-all, p2p) as alpha-beta costs on
the two link classes of ``replay.model.topology``, with nccl-tests bus-bandwidth conventions, the
algorithm NCCL's tuner would pick (least time), and a group's nodes and ranks per node. The
transfer models (``replay.model.timing``) and the calibration (``replay.model.calibrate``) both
price instances with it. Formulas and sources: ``docs/network.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from prism_trace.replay.model.topology import Topology

__all__ = [
    "Algorithm",
    "AllToAll",
    "CollectiveCost",
    "bus_factor",
    "collective_cost",
    "reduction_ns",
]

Algorithm = Literal["auto", "ring", "tree"]
AllToAll = Literal["pairwise", "ring"]
"""All-to-all algorithm of the alpha-beta model: NCCL's pairwise exchange, or ASTRA-sim's ring."""


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
        intra = topology._resolved("intra_node_latency_ns")
        inter = topology._resolved("inter_node_latency_ns")
        return self.intra_steps * intra + self.inter_steps * inter

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

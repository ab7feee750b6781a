"""The network a job runs on: ranks per node and the latency/bandwidth of each link class.

Used only by the alpha-beta transfer model of ``replay.timing`` (not by the default, which
replays recorded transfer times). A first, flat model: two link classes, inside a node and across
nodes; a group that spans nodes runs at the inter-node rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Topology"]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Two-level flat topology (the ``topology`` section of ``EmulationConfig``).

    Attributes:
        ranks_per_node: ranks sharing one node's fast interconnect (NVLink).
        intra_node_gbps: per-rank bus bandwidth inside a node, GB/s.
        inter_node_gbps: per-rank bus bandwidth across nodes, GB/s.
        intra_node_latency_ns: per-step latency inside a node, ns.
        inter_node_latency_ns: per-step latency across nodes, ns.
    """

    ranks_per_node: int = 8
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 25.0
    intra_node_latency_ns: float = 2_000.0
    inter_node_latency_ns: float = 8_000.0

    def spans_nodes(self, lowest: np.ndarray, highest: np.ndarray) -> np.ndarray:
        """Whether a group whose members lie in ``[lowest, highest]`` crosses a node boundary.

        Args:
            lowest: lowest member rank of each group.
            highest: highest member rank of each group.

        Returns:
            One bool per group.
        """
        per = max(1, self.ranks_per_node)
        return (np.asarray(lowest) // per) != (np.asarray(highest) // per)

    def alpha_beta(self, spans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-step latency (ns) and bandwidth (bytes/ns) for groups that do or do not span nodes.

        Args:
            spans: from ``spans_nodes``.

        Returns:
            ``(alpha_ns, bytes_per_ns)`` arrays.
        """
        spans = np.asarray(spans, dtype=bool)
        alpha = np.where(spans, self.inter_node_latency_ns, self.intra_node_latency_ns)
        beta = np.where(spans, self.inter_node_gbps, self.intra_node_gbps)  # GB/s == bytes/ns
        return alpha.astype(np.float64), beta.astype(np.float64)

"""The network a job runs on: ranks per node, and the latency and bus bandwidth of each link class.

Two link classes, as NCCL sees a cluster of NVSwitch nodes: *intra* (NVLink inside a node) and
*inter* (the NICs across nodes). Bandwidths are **bus bandwidths** in the nccl-tests sense
(``busbw``, GB/s = bytes/ns per GPU), so a published ``all_reduce_perf`` figure can be entered
as is; latencies are per algorithm *step* (one hop of a ring or tree), ns. ``replay.model.cost``
and ``replay.model.timing`` turn them into transfer times; ``replay.model.calibrate`` fits them to
a recorded run. ``docs/network.md`` gives the formulas and the sources of the presets.

A config names a preset and overrides single fields::

    Topology.preset("h100", inter_node_gbps=40.0)     # == Topology(system="h100", ...)
    {"topology": {"system": "h200", "bandwidth_scale": 2.0}}   # EmulationConfig section

Fields left at ``None`` take the preset's value, so the stored (``asdict``) form is always fully
resolved and rebuilds the same topology.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from prism_trace.errors import ConfigError

__all__ = ["MAX_SLOW_FACTOR", "PRESETS", "Topology", "TopologyError"]

MAX_SLOW_FACTOR = 1e6
"""The largest factor a what-if may stretch a modelled time by: a slow-down factor, the product
of the slow-down factors that can meet on a node, and ``1 / scale`` of a bandwidth scale.

Emulated times are int64 nanoseconds (at most 9.2e18 ns, 292 years). A factor of 1e6 makes a
recorded hour 3.6e18 ns, still inside; a larger one overflows on realistic runs (the durations
wrapped to -2**63 and ts went negative) and models nothing a what-if asks about: a rank a
million times slower is a dead one (``remove-gpu``, ``dp=N-1``). The same bound, inverted,
bounds the bandwidth what-ifs from below (a transfer takes ``1 / scale`` longer). It lives with
the timing model, whose int64 ns it protects; ``replay.whatif`` checks its factors against it.
"""


class TopologyError(ConfigError):
    """A topology the model cannot use: an unknown preset, a non-positive or non-finite figure,
    a bandwidth scale past ``MAX_SLOW_FACTOR``."""


# Per-GPU figures. Sources and reasoning: docs/network.md ("Presets").
_DGX_A100: dict[str, float] = {
    "ranks_per_node": 8,
    "intra_node_gbps": 230.0,  # NVLink3: nccl-tests all_reduce busbw of 8 A100 SXM4
    "inter_node_gbps": 24.0,  # one HDR 200 Gb/s NIC per GPU (8 per node: 192 GB/s ring busbw)
    "intra_node_latency_ns": 1_000.0,
    "inter_node_latency_ns": 3_200.0,
}
_DGX_H100: dict[str, float] = {
    "ranks_per_node": 8,
    "intra_node_gbps": 475.0,  # NVLink4 + NVSwitch (NVLS): nccl-tests all_reduce busbw, 8 GPUs
    "inter_node_gbps": 46.0,  # one NDR 400 Gb/s ConnectX-7 per GPU (8 per node: 368 GB/s)
    "intra_node_latency_ns": 1_000.0,
    "inter_node_latency_ns": 3_200.0,
}

PRESETS: dict[str, dict[str, float]] = {
    "generic": _DGX_A100,  # the default: a DGX A100-class node
    "a100": _DGX_A100,
    "h100": _DGX_H100,
    "h200": _DGX_H100,  # DGX H200 has DGX H100's NVSwitch fabric and NICs (docs/network.md)
}

_FROM_PRESET = (
    "ranks_per_node",
    "intra_node_gbps",
    "inter_node_gbps",
    "intra_node_latency_ns",
    "inter_node_latency_ns",
)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Two-level topology (the ``topology`` section of ``EmulationConfig``).

    Attributes:
        system: the preset the unset fields come from (``PRESETS``: ``generic``, ``a100``,
            ``h100``, ``h200``).
        ranks_per_node: ranks (GPUs) sharing one node's NVLink fabric.
        intra_node_gbps: bus bandwidth inside a node, GB/s per GPU (nccl-tests ``busbw`` of a
            one-node all_reduce).
        inter_node_gbps: bus bandwidth across nodes, GB/s per GPU: what one GPU's NIC sustains
            (nccl-tests ``busbw`` of a group with one GPU per node). A group with ``g`` GPUs on
            each node crosses nodes at up to ``g`` times this.
        intra_node_latency_ns: per-step latency inside a node, ns.
        inter_node_latency_ns: per-step latency across nodes, ns.
        tree_efficiency: bandwidth of NCCL's tree relative to a ring (0.9 in NCCL's tuner).
        bandwidth_scale: what-if: multiplies both bandwidths (2.0 = a network twice as fast).
        intra_bandwidth_scale: what-if: multiplies the intra-node bandwidth only.
        inter_bandwidth_scale: what-if: multiplies the inter-node bandwidth only.

    Raises:
        TopologyError: an unknown ``system``, a figure that is not a positive finite number,
            ``ranks_per_node < 1``, or a bandwidth scale outside ``[1 / MAX_SLOW_FACTOR,
            MAX_SLOW_FACTOR]`` (one line each).
    """

    system: str = "generic"
    ranks_per_node: int | None = None
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    intra_node_latency_ns: float | None = None
    inter_node_latency_ns: float | None = None
    tree_efficiency: float = 0.9
    bandwidth_scale: float = 1.0
    intra_bandwidth_scale: float = 1.0
    inter_bandwidth_scale: float = 1.0

    def __post_init__(self) -> None:
        base = PRESETS.get(self.system)
        if base is None:
            msg = f"unknown topology `system` {self.system!r}; presets: {', '.join(PRESETS)}"
            raise TopologyError(msg)
        for name in _FROM_PRESET:
            if getattr(self, name) is None:
                object.__setattr__(self, name, base[name])
        object.__setattr__(
            self,
            "ranks_per_node",
            self.per_node,
        )
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name not in ("system", "ranks_per_node") and not (
                isinstance(v, int | float) and v > 0 and math.isfinite(v)
            ):
                msg = f"topology `{f.name}` must be a positive finite number, got {v!r}"
                raise TopologyError(msg)
        if self.per_node < 1:
            msg = f"topology `ranks_per_node` must be >= 1, got {self.ranks_per_node!r}"
            raise TopologyError(msg)
        self._check_scales()

    def _check_scales(self) -> None:
        """Bound the bandwidth what-ifs as the slow-downs are (``MAX_SLOW_FACTOR``): a
        transfer takes ``1 / scale`` as long, and ``bandwidth_scale = 1e-300`` overflowed the
        int64 ns transfers into garbage (iterations *faster* than the baseline)."""
        for name in ("bandwidth_scale", "intra_bandwidth_scale", "inter_bandwidth_scale"):
            v = getattr(self, name)
            if not 1 / MAX_SLOW_FACTOR <= v <= MAX_SLOW_FACTOR:
                msg = (
                    f"topology `{name}` must be in [{1 / MAX_SLOW_FACTOR:g},"
                    f" {MAX_SLOW_FACTOR:g}], got {v!r}"
                )
                raise TopologyError(msg)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Topology:
        """A preset system with some fields overridden: ``Topology.preset("h100", ...)``."""
        return cls(system=name, **overrides)

    @property
    def scaled(self) -> bool:
        """Whether a bandwidth what-if is set."""
        return (
            self.bandwidth_scale * self.intra_bandwidth_scale != 1.0
            or self.bandwidth_scale * self.inter_bandwidth_scale != 1.0
        )

    def with_system(self, name: str) -> Topology:
        """This topology on the preset ``name``: the fields that came from the old preset come
        from the new one; those set to other values stay.

        ``dataclasses.replace(t, system=...)`` would keep the old preset's figures, which
        ``__post_init__`` already filled in (``--topology a100`` over a file's ``h100``).
        A field set to exactly the old preset's value is taken as coming from the preset.
        """
        old = PRESETS[self.system]
        own = {f: getattr(self, f) for f in _FROM_PRESET if getattr(self, f) != old[f]}
        unset: dict[str, Any] = {f: own.get(f) for f in _FROM_PRESET}
        return replace(self, system=name, **unset)

    def unscaled(self) -> Topology:
        """The same network without the bandwidth what-if (the network of the recording)."""
        return replace(
            self, bandwidth_scale=1.0, intra_bandwidth_scale=1.0, inter_bandwidth_scale=1.0
        )

    @property
    def per_node(self) -> int:
        """``ranks_per_node`` once resolved from the preset (never None after construction)."""
        return int(self._resolved("ranks_per_node"))

    def _resolved(self, name: str) -> float:
        """A preset-backed field after ``__post_init__`` filled it in."""
        value = getattr(self, name)
        assert value is not None, name  # __post_init__ fills every _FROM_PRESET field
        return float(value)

    @property
    def intra_bytes_per_ns(self) -> float:
        """Effective intra-node bus bandwidth, what-if applied (GB/s == bytes/ns)."""
        return self._resolved("intra_node_gbps") * self.bandwidth_scale * self.intra_bandwidth_scale

    @property
    def inter_bytes_per_ns(self) -> float:
        """Effective per-GPU inter-node bus bandwidth, what-if applied (bytes/ns)."""
        return self._resolved("inter_node_gbps") * self.bandwidth_scale * self.inter_bandwidth_scale

    # -- where a group lies ----------------------------------------------------------------------

    def spans_nodes(self, lowest: np.ndarray, highest: np.ndarray) -> np.ndarray:
        """Whether a group whose members lie in ``[lowest, highest]`` crosses a node boundary.

        Args:
            lowest: lowest member rank of each group.
            highest: highest member rank of each group.

        Returns:
            One bool per group.
        """
        per = self.ranks_per_node
        return (np.asarray(lowest) // per) != (np.asarray(highest) // per)

    def group_nodes(
        self, lowest: np.ndarray, highest: np.ndarray, size: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Nodes a group spans and its ranks per node, from its rank range and size.

        Exact for the groups of a parallel layout (members evenly spaced: contiguous ``tp``,
        strided ``dp``): ``size`` members in ``[lowest, highest]`` touch
        ``min(size, highest // rpn - lowest // rpn + 1)`` nodes. Use ``group_shape`` when the
        member lists are at hand.

        Args:
            lowest: lowest member rank of each group.
            highest: highest member rank of each group.
            size: members of each group.

        Returns:
            ``(n_nodes, ranks_per_node_of_group)``, int64 arrays (``ceil(size / n_nodes)``).
        """
        per = self.per_node
        lo = np.asarray(lowest, dtype=np.int64)
        hi = np.asarray(highest, dtype=np.int64)
        n = np.maximum(np.asarray(size, dtype=np.int64), 1)
        nodes = np.clip(hi // per - lo // per + 1, 1, n)
        return nodes, -(-n // nodes)

    def group_shape(self, ranks: np.ndarray, group: np.ndarray, n_groups: int) -> tuple:
        """Nodes each group spans and its largest number of ranks on one node, from its members.

        Args:
            ranks: member ranks, all groups concatenated.
            group: group index (``0 .. n_groups-1``) of each entry of ``ranks``.
            n_groups: number of groups.

        Returns:
            ``(n_nodes, ranks_per_node_of_group)``, int64 arrays of length ``n_groups`` (0 for a
            group without members).
        """
        nodes = np.zeros(n_groups, dtype=np.int64)
        most = np.zeros(n_groups, dtype=np.int64)
        ranks = np.asarray(ranks, dtype=np.int64)
        if ranks.size:
            pair = np.stack([np.asarray(group, dtype=np.int64), ranks // self.per_node])
            uniq, count = np.unique(pair, axis=1, return_counts=True)
            np.add.at(nodes, uniq[0], 1)
            np.maximum.at(most, uniq[0], count)
        return nodes, most

    def alpha_beta(self, spans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-step latency (ns) and bandwidth (bytes/ns) of the link class of each group.

        Args:
            spans: from ``spans_nodes``.

        Returns:
            ``(alpha_ns, bytes_per_ns)`` arrays.
        """
        spans = np.asarray(spans, dtype=bool)
        alpha = np.where(
            spans, self._resolved("inter_node_latency_ns"), self._resolved("intra_node_latency_ns")
        )
        beta = np.where(spans, self.inter_bytes_per_ns, self.intra_bytes_per_ns)
        return np.asarray(alpha, dtype=np.float64), np.asarray(beta, dtype=np.float64)

"""A network model in the shape of NCCL's own tuner, with parameters fitted to nccl-tests.

NCCL picks, for every call, the algorithm and protocol its cost model says is fastest
(``src/graph/tuning.cc``: ``ncclTopoTuneModel`` fills a latency and a bandwidth per collective,
algorithm and protocol; ``ncclTopoGetAlgoTime`` prices a call as ``latency + bytes / bandwidth``).
This module evaluates the same shape:

- **latency** (us): a base per algorithm/protocol plus per-hop terms, hops counted as NCCL counts
  them: a ring of ``n`` ranks on ``N`` nodes makes ``nsteps`` hops (all_reduce ``2(n-1)``,
  all_gather/reduce_scatter ``n-1``), ``nInterSteps`` of them across nodes (all_reduce ``2N``,
  the others ``N-1``); a tree makes ``2((g-1) intra + log2(N) inter)`` hops with ``g`` ranks
  per node; NVLS one NVSwitch hop, NVLS-tree one plus ``2 log2(N)`` network hops. The per-hop
  figures are NCCL's tables (``baseLat``, ``hwLat``) times three fitted scales: base, intra-node
  hop, inter-node hop;
- **bandwidth** (bus GB/s): the slowest link on the way. Inside a node NVLink (``intra_gbps``;
  NVSwitch multicast ``nvls_gbps`` where the system has it); across nodes one NIC per GPU
  (``inter_gbps``), so a ring leaving a node through its ``g`` GPUs' NICs moves
  ``min(intra, g * inter)``. A tree with two nodes sends half a ring's bytes over each NIC
  (NCCL prices it at the intra-node speed for ``N <= 2``), and NVLS-tree gets the full network
  speed at ``N <= 2`` but half of it beyond (``bwInter / 2``), times NCCL's ``5/6`` ratio. The
  protocol scales the bandwidth as NCCL's refinements do (ring LL 1/4, LL128 0.92, tree 0.92
  with LL 1/3.8 and LL128 120/128);
- **efficiency** per collective: a fitted factor on the bandwidth of each kind the logs hold.

Time of a call = the least, over the algorithm/protocol pairs NCCL would consider (or the one a
log was forced to with ``NCCL_ALGO``/``NCCL_PROTO``), of ``latency + size * bus_factor / busbw``
(``bus_factor`` is nccl-tests' busbw/algbw: all_reduce ``2(n-1)/n``, all_gather, reduce_scatter
and all_to_all ``(n-1)/n``, the rest 1). ``docs/network.md`` ("A network model fitted on
nccl-tests") gives the tables and what a fit from few nodes can and cannot say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from prism_trace.errors import ConfigError

__all__ = [
    "ALGORITHMS",
    "EFFICIENCY_OPS",
    "PROTOCOLS",
    "NetworkModel",
    "NetworkModelError",
    "allowed_pairs",
    "network_time_us",
]

ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree", "pairwise", "p2p")
PROTOCOLS = ("LL", "LL128", "Simple")
EFFICIENCY_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "sendrecv")
"""The kinds with their own fitted efficiency; broadcast and reduce use all_gather's."""

# NCCL src/graph/tuning.cc (NVIDIA/nccl@b6475625): Tree, Ring x (LL, LL128, Simple), us.
_BASE = {"tree": (6.8, 14.0, 0.0), "ring": (6.6, 14.0, 8.4)}
_NVLINK = {"tree": (0.6, 1.25, 28.0), "ring": (0.6, 1.9, 3.4)}
_NET = {"tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 14.0)}
_NVLS_HOP = 23.0  # hwLat[NVLINK][NVLS][Simple]
_NVLS_TREE_NET = 14.0  # hwLat[NET][NVLS_TREE][Simple]
_NET_OVERHEAD = (1.0, 1.0, 3.0)  # getNetOverhead(): 1 us, x3 for Simple; a multi-node ring hop
_RING_PROTO_BW = (1.0 / 4.0, 0.92, 1.0)
_TREE_PROTO_BW = (1.0 / 3.8, 120.0 / 128.0, 1.0)
_TREE_BW = 0.92
_NVLS_RATIO = 5.0 / 3.0  # NCCL's algbw = 5/6 busBw; nccl-tests' all_reduce busbw = 2 algbw

_KIND_ALIASES = {"alltoall": "all_to_all", "send": "sendrecv", "recv": "sendrecv"}


class NetworkModelError(ConfigError):
    """A network model that cannot be used: a bandwidth or scale that is not a positive
    finite number, or an efficiency outside (0, 2]."""


@dataclass(frozen=True, kw_only=True)
class NetworkModel:
    """The ``[network]`` section: a fitted network (``prism network fit``), or off.

    Attributes:
        intra_gbps: bus bandwidth of a ring inside one node, GB/s (NVLink). None: no model
            (the emulator keeps its topology's alpha-beta costs).
        inter_gbps: bus bandwidth one GPU's NIC gives a ring across nodes, GB/s.
        nvls_gbps: bus bandwidth of NVSwitch multicast (NVLS, NVLS-tree all_reduce), GB/s;
            0: the system has none (NCCL then uses ring and tree only).
        base_latency_scale: multiplies NCCL's base latencies (``baseLat``).
        intra_latency_scale: multiplies NCCL's per-hop latency inside a node.
        inter_latency_scale: multiplies NCCL's per-hop latency across nodes.
        ranks_per_node: ranks per node of the cluster the logs came from (the default of
            ``prism network predict --ranks-per-node``).
        all_reduce_efficiency ... sendrecv_efficiency: the bandwidth factor of each kind
            (1.0 where the logs held none of it).
        fitted_from: the logs (``op@ranks r/nodes n``) the fit used.
        fit_error: median |relative error| of the fit on its own rows.
        determined: the parameters the logs determined; the others kept their starting values
            (docs/network.md: what a fit from a few nodes can and cannot say).

    Raises:
        NetworkModelError: a figure out of range (one line).
    """

    intra_gbps: float | None = None
    inter_gbps: float = 25.0
    nvls_gbps: float = 0.0
    base_latency_scale: float = 1.0
    intra_latency_scale: float = 1.0
    inter_latency_scale: float = 1.0
    ranks_per_node: int = 8
    all_reduce_efficiency: float = 1.0
    all_gather_efficiency: float = 1.0
    reduce_scatter_efficiency: float = 1.0
    all_to_all_efficiency: float = 1.0
    sendrecv_efficiency: float = 1.0
    fitted_from: tuple[str, ...] = ()
    fit_error: float | None = None
    determined: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("fitted_from", "determined"):  # JSON gives lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("fitted_from", "determined", "fit_error") or v is None:
                continue
            if f.name == "nvls_gbps":
                ok = isinstance(v, int | float) and v >= 0 and math.isfinite(v)
            elif f.name.endswith("_efficiency"):
                ok = isinstance(v, int | float) and 0 < v <= 2
            else:
                ok = isinstance(v, int | float) and v > 0 and math.isfinite(v)
            if not ok:
                msg = f"network `{f.name}` must be a positive finite number, got {v!r}"
                raise NetworkModelError(msg)

    @property
    def enabled(self) -> bool:
        """Whether a fitted model is set (``intra_gbps`` given)."""
        return self.intra_gbps is not None

    def efficiency(self, op: str) -> float:
        """The bandwidth factor of collective kind ``op``."""
        op = _KIND_ALIASES.get(op, op)
        if op in ("broadcast", "reduce"):
            op = "all_gather"
        return float(getattr(self, f"{op}_efficiency", 1.0))

    def scaled(self, intra: float = 1.0, inter: float = 1.0) -> NetworkModel:
        """The same network with its bandwidths multiplied (a bandwidth what-if)."""
        base = self.intra_gbps or 0.0
        return replace(
            self,
            intra_gbps=base * intra,
            nvls_gbps=self.nvls_gbps * intra,
            inter_gbps=self.inter_gbps * inter,
        )

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> NetworkModel:
        """From a ``[network]`` mapping (as `as_table` or ``asdict`` write it)."""
        return cls(**table)

    def as_table(self) -> dict[str, Any]:
        """The ``[network]`` table of a TOML file (None left out, tuples as lists)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


def allowed_pairs(algo: str | None, proto: str | None) -> tuple[set[str] | None, set[str] | None]:
    """The algorithms and protocols an ``NCCL_ALGO``/``NCCL_PROTO`` value leaves enabled.

    ``Ring``, ``Tree``, ``NVLS``, ``NVLSTree``, comma lists and a leading ``^`` (all but) as NCCL
    parses them; None: no restriction.
    """

    def parse(text: str | None, names: dict[str, str]) -> set[str] | None:
        if not text:
            return None
        neg = text.startswith("^")
        given = {
            names.get(t.strip().lower(), t.strip().lower()) for t in text.lstrip("^").split(",")
        }
        universe = set(names.values())
        return universe - given if neg else given & universe

    algos = {"ring": "ring", "tree": "tree", "nvls": "nvls", "nvlstree": "nvls_tree"}
    protos = {"ll": "LL", "ll128": "LL128", "simple": "Simple"}
    return parse(algo, algos), parse(proto, protos)


def _bus_factor(op: str, n: np.ndarray) -> np.ndarray:
    if op == "all_reduce":
        return 2.0 * (n - 1.0) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1.0) / n
    return np.ones_like(n)


def network_time_us(
    model: NetworkModel,
    op: str | np.ndarray,
    size: npt.ArrayLike,
    ranks: npt.ArrayLike,
    nodes: npt.ArrayLike,
    *,
    algo: str | None = None,
    proto: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Modelled time of each call and the algorithm/protocol that gives it (vectorised).

    Args:
        model: an enabled `NetworkModel`.
        op: collective kind of every call, or one kind for all (``all_reduce``, ``all_gather``,
            ``reduce_scatter``, ``all_to_all``/``alltoall``, ``sendrecv``/``send``/``recv``,
            ``broadcast``, ``reduce``; anything else is priced as ``all_gather``).
        size: nccl-tests size, bytes.
        ranks: participants.
        nodes: nodes the participants span (clipped to ``[1, ranks]``). ``size``, ``ranks`` and
            ``nodes`` broadcast against each other.
        algo: ``NCCL_ALGO`` to restrict to (as `allowed_pairs`).
        proto: ``NCCL_PROTO`` to restrict to.

    Returns:
        ``(time_us, choice)``: float64 times (0 for a group of one) and ``"algo/proto"`` labels.
    """
    shaped = np.broadcast_arrays(np.atleast_1d(size), np.atleast_1d(ranks), np.atleast_1d(nodes))
    size, n, nn = (np.array(a, dtype=np.float64) for a in shaped)
    size = np.maximum(size, 0.0)
    n = np.maximum(n, 1.0)
    nn = np.clip(nn, 1.0, n)
    ops = np.full(size.size, op, dtype=object) if isinstance(op, str) else np.asarray(op, object)
    out = np.zeros(size.size)
    choice = np.full(size.size, "none", dtype=object)
    algos, protos = allowed_pairs(algo, proto)
    for kind in np.unique(ops):
        where = np.flatnonzero(ops == kind)
        k = _KIND_ALIASES.get(str(kind), str(kind))
        t, c = _one_kind(model, k, size[where], n[where], nn[where], algos, protos)
        out[where] = t
        choice[where] = c
    lone = n <= 1
    out[lone] = 0.0
    choice[lone] = "none"
    return out, choice


def _one_kind(
    m: NetworkModel,
    op: str,
    size: np.ndarray,
    n: np.ndarray,
    nodes: np.ndarray,
    algos: set[str] | None,
    protos: set[str] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The least time over the candidate algorithm/protocol pairs for one kind."""
    intra = float(m.intra_gbps or 0.0)
    inter, nvls = m.inter_gbps, m.nvls_gbps
    sb, si, se = m.base_latency_scale, m.intra_latency_scale, m.inter_latency_scale
    eff = m.efficiency(op)
    g = np.ceil(n / nodes)
    multi = nodes > 1
    log2n = np.floor(np.log2(nodes))
    cross = np.minimum(intra, g * inter)  # a ring leaving a node through its g NICs
    cands: list[tuple[str, np.ndarray]] = []

    def ok(a: str, p: str) -> bool:
        return (algos is None or a in algos) and (protos is None or p in protos)

    if op in ("all_to_all", "sendrecv"):
        a = "pairwise" if op == "all_to_all" else "p2p"
        hop = np.where(multi, se * _NET["ring"][2], si * _NVLINK["ring"][2])
        lat = sb * _BASE["ring"][2] + hop
        if op == "all_to_all":
            bw_t = np.maximum((g - 1.0) / n * size / intra, (n - g) / n * size / inter)
        else:
            bw_t = size / np.where(multi, np.minimum(intra, inter), intra)
        cands.append((f"{a}/Simple", lat + bw_t / (1e3 * eff)))
    else:
        factor = _bus_factor(op, n)
        ar = op == "all_reduce"
        if ar:
            nsteps, ninter = 2.0 * (n - 1.0), np.where(multi, 2.0 * nodes, 0.0)
        elif op in ("all_gather", "reduce_scatter"):
            nsteps, ninter = n - 1.0, nodes - 1.0
        else:  # broadcast, reduce: a pipelined chain, one hop of latency (sameChannels)
            nsteps, ninter = np.ones_like(n), np.where(multi, 1.0, 0.0)
        ninter = np.minimum(ninter, nsteps)
        for i, p in enumerate(PROTOCOLS):
            if ok("ring", p):
                hop_in = np.where(
                    multi, max(_NVLINK["ring"][i], _NET_OVERHEAD[i]), _NVLINK["ring"][i]
                )
                lat = sb * _BASE["ring"][i] + (nsteps - ninter) * si * hop_in
                lat = lat + ninter * se * _NET["ring"][i]
                busbw = _RING_PROTO_BW[i] * np.where(multi, cross, intra) * eff
                cands.append((f"ring/{p}", lat + factor * size / (1e3 * busbw)))
            if ar and ok("tree", p) and multi.any():
                lat = sb * _BASE["tree"][i] + 2.0 * (
                    (g - 1.0) * si * _NVLINK["tree"][i] + log2n * se * _NET["tree"][i]
                )
                link = np.minimum(intra, np.where(nodes <= 2, 2.0, 1.0) * g * inter)
                busbw = _TREE_BW * _TREE_PROTO_BW[i] * link * eff
                t = lat + factor * size / (1e3 * busbw)
                cands.append((f"tree/{p}", np.where(multi, t, np.inf)))
        if ar and nvls > 0 and ok("nvls", "Simple") and (~multi).any():
            t = si * _NVLS_HOP + factor * size / (1e3 * nvls * eff)
            cands.append(("nvls/Simple", np.where(multi, np.inf, t)))
        if ar and nvls > 0 and ok("nvls_tree", "Simple") and multi.any():
            lat = si * _NVLS_HOP + 2.0 * log2n * se * _NVLS_TREE_NET
            net = _NVLS_RATIO * np.where(nodes <= 2, 1.0, 0.5) * g * inter
            busbw = np.minimum(nvls, net) * eff
            t = lat + factor * size / (1e3 * busbw)
            cands.append(("nvls_tree/Simple", np.where(multi, t, np.inf)))
    if not cands:  # the forced choice does not apply to this kind: NCCL falls back to ring
        return _one_kind(m, op, size, n, nodes, None, None)
    times = np.vstack([c[1] for c in cands])
    best = np.argmin(times, axis=0)
    names = np.array([c[0] for c in cands], dtype=object)
    return times[best, np.arange(size.size)], names[best]

"""`prism network predict`: a fitted model's time and bandwidth for sizes at a given scale.

The figures are in nccl-tests' terms, so a prediction reads beside a measured log: time (us),
``algbw = size / time`` and ``busbw = algbw * bus_factor`` (GB/s), plus the algorithm/protocol
the model's NCCL-shaped tuner picks for the size.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import numpy as np
from prism_trace.replay.network.model import NetworkModel, network_time_us
from prism_trace.replay.network.parse import OPS

from prism_trace.errors import UsageError

__all__ = ["Prediction", "choice_by_size", "parse_size", "predict_sizes"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^(\d+)\s*([KMGT]?)(?:I?B)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``1048576``, ``1M``, ``8G`` or ``64KiB`` (binary units, as nccl-tests' -b/-e).

    Raises:
        UsageError: anything else (one line).
    """
    m = _SIZE.match(text.strip())
    if m is None:
        msg = f"--bytes {text!r} is not a size (a whole number of bytes, or 64K, 1M, 8G)"
        raise UsageError(msg)
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


@dataclass(frozen=True)
class Prediction:
    """One size at one scale.

    Attributes:
        op: collective kind.
        ranks: participants.
        nodes: nodes they span.
        bytes: nccl-tests size.
        time_us: predicted time.
        algbw_gbps: ``bytes / time``.
        busbw_gbps: ``algbw`` times nccl-tests' bus factor of ``op``.
        algorithm: the algorithm/protocol the model picks (``ring/Simple``, ``tree/LL``...).
    """

    op: str
    ranks: int
    nodes: int
    bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    algorithm: str

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return asdict(self)


def _bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def predict_sizes(
    model: NetworkModel, op: str, ranks: int, sizes: list[int], *, ranks_per_node: int | None = None
) -> list[Prediction]:
    """The model's prediction of ``op`` over ``ranks`` ranks for each size.

    Args:
        model: an enabled model.
        op: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` (or
            ``alltoall``), ``sendrecv``, ``broadcast``, ``reduce``.
        ranks: participants (>= 1).
        sizes: nccl-tests sizes, bytes.
        ranks_per_node: ranks per node (default: the cluster's the model was fitted on).

    Raises:
        UsageError: an unknown op, ``ranks < 1`` or ``ranks_per_node < 1``.
    """
    op = OPS.get(op, op)
    if op not in OPS.values():
        msg = f"--op {op!r} is not a collective nccl-tests measures: {', '.join(OPS.values())}"
        raise UsageError(msg)
    per = model.ranks_per_node if ranks_per_node is None else ranks_per_node
    if ranks < 1 or per < 1:
        msg = f"--ranks and --ranks-per-node must be >= 1, got {ranks} and {per}"
        raise UsageError(msg)
    nodes = -(-ranks // per)
    size = np.asarray(sizes, dtype=np.float64)
    t, choice = network_time_us(
        model, op, size, np.full(size.size, ranks), np.full(size.size, nodes)
    )
    out = []
    for s, us, c in zip(sizes, t.tolist(), choice.tolist(), strict=True):
        alg = s / (us * 1e3) if us > 0 else 0.0
        out.append(
            Prediction(
                op=op,
                ranks=ranks,
                nodes=nodes,
                bytes=int(s),
                time_us=round(us, 3),
                algbw_gbps=round(alg, 3),
                busbw_gbps=round(alg * _bus_factor(op, ranks), 3),
                algorithm=str(c),
            )
        )
    return out


def choice_by_size(
    model: NetworkModel, op: str, ranks: int, nodes: int, *, max_bytes: int = 1 << 34
) -> list[tuple[int, str]]:
    """Where the model's algorithm/protocol choice changes, from 1 byte up to ``max_bytes``.

    Returns:
        ``(smallest size, choice)`` pairs over powers of two: the choice holds from that size
        until the next pair's (``[(1, "tree/LL"), (524288, "tree/LL128"), ...]``).
    """
    sizes = np.array([1 << k for k in range(int(max_bytes).bit_length())], dtype=np.float64)
    _, choice = network_time_us(model, OPS.get(op, op), sizes, ranks, nodes)
    out: list[tuple[int, str]] = []
    for s, c in zip(sizes.tolist(), choice.tolist(), strict=True):
        if not out or out[-1][1] != c:
            out.append((int(s), str(c)))
    return out

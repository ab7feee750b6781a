"""Process groups and annotated communication calls for the trace generator.

Every collective and point-to-point call goes through `Comm`, which wraps it (including the wait of
an async op) in a `torch.profiler.record_function` named::

    prism_comm:pg=<name>;desc=<axis>;seq=<n>;op=<op>;in_bytes=<n>;out_bytes=<n>;dtype=<t>;peer=<r>;tag=<t>

gloo collectives carry no process-group name in Kineto, so ingest recovers the group and the
per-group sequence number of each call from these annotations.

Sequence numbers are 0-based and count from process start (calls before the profiled window
count too), so the first profiled call of a group may have ``seq > 0``; every member rank agrees.
Collectives count per group. Point-to-point calls count per (group, peer): the k-th send from A to
B and the k-th recv on B from A carry the same ``seq``, whatever other peers A and B talk to.
For send and recv, ``in_bytes`` and ``out_bytes`` both hold the message size; for all_gather
``out_bytes`` is the group size times ``in_bytes``, for reduce_scatter ``in_bytes`` is.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import timedelta

__all__ = [
    "ANNOTATION_PREFIX",
    "Comm",
    "CommGroup",
    "Layout",
    "dtype_name",
    "format_annotation",
    "groups_metadata",
    "new_groups",
]

ANNOTATION_PREFIX = "prism_comm:"

Axis = Literal["tp", "dp", "pp", "world"]
Op = Literal[
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "barrier",
    "send",
    "recv",
]

# c10 ScalarType names, lowercased (what Kineto's record_param_comms shows, e.g. "Float").
_DTYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "half",
    torch.bfloat16: "bfloat16",
    torch.int64: "long",
    torch.int32: "int",
    torch.int8: "char",
    torch.uint8: "byte",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The c10 scalar-type name of `dtype`, lowercased (``torch.float32`` -> ``"float"``)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def format_annotation(
    *,
    pg: str,
    desc: str,
    seq: int,
    op: Op,
    in_bytes: int,
    out_bytes: int,
    dtype: str,
    peer: int = -1,
    tag: int = 0,
) -> str:
    """The `record_function` name that marks one communication call."""
    return (
        f"{ANNOTATION_PREFIX}pg={pg};desc={desc};seq={seq};op={op};in_bytes={in_bytes};"
        f"out_bytes={out_bytes};dtype={dtype};peer={peer};tag={tag}"
    )


@dataclass(frozen=True)
class Layout:
    """Megatron rank order: tp fastest, then dp, then pp."""

    tp: int
    dp: int
    pp: int

    @property
    def world(self) -> int:
        """Number of ranks."""
        return self.tp * self.dp * self.pp

    def rank(self, *, tp: int, dp: int, pp: int) -> int:
        """Global rank of the given coordinates."""
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)


@dataclass(frozen=True)
class CommGroup:
    """One process group: torch's name (same on all ranks), axis, readable label, members."""

    name: str
    desc: Axis
    label: str
    ranks: tuple[int, ...]
    pg: dist.ProcessGroup | None  # None on ranks outside the group

    def to_json(self) -> dict[str, object]:
        """The entry of this group in the ``prism_groups`` trace metadata."""
        return {
            "name": self.name,
            "desc": self.desc,
            "label": self.label,
            "ranks": list(self.ranks),
        }


def new_groups(layout: Layout, *, timeout: timedelta) -> list[CommGroup]:
    """Create every TP, DP and PP group, in the same order on all ranks.

    Args:
        layout: The parallel layout.
        timeout: Collective timeout of each group.

    Returns:
        All groups of the job (tp, then dp, then pp, then the default group, desc ``world``),
        including those this rank is not in.
    """
    specs: list[tuple[Axis, str, list[int]]] = []
    for p in range(layout.pp):
        for d in range(layout.dp):
            ranks = [layout.rank(tp=t, dp=d, pp=p) for t in range(layout.tp)]
            specs.append(("tp", f"tp{len(specs)}", ranks))
    n = len(specs)
    for p in range(layout.pp):
        for t in range(layout.tp):
            ranks = [layout.rank(tp=t, dp=d, pp=p) for d in range(layout.dp)]
            specs.append(("dp", f"dp{len(specs) - n}", ranks))
    n = len(specs)
    for d in range(layout.dp):
        for t in range(layout.tp):
            ranks = [layout.rank(tp=t, dp=d, pp=p) for p in range(layout.pp)]
            specs.append(("pp", f"pp{len(specs) - n}", ranks))
    me = dist.get_rank()
    groups = []
    for desc, label, ranks in specs:
        # torch names a group by a counter that every rank advances, members or not; read it
        # first so that non-members (which get no group object) know the name too.
        name = str(dist.distributed_c10d._world.group_count)
        pg = dist.new_group(ranks, timeout=timeout, group_desc=desc)
        if me in ranks:
            if pg.group_name != name:
                msg = f"process group for ranks {ranks!r} is named {pg.group_name!r}, not {name!r}"
                raise RuntimeError(msg)
        else:
            pg = None
        groups.append(CommGroup(name, desc, label, tuple(ranks), pg))
    world = dist.group.WORLD
    assert world is not None
    groups.append(CommGroup(world.group_name, "world", "world", tuple(range(layout.world)), world))
    return groups


def groups_metadata(groups: Sequence[CommGroup]) -> str:
    """The ``prism_groups`` metadata value: a JSON list of every group of the job."""
    return json.dumps([g.to_json() for g in groups])


class Comm:
    """Annotated communication calls on one rank, with per-group sequence numbers."""

    def __init__(self) -> None:
        """Start all sequence counters at 0."""
        self._seq: collections.Counter[tuple[str, int]] = collections.Counter()

    def _next(self, group: CommGroup, peer: int = -1) -> int:
        key = (group.name, peer)
        seq = self._seq[key]
        self._seq[key] += 1
        return seq

    def _annotate(
        self,
        group: CommGroup,
        op: Op,
        t: torch.Tensor,
        *,
        out_numel: int,
        peer: int = -1,
        in_numel: int | None = None,
    ) -> torch.profiler.record_function:
        size = t.element_size()
        name = format_annotation(
            pg=group.name,
            desc=group.desc,
            seq=self._next(group, peer),
            op=op,
            in_bytes=(t.numel() if in_numel is None else in_numel) * size,
            out_bytes=out_numel * size,
            dtype=dtype_name(t.dtype),
            peer=peer,
        )
        return torch.profiler.record_function(name)

    def all_reduce(self, t: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """Sum `t` in place over `group`."""
        with self._annotate(group, "all_reduce", t, out_numel=t.numel()):
            dist.all_reduce(t, group=group.pg)
        return t

    def all_gather(self, t: torch.Tensor, group: CommGroup) -> list[torch.Tensor]:
        """The `t` of every member of `group`, in group-rank order."""
        n = len(group.ranks)
        out = [torch.empty_like(t) for _ in range(n)]
        with self._annotate(group, "all_gather", t, out_numel=t.numel() * n):
            dist.all_gather(out, t.contiguous(), group=group.pg)
        return out

    def reduce_scatter(
        self, out: torch.Tensor, inputs: Sequence[torch.Tensor], group: CommGroup
    ) -> torch.Tensor:
        """Sum `inputs` (one tensor per member, in group-rank order) over `group`; this rank's
        sum lands in `out`. ``in_bytes`` is the whole input, ``out_bytes`` this rank's part."""
        in_numel = sum(t.numel() for t in inputs)
        with self._annotate(group, "reduce_scatter", out, out_numel=out.numel(), in_numel=in_numel):
            dist.reduce_scatter(out, list(inputs), group=group.pg)
        return out

    def barrier(self, group: CommGroup) -> None:
        """Wait for every member of `group`."""
        with self._annotate(group, "barrier", torch.empty(0), out_numel=0):
            dist.barrier(group=group.pg)

    def send(self, t: torch.Tensor, peer: int, group: CommGroup) -> None:
        """Send `t` to global rank `peer` (blocking)."""
        with self._annotate(group, "send", t, out_numel=t.numel(), peer=peer):
            dist.send(t.contiguous(), dst=peer, group=group.pg)

    def recv(self, t: torch.Tensor, peer: int, group: CommGroup) -> torch.Tensor:
        """Receive into `t` from global rank `peer` (blocking)."""
        with self._annotate(group, "recv", t, out_numel=t.numel(), peer=peer):
            dist.recv(t, src=peer, group=group.pg)
        return t

"""The program a replay executes: its op calls, the ops it cannot run, and their tensors."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prism_trace.replay.kernels.schema import TensorMeta
from prism_trace.replay.kernels.units import Unit

__all__ = ["OpCall", "Program", "UnsupportedOp"]


@dataclass
class OpCall:
    """A compute unit rebuilt: the op, its arguments and where its results go.

    Argument references (``args``, ``kwargs``) are ``("c", value)`` for a constant,
    ``("s", slot)`` for an earlier result, ``("x", ext)`` for an external tensor,
    ``("a", alias)`` for a view rebuilt before the call, ``("l", [refs])`` for a list.

    Attributes:
        unit: the unit.
        op: the ``torch.ops`` overload packet entry (``OpOverload``).
        args: positional argument references.
        kwargs: keyword-only argument references.
        n_returns: values the schema returns.
        outputs: ``(return index, list index or None, slot, meta)`` for each tensor result.
        aliases: ``(alias, base reference, meta)``: views to build before the call.
        frees: slots whose last use is this unit.
    """

    unit: Unit
    op: Any
    args: list[tuple[str, Any]]
    kwargs: dict[str, tuple[str, Any]]
    n_returns: int
    outputs: list[tuple[int, int | None, int, TensorMeta]]
    aliases: list[tuple[int, tuple[str, Any], TensorMeta]] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class UnsupportedOp:
    """Ops of one name the replay cannot rebuild, with why and how often."""

    name: str
    reason: str
    count: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "reason": self.reason, "count": self.count}


@dataclass
class Program:
    """One rank's replay: units in order, the rebuilt ops, external tensors, unsupported ops.

    Attributes:
        units: compute and communication units in recorded order.
        calls: rebuilt op per compute unit index (absent: unsupported).
        unsupported: unit index -> reason, for compute units that could not be rebuilt.
        externals: tensors made outside the replayed ops, allocated once.
        ext_buffer: per external, its buffer (externals of one storage share one).
        buffers: ``(dtype, elements, device)`` of each external buffer.
        n_slots: results the program names.
        substituted_outputs: per unsupported unit, its results ``(slot, meta)`` (made empty with
            the recorded layout when substituted).
        skipped: ET ops left out on purpose, per reason (``select_units``).
        slot_meta: recorded layout of every result slot.
        slot_made: unit index at which each slot's tensor appears (its op, or for a nested
            output the unit whose inner op made it).
        frees_after: unit index -> slots freed after it: their last use, or later where the
            recording's allocator held them longer (``replay.memory.lifetimes``).
        nested_outputs: unit index -> ``(slot, meta)`` of floating-point storages an op nested
            in the unit made and a later unit reads (saved for backward: ``native_layer_norm``'s
            mean and rstd inside ``layer_norm``); the replay allocates each, uninitialised, right
            after the unit, as a flat buffer that later units view.
    """

    units: list[Unit]
    calls: dict[int, OpCall]
    unsupported: dict[int, str]
    externals: list[TensorMeta]
    ext_buffer: list[int]
    buffers: list[tuple[str, int, str]]
    n_slots: int
    substituted_outputs: dict[int, list[tuple[int, TensorMeta]]]
    skipped: Counter[str]
    slot_meta: dict[int, TensorMeta] = field(default_factory=dict)
    slot_made: dict[int, int] = field(default_factory=dict)
    frees_after: dict[int, list[int]] = field(default_factory=dict)
    nested_outputs: dict[int, list[tuple[int, TensorMeta]]] = field(default_factory=dict)

    @property
    def compute_units(self) -> int:
        """Compute units (supported or not)."""
        return sum(1 for u in self.units if u.kind == "compute")

    def unsupported_ops(self) -> list[UnsupportedOp]:
        """Unsupported ops grouped by name and reason, most frequent first."""
        c: Counter[tuple[str, str]] = Counter(
            (self.units[i].name, r) for i, r in self.unsupported.items()
        )
        return [UnsupportedOp(n, r, k) for (n, r), k in c.most_common()]

    def support_summary(self) -> dict[str, Any]:
        """Counts of compute units by support, for reports."""
        n = self.compute_units
        bad = len(self.unsupported)
        return {
            "compute_units": n,
            "supported": n - bad,
            "unsupported": bad,
            "supported_fraction": (n - bad) / n if n else 1.0,
            "comm_units": sum(1 for u in self.units if u.kind == "comm"),
            "externals": len(self.externals),
            "skipped": dict(self.skipped),
            "unsupported_ops": [u.as_dict() for u in self.unsupported_ops()],
        }

"""The `prism` backend's data rule: what a call returns when some members are virtual."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []


def _op_is(op: Any, ref: Any) -> bool:
    try:
        return bool(op == ref)
    except (TypeError, RuntimeError):
        return False


def _pre(t: torch.Tensor, op: Any, count: int) -> torch.Tensor:
    """This real member's contribution when ``count`` members (itself included) hold its data."""
    R = dist.ReduceOp
    if _op_is(op, R.SUM) or _op_is(op, R.AVG):
        return t * count if count != 1 else t.clone()
    if _op_is(op, R.PRODUCT):
        return t**count if count != 1 else t.clone()
    if _op_is(op, R.BXOR):
        return t.clone() if count % 2 else torch.zeros_like(t)
    if any(_op_is(op, o) for o in (R.MIN, R.MAX, R.BAND, R.BOR)):
        return t.clone()
    msg = f"reduce op {op!r} is not supported by the `prism` backend"
    raise ValueError(msg)


def _real_op(op: Any) -> Any:
    return dist.ReduceOp.SUM if _op_is(op, dist.ReduceOp.AVG) else op


def _post(t: torch.Tensor, op: Any, n: int) -> torch.Tensor:
    if _op_is(op, dist.ReduceOp.AVG):
        return t / n if t.is_floating_point() or t.is_complex() else t.div(n, rounding_mode="floor")
    return t


@dataclass(frozen=True)
class _Members:
    """Group members, which of them are real, and whom each virtual member mirrors.

    Virtual members take the data of the real members round-robin in group order: the k-th
    virtual member (in group order) mirrors the (k mod R)-th real member. With one real member
    every virtual member holds that member's data.
    """

    ranks: tuple[int, ...]  # global ranks in group order
    me: int  # my group rank
    real_pos: tuple[int, ...]  # group ranks of the real members, ascending
    mirror: tuple[int, ...]  # group rank -> group rank of the real member it mirrors

    @classmethod
    def build(cls, ranks: tuple[int, ...], me: int, real: frozenset[int]) -> _Members:
        real_pos = tuple(i for i, r in enumerate(ranks) if r in real)
        mirror, k = [], 0
        for i, r in enumerate(ranks):
            if r in real:
                mirror.append(i)
            else:
                mirror.append(real_pos[k % len(real_pos)])
                k += 1
        return cls(ranks, me, real_pos, tuple(mirror))

    @property
    def n(self) -> int:
        return len(self.ranks)

    def count(self, pos: int) -> int:
        """How many members hold the data of real member ``pos`` (itself included)."""
        return self.mirror.count(pos)

    def real_index(self, pos: int) -> int:
        """Rank of real member ``pos`` in the real sub-group."""
        return self.real_pos.index(pos)

    def is_real(self, pos: int) -> bool:
        return self.mirror[pos] == pos

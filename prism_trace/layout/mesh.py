"""The layout vocabulary: mesh axes, a layout's rank <-> coordinate map and groups, axis values.

Pure: no store. Reading, inferring and writing a run's layout build on it (``infer``, ``choice``,
``declare``, ``assign``).

Vocabulary. An *axis* (``ParallelAxis``) is one dimension of the device mesh: ``tp`` tensor,
``cp`` context, ``ep`` expert, ``dp`` data, ``pp`` pipeline. A *layout* (``ParallelLayout``) gives
each axis a size and an ``order``: the first axis varies fastest along the global rank, as in
Megatron-LM's default ``tp-cp-ep-dp-pp``, so ``rank = sum(coord[a] * stride[a])`` with
``stride[order[0]] = 1`` and ``stride[order[i+1]] = stride[order[i]] * size[order[i]]``.

The world is the product of the five sizes: ``ep`` is treated here as its own mesh axis. Megatron
instead folds EP into DP: its dense layers see the mesh ``tp-cp-dp-pp`` and its expert layers
re-cut the same ranks as ``tp-ep-dp_expert-pp`` with ``dp = ep * dp_expert``, so EP adds no
ranks. To describe such a job, give the mesh the job used: ``ep`` and the *expert*
data-parallel size as ``dp`` (``dp=16,ep=8`` for ``--expert-model-parallel-size 8`` at
data-parallel size 128); the dense data-parallel group is then the ``ep-dp`` combination.

A communicator's role is an *axis value* (stored in ``comm_group.axis``): one axis (``tp``),
several joined by ``-`` in Megatron's naming order tp, ep, dp, cp, pp (``dp-cp``, ``tp-pp``),
``world`` (every rank) or ``embd`` (Megatron's embedding group: the first and the last pipeline
stage of one (tp, cp, ep, dp) cell).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from prism_trace.errors import PrismError
from prism_trace.ranks import ascii_int

__all__ = [
    "AXES",
    "DEFAULT_ORDER",
    "EMBD",
    "NAME_ORDER",
    "WORLD",
    "LayoutError",
    "ParallelAxis",
    "ParallelLayout",
    "axis_name",
    "parse_axes",
    "parse_order",
]


class ParallelAxis(str, enum.Enum):
    """One axis of the device mesh (a StrEnum: ``ParallelAxis.TP == "tp"``)."""

    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"
    PP = "pp"

    def __str__(self) -> str:
        """The axis name, e.g. ``dp``."""
        return self.value


class LayoutError(PrismError, ValueError):
    """A layout spec is malformed, or a run's groups/coordinates fit no layout."""


AXES: tuple[ParallelAxis, ...] = tuple(ParallelAxis)
DEFAULT_ORDER: tuple[ParallelAxis, ...] = AXES
"""Megatron-LM's rank order ``tp-cp-ep-dp-pp``: tp varies fastest."""

WORLD = "world"
"""The axis value of a group of every rank."""
EMBD = "embd"
"""The axis value of Megatron's embedding group (first and last pipeline stage of a cell)."""
NAME_ORDER = (ParallelAxis.TP, ParallelAxis.EP, ParallelAxis.DP, ParallelAxis.CP, ParallelAxis.PP)
"""Megatron's group names put the axes in this order (`dp-cp`, `tp-dp-cp`, `tp-ep-pp`)."""


def axis_name(axes: Iterable[ParallelAxis | str]) -> str:
    """The ``comm_group.axis`` value of a set of axes: joined by ``-`` in Megatron's name order.

    Args:
        axes: the axes a group spans.

    Returns:
        E.g. ``"dp-cp"`` for {cp, dp}.
    """
    chosen = {ParallelAxis(a) for a in axes}
    return "-".join(a.value for a in NAME_ORDER if a in chosen)


def parse_axes(value: str) -> tuple[ParallelAxis, ...]:
    """The axes of a ``comm_group.axis`` value (``"dp-cp"`` → (cp, dp) in mesh order).

    ``world`` gives all five axes; ``embd`` is not a product of axes and is refused.

    Raises:
        LayoutError: an unknown axis name.
    """
    if value == WORLD:
        return AXES
    try:
        chosen = {ParallelAxis(t) for t in value.split("-")}
    except ValueError:
        msg = f"axis value {value!r} is not `world` or axes joined by `-` (tp, cp, ep, dp, pp)"
        raise LayoutError(msg) from None
    return tuple(a for a in AXES if a in chosen)


def parse_order(order: str | Sequence[ParallelAxis | str] | None) -> tuple[ParallelAxis, ...]:
    """All five axes in the rank order ``order`` names (fastest first; None: the default).

    Axes it leaves out keep their default slots after the named ones, so inference can start its
    search of rank orders from a partial order.

    Raises:
        LayoutError: an unknown or repeated axis.
    """
    if order is None:
        return DEFAULT_ORDER
    tokens = [t.strip() for t in re.split(r"[-,\s]+", order)] if isinstance(order, str) else order
    tokens = [t for t in tokens if t]
    try:
        axes = [ParallelAxis(t) for t in tokens]
    except ValueError:
        msg = f"order {order!r}: unknown axis (use tp, cp, ep, dp, pp joined by `-`)"
        raise LayoutError(msg) from None
    if len(set(axes)) != len(axes):
        msg = f"order {order!r}: an axis appears twice"
        raise LayoutError(msg)
    # Axes left out keep their place from the default order, after the named ones' slots.
    return (*axes, *(a for a in DEFAULT_ORDER if a not in axes))


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the five mesh axes and their rank order (first = fastest varying).

    The order is normalised so that equal rank mappings compare equal: axes of size 1 cannot
    change any rank, so they are put back in their default slots.
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    order: tuple[ParallelAxis, ...] = field(default=DEFAULT_ORDER)

    def __post_init__(self) -> None:
        """Check the sizes and normalise the order."""
        for a in AXES:
            size = getattr(self, a.value)
            if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
                msg = f"layout: `{a}` must be a positive integer, got {size!r}"
                raise LayoutError(msg)
            object.__setattr__(self, a.value, int(size))
        order = parse_order(self.order)
        if len(order) != len(AXES):
            msg = f"layout: order {self.order!r} must name each of tp, cp, ep, dp, pp once"
            raise LayoutError(msg)
        big = iter([a for a in order if self.size(a) > 1])
        normal = tuple(next(big) if self.size(a) > 1 else a for a in DEFAULT_ORDER)
        object.__setattr__(self, "order", normal)

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def parse(cls, spec: str, order: str | None = None) -> ParallelLayout:
        """A layout from ``"tp=8,cp=1,ep=1,dp=128,pp=8"`` (missing axes have size 1).

        Args:
            spec: comma-separated ``axis=size`` pairs.
            order: axes joined by ``-``, fastest first (default ``tp-cp-ep-dp-pp``); axes left
                out keep their default slots and must then have size 1.

        Returns:
            The layout.

        Raises:
            LayoutError: an unknown or repeated axis, a size that is not a positive integer, an
                empty spec or item, or an order that leaves out an axis of size > 1.
        """
        sizes: dict[str, int] = {}
        parts = [p.strip() for p in spec.split(",")]
        if not any(parts):
            msg = f"layout {spec!r}: empty; expected e.g. `tp=8,dp=128,pp=8`"
            raise LayoutError(msg)
        if not all(parts):  # as in rank lists: `tp=2,,dp=4` is a typo, not two items
            msg = f"layout {spec!r}: an empty item between commas; expected e.g. `tp=8,dp=128`"
            raise LayoutError(msg)
        for part in parts:
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep:
                msg = f"layout {spec!r}: {part!r} is not `axis=size` (e.g. `dp=128`)"
                raise LayoutError(msg)
            if key not in {a.value for a in AXES}:
                msg = f"layout {spec!r}: unknown axis {key!r} (use tp, cp, ep, dp, pp)"
                raise LayoutError(msg)
            if key in sizes:
                msg = f"layout {spec!r}: axis {key!r} given twice"
                raise LayoutError(msg)
            try:
                size = ascii_int(value)
            except ValueError:
                size = 0
            if size < 1:
                msg = f"layout {spec!r}: size of {key!r} must be a positive integer, got {value!r}"
                raise LayoutError(msg)
            sizes[key] = size
        axes = parse_order(order)
        if order is not None:
            named = [t for t in re.split(r"[-,\s]+", order) if t]
            left_out = [a.value for a in AXES if a.value not in named and sizes.get(a.value, 1) > 1]
            if left_out:
                msg = f"order {order!r} leaves out {', '.join(left_out)}, whose size is > 1"
                raise LayoutError(msg)
        return cls(**sizes, order=axes)

    # --- facts -----------------------------------------------------------------------------

    def size(self, axis: ParallelAxis | str) -> int:
        """Size of one axis."""
        return int(getattr(self, ParallelAxis(axis).value))

    @property
    def sizes(self) -> dict[ParallelAxis, int]:
        """Size per axis, in mesh order tp, cp, ep, dp, pp."""
        return {a: self.size(a) for a in AXES}

    @property
    def world_size(self) -> int:
        """Number of ranks: the product of the five sizes."""
        return int(np.prod([self.size(a) for a in AXES]))

    @property
    def strides(self) -> dict[ParallelAxis, int]:
        """Rank distance between neighbours along each axis."""
        out: dict[ParallelAxis, int] = {}
        stride = 1
        for a in self.order:
            out[a] = stride
            stride *= self.size(a)
        return out

    @property
    def spec(self) -> str:
        """The spec string ``parse`` reads back (all five axes)."""
        return ",".join(f"{a}={self.size(a)}" for a in AXES)

    @property
    def order_spec(self) -> str:
        """The order joined by ``-``, fastest first."""
        return "-".join(a.value for a in self.order)

    def __str__(self) -> str:
        """``tp=..,cp=..,ep=..,dp=..,pp=.. (order ...)``."""
        return f"{self.spec} (order {self.order_spec})"

    # --- rank <-> coordinates --------------------------------------------------------------

    def _check_ranks(self, ranks: np.ndarray) -> None:
        if ranks.size and (ranks.min() < 0 or ranks.max() >= self.world_size):
            bad = ranks[(ranks < 0) | (ranks >= self.world_size)][0]
            msg = f"rank {int(bad)} is outside the world of {self.world_size} ranks of {self}"
            raise LayoutError(msg)

    def coords(self, ranks: np.ndarray | Sequence[int] | int) -> dict[ParallelAxis, np.ndarray]:
        """Coordinates of each rank, vectorised.

        Args:
            ranks: global ranks (any shape).

        Returns:
            One int64 array per axis, shaped like ``ranks``.

        Raises:
            LayoutError: a rank outside ``[0, world_size)``.
        """
        r = np.asarray(ranks, dtype=np.int64)
        self._check_ranks(r)
        strides = self.strides
        return {a: (r // strides[a]) % self.size(a) for a in AXES}

    def rank_of(
        self,
        coords: Mapping[ParallelAxis, np.ndarray | Sequence[int] | int]
        | Mapping[str, np.ndarray | Sequence[int] | int],
    ) -> np.ndarray:
        """Global ranks of coordinates (axes left out are 0), vectorised.

        Raises:
            LayoutError: a coordinate outside its axis.
        """
        strides = self.strides
        total: np.ndarray = np.zeros((), dtype=np.int64)
        for key, value in coords.items():
            a = ParallelAxis(key)
            c = np.asarray(value, dtype=np.int64)
            if c.size and (c.min() < 0 or c.max() >= self.size(a)):
                msg = f"`{a}` coordinate out of range [0, {self.size(a)}) in {self}"
                raise LayoutError(msg)
            total = total + c * strides[a]
        return total

    # --- groups ----------------------------------------------------------------------------

    def groups(self, axes: Sequence[ParallelAxis | str] | str) -> np.ndarray:
        """Member ranks of every group spanning ``axes``.

        A group holds the ranks that share every coordinate except those of ``axes``. Groups are
        sorted by their lowest rank and members by rank, so group ``i`` holds the ranks whose
        ``group_index`` is ``i``.

        Args:
            axes: the axes (e.g. ``("dp", "cp")``), or an axis value: ``"dp-cp"``, ``"world"``,
                ``"embd"`` (first and last stage; one member when ``pp`` is 1).

        Returns:
            int64 array of shape (n_groups, group_size).
        """
        if isinstance(axes, str) and axes == EMBD:
            pp = self.groups((ParallelAxis.PP,))
            return pp[:, [0]] if self.pp == 1 else pp[:, [0, -1]]
        chosen = set(parse_axes(axes) if isinstance(axes, str) else map(ParallelAxis, axes))
        # Array axis i (C order) is order[-1-i]: slowest first.
        slow_first = list(reversed(self.order))
        grid = np.arange(self.world_size, dtype=np.int64).reshape(
            [self.size(a) for a in slow_first]
        )
        keep = [i for i, a in enumerate(slow_first) if a not in chosen]
        span = [i for i, a in enumerate(slow_first) if a in chosen]
        n_members = int(np.prod([self.size(slow_first[i]) for i in span]))
        return grid.transpose(keep + span).reshape(-1, n_members)

    def group_index(
        self, axes: Sequence[ParallelAxis | str] | str, ranks: np.ndarray | Sequence[int] | int
    ) -> np.ndarray:
        """Row of ``groups(axes)`` that holds each rank (-1 for ranks outside every ``embd`` group).

        Args:
            axes: as for ``groups``.
            ranks: global ranks (any shape).

        Returns:
            int64 array shaped like ``ranks``.
        """
        c = self.coords(ranks)
        embd = isinstance(axes, str) and axes == EMBD
        if embd:
            chosen = {ParallelAxis.PP}
        else:
            chosen = set(parse_axes(axes) if isinstance(axes, str) else map(ParallelAxis, axes))
        index = np.zeros_like(c[ParallelAxis.TP])
        stride = 1
        for a in self.order:
            if a in chosen:
                continue
            index = index + c[a] * stride
            stride *= self.size(a)
        if embd:
            pp = c[ParallelAxis.PP]
            index = np.where((pp == 0) | (pp == self.pp - 1), index, -1)
        return index

"""The parallel layout of a job: which rank holds which tp/cp/ep/dp/pp coordinate, and its groups.

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
import functools
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from prism_trace.errors import PrismError

if TYPE_CHECKING:
    import duckdb

    from prism_trace.store.connection import Store

__all__ = [
    "DEFAULT_ORDER",
    "LayoutError",
    "ParallelAxis",
    "ParallelLayout",
    "assign_axes",
    "axis_name",
    "group_axis",
    "infer_layout",
    "parse_axes",
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
EMBD = "embd"
# Megatron's group names put the axes in this order (`dp-cp`, `tp-dp-cp`, `tp-ep-pp`).
_NAME_ORDER = (ParallelAxis.TP, ParallelAxis.EP, ParallelAxis.DP, ParallelAxis.CP, ParallelAxis.PP)


def axis_name(axes: Iterable[ParallelAxis | str]) -> str:
    """The ``comm_group.axis`` value of a set of axes: joined by ``-`` in Megatron's name order.

    Args:
        axes: the axes a group spans.

    Returns:
        E.g. ``"dp-cp"`` for {cp, dp}.
    """
    chosen = {ParallelAxis(a) for a in axes}
    return "-".join(a.value for a in _NAME_ORDER if a in chosen)


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


def _parse_order(order: str | Sequence[ParallelAxis | str] | None) -> tuple[ParallelAxis, ...]:
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
        order = _parse_order(self.order)
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
                size = int(value.strip())
            except ValueError:
                size = 0
            if size < 1:
                msg = f"layout {spec!r}: size of {key!r} must be a positive integer, got {value!r}"
                raise LayoutError(msg)
            sizes[key] = size
        axes = _parse_order(order)
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


# --- which axis does a communicator span? ------------------------------------------------------

_DESCRIPTIONS: dict[str, str] = {
    "tensor": "tp",
    "tensor_model_parallel": "tp",
    "tensor_parallel": "tp",
    "context": "cp",
    "context_parallel": "cp",
    "expert": "ep",
    "expert_model_parallel": "ep",
    "expert_parallel": "ep",
    "data": "dp",
    "data_parallel": "dp",
    "data_parallel_with_cp": "dp-cp",
    "pipeline": "pp",
    "pipeline_model_parallel": "pp",
    "pipeline_parallel": "pp",
    "model_parallel": "tp-pp",
    "mp": "tp-pp",
    "tensor_and_data_parallel": "tp-dp",
    "tensor_and_context_parallel": "tp-cp",
    "tensor_and_expert_parallel": "tp-ep",
    "tensor_and_data_parallel_with_cp": "tp-dp-cp",
    "expert_data_parallel": "dp",  # the expert mesh's dp (see the module docstring)
    # torchtitan's DeviceMesh dims (described `mesh_<dim>`): FSDP shards over dp; HSDP's
    # replicate dim is only part of dp, so it names no size on its own.
    "dp_shard": "dp",
    "dp_shard_cp": "dp-cp",
    "dp_replicate": "",
    # DeepSpeed: Ulysses sequence parallelism splits the sequence, as context parallelism does.
    "sequence_parallel": "cp",
    "sequence_data_parallel": "dp-cp",
    "sp": "cp",
    "embedding": EMBD,
    "embd": EMBD,
    "default_pg": WORLD,
    "world": WORLD,
    "global": WORLD,
}
_AXIS_TOKENS = {a.value for a in AXES}


@functools.lru_cache(maxsize=1024)  # a run has thousands of groups and a few descriptions
def _described_axis(description: str | None) -> str | None:
    """The axis value a group description names (``tp``, ``dp_stage0``, ``data``, ...), or None."""
    if not description:
        return None
    text = description.strip().lower()
    if text != "default_pg":
        # Megatron's `DATA_PARALLEL_GROUP_WITH_CP`, torchtitan's `mesh_tp`: drop the
        # `group`/`pg` words and the `mesh_` prefix.
        text = re.sub(r"[\s_-]*(groups?|pg)(?=[\s_-]|$)", "", text)
        text = re.sub(r"^mesh[\s_-]+", "", text)
    if text in _DESCRIPTIONS:
        return _DESCRIPTIONS[text] or None
    # Leading axis tokens: `tp`, `dp-cp`, `dp_stage0` (→ dp), `pp_dp0` (→ pp; `dp0` is no token).
    tokens = re.split(r"[-_\s]+", text)
    axes: list[str] = []
    for t in tokens:
        if t not in _AXIS_TOKENS:
            break
        axes.append(t)
    if axes:
        return axis_name(axes)
    return _DESCRIPTIONS.get(tokens[0]) if tokens[0] in ("embd", "embedding") else None


@functools.lru_cache(maxsize=32)
def _groups_by_first(layout: ParallelLayout, value: str) -> tuple[dict[int, int], np.ndarray]:
    """``layout.groups(value)`` and the row each group's lowest rank starts.

    Checking a run's groups asks this once per group; the grid is the same for every group of
    an axis, so it is built once (8197 groups at 8192 ranks: 5 s without, milliseconds with).
    """
    groups = layout.groups(value)
    return {int(first): i for i, first in enumerate(groups[:, 0])}, groups


def _fits(layout: ParallelLayout, members: np.ndarray, value: str) -> bool:
    """Whether ``members`` (sorted, unique) are exactly one group of axis value ``value``."""
    if value == EMBD:
        if layout.pp < 2:
            return False
    elif int(np.prod([layout.size(a) for a in parse_axes(value)])) != members.size:
        return False
    rows, groups = _groups_by_first(layout, value)
    row = rows.get(int(members[0]))
    return row is not None and bool(np.array_equal(groups[row], members))


def _world_axis(layout: ParallelLayout) -> str:
    """The role of an all-rank group: the one axis of size > 1 when there is only one (a TP8 job
    on 8 GPUs: its default group is its TP group, and what-ifs and slicing treat it so), else
    ``world``."""
    big = [a for a in AXES if layout.size(a) > 1]
    return big[0].value if len(big) == 1 else WORLD


def group_axis(
    layout: ParallelLayout,
    ranks: Sequence[int] | np.ndarray,
    description: str | None = None,
    *,
    name: str | None = None,
) -> str:
    """The axis value of a communicator with these member ranks under ``layout``.

    The description decides when it names a role that fits (``tp``, ``data``, ``default_pg``,
    ``dp_stage0``, ``embd``, ...); otherwise the whole world is ``world`` (or its one axis of
    size > 1, when it has only one: ``_world_axis``), Megatron's embedding
    pair is ``embd``, and any other group is named by the axes its members differ on. A one-rank
    group without a usable description gets the first size-1 axis (any fits).

    Args:
        layout: the run's layout.
        ranks: the group's members (global ranks).
        description: the group's description, if any.
        name: the group's name, for messages.

    Returns:
        The axis value (``tp``, ``dp-cp``, ``world``, ``embd``, ...).

    Raises:
        LayoutError: the description names a role the members do not fit, or no axis
            combination fits them; the message names the group.
    """
    label = f"group {name!r} (description {description!r}, ranks {list(map(int, ranks))})"
    members = np.unique(np.asarray(ranks, dtype=np.int64))
    if members.size == 0 or members.size != len(ranks):
        msg = f"{label}: empty, or a rank is listed twice"
        raise LayoutError(msg)
    if members.min() < 0 or members.max() >= layout.world_size:
        msg = f"{label}: a member is outside the world of {layout.world_size} ranks of {layout}"
        raise LayoutError(msg)
    described = _described_axis(description)
    if described == WORLD and members.size == layout.world_size:
        return _world_axis(layout)
    if described is not None:
        if _fits(layout, members, described):
            return described
        msg = (
            f"{label}: described as {described!r} but is not a {described!r} group of {layout};"
            " check the layout or the order"
        )
        raise LayoutError(msg)
    if members.size == layout.world_size:
        return _world_axis(layout)
    c = layout.coords(members)
    varying = [a for a in AXES if np.unique(c[a]).size > 1]
    if varying:
        value = axis_name(varying)
        if _fits(layout, members, value):
            return value
        if varying == [ParallelAxis.PP] and _fits(layout, members, EMBD):
            return EMBD
        msg = f"{label}: fits no axis combination of {layout}"
        raise LayoutError(msg)
    ones = [a for a in _NAME_ORDER if layout.size(a) == 1]
    if not ones:
        msg = f"{label}: a one-rank group, but no axis of {layout} has size 1"
        raise LayoutError(msg)
    return ones[0].value


# --- inference from a recorded run ------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    group_id: int
    name: str | None
    description: str | None
    ranks: tuple[int, ...]


def _read_groups(con: duckdb.DuckDBPyConnection, run_id: int) -> list[_Group]:
    rows = con.execute(
        "SELECT group_id, name, description, ranks FROM comm_group WHERE run_id = ?"
        " ORDER BY group_id",
        [run_id],
    ).fetchall()
    return [_Group(int(g), n, d, tuple(int(x) for x in r or ())) for g, n, d, r in rows]


def _read_coords(
    con: duckdb.DuckDBPyConnection, run_id: int
) -> tuple[np.ndarray, dict[ParallelAxis, np.ndarray]]:
    rows = con.execute(
        "SELECT rank, tp, cp, ep, dp, pp FROM rank WHERE run_id = ? ORDER BY rank", [run_id]
    ).fetchall()
    ranks = np.array([r[0] for r in rows], dtype=np.int64)
    coords = {
        a: np.array([-1 if r[i + 1] is None else r[i + 1] for r in rows], dtype=np.int64)
        for i, a in enumerate(AXES)
    }
    return ranks, coords


def _sizes(
    world: int, groups: list[_Group], coords: dict[ParallelAxis, np.ndarray], run: str
) -> dict[ParallelAxis, int]:
    """Axis sizes of a run, from its described groups and recorded coordinates.

    Exact from described groups, else bounds from coordinates; data parallelism takes the ranks
    no other axis explains.
    """
    exact: dict[ParallelAxis, int] = {}
    for g in groups:
        described = _described_axis(g.description)
        if described in _AXIS_TOKENS and g.ranks:
            a = ParallelAxis(described)
            if exact.setdefault(a, len(g.ranks)) != len(g.ranks):
                msg = (
                    f"run {run!r}: {a} groups have different sizes ({exact[a]} and"
                    f" {len(g.ranks)} in group {g.name!r})"
                )
                raise LayoutError(msg)
    # Multi-axis descriptions (`dp-cp`) give one size more when the others are known.
    for g in groups:
        described = _described_axis(g.description)
        if described in (None, WORLD, EMBD) or described in _AXIS_TOKENS or not g.ranks:
            continue
        axes = parse_axes(described)  # type: ignore[arg-type]
        unknown = [a for a in axes if a not in exact]
        known = int(np.prod([exact[a] for a in axes if a in exact]))
        if len(unknown) == 1 and len(g.ranks) % known == 0:
            exact[unknown[0]] = len(g.ranks) // known
    sizes = {a: exact.get(a, max(1, int(coords[a].max(initial=-1)) + 1)) for a in AXES}
    if ParallelAxis.DP not in exact:
        rest = int(np.prod([sizes[a] for a in AXES if a != ParallelAxis.DP]))
        if world % rest == 0 and world // rest >= sizes[ParallelAxis.DP]:
            sizes[ParallelAxis.DP] = world // rest
    total = int(np.prod(list(sizes.values())))
    if total != world:
        got = ",".join(f"{a}={s}" for a, s in sizes.items())
        msg = (
            f"run {run!r}: axis sizes {got} from its groups and rank coordinates make"
            f" {total} ranks, but its world has {world}"
        )
        raise LayoutError(msg)
    return sizes


def _check(
    layout: ParallelLayout,
    groups: list[_Group],
    ranks: np.ndarray,
    coords: dict[ParallelAxis, np.ndarray],
) -> str | None:
    """Why ``layout`` does not fit the run (None when it does)."""
    if ranks.size:
        if ranks.max() >= layout.world_size:
            return f"rank {int(ranks.max())} is outside the world of {layout.world_size}"
        mine = layout.coords(ranks)
        for a in AXES:
            known = coords[a] >= 0
            bad = known & (coords[a] != mine[a])
            if bad.any():
                r = int(ranks[bad][0])
                return (
                    f"rank {r} has {a}={int(coords[a][bad][0])} in the rank table,"
                    f" but {a}={int(mine[a][bad][0])} under {layout}"
                )
    for g in groups:
        if not g.ranks:
            continue
        try:
            group_axis(layout, g.ranks, g.description, name=g.name)
        except LayoutError as exc:
            return str(exc)
    return None


def _infer(
    world: int,
    groups: list[_Group],
    ranks: np.ndarray,
    coords: dict[ParallelAxis, np.ndarray],
    *,
    run: str,
    order: str | None = None,
) -> ParallelLayout:
    sizes = _sizes(world, groups, coords, run)
    big = [a for a in _parse_order(order) if sizes[a] > 1]
    first_reason = None
    for perm in itertools.permutations(big):
        it = iter(perm)
        full = tuple(next(it) if sizes[a] > 1 else a for a in DEFAULT_ORDER)
        layout = ParallelLayout(**{a.value: s for a, s in sizes.items()}, order=full)
        reason = _check(layout, groups, ranks, coords)
        if reason is None:
            return layout
        first_reason = first_reason or reason
    msg = f"run {run!r}: no rank order of the axes fits its groups and coordinates: {first_reason}"
    raise LayoutError(msg)


def infer_layout(store: Store, run: str, *, order: str | None = None) -> ParallelLayout:
    """The parallel layout of a recorded run: the declared one, else from its groups and ranks.

    A layout declared for the run (``layout.declare_layout``) wins; ``layout.choose_layout``
    gives the same answer with its reasons.

    Sizes come from groups whose description names one axis (``tp``, ``data``, ``dp_stage0``,
    ...), else from the largest coordinate in the ``rank`` table; ``dp`` takes whatever part of
    the world no other axis explains (so a plain data-parallel job with only ``default_pg`` is
    ``dp=world``). The order is the first permutation (starting from ``order``, default
    Megatron's) under which every rank's recorded coordinates and every group fit.

    Args:
        store: the store.
        run: a run name.
        order: the order to try first (``tp-cp-ep-dp-pp`` by default).

    Returns:
        The layout.

    Raises:
        LayoutError: sizes that do not multiply to the world, or a group that fits no axis
            combination under any order (the message names the group).
        PrismError: no such run.
    """
    from prism_trace.layout.choice import choose_layout  # it builds on this module

    choice = choose_layout(store, run, order=order)
    if choice.layout is None:
        raise LayoutError(choice.error or f"run {run!r}: no layout fits")
    return choice.layout


def _write_axes(
    con: duckdb.DuckDBPyConnection, run_id: int, layout: ParallelLayout, *, run: str
) -> dict[int, str]:
    """Fill ``comm_group.axis`` and the ranks' coordinates of one run (inside a transaction)."""
    axes: dict[int, str] = {}
    for g in _read_groups(con, run_id):
        if not g.ranks:
            continue
        axes[g.group_id] = group_axis(layout, g.ranks, g.description, name=g.name)
    if axes:
        con.executemany(
            "UPDATE comm_group SET axis = ? WHERE run_id = ? AND group_id = ?",
            [[v, run_id, k] for k, v in axes.items()],
        )
    ranks = np.array(
        [r[0] for r in con.execute("SELECT rank FROM rank WHERE run_id = ?", [run_id]).fetchall()],
        dtype=np.int64,
    )
    if ranks.size and ranks.max() >= layout.world_size:
        msg = f"run {run!r}: rank {int(ranks.max())} is outside the {layout.world_size} of {layout}"
        raise LayoutError(msg)
    c = layout.coords(ranks)
    con.executemany(
        "UPDATE rank SET tp = ?, cp = ?, ep = ?, dp = ?, pp = ? WHERE run_id = ? AND rank = ?",
        [[*(int(c[a][i]) for a in AXES), run_id, int(r)] for i, r in enumerate(ranks)],
    )
    return axes


def assign_axes(store: Store, run: str, layout: ParallelLayout) -> dict[int, str]:
    """Write ``comm_group.axis`` and ``rank.tp..pp`` of a run under ``layout``, atomically.

    Args:
        store: an open, writable store.
        run: the run name.
        layout: its layout (e.g. from ``infer_layout``).

    Returns:
        The axis value written per group id (groups without member lists are left NULL).

    Raises:
        LayoutError: a group fits no axis combination (the message names it); nothing is written.
    """
    run_id = store.require_run(run)
    with store.transaction() as con:
        return _write_axes(con, run_id, layout, run=run)

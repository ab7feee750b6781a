"""Which axis a communicator spans: its role named from its description, else from its members.

Pure, like ``mesh``: given a layout, a group's members and its description (Megatron's
``data_parallel``, torchtitan's ``mesh_tp``, DeepSpeed's ``sequence_parallel``, ``default_pg``,
...), the axis value it has (``tp``, ``dp-cp``, ``world``, ``embd``). Inference, declaration
and slicing all name a group's role through ``group_axis``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np

from prism_trace.layout.mesh import (
    AXES,
    EMBD,
    NAME_ORDER,
    WORLD,
    LayoutError,
    ParallelAxis,
    ParallelLayout,
    axis_name,
    parse_axes,
)

__all__ = ["AXIS_TOKENS", "described_axis", "group_axis"]

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
    "expert_data_parallel": "dp",  # the expert mesh's dp (see `mesh`'s docstring)
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
AXIS_TOKENS = frozenset(a.value for a in AXES)
"""The one-axis values: a description naming one of these names that axis's size."""


@functools.lru_cache(maxsize=1024)  # a run has thousands of groups and a few descriptions
def described_axis(description: str | None) -> str | None:
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
        if t not in AXIS_TOKENS:
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
    described = described_axis(description)
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
    ones = [a for a in NAME_ORDER if layout.size(a) == 1]
    if not ones:
        msg = f"{label}: a one-rank group, but no axis of {layout} has size 1"
        raise LayoutError(msg)
    return ones[0].value

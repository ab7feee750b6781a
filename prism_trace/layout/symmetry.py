"""Symmetric peers: the TP/CP peers a recording left out run their recorded partner's program.

Megatron's op loggers, and many profiling setups, record one rank per tensor- or
context-parallel group: the peers run the same program on their shard of the same data, in
lock step (every TP/CP collective joins them). Such a recording is complete for emulation: an
unrecorded rank whose TP/CP group holds a recorded rank is a *copy* of it (same graph, same
timing), so a TP/CP collective completes at that partner's timing and every other collective
sees the copy arrive when its partner does. Ranks without such a partner stay unrecorded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prism_trace.layout.mesh import ParallelAxis, ParallelLayout

__all__ = ["missing_ranks", "ranges", "symmetric_partners"]

_PEER_AXES = (ParallelAxis.TP, ParallelAxis.CP)


def symmetric_partners(
    layout: ParallelLayout, recorded: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The unrecorded ranks that copy a recorded TP/CP peer, and that peer.

    Args:
        layout: the run's layout.
        recorded: the recorded ranks.

    Returns:
        ``(ranks, partners)``, sorted by rank: each unrecorded rank of the world whose TP/CP
        group holds a recorded rank, and the lowest recorded rank of that group.
    """
    world = np.arange(layout.world_size, dtype=np.int64)
    rec = np.unique(np.asarray(recorded, dtype=np.int64))
    rec = rec[(rec >= 0) & (rec < layout.world_size)]
    empty = np.zeros(0, dtype=np.int64)
    if rec.size == 0 or layout.tp * layout.cp == 1:
        return empty, empty
    cell = layout.group_index(_PEER_AXES, world)  # one id per TP x CP group
    keys, first = np.unique(cell[rec], return_index=True)
    partner_of = np.full(int(cell.max()) + 1, -1, dtype=np.int64)
    partner_of[keys] = rec[first]
    missing = np.setdiff1d(world, rec)
    partner = partner_of[cell[missing]]
    ok = partner >= 0
    return missing[ok], partner[ok]


def ranges(ranks: Sequence[int] | np.ndarray) -> str:
    """Ranks as compact ranges: ``1..63, 65..127``."""
    values = np.unique(np.asarray(ranks, dtype=np.int64))
    if values.size == 0:
        return "none"
    cuts = np.flatnonzero(np.diff(values) != 1) + 1
    parts = []
    for run in np.split(values, cuts):
        lo, hi = int(run[0]), int(run[-1])
        parts.append(str(lo) if lo == hi else f"{lo}..{hi}")
    return ", ".join(parts)


def missing_ranks(
    world: int, recorded: Sequence[int] | np.ndarray, layout: ParallelLayout | None
) -> str | None:
    """One line naming the ranks of the world a recording lacks, or None when it lacks none.

    Copies of a recorded TP/CP peer are told apart from ranks that have no recorded program.
    """
    rec = np.unique(np.asarray(recorded, dtype=np.int64))
    absent = np.setdiff1d(np.arange(world, dtype=np.int64), rec)
    if absent.size == 0:
        return None
    copies = np.zeros(0, dtype=np.int64)
    if layout is not None and layout.world_size == world:
        copies = symmetric_partners(layout, rec)[0]
    rest = np.setdiff1d(absent, copies)
    out = f"{rec.size} of {world} ranks recorded"
    if copies.size:
        out += f"; {copies.size} TP/CP peers run as copies of a recorded partner"
    if rest.size:
        out += f"; not recorded: {ranges(rest)} ({rest.size} ranks)"
    return out

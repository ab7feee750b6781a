"""Typical op durations: what each op would take without stragglers.

The ``no-stragglers`` what-if (StragglerAnalysis's ``step_t_noblk``) replaces every op by the
typical op of its type, so that what is left of the step is the schedule itself. The type of an op
is its name (an op-timeline ``optype``, a kernel or host-op name). Computation takes the **mean**
duration of its type over every rank and every step: a slow rank or step then counts for what it
adds on average (StragglerAnalysis's rule; the median would drop ST's slow stage and put its
``no-stragglers`` 10 % off, docs/emulator.md), so with N ranks one straggler's excess S leaves
S / N in every rank's typical op. Communication takes the **median** transfer of its type (its name
and message size: one NCCL kernel name serves every size; its time from the last participant's
arrival to its own completion), because a collective's recorded duration is mostly waiting and its
spread comes from the peers, not from the wire.

Own delays (``prism_trace.graph.deps_op_timeline``) are not durations: ``replay.emulate``
keeps those before a computation (CPU work and launches happen without stragglers too) and drops
those before a communication op, which could have been posted as soon as its dependencies allowed.

Why ``no-stragglers`` is not monotone by construction, unlike the slow-downs and
``no-launch-delay`` (docs/emulator.md, "Monotone what-ifs"): the mean *raises* every op that was
faster than its type's mean, and a raised op on the critical path can lengthen the run. The
largest rule that never lengthens an op, ``min(recorded, mean)``, puts ST 4.62 % from
StragglerAnalysis's ``step_t_noblk`` (0.91 % with the mean), because ST's figure rests on raising
its three fast stages to the pooled mean. What does hold by construction: a communication's
typical time is a transfer, never a duration that holds a wait, and no release moves; the rest is
checked on every multi-rank set (``tests/replay/test_whatif_monotone.py``).

Both functions take a mask of the rows to replace, so that one group of ops can keep its
recorded times while the rest are typical (the slowdown attribution, ``replay.emulate.slowdown``).
"""

from __future__ import annotations

import numpy as np
import polars as pl

__all__ = ["typical_durations", "typical_transfers"]


def typical_durations(
    names: pl.Series, dur: np.ndarray, replace: np.ndarray, held: np.ndarray | None = None
) -> np.ndarray:
    """Each op's duration, the rows in ``replace`` set to the mean of their name.

    A host op that blocks in a synchronising call (the destination of a ``sync`` edge) recorded
    its wait for the device, and through the device for other ranks, in its duration; the
    emulator produces that wait from the ``sync`` edge. Such ops are left out of the means, and
    take the mean of the ops of their name that did not block, or, when every one blocked, the
    shortest of them (the one that waited least).

    Args:
        names: op names, one per row.
        dur: recorded (or already changed) durations, ns.
        replace: bool per row: take the typical duration.
        held: bool per row: the op's end is held by a ``sync`` edge (None: none is).

    Returns:
        int64 durations, ns.
    """
    held = np.zeros(dur.size, dtype=bool) if held is None else held
    df = pl.DataFrame({"name": names, "dur": dur, "held": held})
    free = pl.col("dur").filter(~pl.col("held"))
    typ = (
        df.select(
            pl.coalesce(free.mean().over("name"), pl.col("dur").min().over("name")).alias("t")
        )
        .to_series()
        .to_numpy()
    )
    return np.where(replace, np.rint(typ), dur).astype(np.int64)


def typical_transfers(names: pl.Series, transfer: np.ndarray, replace: np.ndarray) -> np.ndarray:
    """Each participation's transfer, the rows in ``replace`` set to the median of their name.

    Args:
        names: the name of each participation's communication op.
        transfer: per participation, ns from the instance's last arrival to its completion.
        replace: bool per row: take the typical transfer.

    Returns:
        int64 transfers, ns.
    """
    df = pl.DataFrame({"name": names, "t": transfer})
    med = df.select(pl.col("t").median().over("name")).to_series().to_numpy()
    return np.where(replace, np.rint(med), transfer).astype(np.int64)

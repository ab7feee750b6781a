"""Tensor lifetimes from the recording's allocator events.

The replay frees a result after the last op that reads it (``kernels.build_program``). A
program can hold a tensor longer through a Python reference that no trace shows: a pipeline
stage keeps each micro-batch's output in a list until its backward (or the step's end) after
the ``send`` that is its last use in the ET, an optimizer keeps a value for the next step. The
replay then holds less memory than the recording did (the first stage of the bundled pipeline
runs, about 6-9 % of its peak).

When the recording has allocator events (Kineto ``[memory]`` with addresses: the ``memory``
table), the time each storage was really freed is there. A result is matched to the allocation
its op made: inside the op's recorded span, of the result's size, and still alive when the op
ended (a temporary freed inside the op is not a result). The replay then frees it after the
last compute unit that started before the recorded free, when that is later than its last use.
A result never freed in the recording is held to the end of the pass. Lifetimes are only ever
extended: the replay still needs every tensor until its last use.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl
from prism_trace.replay.kernels.program import Program

__all__ = ["hold", "recorded_frees"]

_CUDA_ROUND = 512
"""The CUDA caching allocator reports blocks rounded up to this many bytes."""


def recorded_frees(
    program: Program, rec_ts: np.ndarray, rec_dur: np.ndarray, memory: pl.DataFrame
) -> dict[int, int]:
    """Per result slot, the compute unit after which the recording's allocator freed it.

    Args:
        program: the rank's program.
        rec_ts: recorded start of every unit, ns (-1: not linked to a recorded event).
        rec_dur: recorded duration of every unit, ns.
        memory: the source rank's allocator events: ``ts``, ``addr``, ``bytes`` (+ alloc,
            - free), ``device_type``.

    Returns:
        slot -> unit index, only for slots whose recorded free comes after their last use.
    """
    allocs = _allocations(memory)
    if allocs.is_empty() or not program.slot_made:
        return {}
    a_ts = allocs["ts"].to_numpy()
    a_bytes = allocs["bytes"].to_numpy()
    a_free = allocs["free_ts"].fill_null(np.iinfo(np.int64).max).to_numpy()
    a_dev = allocs["device_type"].to_list()
    compute = [
        u.index
        for u in program.units
        if u.kind == "compute" and rec_ts[u.index] >= 0 and rec_dur[u.index] >= 0
    ]
    if not compute:
        return {}
    starts = np.array([rec_ts[k] for k in compute], dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    starts, compute = starts[order], [compute[i] for i in order]
    last = {slot: k for k, slots in program.frees_after.items() for slot in slots}
    made: dict[int, list[int]] = {}
    for slot, k in sorted(program.slot_made.items()):
        made.setdefault(k, []).append(slot)
    taken = np.zeros(len(a_ts), dtype=bool)
    out: dict[int, int] = {}
    for k, slots in made.items():
        t0, d = int(rec_ts[k]), int(rec_dur[k])
        if t0 < 0 or d < 0:
            continue
        lo = int(np.searchsorted(a_ts, t0, side="left"))
        hi = int(np.searchsorted(a_ts, t0 + d, side="right"))
        cand = [i for i in range(lo, hi) if a_free[i] > t0 + d and not taken[i]]
        for slot in slots:
            meta = program.slot_meta[slot]
            nbytes = max(meta.extent, 1) * meta.elem_bytes
            dev = "cuda" if meta.device.startswith("cuda") else meta.device.split(":")[0]
            sizes = {nbytes, -(-nbytes // _CUDA_ROUND) * _CUDA_ROUND} if dev == "cuda" else {nbytes}
            hit = next(
                (i for i in cand if not taken[i] and a_dev[i] == dev and a_bytes[i] in sizes),
                None,
            )
            if hit is None:
                continue
            taken[hit] = True
            pos = int(np.searchsorted(starts, a_free[hit], side="right")) - 1
            until = compute[max(pos, 0)]
            if until > last.get(slot, k):
                out[slot] = until
    return out


def _allocations(memory: pl.DataFrame) -> pl.DataFrame:
    """Allocation events with the time their block was freed (null: never, in the trace).

    One address is allocated and freed in turn, so an allocation's free is the next event of
    its address, when that event is a free."""
    if memory.is_empty():
        return pl.DataFrame(
            schema={"ts": pl.Int64, "bytes": pl.Int64, "free_ts": pl.Int64, "device_type": pl.Utf8}
        )
    ev = memory.filter(pl.col("addr").is_not_null()).sort("addr", "ts")
    nxt = pl.struct(ts=pl.col("ts"), bytes=pl.col("bytes")).shift(-1).over("addr", "device_type")
    return (
        ev.with_columns(nxt.alias("next"))
        .filter(pl.col("bytes") > 0)
        .with_columns(
            pl.when(pl.col("next").struct.field("bytes") < 0)
            .then(pl.col("next").struct.field("ts"))
            .alias("free_ts")
        )
        .select(
            pl.col("ts").cast(pl.Int64),
            pl.col("bytes").cast(pl.Int64),
            pl.col("free_ts").cast(pl.Int64),
            "device_type",
        )
        .sort("ts")
    )


def hold(program: Program, until: dict[int, int]) -> Program:
    """``program`` with each slot of ``until`` freed after that unit instead of its last use."""
    if not until:
        return program
    frees: dict[int, list[int]] = {}
    for k, slots in program.frees_after.items():
        for slot in slots:
            frees.setdefault(until.get(slot, k), []).append(slot)
    frees = {k: sorted(v) for k, v in frees.items()}
    calls = {k: replace(c, frees=frees.get(k, [])) for k, c in program.calls.items()}
    return replace(program, calls=calls, frees_after=frees)

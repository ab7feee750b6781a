"""Tensor lifetimes from the recording's allocator events (``replay.lifetimes``)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import polars as pl
from prism_trace.replay.kernels.program import OpCall, Program
from prism_trace.replay.kernels.schema import TensorMeta
from prism_trace.replay.kernels.units import Unit
from prism_trace.replay.memory.lifetimes import hold, recorded_frees


def _meta(tid: int, numel: int, device: str = "cpu") -> TensorMeta:
    return TensorMeta(
        key=(tid, tid, 0, numel, 4, device), shape=(numel,), strides=(1,), dtype="float32"
    )


def _program(
    n_units: int, made: dict[int, int], numel: dict[int, int], last: dict[int, int]
) -> Program:
    """Compute units 0..n-1; slot s is made at ``made[s]`` with ``numel[s]`` float32 elements
    and last read at ``last[s]``."""
    units = [
        Unit(index=k, node_id=k, event_id=k, name=f"op{k}", kind="compute", iteration=1)
        for k in range(n_units)
    ]
    frees: dict[int, list[int]] = {}
    for s, k in last.items():
        frees.setdefault(k, []).append(s)
    calls = {
        k: OpCall(
            unit=u, op=None, args=[], kwargs={}, n_returns=0, outputs=[], frees=frees.get(k, [])
        )
        for k, u in enumerate(units)
    }
    return Program(
        units=units,
        calls=calls,
        unsupported={},
        externals=[],
        ext_buffer=[],
        buffers=[],
        n_slots=len(made),
        substituted_outputs={},
        skipped=Counter(),
        slot_meta={s: _meta(100 + s, numel[s]) for s in made},
        slot_made=made,
        frees_after=frees,
    )


def _mem(rows: list[tuple[int, int, int]]) -> pl.DataFrame:
    """``(ts, addr, bytes)`` CPU allocator events."""
    ts, addr, b = zip(*rows, strict=True)
    return pl.DataFrame(
        {"ts": list(ts), "addr": list(addr), "bytes": list(b), "device_type": ["cpu"] * len(ts)}
    )


# units 0..4 start at 0, 100, 200, 300, 400 and last 50 ns each
TS = np.array([0, 100, 200, 300, 400], dtype=np.int64)
DUR = np.full(5, 50, dtype=np.int64)


def test_a_result_held_by_the_program_is_freed_when_the_recording_freed_it() -> None:
    # slot 0 (256 B) made by unit 0, last read by unit 1, freed by the recording during unit 3's
    # gap (ts 330): held until after unit 3. A temporary of the same size allocated and freed
    # inside unit 0 is not the result.
    p = _program(5, made={0: 0}, numel={0: 64}, last={0: 1})
    mem = _mem([(10, 7, 256), (12, 7, -256), (20, 8, 256), (330, 8, -256)])
    until = recorded_frees(p, TS, DUR, mem)
    assert until == {0: 3}
    held = hold(p, until)
    assert held.calls[3].frees == [0]
    assert held.calls[1].frees == []
    assert held.frees_after == {3: [0]}
    assert p.calls[1].frees == [0]  # the original program is unchanged


def test_lifetimes_are_only_extended_and_sizes_must_match() -> None:
    # slot 0: the recording freed it (ts 150) before its last use (unit 3): kept to unit 3.
    # slot 1: no allocation of its size inside unit 1: unchanged.
    # slot 2: never freed in the trace: held to the last unit.
    p = _program(5, made={0: 0, 1: 1, 2: 2}, numel={0: 64, 1: 32, 2: 16}, last={0: 3, 1: 2, 2: 2})
    mem = _mem([(10, 1, 256), (150, 1, -256), (110, 2, 999), (210, 3, 64)])
    assert recorded_frees(p, TS, DUR, mem) == {2: 4}


def test_no_allocator_events_changes_nothing() -> None:
    p = _program(3, made={0: 0}, numel={0: 4}, last={0: 1})
    empty = pl.DataFrame(
        schema={"ts": pl.Int64, "addr": pl.Int64, "bytes": pl.Int64, "device_type": pl.Utf8}
    )
    assert recorded_frees(p, TS[:3], DUR[:3], empty) == {}
    assert hold(p, {}) is p

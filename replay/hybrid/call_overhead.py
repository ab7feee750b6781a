"""The replay's own cost of calling each op, outside the span the profiler gives the op.

A recorded op's duration is its profiler span (``RecordFunction`` begin to end). Everything
around that span, such as Python's argument parsing, the dispatcher up to ``RecordFunction`` and
the instrumentation's callbacks that run outside the span (the execution-trace observer's, 7-11
µs per op on average in the dp=2 accuracy benchmark), is in the recorded *gap* before the next
op. The replay spends that gap (``gaps="recorded"``) and then times the call from Python, which
pays the same costs again. Each op's call cost would then count twice: 39-63 ms of a 5-iteration
dp=2 pass of 375-613 ms under the recording's instrumentation
(``benchmarks/bench_replay_accuracy.py``, docs/replay.md).

So before the measured passes the replay runs calibration passes under a profiler, matches each
unit's clock window to its own top-level profiler event, and takes ``call_overhead[k]`` = the
window minus the span (the smallest over the calibration passes: preemption only adds). The gap
spent before unit ``k`` is the recorded gap less this overhead, so that a replayed iteration is
the recorded gaps plus the replayed ops' own spans plus the waits, as the recorded one was.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import polars as pl
from prism_trace.replay.kernels.program import Program

__all__ = ["PASS_MARK", "CallOverhead", "call_overhead", "expected_events", "top_level_spans"]

#: Look this many events ahead for a unit's op before deciding it has none (real communication,
#: hooks and allocations between units add top-level events of their own).
_LOOKAHEAD = 64


def expected_events(
    program: Program, *, views_profiled: bool = True
) -> list[tuple[int | None, str]]:
    """Top-level profiler events one pass of ``program`` produces, in order: ``(unit, name)`` for
    a unit's op, ``(None, name)`` for the views and buffers the pass makes between ops (unless
    the pass makes them unprofiled: ``views_profiled=False``)."""
    out: list[tuple[int | None, str]] = []
    for u in program.units:
        k = u.index
        if u.kind == "comm":
            continue
        call = program.calls.get(k)
        n = int(views_profiled)
        if call is None:  # substituted: no op runs, its results are empty buffers
            out += [(None, "aten::empty_strided")] * len(program.substituted_outputs.get(k, [])) * n
        else:
            out += [(None, "aten::as_strided")] * len(call.aliases) * n
            out.append((k, u.name))
        out += [(None, "aten::empty_strided")] * len(program.nested_outputs.get(k, [])) * n
    return out


#: The ``record_function`` name around each calibration pass (``_Driver.run(mark=...)``).
PASS_MARK = "prism::calibration_pass"


def top_level_spans(kineto_json: Path, mark: str = PASS_MARK) -> list[list[tuple[str, int, int]]]:
    """Per ``mark`` annotation of a Kineto trace (one per calibration pass, in order), the
    ``(name, start ns, duration ns)`` of the top-level CPU ops on its thread inside it, in start
    order (nested ops are inside their parent's span).

    Only the host's annotation counts as a mark: under CUDA activity Kineto mirrors each
    ``record_function`` on the GPU timeline (``gpu_user_annotation``, the span of the kernels it
    launched), which would count every pass twice."""
    import orjson

    events = [
        e
        for e in orjson.loads(kineto_json.read_bytes()).get("traceEvents", [])
        if e.get("ph") == "X"
        and (
            e.get("cat") == "cpu_op"
            or (e.get("name") == mark and not str(e.get("cat", "")).startswith("gpu_"))
        )
    ]
    ev = pl.DataFrame(
        {
            "ts": [float(e["ts"]) for e in events],
            "dur": [float(e.get("dur", 0.0)) for e in events],
            "tid": [str(e.get("tid")) for e in events],
            "name": [e["name"] for e in events],
        },
        schema={"ts": pl.Float64, "dur": pl.Float64, "tid": pl.String, "name": pl.String},
    )
    marks = ev.filter(pl.col("name") == mark).sort("ts")
    ops = ev.filter(pl.col("name") != mark)
    out: list[list[tuple[str, int, int]]] = []
    for m_ts, m_dur, m_tid in marks.select("ts", "dur", "tid").iter_rows():
        inside = ops.filter(
            (pl.col("tid") == m_tid) & pl.col("ts").is_between(m_ts, m_ts + m_dur)
        ).sort("ts", pl.col("dur"), descending=[False, True])
        # Top level: starts at or after the end of every op before it.
        ends_before = (pl.col("ts") + pl.col("dur")).cum_max().shift(1)
        top = inside.filter(ends_before.is_null() | (pl.col("ts") >= ends_before))
        out.append(
            list(
                top.select(
                    "name",
                    (pl.col("ts") * 1000).round().cast(pl.Int64),
                    (pl.col("dur") * 1000).round().cast(pl.Int64),
                ).iter_rows()
            )
        )
    return out


class CallOverhead(NamedTuple):
    """``per_unit``: ns per unit (0 for communication and unmatched units); ``matched``: compute
    units whose op was found in every calibration pass; ``units``: compute units with an op."""

    per_unit: np.ndarray
    matched: int
    units: int


def call_overhead(
    program: Program,
    windows: Sequence[Sequence[int]],
    spans: Sequence[Sequence[tuple[str, int, int]]],
    *,
    views_profiled: bool = True,
) -> CallOverhead:
    """Per unit, the smallest ``window - span`` over the calibration passes (0 where unmatched).

    A unit's op is the next event of its name whose span lies inside the unit's clock window:
    the profiler's clock differs from ``perf_counter_ns`` by an offset, estimated per pass from
    the first name matches (``_clock_offset``). Events the pass does not predict (real
    communication, hooks) are passed over; an op whose event is missing leaves its unit
    unmatched without shifting the others onto the wrong events.

    Args:
        program: the program the passes ran.
        windows: per calibration pass, its ``T`` list (unit ``k``: ``T[2k]`` start, ``T[2k+1]``
            end, ``perf_counter_ns``).
        spans: per calibration pass, ``top_level_spans`` of the profiler that watched it.
        views_profiled: whether the passes made their views and buffers as profiled ops.
    """
    expected = expected_events(program, views_profiled=views_profiled)
    best = np.full(len(program.units), np.iinfo(np.int64).max, dtype=np.int64)
    hits = np.zeros(len(program.units), dtype=np.int64)
    for T, pass_spans in zip(windows, spans, strict=True):
        names = [name for name, _, _ in pass_spans]
        offset = _clock_offset(expected, T, pass_spans, names)
        i = 0
        for k, name in expected:
            lo = hi = None
            if k is not None:
                lo, hi = T[2 * k] + offset - _SLACK_NS, T[2 * k + 1] + offset + _SLACK_NS
            j = _find(names, name, i)
            while j is not None and lo is not None and pass_spans[j][1] < lo:
                j = _find(names, name, j + 1)  # an earlier op of that name: not this unit's
            if j is None:
                continue
            _, s0, d = pass_spans[j]
            if hi is not None and s0 + d > hi:
                continue  # the next op of that name, after this unit: this unit's is missing
            i = j + 1
            if k is not None:
                best[k] = min(best[k], max(0, int(T[2 * k + 1] - T[2 * k]) - d))
                hits[k] += 1
    best[best == np.iinfo(np.int64).max] = 0
    units = sum(1 for k, _ in expected if k is not None)
    return CallOverhead(best, int((hits == len(windows)).sum()), units)


#: How far the profiler's span may stick out of the unit's window (clock conversion, rounding).
_SLACK_NS = 3_000


def _clock_offset(
    expected: list[tuple[int | None, str]],
    T: Sequence[int],
    spans: Sequence[tuple[str, int, int]],
    names: list[str],
    first: int = 64,
) -> int:
    """Profiler clock minus ``perf_counter_ns``, from the first ``first`` ops matched by name.

    Each puts the offset in an interval (its span inside its window: at least ``span end -
    window end``, at most ``span start - window start``); the estimate is the middle of the
    range most of them agree on (90th percentile of the lower ends to 10th of the upper ends, so
    that a wrong match among them does not move it), else the median of the intervals' middles.
    """
    lows: list[int] = []
    highs: list[int] = []
    i = 0
    for k, name in expected:
        j = _find(names, name, i)
        if j is None:
            continue
        i = j + 1
        if k is not None:
            _, s0, d = spans[j]
            lows.append(s0 + d - T[2 * k + 1])
            highs.append(s0 - T[2 * k])
            if len(lows) == first:
                break
    if not lows:
        return 0
    lo, hi = float(np.percentile(lows, 90)), float(np.percentile(highs, 10))
    if lo <= hi:
        return round((lo + hi) / 2)
    return round(float(np.median((np.asarray(lows) + np.asarray(highs)) / 2)))


def _find(names: list[str], name: str, start: int) -> int | None:
    """Index of ``name`` in ``names[start:start + _LOOKAHEAD]``, or None."""
    try:
        return names.index(name, start, start + _LOOKAHEAD)
    except ValueError:
        return None

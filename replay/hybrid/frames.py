"""Hybrid replay, results: the representative pass, its timing figures, and the event, iteration
and memory frames of a replayed rank."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import polars as pl
from prism_trace.replay.hybrid.load import _RankInputs
from prism_trace.replay.hybrid.options import RankReplay
from prism_trace.replay.hybrid.passes import _Driver, _Pass, _unit_calls
from prism_trace.replay.kernels.program import Program

from prism_trace.ingestion.derive import assign_iteration

__all__: list[str] = []


def _bare_pairs(
    driver: _Driver, fn: Any, bare: Any, externals: list[Any], n: int
) -> list[tuple[_Pass, int]]:
    """``n`` pairs of a timed pass and a bare one, run alternately so that the machine's drift
    hits both alike. The timed passes of the pairs do not wait for the virtual peers: ops run
    back to back in both, and a long spin changes how fast the ops after it run (the measured
    passes' figures carry that; this comparison is of the instrumentation alone)."""
    driver.peer_waits = False
    try:
        return [(driver.run(fn, externals), driver.run_bare(bare, externals)) for _ in range(n)]
    finally:
        driver.peer_waits = True


def _spans(p: _Pass) -> np.ndarray:
    """Each unit's span in pass ``p`` (end stamp - start stamp), ns."""
    T = np.asarray(p.T, dtype=np.int64)
    return T[1::2] - T[0::2]


def _pair_figures(result: RankReplay, program: Program, pairs: list[tuple[_Pass, int]]) -> None:
    """Per (timed, bare) pair of passes: the bare wall time, the timed pass's op time, and what
    the timed pass spent beyond the bare one, % of the bare one. Communication and substitutes
    are not in the bare pass; their spans (between their stamps) come off the timed pass, the
    hook calls around them stay in as instrumentation."""
    rebuilt = np.array([u.index in program.calls for u in program.units])
    result.bare_ns = [b for _, b in pairs]
    result.paired_op_ns = [int(_spans(p)[rebuilt].sum()) for p, _ in pairs]
    result.instrumentation_pct_passes = [
        100.0 * (p.wall_ns - int(_spans(p)[~rebuilt].sum()) - b) / b if b > 0 else 0.0
        for p, b in pairs
    ]


def _representative(passes: list[_Pass], program: Program, *, together: bool = False) -> _Pass:
    """The most typical pass: the one whose iterations are closest to the per-iteration medians
    over all passes (sum of relative distances). The machine's speed drifts by tens of per cent
    within seconds on a shared host (``benchmarks/bench_machine_drift.py``), so one pass can be
    slow in one iteration and fast in the others; the median pass by total time can still carry
    such a burst, the medoid does not.
    Ranks replayed together pick the same pass (the smallest sum over ranks), so the stored ranks
    come from one pass."""
    its = list(passes[0].it_start)
    d = np.array([[p.it_end[i] - p.it_start[i] for i in its] for p in passes], dtype=np.float64)
    med = np.median(d, axis=0)
    scores = (np.abs(d - med) / np.maximum(med, 1.0)).sum(axis=1).tolist()
    if together:
        import torch.distributed as dist

        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, scores)
        scores = [sum(t) for t in zip(*every, strict=True)]
    return passes[min(range(len(passes)), key=lambda i: (scores[i], i))]


def _memory_in_pass(mem: pl.DataFrame, rep: _Pass, offset: int) -> tuple[pl.DataFrame, int | None]:
    """Memory events of the representative pass (profiled), totals relative to its start."""
    start = min(rep.it_start.values()) + offset
    end = max(rep.it_end.values()) + offset
    before = mem.filter(pl.col("ts") < start)
    base = int(before["total_allocated"][-1]) if before.height else None
    inside = mem.filter((pl.col("ts") >= start) & (pl.col("ts") <= end))
    if inside.is_empty():
        return pl.DataFrame(), None
    if base is None:
        base = int(inside["total_allocated"][0] - inside["bytes"][0])
    rows = inside.with_columns(
        (pl.col("ts") - offset).alias("perf_ts"),
        (pl.col("total_allocated") - base).alias("total_allocated"),
    )
    return rows, int(rows["total_allocated"].max())  # type: ignore[arg-type]


def _memory_mapped(
    mem: pl.DataFrame, mem_pass: _Pass, rep: _Pass, offset: int
) -> tuple[pl.DataFrame, int | None]:
    """Memory events of the profiled memory pass, moved onto the representative pass: each event
    keeps its offset inside the unit it happened in (clipped to that unit's replayed time)."""
    rows, peak = _memory_in_pass(mem, mem_pass, offset)
    if rows.is_empty():
        return rows, peak
    starts = np.asarray(mem_pass.T[0::2], dtype=np.int64)
    ts = rows["perf_ts"].to_numpy()
    k = np.clip(np.searchsorted(starts, ts, side="right") - 1, 0, starts.size - 1)
    rep_start = np.asarray(rep.T[0::2], dtype=np.int64)
    rep_end = np.asarray(rep.T[1::2], dtype=np.int64)
    within = np.minimum(ts - starts[k], np.maximum(rep_end[k] - rep_start[k], 0))
    return rows.with_columns(pl.Series("perf_ts", rep_start[k] + np.maximum(within, 0))), peak


def _timing(
    p: _Pass, units: list[Any], is_comm: np.ndarray, target: np.ndarray
) -> tuple[int, int, np.ndarray]:
    """(op time, communication time, machinery time before each unit) of one pass. Machinery is
    the time between units beyond the recorded gap the replay had to spend there (clock reads,
    frees, views, hooks, and any preemption by the OS)."""
    T = np.asarray(p.T, dtype=np.int64)
    start, end = T[0::2], T[1::2]
    dur = end - start
    between = np.zeros(len(units), dtype=np.int64)
    prev: object = object()
    for u in units:
        k = u.index
        base = p.it_start[u.iteration] if u.iteration != prev else int(end[k - 1])
        prev = u.iteration
        between[k] = int(start[k]) - base
    return (
        int(dur[~is_comm].sum()),
        int(dur[is_comm].sum()),
        np.maximum(between - target, 0),
    )


def _result(
    inputs: _RankInputs,
    program: Program,
    passes: list[_Pass],
    rep: _Pass,
    gap: np.ndarray | None,
    tail: dict[int | None, int],
    mem_rows: pl.DataFrame,
    peak: int | None,
    device: str,
    origin: int | None = None,
) -> RankReplay:
    units = program.units
    is_comm = np.array([u.kind == "comm" for u in units])
    target = gap if gap is not None else np.zeros(len(units), dtype=np.int64)
    per_pass = [_timing(p, units, is_comm, target) for p in passes]
    op_ns, comm_ns, overhead = _timing(rep, units, is_comm, target)
    # Per unit, the median over passes: the machinery every pass pays there, without the OS's
    # preemptions, which land on a different unit each pass.
    typical = np.median(np.stack([o for _, _, o in per_pass]), axis=0).sum()
    typical_op = statistics.median(t for t, _, _ in per_pass)
    its = [i for i in rep.it_start if i is not None] or list(rep.it_start)
    rec = {
        int(i): int(d)
        for i, d in zip(inputs.iterations["iteration"], inputs.iterations["dur"], strict=True)
    }
    emu = {int(k): int(v) for k, v in inputs.schedule.iteration_dur_ns.items()}
    passes_ns = [{i: p.it_end[i] - p.it_start[i] for i in its} for p in passes]
    rep_ns = {i: rep.it_end[i] - rep.it_start[i] for i in its}
    r = RankReplay(
        rank=inputs.rank,
        source_rank=inputs.source_rank,
        support=program.support_summary(),
        iterations=[int(i) for i in its] if None not in its else its,
        recorded_ns=rec,
        emulated_ns=emu,
        passes_ns=passes_ns,
        representative_ns=rep_ns,
        overhead_pct_passes=[100.0 * o.sum() / t if t else 0.0 for t, _, o in per_pass],
        overhead_typical_pct=100.0 * typical / typical_op if typical_op else 0.0,
        op_ns=op_ns,
        comm_ns=comm_ns,
        gap_ns=int(target.sum()),
        overhead_ns=int(overhead.sum()),
        peak_memory=peak,
    )
    r.frames = _frames(inputs, program, rep, mem_rows, device, origin)
    mem = r.frames["memory"]
    if device == "cpu" and not mem.is_empty() and mem["total_allocated"].null_count() < mem.height:
        r.peak_memory = int(mem["total_allocated"].max())  # type: ignore[arg-type]
    return r


def _first_starts(inputs: _RankInputs, program: Program, rep: _Pass) -> tuple[int, int]:
    """(recorded, replayed) start of the rank's first replayed iteration."""
    rec_its = dict(zip(inputs.iterations["iteration"], inputs.iterations["ts"], strict=True))
    first_it = program.units[0].iteration
    return int(rec_its.get(first_it, 0)), int(rep.it_start[first_it])


def _frames(
    inputs: _RankInputs,
    program: Program,
    rep: _Pass,
    mem_rows: pl.DataFrame,
    device: str,
    origin: int | None = None,
) -> dict[str, pl.DataFrame]:
    """The rank's rows, on the replay clock laid over the recording: ``origin`` (ns) is added to
    replay clock readings; by default the rank's first replayed iteration starts where the
    recorded one did. Ranks replayed together share one origin (one clock for all)."""
    units = program.units
    if origin is None:
        rec_first, rep_first = _first_starts(inputs, program, rep)
        origin = rec_first - rep_first
    T = np.asarray(rep.T, dtype=np.int64)
    ev = inputs.events.select("event_id", "category", "track_id")
    unit_df = pl.DataFrame(
        {
            "event_id": [u.node_id for u in units],
            "src_event": [u.event_id for u in units],
            "name": [u.name for u in units],
            "kind": [u.kind for u in units],
            "iteration": [u.iteration for u in units],
            "ts": T[0::2] + origin,
            "dur": T[1::2] - T[0::2],
            "substituted": [u.kind == "compute" and u.index in program.unsupported for u in units],
        },
        schema_overrides={"src_event": pl.Int64, "iteration": pl.Int32},
    ).join(ev, left_on="src_event", right_on="event_id", how="left")
    events = unit_df.select(
        pl.lit(inputs.rank, pl.Int32).alias("rank"),
        "event_id",
        pl.col("track_id").cast(pl.Int32),
        pl.coalesce(
            "category",
            pl.when(pl.col("kind") == "comm").then(pl.lit("comm")).otherwise(pl.lit("cpu_op")),
        ).alias("category"),
        "name",
        "ts",
        "dur",
        "iteration",
        pl.lit(0, pl.Int32).alias("depth"),
        pl.when(pl.col("substituted"))
        .then(pl.lit('{"substituted": true}'))
        .otherwise(None)
        .alias("args"),
    )
    its = [
        (
            inputs.rank,
            i,
            rep.it_start[i] + origin,
            rep.it_end[i] - rep.it_start[i],
            f"ProfilerStep#{i}",
        )
        for i in rep.it_start
        if i is not None
    ]
    iters = pl.DataFrame(
        its,
        schema={
            "rank": pl.Int32,
            "iteration": pl.Int32,
            "ts": pl.Int64,
            "dur": pl.Int64,
            "name": pl.Utf8,
        },
        orient="row",
    )
    # The run's own (group, seq, peer, size) of each call: a sliced run's communicators and
    # rescaled sizes, not those of the recorded rank whose rows are copied.
    calls = _unit_calls(program, inputs.schedule)
    comm = (
        unit_df.with_columns(
            pl.Series("call_group_id", [c and c.group_id for c in calls], pl.Int32),
            pl.Series("call_seq", [c and c.seq for c in calls], pl.Int64),
            pl.Series("call_peer", [c and c.peer for c in calls], pl.Int32),
            pl.Series("call_bytes", [c and c.msg_bytes for c in calls], pl.Int64),
            pl.Series("call_size", [c and len(c.group_ranks) for c in calls], pl.Int32),
        )
        .filter(pl.col("kind") == "comm")
        .select(
            pl.col("src_event").alias("src_event_id"),
            pl.col("event_id").alias("new_event_id"),
            pl.col("ts").alias("host_ts"),
            pl.col("dur").alias("host_dur"),
            "call_group_id",
            "call_seq",
            "call_peer",
            "call_bytes",
            "call_size",
        )
    )
    memory = pl.DataFrame()
    if not mem_rows.is_empty():
        memory = mem_rows.select(
            pl.lit(inputs.rank, pl.Int32).alias("rank"),
            (pl.col("perf_ts") + origin).alias("ts"),
            pl.lit(device).alias("device_type"),
            pl.lit(0 if device == "cuda" else -1, pl.Int32).alias("device_id"),
            "addr",
            "bytes",
            "total_allocated",
            "total_reserved",
        )
        memory = assign_iteration(
            memory.with_columns(pl.lit(None, pl.Int32).alias("iteration")), "ts", iters
        )
        if device == "cpu":
            memory = _align_cpu_levels(memory, inputs.cpu_levels)
    return {"event": events, "iteration": iters, "comm": comm, "memory": memory}


def _align_cpu_levels(memory: pl.DataFrame, levels: dict[int, int]) -> pl.DataFrame:
    """Put each replayed iteration's CPU ``total_allocated`` on the recording's level.

    The CPU allocator's count starts when the profiler starts watching, so its level at an
    iteration's start is an accident of that moment: a recording counts what it allocated since
    profiling began and is still alive (optimizer state created lazily in its first profiled step
    stays in every later step's level), the replay counts nothing of the tensors it built before
    its memory pass. Like the replay clock, which is aligned at iteration start, the level is
    aligned there: each iteration's rows move by the recorded level minus the replayed one, both
    read just before the iteration's first allocator event, so what is compared is what the
    iteration's ops allocate and free on top of it. Iterations without a recorded level (no
    recorded CPU memory events) are left as replayed.
    """
    if not levels or memory.is_empty():
        return memory
    rec = pl.DataFrame(
        {"iteration": list(levels), "_rec_level": list(levels.values())},
        schema={"iteration": pl.Int32, "_rec_level": pl.Int64},
    )
    first = (
        memory.filter(pl.col("iteration").is_not_null())
        .sort("ts")
        .group_by("iteration")
        .agg((pl.col("total_allocated") - pl.col("bytes")).first().alias("_rep_level"))
    )
    shift = first.join(rec, on="iteration", how="inner").select(
        "iteration", (pl.col("_rec_level") - pl.col("_rep_level")).alias("_shift")
    )
    return (
        memory.join(shift, on="iteration", how="left", maintain_order="left")
        .with_columns(
            (pl.col("total_allocated") + pl.col("_shift").fill_null(0)).alias("total_allocated")
        )
        .drop("_shift")
    )

"""Hybrid replay, the passes: the driver that runs the compiled ops against the virtual peers'
clock, the waits, and the profiler capture."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from prism_trace.replay.hybrid.call_overhead import (
    PASS_MARK,
    CallOverhead,
    call_overhead,
    top_level_spans,
)
from prism_trace.replay.hybrid.load import _RankInputs
from prism_trace.replay.hybrid.options import _SPIN_SLEEP_NS, KernelReplayOptions
from prism_trace.replay.hybrid.real_comm import RealComm
from prism_trace.replay.kernels.program import Program
from prism_trace.replay.peers import PeerSchedule

from prism_trace.profiling.torch_profiler import profiling

__all__: list[str] = []


def _device_map(ops: pl.DataFrame, device: str) -> Any:
    """Recorded device string → replay ``torch.device``: the trace's compute device → ``device``."""
    import torch

    gpu_trace = ops["inputs"].str.contains('"cuda').any()
    target = torch.device("cuda" if device == "cuda" else "cpu")
    cpu = torch.device("cpu")
    cache: dict[str, Any] = {}

    def dev(s: str) -> Any:
        d = cache.get(s)
        if d is None:
            is_gpu = s.startswith("cuda")
            d = target if (is_gpu if gpu_trace else s.startswith("cpu")) else cpu
            cache[s] = d
        return d

    return dev


def _unit_times(
    program: Program, inputs: _RankInputs
) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[int, int]]]:
    """Recorded start and duration of every unit (-1 when unlinked), and per iteration its
    recorded (start, end)."""
    ev = inputs.events
    ts_of = dict(zip(ev["event_id"].to_list(), ev["ts"].to_list(), strict=True))
    dur_of = dict(zip(ev["event_id"].to_list(), ev["dur"].to_list(), strict=True))
    n = len(program.units)
    ts = np.full(n, -1, dtype=np.int64)
    dur = np.full(n, -1, dtype=np.int64)
    for u in program.units:
        if u.event_id is not None and ts_of.get(u.event_id) is not None:
            ts[u.index] = int(ts_of[u.event_id])
            dur[u.index] = int(dur_of[u.event_id] or 0)
    its = {
        int(i): (int(t), int(t) + int(d))
        for i, t, d in inputs.iterations.select("iteration", "ts", "dur").iter_rows()
    }
    return ts, dur, its


def _gaps(
    program: Program, ts: np.ndarray, dur: np.ndarray, its: dict[int, tuple[int, int]]
) -> tuple[np.ndarray, dict[int | None, int]]:
    """Recorded host time before each unit (after the previous one of its iteration, or after the
    iteration start) and after the last unit of each iteration (its tail)."""
    gap = np.zeros(len(program.units), dtype=np.int64)
    tail: dict[int | None, int] = {}
    prev_end: int | None = None
    prev_it: object = object()
    for u in program.units:
        k = u.index
        if u.iteration != prev_it:
            if prev_end is not None and prev_it in its:
                tail[prev_it] = max(0, its[prev_it][1] - prev_end)  # type: ignore[index]
            prev_it = u.iteration
            prev_end = its[u.iteration][0] if u.iteration in its else None
        if ts[k] >= 0:
            if prev_end is not None:
                gap[k] = max(0, int(ts[k]) - prev_end)
            prev_end = max(prev_end or 0, int(ts[k] + dur[k]))
    if prev_end is not None and prev_it in its:
        tail[prev_it] = max(0, its[prev_it][1] - prev_end)  # type: ignore[index]
    return gap, tail


def _unit_calls(program: Program, schedule: PeerSchedule) -> list[Any]:
    """Per unit of the program, its ``PeerCall`` (None for compute units and unmatched calls)."""
    return [
        schedule.by_event(u.event_id) if u.kind == "comm" and u.event_id is not None else None
        for u in program.units
    ]


def _wait_until(target: int, pc: Any, sleep: bool) -> None:  # noqa: FBT001
    if sleep:
        now = pc()
        if target - now > _SPIN_SLEEP_NS:
            time.sleep((target - now - _SPIN_SLEEP_NS) / 1e9)
    while pc() < target:
        pass


def _sleeps(options: KernelReplayOptions, processes: int) -> bool:
    """``options.wait`` resolved: True when the waits sleep (``KernelReplayOptions.wait``)."""
    if options.wait != "auto":
        return options.wait == "sleep"
    import torch

    threads = options.threads if options.threads is not None else torch.get_num_threads()
    return processes * threads > (os.cpu_count() or 1)


@dataclass
class _Pass:
    T: list[int]
    it_start: dict[Any, int]
    it_end: dict[Any, int]
    wait_ns: int
    wall_ns: int = 0  # the whole call of the pass function


class _Driver:
    """Hooks of the generated pass: iteration boundaries, gaps, communication, substitutes."""

    def __init__(
        self,
        program: Program,
        schedule: PeerSchedule,
        gap: np.ndarray | None,
        tail: dict[int | None, int],
        rec_dur: np.ndarray,
        sync: Any,
        real: RealComm | None = None,
    ) -> None:
        self.program = program
        self.units = program.units
        self.schedule = schedule
        self.gap = gap.tolist() if gap is not None else None
        self.tail = tail
        self.rec_dur = rec_dur.tolist()
        self.sync = sync
        self.real = real
        self.pc = time.perf_counter_ns
        self.buffers: list[Any] = []
        self.pristine: list[Any] | None = None
        self.first: set[int] = set()
        prev: object = object()
        for u in program.units:
            if u.iteration != prev:
                self.first.add(u.index)
                prev = u.iteration
        self.calls = _unit_calls(program, schedule)
        self.quiet_views = False
        self.sleep = False  # KernelReplayOptions.wait
        self.peer_waits = True  # False: communication returns at once (bare-pass comparisons)
        self.lead = self._lead_ns()
        self.reset()

    def _lead_ns(self) -> int:
        """The time from a gap wait's last clock read to the op's start stamp: ``S``
        returning and the stamp's own clock call (tens of ns). ``S`` ends its wait this much
        early, so that the op starts at the recorded gap instead of one hook return after it,
        which a µs op would otherwise pay as machinery every time. The median of 201 hot
        calls, a path that is a little shorter than ``S``'s exit (no compare, one return):
        cold caches only make the real exit longer, so an op is never started early."""
        pc = self.pc

        def last_read() -> int:
            return pc()

        samples = []
        for _ in range(201):
            end = last_read()
            samples.append(pc() - end)
        return int(np.median(samples))

    def reset(self) -> None:
        self.T = [0] * (2 * len(self.units))
        self.it_start: dict[Any, int] = {}
        self.it_end: dict[Any, int] = {}
        self.cur: Any = None
        self.wait_ns = 0

    def B(self, k: int) -> None:
        if self.real is not None:
            self.real.wait_pending()
        if self.cur is not None:
            if self.gap is not None and self.cur in self.tail:
                _wait_until(self.pc() + self.tail[self.cur], self.pc, self.sleep)
            if self.sync is not None:
                self.sync()
            self.it_end[self.cur] = self.pc()
        if k < len(self.units):
            self.cur = self.units[k].iteration
            self.it_start[self.cur] = self.pc()

    def S(self, k: int) -> None:
        g = self.gap[k]  # type: ignore[index]
        if g <= 0:
            return
        base = self.it_start[self.cur] if k in self.first else self.T[2 * k - 1]
        target = base + g - self.lead
        pc = self.pc
        if self.sleep and target - pc() > _SPIN_SLEEP_NS:
            _wait_until(target, pc, self.sleep)
        else:
            while pc() < target:
                pass

    def W(self, k: int) -> None:
        call = self.calls[k]
        if call is None or not self.peer_waits:
            return
        if self.sync is not None:
            self.sync()  # the device work before the call has to be done to "arrive"
        start = self.it_start[self.cur]
        now = self.pc()
        real = self.real
        if real is not None and real.has(k):
            real.run(k)  # the other real ranks: synchronise and transfer for real
            if self.sync is not None:
                self.sync()
            if not real.mixed(k):
                return
        done = start + self.schedule.completion_ns(call, now - start)  # the virtual peers
        now = self.pc()
        if done > now:
            _wait_until(done, self.pc, self.sleep)
            self.wait_ns += done - now

    def SUB(self, k: int) -> None:
        d = self.rec_dur[k]
        if d > 0:
            _wait_until(self.pc() + d, self.pc, self.sleep)

    def run(self, fn: Any, externals: list[Any], mark: str | None = None) -> _Pass:
        """One pass; ``mark``: a ``record_function`` of that name around it (calibration)."""
        import torch

        self.reset()
        self._restore()
        as_strided, es = _view_makers(quiet=self.quiet_views)
        if self.real is not None:  # the real ranks start each pass together
            self.real.barrier()
        args = (externals, self.T, self.pc, self.B, self.S, self.W, self.SUB, as_strided, es)
        with torch.profiler.record_function(mark) if mark is not None else nullcontext():
            t0 = self.pc()
            fn(*args)
            wall = self.pc() - t0
        return _Pass(list(self.T), dict(self.it_start), dict(self.it_end), self.wait_ns, wall)

    def _restore(self) -> None:
        """Every pass starts from the same data (no drift)."""
        if self.pristine is not None:
            for buf, saved in zip(self.buffers, self.pristine, strict=True):
                buf.copy_(saved)  # from host memory onto the device: wait for it to land
            if self.sync is not None:
                self.sync()

    def run_bare(self, fn: Any, externals: list[Any]) -> int:
        """Wall time of one pass of the bare function (``render(timed=False)``): the same
        start (pristine data, the same view makers), no hooks."""
        self._restore()
        as_strided, es = _view_makers(quiet=self.quiet_views)
        args = (externals, None, None, None, None, None, None, as_strided, es)
        t0 = self.pc()
        fn(*args)
        if self.sync is not None:
            self.sync()
        return self.pc() - t0


def _view_makers(*, quiet: bool) -> tuple[Any, Any]:
    """``AS`` and ``ES`` of the generated pass: ``torch.as_strided`` and ``torch.empty_strided``.

    ``quiet``: with ``RecordFunction`` off around them (allocations are still reported to the
    profiler). These calls are the replay's own (the recorded program got its views from
    autograd and its nested buffers inside an op); under the recording's instrumentation each
    would otherwise be a profiled op paying the execution-trace observer's µs.
    """
    import torch

    if not quiet:

        def es(shape: Any, strides: Any, dtype: Any, dev: Any) -> Any:
            return torch.empty_strided(shape, strides, dtype=dtype, device=dev)

        return torch.as_strided, es
    enable = torch._C._autograd._enable_record_function  # a positional-only binding

    def quiet_as(base: Any, size: Any, stride: Any, offset: Any) -> Any:
        enable(False)  # noqa: FBT003
        try:
            return torch.as_strided(base, size, stride, offset)
        finally:
            enable(True)  # noqa: FBT003

    def quiet_es(shape: Any, strides: Any, dtype: Any, dev: Any) -> Any:
        enable(False)  # noqa: FBT003
        try:
            return torch.empty_strided(shape, strides, dtype=dtype, device=dev)
        finally:
            enable(True)  # noqa: FBT003

    return quiet_as, quiet_es


def _profiler(
    options: KernelReplayOptions, trace_dir: Path, *, memory_only: bool, name: str = "replay"
) -> Any:
    import torch
    from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if options.device == "cuda":
        acts.append(ProfilerActivity.CUDA)
    if memory_only:
        return profile(activities=acts, profile_memory=True)
    et = ExecutionTraceObserver().register_callback(str(trace_dir / f"{name}.et.json"))
    del torch
    return profile(
        activities=acts,
        record_shapes=True,
        profile_memory=True,
        with_stack=False,
        execution_trace_observer=et,
    )


def _call_overhead(
    driver: _Driver,
    fn: Any,
    externals: list[Any],
    program: Program,
    options: KernelReplayOptions,
    trace_dir: Path,
    passes: int = 2,
) -> CallOverhead:
    """Per unit, the replay's cost of calling its op outside the op's profiled span, measured in
    ``passes`` calibration passes under the recording's instrumentation."""
    prof = _profiler(options, trace_dir, memory_only=False, name="calibration")
    with profiling(prof):
        cal = [driver.run(fn, externals, mark=PASS_MARK) for _ in range(passes)]
        if driver.sync is not None:
            driver.sync()
    path = trace_dir / "calibration.kineto.json"
    prof.export_chrome_trace(str(path))
    return call_overhead(
        program, [p.T for p in cal], top_level_spans(path), views_profiled=not driver.quiet_views
    )


def _memory_events(prof: Any, trace_dir: Path, device: str) -> pl.DataFrame:
    """Allocator events of a finished profiler (``ts`` on ``time.time_ns``'s clock)."""
    import orjson

    path = trace_dir / "replay.kineto.json"
    prof.export_chrome_trace(str(path))
    doc = orjson.loads(path.read_bytes())
    rows = []
    base = int(doc.get("baseTimeNanoseconds") or 0)  # ts are µs after it (Kineto >= 2024)
    want = "cuda" if device == "cuda" else "cpu"
    for e in doc.get("traceEvents", []):
        if e.get("name") != "[memory]":
            continue
        a = e.get("args", {})
        dev_type = a.get("Device Type")
        kind = "cuda" if dev_type == 1 else "cpu" if dev_type == 0 else str(dev_type)
        if kind != want:
            continue
        rows.append(
            (
                base + round(float(e["ts"]) * 1000),
                int(a.get("Bytes", 0)),
                int(a.get("Total Allocated", 0)),
                int(a.get("Total Reserved", 0)),
                int(a.get("Addr", 0)),
            )
        )
    return pl.DataFrame(
        rows,
        schema={
            "ts": pl.Int64,
            "bytes": pl.Int64,
            "total_allocated": pl.Int64,
            "total_reserved": pl.Int64,
            "addr": pl.Int64,
        },
        orient="row",
    ).sort("ts")

"""Hybrid replay: real kernels for a few ranks, virtual peers for the rest → a ``replayed`` run.

``replay_run`` takes a recorded or sliced run and the ranks to run for real. For each of them it
rebuilds the compute ops from the host ET (``replay.kernels``), executes them on the device, and
replays every communication call from the peers' schedule (``replay.peers``): no data moves to a
virtual peer; the call completes when the emulator's timeline of the same run says the peers
allow (``max(real arrival, peers' arrival) + transfer``), the replay clock being aligned with the
emulated one at each iteration start. The recorded host gaps between ops (Python and framework
time outside any op) are spent as recorded (``gaps="recorded"``), since replaying kernels cannot
reproduce them. The measured run is stored as kind ``replayed`` in the same schema. See
docs/replay.md for the rules and the measured accuracy and overhead.

torch is imported inside the functions that need it, never at module import.
"""

from __future__ import annotations

import gc
import os
import pickle
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import polars as pl
from prism_trace.replay.call_overhead import PASS_MARK, CallOverhead, call_overhead, top_level_spans
from prism_trace.replay.kernels import (
    Program,
    build_program,
    check_program,
    compile_pass,
    external_buffers,
    make_externals,
    select_units,
)
from prism_trace.replay.lifetimes import hold, recorded_frees
from prism_trace.replay.peers import PeerSchedule, _schedule
from prism_trace.replay.real_comm import RealComm, agree, specs_for_rank

from prism_trace.errors import PrismError
from prism_trace.ingest import assign_iteration
from prism_trace.scratch import ram_scratch_dir
from prism_trace.store_write import append, claim_run_name, drop_run, new_run

if TYPE_CHECKING:
    from prism_trace.replay.run import EmulationConfig

    from prism_trace.store import Store

__all__ = ["RankReplay", "ReplayOptions", "ReplayReport", "replay_run", "write_replayed_header"]

_SPIN_SLEEP_NS = 2_000_000
"""Under ``wait="sleep"``, waits longer than this sleep first and spin only the last
``_SPIN_SLEEP_NS``."""


@dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    """How a replay runs; stored in ``run.config_json``.

    Attributes:
        device: ``cpu`` or ``cuda`` (recorded compute devices map to it).
        iterations: measured passes over the recorded iterations.
        warmup: passes before those, not measured.
        substitute_recorded: ops that cannot be rebuilt take their recorded duration instead of
            making the replay fail.
        gaps: ``recorded``: spend the recorded host time between ops (framework and Python work
            no kernel replay reproduces); ``none``: run the ops back to back.
        instrument: ``none``, or ``profiler``: run the measured passes under the recording's
            instrumentation (torch.profiler with shapes and memory, plus an
            ExecutionTraceObserver), whose per-op cost is part of every recorded duration; this
            is how a replay is compared with a profiled recording (docs/replay.md).
        memory: measure peak memory (CPU: allocator events of one profiled pass; CUDA:
            ``torch.cuda.max_memory_allocated``).
        seed: seed of the random tensor data.
        threads: intra-op CPU threads (``torch.set_num_threads``) during the replay; None
            keeps torch's setting. Use the recording's (the bundled generator runs 1 per rank).
        call_overhead: with recorded gaps under ``instrument="profiler"``, measure the
            replay's own cost of calling each op outside the op's profiled span (the
            instrumentation's callbacks: µs per op on CPU) in calibration passes, and
            spend that much less of the recorded gap before the op, which already holds the
            recording's own call cost (``replay.call_overhead``). Without instrumentation the
            call costs about a µs, which no profiler can measure without adding its own.
        recorded_lifetimes: where the recording has allocator events with addresses, free
            each result when the recording's allocator did, if that is after its last use (a
            Python reference the ET does not show held it: ``replay.lifetimes``).
        wait: how the replay waits for a recorded gap or for the virtual peers. ``spin``: on
            the clock, keeping the core busy; ``sleep``: sleep through waits over 2 ms and spin
            only their end, leaving the core to others; ``auto``: spin when every replaying
            process can have cores of its own (ranks x threads <= CPUs), else sleep. A sleep
            lets the core go idle, and on a virtual machine the ops after it ran 1.07-1.19x
            slower (``benchmarks/bench_replay.py --wait sleep``; docs/replay.md).
        together: several selected ranks run together, one process each, and communicate with
            each other through ``torch.distributed`` (gloo on CPU, NCCL on CUDA;
            ``replay.real_comm``); False: one after the other in this process, each seeing the
            others as virtual peers.
        bare_passes: after each of the first this many measured passes, run the *bare* pass:
            the same ops, views, allocations and frees without clock reads, hooks,
            communication or substitutes (``replay.kernels.render``). The difference of the two
            wall times, less the timed pass's communication and substitutes, is what the
            replay's instrumentation costs (``RankReplay.instrumentation_pct_passes``). Needs
            ``gaps="none"`` and ranks replayed alone (a bare pass cannot meet real peers).
    """

    device: Literal["cpu", "cuda"] = "cpu"
    iterations: int = 3
    warmup: int = 1
    substitute_recorded: bool = False
    gaps: Literal["recorded", "none"] = "recorded"
    instrument: Literal["none", "profiler"] = "none"
    memory: bool = True
    seed: int = 0
    threads: int | None = None
    call_overhead: bool = True
    recorded_lifetimes: bool = True
    wait: Literal["auto", "spin", "sleep"] = "auto"
    together: bool = True
    bare_passes: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


@dataclass
class RankReplay:
    """What one rank's replay measured (the stored pass: ``_representative``)."""

    rank: int
    source_rank: int
    support: dict[str, Any]
    iterations: list[int]
    recorded_ns: dict[int, int]
    emulated_ns: dict[int, int]
    passes_ns: list[dict[int, int]]
    representative_ns: dict[int, int] = field(default_factory=dict)
    overhead_pct_passes: list[float] = field(default_factory=list)
    overhead_typical_pct: float = 0.0
    op_ns: int = 0
    comm_ns: int = 0
    gap_ns: int = 0
    overhead_ns: int = 0
    call_overhead: dict[str, int] = field(default_factory=dict)
    wait_lead_ns: int = 0
    # Per bare pass (ReplayOptions.bare_passes): its wall time, the instrumentation's cost, and
    # the op time of the timed pass paired with it (ops back to back, no waits for the peers).
    bare_ns: list[int] = field(default_factory=list)
    paired_op_ns: list[int] = field(default_factory=list)
    instrumentation_pct_passes: list[float] = field(default_factory=list)
    peak_memory: int | None = None
    real_calls: int = 0
    frames: dict[str, pl.DataFrame] = field(default_factory=dict, repr=False)

    @property
    def replayed_ns(self) -> dict[int, int]:
        """Per iteration, the stored duration: that of the representative pass."""
        return self.representative_ns

    @property
    def overhead_pct(self) -> float:
        """Replay machinery time (between units, beyond the recorded gaps) over op time, %."""
        return 100.0 * self.overhead_ns / self.op_ns if self.op_ns else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "rank": self.rank,
            "source_rank": self.source_rank,
            "support": self.support,
            "iterations": [
                {
                    "iteration": i,
                    "recorded_ns": self.recorded_ns.get(i),
                    "emulated_ns": self.emulated_ns.get(i),
                    "replayed_ns": self.replayed_ns[i],
                    "passes_ns": [p[i] for p in self.passes_ns],
                }
                for i in self.iterations
            ],
            "op_ns": self.op_ns,
            "comm_ns": self.comm_ns,
            "gap_ns": self.gap_ns,
            "overhead_ns": self.overhead_ns,
            "overhead_pct": round(self.overhead_pct, 4),
            "overhead_pct_passes": [round(x, 4) for x in self.overhead_pct_passes],
            "overhead_typical_pct": round(self.overhead_typical_pct, 4),
            "call_overhead": self.call_overhead,
            "wait_lead_ns": self.wait_lead_ns,
            "bare_ns": self.bare_ns,
            "paired_op_ns": self.paired_op_ns,
            "instrumentation_pct_passes": [round(x, 4) for x in self.instrumentation_pct_passes],
            "peak_memory": self.peak_memory,
            "real_calls": self.real_calls,
        }


@dataclass
class ReplayReport:
    """What ``replay_run`` did."""

    run: str
    run_id: int
    input_run: str
    device: str
    options: ReplayOptions
    ranks: list[RankReplay]
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "run": self.run,
            "run_id": self.run_id,
            "input_run": self.input_run,
            "device": self.device,
            "options": self.options.as_dict(),
            "ranks": [r.as_dict() for r in self.ranks],
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "notes": self.notes,
        }

    def summary(self) -> str:
        """A few lines for the CLI."""
        lines = [
            f"replayed run {self.run!r} (id {self.run_id}) from {self.input_run!r} on"
            f" {self.device}: ranks {[r.rank for r in self.ranks]}"
        ]
        for r in self.ranks:
            s = r.support
            lines.append(
                f"  rank {r.rank}: {s['supported']}/{s['compute_units']} compute ops rebuilt,"
                f" {s['comm_units']} communication calls; overhead {r.overhead_pct:.2f} % of"
                f" op time; peak memory {r.peak_memory}"
            )
            for u in s["unsupported_ops"]:
                lines.append(f"    unsupported {u['name']} x{u['count']}: {u['reason']}")
            for i in r.iterations:
                rec, rep = r.recorded_ns.get(i), r.replayed_ns[i]
                err = f" ({100.0 * (rep - rec) / rec:+.2f} %)" if rec else ""
                lines.append(
                    f"    iteration {i}: replayed {rep / 1e6:.3f} ms, recorded"
                    f" {(rec or 0) / 1e6:.3f} ms{err}"
                )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- loading ----------------------------------------------------------------


@dataclass
class _RankInputs:
    rank: int
    source_rank: int
    ops: pl.DataFrame
    events: pl.DataFrame  # event_id, ts, dur, category, track_id, iteration
    iterations: pl.DataFrame  # iteration, ts, dur, name (recorded, of the source rank)
    schedule: PeerSchedule
    # Recorded CPU allocator level (``total_allocated`` before the first event) per iteration.
    cpu_levels: dict[int, int] = field(default_factory=dict)
    # The source rank's allocator events with addresses (``replay.lifetimes``).
    allocator: pl.DataFrame = field(default_factory=pl.DataFrame)


def _source_of(store: Store, run_id: int) -> tuple[str, int]:
    line = store.run_ancestry(run_id)
    kind = line[0].kind
    if kind not in ("recorded", "sliced"):
        msg = f"{store.path}: run id {run_id} is {kind}; replay needs a recorded or sliced run"
        raise PrismError(msg)
    return kind, line[1].run_id if kind == "sliced" else run_id


def _load_rank(
    store: Store, run_id: int, source_run: int, rank: int, schedule: PeerSchedule
) -> _RankInputs:
    rows = store.con.execute(
        "SELECT coalesce(represented_by, rank) FROM rank WHERE run_id = ? AND rank = ?",
        [run_id, rank],
    ).fetchall()
    if not rows:
        msg = f"{store.path}: rank {rank} is not in the run"
        raise PrismError(msg)
    src = int(rows[0][0])
    ops = store.con.sql(
        "SELECT o.*, e.iteration FROM et_op o LEFT JOIN event e ON e.run_id = o.run_id"
        " AND e.rank = o.rank AND e.event_id = o.event_id WHERE o.run_id = $1 AND o.rank = $2",
        params=[source_run, src],
    ).pl()
    if ops.is_empty():
        msg = (
            f"{store.path}: rank {src} has no host execution trace (et_op); replay rebuilds ops"
            " from it"
        )
        raise PrismError(msg)
    events = store.con.sql(
        "SELECT event_id, ts, dur, category, track_id, iteration FROM event"
        " WHERE run_id = $1 AND rank = $2",
        params=[source_run, src],
    ).pl()
    iters = store.con.sql(
        "SELECT iteration, ts, dur, name FROM iteration WHERE run_id = $1 AND rank = $2"
        " ORDER BY iteration",
        params=[source_run, src],
    ).pl()
    levels = store.con.execute(
        "SELECT i.iteration, arg_min(m.total_allocated - m.bytes, m.ts)"
        " FROM iteration i JOIN memory m ON m.run_id = i.run_id AND m.rank = i.rank"
        " AND m.ts >= i.ts AND m.ts < i.ts + i.dur"
        " WHERE i.run_id = ? AND i.rank = ? AND m.device_type = 'cpu'"
        " AND m.total_allocated IS NOT NULL GROUP BY i.iteration",
        [source_run, src],
    ).fetchall()
    cpu_levels = {int(i): int(v) for i, v in levels if v is not None}
    allocator = store.con.sql(
        "SELECT ts, addr, bytes, device_type FROM memory"
        " WHERE run_id = $1 AND rank = $2 AND addr IS NOT NULL",
        params=[source_run, src],
    ).pl()
    return _RankInputs(rank, src, ops, events, iters, schedule, cpu_levels, allocator)


# -- one rank ----------------------------------------------------------------


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


def _sleeps(options: ReplayOptions, processes: int) -> bool:
    """``options.wait`` resolved: True when the waits sleep (``ReplayOptions.wait``)."""
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
        self.sleep = False  # ReplayOptions.wait
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
                buf.copy_(saved)

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
    options: ReplayOptions, trace_dir: Path, *, memory_only: bool, name: str = "replay"
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
    options: ReplayOptions,
    trace_dir: Path,
    passes: int = 2,
) -> CallOverhead:
    """Per unit, the replay's cost of calling its op outside the op's profiled span, measured in
    ``passes`` calibration passes under the recording's instrumentation."""
    prof = _profiler(options, trace_dir, memory_only=False, name="calibration")
    with prof:
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


def _replay_rank(
    inputs: _RankInputs, options: ReplayOptions, real: list[int] | None = None
) -> RankReplay:
    """Replay one rank; ``real``: every rank of a multi-process replay (``torch.distributed``
    initialised, this process being ``real.index(inputs.rank)``), None when it runs alone."""
    import torch

    if options.device == "cuda" and not torch.cuda.is_available():
        msg = "--device cuda: no CUDA device is available to this torch"
        raise PrismError(msg)
    dev = _device_map(inputs.ops, options.device)
    comm_events = [c.event_id for c in inputs.schedule.calls if c.event_id is not None]
    units, skipped = select_units(inputs.ops, comm_events)
    if not any(u.kind == "compute" for u in units):
        msg = f"rank {inputs.source_rank}: no compute op to replay in its host ET"
        raise PrismError(msg)
    program = build_program(units, inputs.ops, device=dev, skipped=skipped)
    externals = make_externals(program, dev, seed=options.seed)
    with torch.no_grad():
        bad = check_program(program, externals, dev)
    if bad:
        program = build_program(
            units,
            inputs.ops,
            device=dev,
            skipped=skipped,
            unsupported={**program.unsupported, **bad},
        )
        externals = make_externals(program, dev, seed=options.seed)
    if program.unsupported and not options.substitute_recorded:
        listed = ", ".join(f"{u.name} x{u.count} ({u.reason})" for u in program.unsupported_ops())
        msg = (
            f"rank {inputs.rank}: {len(program.unsupported)} of {program.compute_units} compute"
            f" ops cannot be rebuilt: {listed}; pass --substitute-recorded to use their recorded"
            " durations"
        )
        raise PrismError(msg)
    rec_ts, rec_dur, rec_its = _unit_times(program, inputs)
    held: dict[int, int] = {}
    if options.recorded_lifetimes:
        held = recorded_frees(program, rec_ts, rec_dur, inputs.allocator)
        program = hold(program, held)
    gap, tail = _gaps(program, rec_ts, rec_dur, rec_its)
    use_gaps = options.gaps == "recorded"
    fn = compile_pass(program, gaps=use_gaps, device=dev)
    bare = None
    if options.bare_passes:
        bare = compile_pass(program, gaps=False, device=dev, timed=False)
    sync = torch.cuda.synchronize if options.device == "cuda" else None
    driver = _Driver(program, inputs.schedule, gap if use_gaps else None, tail, rec_dur, sync)
    if real is not None:
        driver.real = _real_comm(inputs.rank, real, driver.calls, options.device)
    driver.quiet_views = options.instrument == "profiler"
    driver.sleep = _sleeps(options, len(real) if real is not None else 1)
    driver.buffers = external_buffers(program, externals)
    driver.pristine = [b.clone() for b in driver.buffers]

    passes: list[_Pass] = []
    mem_rows = pl.DataFrame()
    peak: int | None = None
    gc_was = gc.isenabled()
    flush = torch.set_flush_denormal(True)  # random data must not take denormal slow paths
    # The instrumentation's trace files go to RAM when it can (prism_trace.scratch: disk writes
    # of the ET observer stall profiled ops at random).
    scratch = ram_scratch_dir()
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="prism-replay-", dir=scratch) as tmp:
        trace_dir = Path(tmp)
        for _ in range(options.warmup):
            driver.run(fn, externals)
            if bare is not None:
                driver.run_bare(bare, externals)
        pairs: list[tuple[_Pass, int]] = []
        calls = None
        if use_gaps and options.call_overhead and options.instrument == "profiler":
            calls = _call_overhead(driver, fn, externals, program, options, trace_dir)
            gap = np.maximum(gap - calls.per_unit, 0)
            driver.gap = gap.tolist()
        gc.collect()
        gc.disable()
        try:
            offset = time.time_ns() - time.perf_counter_ns()
            if options.instrument == "profiler":
                prof = _profiler(options, trace_dir, memory_only=False)
                with prof:
                    for _ in range(options.iterations):
                        passes.append(driver.run(fn, externals))
                mem = _memory_events(prof, trace_dir, options.device)
            else:
                for _ in range(options.iterations):
                    if options.device == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    passes.append(driver.run(fn, externals))
                if bare is not None:
                    pairs = _bare_pairs(driver, fn, bare, externals, options.bare_passes)
                mem = None
                if options.memory and options.device == "cpu":
                    prof = _profiler(options, trace_dir, memory_only=True)
                    with prof:
                        mem_pass = driver.run(fn, externals)
                    mem = _memory_events(prof, trace_dir, options.device)
        finally:
            if gc_was:
                gc.enable()
            if flush:
                torch.set_flush_denormal(False)
        rep = _representative(passes, program, together=real is not None)
        if options.instrument == "profiler":
            mem_rows, peak = (
                _memory_in_pass(mem, rep, offset) if mem is not None else (mem_rows, None)
            )
        elif mem is not None:
            mem_rows, peak = _memory_mapped(mem, mem_pass, rep, offset)
        elif options.device == "cuda" and options.memory:
            peak = int(torch.cuda.max_memory_allocated())
    origin = None
    if real is not None:  # one clock for all: the earliest replayed start on the earliest recorded
        import torch.distributed as dist

        starts: list[Any] = [None] * len(real)
        dist.all_gather_object(starts, _first_starts(inputs, program, rep))
        origin = min(r for r, _ in starts) - min(p for _, p in starts)
    result = _result(
        inputs,
        program,
        passes,
        rep,
        gap if use_gaps else None,
        tail,
        mem_rows,
        peak,
        options.device,
        origin,
    )
    result.real_calls = len(driver.real.ops) if driver.real is not None else 0
    result.support["held_by_recording"] = len(held)
    result.wait_lead_ns = driver.lead if use_gaps else 0
    _pair_figures(result, program, pairs)
    if calls is not None:
        result.call_overhead = {
            "ns_per_pass": int(calls.per_unit.sum()),
            "matched_units": calls.matched,
            "units": calls.units,
        }
    return result


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


# -- writing ----------------------------------------------------------------


_COMM_FROM_CALL = {
    "group_id": "coalesce(f.call_group_id, c.group_id)",
    "seq": "coalesce(f.call_seq, c.seq)",
    "msg_bytes": "coalesce(f.call_bytes, c.msg_bytes)",
    "group_size": "coalesce(f.call_size, c.group_size)",
    "peer": "coalesce(f.call_peer, c.peer)",
    "bytes": "coalesce(f.call_bytes, c.bytes)",
}
"""Columns of a replayed call taken from the run's emulated call (``PeerCall``) where it has
them: a sliced run's groups, sequence numbers, peers and rescaled sizes."""


def write_replayed_header(
    con: Any,
    *,
    old_id: int | None,
    out_run: str,
    input_run_id: int,
    config: dict[str, Any],
    ranks: list[int],
    device: str | None = None,
    backend: str | None = None,
) -> int:
    """Inside an open transaction: drop the run being replaced, then write a ``replayed`` run's
    ``run`` row (parent ``input_run_id``), its ranks (copied, ``represented_by`` kept; ``device``
    and ``backend`` replaced when given) and the input run's communicators. Shared by
    ``prism replay`` and ``prism run --out-run`` (``replay.launched_run``).

    Returns:
        The new run's id.
    """
    if old_id is not None:
        drop_run(con, old_id)
    ((world_size, source_format),) = con.execute(
        "SELECT world_size, source_format FROM run WHERE run_id = ?", [input_run_id]
    ).fetchall()
    run_id = new_run(
        con,
        name=out_run,
        kind="replayed",
        parent_run_id=input_run_id,
        world_size=int(world_size),
        source_format=source_format,
        config=config,
    )
    con.execute(
        "INSERT INTO rank (run_id, rank, backend, hostname, pid, device, class_id,"
        " represented_by, tp, cp, ep, dp, pp, et_ops, et_ops_linked, args)"
        " SELECT $1, rank, coalesce($5, backend), hostname, pid, coalesce($3, device), class_id,"
        " coalesce(represented_by, rank), tp, cp, ep, dp, pp, et_ops, et_ops_linked, args"
        " FROM rank WHERE run_id = $2 AND list_contains($4, rank)",
        [run_id, input_run_id, device, ranks, backend],
    )
    con.execute(
        "INSERT INTO comm_group (run_id, group_id, name, description, backend, size, ranks,"
        " axis) SELECT $1, group_id, name, description, backend, size, ranks, axis"
        " FROM comm_group WHERE run_id = $2",
        [run_id, input_run_id],
    )
    return run_id


def _write(
    store: Store,
    *,
    input_run_id: int,
    source_run_id: int,
    out_run: str,
    old_id: int | None,
    results: list[RankReplay],
    config: dict[str, Any],
    device_name: str,
) -> int:
    with store.transaction() as con:
        run_id = write_replayed_header(
            con,
            old_id=old_id,
            out_run=out_run,
            input_run_id=input_run_id,
            config=config,
            ranks=[r.rank for r in results],
            device=device_name,
        )
        for r in results:
            con.execute(
                "INSERT INTO track (run_id, rank, track_id, kind, pid, tid, name)"
                " SELECT $1, $2, track_id, kind, pid, tid, name FROM track"
                " WHERE run_id = $3 AND rank = $4",
                [run_id, r.rank, source_run_id, r.source_rank],
            )
            f = r.frames
            lit = pl.lit(run_id, pl.Int32).alias("run_id")
            append(con, "event", f["event"].with_columns(lit))
            append(con, "iteration", f["iteration"].with_columns(lit))
            if not f["memory"].is_empty():
                append(con, "memory", f["memory"].with_columns(lit))
            if not f["comm"].is_empty():
                con.register("_replay_comm", f["comm"].to_arrow())
                try:
                    for table, cols in (
                        (
                            "collective",
                            "group_id, seq, kind, dtype, in_bytes, out_bytes, msg_bytes,"
                            " group_size, iteration",
                        ),
                        (
                            "p2p",
                            "group_id, seq, direction, peer, bytes, tag, dtype, iteration",
                        ),
                    ):
                        sel = ", ".join(
                            _COMM_FROM_CALL.get(c.strip(), f"c.{c.strip()}")
                            for c in cols.split(",")
                        )
                        con.execute(
                            f"INSERT INTO {table} (run_id, rank, event_id, host_ts, host_dur,"
                            f" {cols}) SELECT $1, $2, f.new_event_id, f.host_ts, f.host_dur, {sel}"
                            f" FROM {table} c JOIN _replay_comm f ON c.event_id = f.src_event_id"
                            " WHERE c.run_id = $3 AND c.rank = $4",
                            [run_id, r.rank, source_run_id, r.source_rank],
                        )
                finally:
                    con.unregister("_replay_comm")
    return run_id


# -- several ranks together -----------------------------------------------------

_TOGETHER_TIMEOUT_S = 300
"""How long a real rank waits for the others in one ``torch.distributed`` call before the replay
fails (their calls are checked against each other first, so this only catches a dead process)."""


def _real_comm(rank: int, real: list[int], calls: list[Any], device: str) -> RealComm:
    """This process's real communication, agreed with the other real ranks' processes."""
    import torch.distributed as dist

    specs = specs_for_rank([(k, c) for k, c in enumerate(calls) if c is not None], rank, real)
    every: list[Any] = [None] * len(real)
    dist.all_gather_object(every, specs)
    ops, subgroups = agree(dict(zip(real, every, strict=True)))
    return RealComm(rank, real, ops[rank], subgroups, device)


def _together_worker(index: int, tmp: str) -> None:
    """One real rank of a multi-process replay (``torch.multiprocessing.spawn`` target)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    d = Path(tmp)
    inputs, options, real = pickle.loads((d / f"inputs-{index}.pkl").read_bytes())
    try:
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        torch.manual_seed(options.seed)
        backend = "gloo"
        if options.device == "cuda":
            if torch.cuda.device_count() < len(real):
                msg = (
                    f"--device cuda with {len(real)} ranks together needs {len(real)} GPUs,"
                    f" {torch.cuda.device_count()} visible; replay them one by one instead"
                )
                raise PrismError(msg)
            torch.cuda.set_device(index)
            backend = "nccl"
        dist.init_process_group(
            backend,
            init_method=(d / "rendezvous").as_uri(),
            rank=index,
            world_size=len(real),
            timeout=timedelta(seconds=_TOGETHER_TIMEOUT_S),
        )
        try:
            result = _replay_rank(inputs, options, real=real)
        finally:
            dist.destroy_process_group()
        (d / f"result-{index}.pkl").write_bytes(pickle.dumps(result))
    except PrismError as e:
        (d / f"error-{index}.txt").write_text(str(e))
        raise SystemExit(1) from None
    except Exception as e:  # a crash of one rank: its one line, then the others are stopped
        (d / f"error-{index}.txt").write_text(f"rank {inputs.rank}: {type(e).__name__}: {e}")
        raise SystemExit(1) from None


def _replay_together(inputs: list[_RankInputs], options: ReplayOptions) -> list[RankReplay]:
    """Replay the ranks as processes that run together (one each) and talk for real."""
    import torch.multiprocessing as mp

    real = [i.rank for i in inputs]
    with tempfile.TemporaryDirectory(prefix="prism-replay-together-") as tmp:
        d = Path(tmp)
        for k, i in enumerate(inputs):
            (d / f"inputs-{k}.pkl").write_bytes(pickle.dumps((i, options, real)))
        try:
            mp.spawn(_together_worker, args=(tmp,), nprocs=len(inputs), join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            # The process that failed first has the cause; the others saw their peer vanish.
            first = d / f"error-{e.error_index}.txt"
            errors = [first] if first.exists() else sorted(d.glob("error-*.txt"))
            msg = errors[0].read_text() if errors else f"a replay process failed: {e}"
            raise PrismError(msg) from None
        return [pickle.loads((d / f"result-{k}.pkl").read_bytes()) for k in range(len(inputs))]


# -- the entry point ----------------------------------------------------------------


def replay_run(
    store: Store,
    *,
    run: str,
    ranks: list[int],
    out_run: str,
    options: ReplayOptions | None = None,
    replace: bool = False,
    config: EmulationConfig | None = None,
) -> ReplayReport:
    """Replay ``ranks`` of ``run`` with real kernels and virtual peers; store a ``replayed`` run.

    Several selected ranks run together by default, one process each: their communication with
    each other goes through ``torch.distributed`` (``replay.real_comm``), and every other rank is
    a virtual peer whose timing comes from the emulation of ``run``. With
    ``options.together=False`` (or one rank) they run in this process one after the other, each
    seeing the others as virtual peers too.

    Args:
        store: an open, writable store.
        run: a recorded or sliced run whose ranks (or their representatives) have host ETs.
        ranks: the ranks to replay for real.
        out_run: name of the new run (kind ``replayed``, parent ``run``).
        options: how to replay (``ReplayOptions``).
        replace: overwrite an existing replayed run of that name.
        config: the emulation config for the virtual peers.

    Returns:
        What was measured and written.

    Raises:
        PrismError: no such run or rank, a rank without host ET, ops that cannot be rebuilt
            (without ``substitute_recorded``), no CUDA device for ``device="cuda"``.
    """
    import torch

    t0 = time.perf_counter()
    options = options or ReplayOptions()
    if not ranks:
        msg = "replay needs at least one rank (--ranks)"
        raise PrismError(msg)
    if out_run == run:
        msg = f"{store.path}: --out-run {out_run!r} is the input run itself; choose a new name"
        raise PrismError(msg)
    if options.iterations < 1 or options.warmup < 0:
        msg = "--iterations must be >= 1 and --warmup >= 0"
        raise PrismError(msg)
    if options.bare_passes and (
        options.gaps != "none"
        or options.instrument != "none"
        or (options.together and len(ranks) > 1)
    ):
        msg = (
            "bare passes measure the instrumentation against the ops alone: they need"
            " gaps='none', instrument='none' and ranks replayed alone (together=False)"
        )
        raise PrismError(msg)
    old_id = claim_run_name(store, out_run, replace=replace, over=("replayed",))
    run_id = store.require_run(run)
    _, source_run = _source_of(store, run_id)
    # One emulation; each rank replayed alone sees every other rank, selected or not, as virtual.
    from prism_trace.replay.run import emulate_in_memory

    res, iters = emulate_in_memory(store, run=run, config=config)
    together = options.together and len(ranks) > 1
    schedules = {
        r: _schedule(store, res, iters, run=run, rank=r, real=list(ranks) if together else [r])
        for r in ranks
    }
    inputs = [_load_rank(store, run_id, source_run, r, schedules[r]) for r in ranks]
    t_load = time.perf_counter() - t0
    torch.manual_seed(options.seed)
    threads = torch.get_num_threads()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    try:
        if together:
            results = _replay_together(inputs, options)
        else:
            results = [_replay_rank(i, options) for i in inputs]
    finally:
        torch.set_num_threads(threads)
    t_replay = time.perf_counter() - t0 - t_load
    device_name = torch.cuda.get_device_name() if options.device == "cuda" else "cpu"
    cfg = {
        "input_run": run,
        "ranks": list(ranks),
        "replay": options.as_dict(),
        "emulation": config.as_dict() if config is not None else None,
        "torch_version": torch.__version__,
        "per_rank": [r.as_dict() for r in results],
    }
    out_id = _write(
        store,
        input_run_id=run_id,
        source_run_id=source_run,
        out_run=out_run,
        old_id=old_id,
        results=results,
        config=cfg,
        device_name=device_name,
    )
    notes = []
    if together:
        n_real = sum(r.real_calls for r in results)
        backend = "nccl" if options.device == "cuda" else "gloo"
        notes.append(
            f"ranks ran together, one process each; {n_real} of their communication calls"
            f" (counted per rank) went through torch.distributed ({backend})"
        )
    elif len(ranks) > 1:
        notes.append(
            "ranks were replayed one after the other in one process; each sees the others as"
            " virtual peers"
        )
    return ReplayReport(
        run=out_run,
        run_id=out_id,
        input_run=run,
        device=device_name,
        options=options,
        ranks=results,
        seconds={
            "load": t_load,
            "replay": t_replay,
            "total": time.perf_counter() - t0,
        },
        notes=notes,
    )

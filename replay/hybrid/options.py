"""What a hybrid replay is asked for (``KernelReplayOptions``) and what it returns (its reports)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import polars as pl
from prism_trace.replay.emulate.config import MAX_SEED

from prism_trace.errors import ConfigError

__all__ = [
    "MAX_PASSES",
    "MAX_THREADS",
    "KernelReplayOptions",
    "RankReplay",
    "ReplayOptionsError",
    "ReplayReport",
]


MAX_PASSES = 1000
"""The most measured (``iterations``) or warmup passes a replay runs. Each pass replays every
recorded iteration with real kernels, as long as the recording took; the default is 3, and a
few dozen already settle the spread. ``--iterations 1000000000`` ran for ever."""

MAX_THREADS = 4096
"""The most intra-op CPU threads (``torch.set_num_threads``): more than any machine has."""


class ReplayOptionsError(ConfigError):
    """A value ``KernelReplayOptions`` refuses (one line naming the option)."""


def _check_int(value: object, name: str, lo: int, hi: int) -> None:
    """Refuse ``value`` unless it is a whole number in ``[lo, hi]`` (bools are refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        msg = f"{name} must be a whole number in [{lo}, {hi}], got {value!r}"
        raise ReplayOptionsError(msg)


_SPIN_SLEEP_NS = 2_000_000
"""Under ``wait="sleep"``, waits longer than this sleep first and spin only the last
``_SPIN_SLEEP_NS``."""


@dataclass(frozen=True, kw_only=True)
class KernelReplayOptions:
    """How a replay runs; stored in ``run.config_json``.

    Attributes:
        device: ``cpu`` or ``cuda`` (recorded compute devices map to it).
        iterations: measured passes over the recorded iterations (1 to ``MAX_PASSES``).
        warmup: passes before those, not measured (0 to ``MAX_PASSES``).
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
            recording's own call cost (``replay.hybrid.call_overhead``). Without instrumentation the
            call costs about a µs, which no profiler can measure without adding its own.
        recorded_lifetimes: where the recording has allocator events with addresses, free
            each result when the recording's allocator did, if that is after its last use (a
            Python reference the ET does not show held it: ``replay.memory.lifetimes``).
        wait: how the replay waits for a recorded gap or for the virtual peers. ``spin``: on
            the clock, keeping the core busy; ``sleep``: sleep through waits over 2 ms and spin
            only their end, leaving the core to others; ``auto``: spin when every replaying
            process can have cores of its own (ranks x threads <= CPUs), else sleep. A sleep
            lets the core go idle, and on a virtual machine the ops after it ran 1.07-1.19x
            slower (``benchmarks/bench_replay.py --wait sleep``; docs/replay.md).
        together: several selected ranks run together, one process each, and communicate with
            each other through ``torch.distributed`` (gloo on CPU, NCCL on CUDA;
            ``replay.hybrid.real_comm``); False: one after the other in this process, each seeing
            the others as virtual peers.
        bare_passes: after each of the first this many measured passes, run the *bare* pass:
            the same ops, views, allocations and frees without clock reads, hooks,
            communication or substitutes (``replay.kernels.codegen.render``). The difference of
            the two wall times, less the timed pass's communication and substitutes, is what the
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

    def __post_init__(self) -> None:
        _check_int(self.iterations, "iterations", 1, MAX_PASSES)
        _check_int(self.warmup, "warmup", 0, MAX_PASSES)
        _check_int(self.bare_passes, "bare_passes", 0, MAX_PASSES)
        _check_int(self.seed, "seed", 0, MAX_SEED)
        if self.threads is not None:
            _check_int(self.threads, "threads", 1, MAX_THREADS)

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
    # Per bare pass (KernelReplayOptions.bare_passes): its wall time, the instrumentation's cost,
    # and the op time of the timed pass paired with it (ops back to back, no waits for the peers).
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
    options: KernelReplayOptions
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

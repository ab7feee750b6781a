"""Validation: how close emulated iteration times come to a fully recorded run's.

Two checks on a run whose ranks were all recorded: *replay fidelity* (emulate the graphs of every
recorded rank) and *slice fidelity* (slice the run from a few ranks to its own layout with
``prism_trace.slicing.slicer.slice_run``, emulate the full world from the classes, compare).
Nothing is left in the store: the temporary sliced run is deleted again.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.driver import emulate_in_memory, temporary_slice
from prism_trace.replay.emulate.run_memory import rank_peaks
from prism_trace.replay.validate.compare import (
    IterationError,
    RankPeak,
    _compare,
    _compare_memory,
    _max_rank,
    _mean_abs,
    _mean_time_error,
    _mem_mean,
)
from prism_trace.replay.validate.inside_step import InsideStep, inside_step
from prism_trace.replay.whatif.config import VarianceMode, WhatIfConfig

from prism_trace.errors import PrismError, RunStateError
from prism_trace.layout.choice import infer_layout
from prism_trace.layout.mesh import ParallelAxis
from prism_trace.query.steps import WHOLE_TRACE, step_windows

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["ValidationReport", "validate_run"]


@dataclass
class ValidationReport:
    """What ``validate_run`` measured."""

    run: str
    world_size: int
    layout: str | None
    slice_ranks: list[int] | None
    replay: list[IterationError]
    slice: list[IterationError] | None
    replay_memory: list[RankPeak] | None = None
    slice_memory: list[RankPeak] | None = None
    variance: list[IterationError] | None = None
    variance_mode: str | None = None
    variance_seeds: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    replay_inside: InsideStep | None = None  # op starts and communication time, replay
    slice_inside: InsideStep | None = None  # the same for the slice's emulated exemplars

    @property
    def replay_iteration_time_error_pct(self) -> float | None:
        """Mean over iterations of ``|error_pct|`` of the replay from every recorded rank."""
        return _mean_abs(self.replay)

    @property
    def slice_iteration_time_error_pct(self) -> float | None:
        """Mean over iterations of ``|error_pct|`` of the emulation from the sliced run."""
        return _mean_abs(self.slice)

    @property
    def slice_mean_iteration_time_error_pct(self) -> float | None:
        """Signed error of the sliced emulation's mean iteration time over all iterations."""
        return _mean_time_error(self.slice)

    @property
    def variance_iteration_time_error_pct(self) -> float | None:
        """Mean over iterations of ``|error_pct|`` of the sliced emulation in variance mode
        (each iteration's emulated time averaged over the seeds)."""
        return _mean_abs(self.variance)

    @property
    def variance_mean_iteration_time_error_pct(self) -> float | None:
        """Signed error of the variance-mode mean iteration time over all iterations."""
        return _mean_time_error(self.variance)

    @property
    def peak_memory_error_pct(self) -> float | None:
        """Mean over ranks of ``|error|`` of the replayed peak memory (None: no memory events)."""
        return _mem_mean(self.replay_memory)

    @property
    def slice_peak_memory_error_pct(self) -> float | None:
        """Mean over ranks of ``|error|`` of the peak memory emulated from the sliced run."""
        return _mem_mean(self.slice_memory)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (memory errors are null when the run has no memory events)."""

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {
            "run": self.run,
            "world_size": self.world_size,
            "layout": self.layout,
            "slice_ranks": self.slice_ranks,
            "replay_iteration_time_error_pct": r(self.replay_iteration_time_error_pct),
            "replay_max_rank_error_pct": r(_max_rank(self.replay)),
            "slice_iteration_time_error_pct": r(self.slice_iteration_time_error_pct),
            "slice_max_rank_error_pct": r(_max_rank(self.slice)),
            "slice_mean_iteration_time_error_pct": r(self.slice_mean_iteration_time_error_pct),
            "variance_mode": self.variance_mode,
            "variance_seeds": self.variance_seeds,
            "variance_iteration_time_error_pct": r(self.variance_iteration_time_error_pct),
            "variance_mean_iteration_time_error_pct": r(
                self.variance_mean_iteration_time_error_pct
            ),
            "peak_memory_error_pct": r(self.peak_memory_error_pct),
            "slice_peak_memory_error_pct": r(self.slice_peak_memory_error_pct),
            **_inside_dict(self.replay_inside, "replay"),
            **_inside_dict(self.slice_inside, "slice"),
            "replay": [e.as_dict() for e in self.replay],
            "slice": None if self.slice is None else [e.as_dict() for e in self.slice],
            "variance": None if self.variance is None else [e.as_dict() for e in self.variance],
            "replay_memory": None
            if self.replay_memory is None
            else [e.as_dict() for e in self.replay_memory],
            "slice_memory": None
            if self.slice_memory is None
            else [e.as_dict() for e in self.slice_memory],
            "notes": self.notes,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }

    def summary(self) -> str:
        """A few lines for the CLI."""

        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.4f} %"

        lines = [
            f"validation of {self.run!r} ({self.world_size} ranks, "
            + (
                f"layout {self.layout}):"
                if self.layout is not None
                else "layout not inferred, so no slice check: see the note):"
            ),
            "  replay from all recorded ranks: mean |error|"
            f" {pct(self.replay_iteration_time_error_pct)}"
            f" over {len(self.replay)} iterations (worst rank {pct(_max_rank(self.replay))})",
        ]
        if self.slice is not None:
            lines.append(
                f"  sliced from ranks {self.slice_ranks}: mean |error|"
                f" {pct(self.slice_iteration_time_error_pct)} (worst rank"
                f" {pct(_max_rank(self.slice))}); mean iteration"
                f" {pct(self.slice_mean_iteration_time_error_pct)}"
            )
        if self.variance is not None:
            lines.append(
                f"  sliced, variance mode ({self.variance_mode}, {self.variance_seeds} seeds):"
                f" mean |error| {pct(self.variance_iteration_time_error_pct)}; mean iteration"
                f" {pct(self.variance_mean_iteration_time_error_pct)}"
            )
        for label, inside in (("replay", self.replay_inside), ("slice", self.slice_inside)):
            if inside is not None:
                lines.append(
                    f"  inside the step ({label}): op start |error| p50"
                    f" {pct(inside.op_start_error_p50_pct)}, p99"
                    f" {pct(inside.op_start_error_p99_pct)} of the iteration over {inside.ops} ops;"
                    f" communication time {pct(inside.comm_time_error_pct)}"
                )
        if self.replay_memory is None:
            lines.append("  peak memory: n/a (no memory events recorded)")
        else:
            lines.append(
                f"  peak memory: replay mean |error| {pct(self.peak_memory_error_pct)}"
                + (
                    f", sliced {pct(self.slice_peak_memory_error_pct)}"
                    if self.slice_memory is not None
                    else ""
                )
                + f" over {len(self.replay_memory)} ranks"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _inside_dict(inside: InsideStep | None, prefix: str) -> dict[str, Any]:
    """The inside-step figures for the report; all null when that check did not run."""
    if inside is None:
        return InsideStep(None, None, None, 0).as_dict(prefix)
    return inside.as_dict(prefix)


def _symmetric_copies(store: Store, run: str, ranks: list[int]) -> int:
    """How many unrecorded ranks copy a recorded TP/CP peer (0 without a layout)."""
    from prism_trace.layout.symmetry import symmetric_partners

    try:
        layout = infer_layout(store, run)
    except PrismError:
        return 0
    return int(symmetric_partners(layout, ranks)[0].size)


def validate_run(
    store: Store,
    *,
    run: str,
    slice_ranks: list[int] | None = None,
    config: EmulationConfig | None = None,
    variance: VarianceMode | None = None,
    seeds: int = 5,
    allow_partial: bool = False,
) -> ValidationReport:
    """Measure emulation fidelity on a run whose every rank was recorded.

    (a) Replay: emulate the graphs of all recorded ranks and compare each rank's iteration
    durations with the recorded ones (the ``iteration`` table). (b) Slice: slice the run from
    ``slice_ranks`` to its own inferred layout (``slice_run``), emulate the full world from the
    class exemplars, compare the same way; the sliced run is deleted afterwards. Errors are per
    iteration on the mean over ranks, then averaged (absolute) over iterations.

    Args:
        store: an open store; writable for the slice check (and to build a missing graph).
        run: a recorded run with every rank of its world recorded.
        slice_ranks: ranks to slice from (default: the ranks with data-parallel coordinate 0
            under the inferred layout, i.e. one replica).
        config: the emulation config for both checks (its what-ifs are ignored: validation
            compares with the recording as it happened).
        variance: also emulate the slice in this variance mode (``replay.whatif``), once per
            seed ``0 .. seeds-1``, and compare the per-iteration mean over seeds.
        seeds: number of seeds of the variance check.
        allow_partial: a run missing ranks is replayed from the ranks it has (collectives and
            sends resolved over the participants present, ``CompletionConfig.allow_partial``) and
            compared on those ranks; the slice check is skipped.

    Returns:
        The per-iteration errors of both checks.

    Raises:
        RunNotFoundError: no such run.
        RunStateError: not a recorded run, ranks missing, or no iterations recorded.
    """
    t0 = time.perf_counter()
    config = dataclasses.replace(config or EmulationConfig(), what_if=WhatIfConfig())
    run_id = store.require_run(run)
    ((kind, world),) = store.con.execute(
        "SELECT kind, world_size FROM run WHERE run_id = ?", [run_id]
    ).fetchall()
    if kind != "recorded":
        msg = f"{store.path}: run {run!r} is {kind}; validation needs a recorded run"
        raise RunStateError(msg)
    ranks = [
        r
        for (r,) in store.con.execute(
            "SELECT rank FROM rank WHERE run_id = ? ORDER BY rank", [run_id]
        ).fetchall()
    ]
    world = int(world or len(ranks))
    notes: list[str] = []
    partial = False
    if len(ranks) != world:
        copies = _symmetric_copies(store, run, ranks)
        if len(ranks) + copies == world:
            notes.append(
                f"{copies} unrecorded ranks are TP/CP peers of recorded ones (copies);"
                f" compared on the {len(ranks)} recorded ranks"
            )
        elif not allow_partial:
            msg = (
                f"{store.path}: run {run!r} recorded {len(ranks)} of {world} ranks; validation"
                " needs every rank as ground truth, or one per TP/CP group (--partial"
                " replays the recorded ones)"
            )
            raise RunStateError(msg)
        else:
            partial = True
    if partial:
        config = dataclasses.replace(
            config, completion=dataclasses.replace(config.completion, allow_partial=True)
        )
    rec_peaks = store.con.sql(
        "SELECT rank, max(total_allocated)::BIGINT AS peak FROM memory WHERE run_id = $1"
        " GROUP BY rank",
        params=[run_id],
    ).pl()

    res, emulated = emulate_in_memory(store, run=run, config=config)
    # After the emulation, which built the graph if the run had none: a trace without steps is
    # compared over the ops the emulation replays.
    recorded = step_windows(store.con, run_id)
    if recorded.is_empty():
        msg = f"{store.path}: run {run!r} has no timed ops to compare with"
        raise RunStateError(msg)
    if (recorded["iteration"] == WHOLE_TRACE).all():
        notes.append(
            "no steps recorded (no ProfilerStep): compared on the whole trace, one window per"
            " rank from its first op to its last"
        )
    replay = _compare(emulated, recorded)
    replay_memory = _compare_memory(rank_peaks(res), rec_peaks)
    replay_inside = inside_step(res, recorded, emulated)
    slice_inside: InsideStep | None = None
    slice_memory: list[RankPeak] | None = None
    t_replay = time.perf_counter() - t0

    layout_spec: str | None = None
    sliced: list[IterationError] | None = None
    variance_errors: list[IterationError] | None = None
    layout = None
    if partial:
        notes.append(
            f"{len(ranks)} of {world} ranks recorded: replayed with partial instances;"
            " slice check skipped"
        )
    else:
        try:
            layout = infer_layout(store, run)
            layout_spec = layout.spec
        except PrismError as exc:
            notes.append(f"slice check skipped: no layout ({exc})")
    if layout is not None and slice_ranks is None:
        dp = layout.coords(np.asarray(ranks))[ParallelAxis.DP]
        slice_ranks = [r for r, d in zip(ranks, dp.tolist(), strict=True) if d == 0]
    if layout is not None and store.read_only:
        notes.append("slice check skipped: the store is read-only")
    elif layout is not None:
        try:
            with temporary_slice(
                store, run=run, layout=layout, from_ranks=slice_ranks, name=f"_validate_{run}_slice"
            ) as tmp:
                res_s, emulated_s = emulate_in_memory(store, run=tmp, config=config)
                sliced = _compare(emulated_s, recorded)
                slice_memory = _compare_memory(rank_peaks(res_s), rec_peaks)
                slice_inside = inside_step(res_s, recorded, emulated_s)
                if variance is not None:
                    draws = []
                    for seed in range(seeds):
                        cfg = dataclasses.replace(
                            config,
                            what_if=WhatIfConfig(variance=True, variance_mode=variance),
                            seed=seed,
                        )
                        draws.append(emulate_in_memory(store, run=tmp, config=cfg)[1])
                    mean = pl.concat(draws).group_by("rank", "iteration").agg(pl.col("dur").mean())
                    variance_errors = _compare(mean, recorded)
        except PrismError as exc:
            notes.append(f"slice check failed: {exc}")
    return ValidationReport(
        run=run,
        world_size=world,
        layout=layout_spec,
        slice_ranks=slice_ranks,
        replay=replay,
        slice=sliced,
        replay_memory=replay_memory,
        slice_memory=slice_memory,
        variance=variance_errors,
        variance_mode=variance,
        variance_seeds=seeds if variance_errors is not None else 0,
        notes=notes,
        seconds={"replay": t_replay, "total": time.perf_counter() - t0},
        replay_inside=replay_inside,
        slice_inside=slice_inside,
    )

"""Validation inside the step: where the emulated timeline departs from the recording.

An exact iteration time can hide a wrong timeline: a kernel that starts 30 ms early behind an
NCCL kernel it waited for, compensated elsewhere, or a host-bound job whose device timeline is
not on the critical path. Two figures look inside:

- **op start error**: per op, ``|emulated start - recorded start|`` as a share of its rank's
  recorded iteration time (the iteration the op belongs to; the rank's mean iteration when it
  has none). Both starts are taken from the start of the op's iteration (emulated and recorded
  respectively) when the op has one, so that an error in one step's length shows once, in the
  step where it happens, not again in every later op. Device ops (kernels, copies, memsets)
  where a rank has any; otherwise its host ops (op timelines: their compute ops, whose kind is
  ``kernel``; CPU-only traces: host ops). Reported as the 50th and 99th percentile over all ops.
- **communication time error**: per rank, the total time of its communication sync nodes (the
  kernel of a collective where there is one, else the communication op) emulated against
  recorded, ``|emu - rec| / rec``, averaged over ranks.

Only emulated units are compared (every rank in a replay; the class exemplars in a slice, whose
nodes are their representatives' recorded nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

if TYPE_CHECKING:
    from prism_trace.replay.emulate.values import EmulationResult

__all__ = ["InsideStep", "inside_step"]

_DEVICE = ("kernel", "memcpy", "memset")


@dataclass(frozen=True)
class InsideStep:
    """What ``inside_step`` measured (percentages; None where nothing was comparable)."""

    op_start_error_p50_pct: float | None
    op_start_error_p99_pct: float | None
    comm_time_error_pct: float | None
    ops: int

    def as_dict(self, prefix: str) -> dict[str, Any]:
        """``{prefix}_op_start_error_p50_pct``, ... for the validation report."""

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {
            f"{prefix}_op_start_error_p50_pct": r(self.op_start_error_p50_pct),
            f"{prefix}_op_start_error_p99_pct": r(self.op_start_error_p99_pct),
            f"{prefix}_comm_time_error_pct": r(self.comm_time_error_pct),
        }


def inside_step(
    res: EmulationResult, recorded_iterations: pl.DataFrame, emulated_iterations: pl.DataFrame
) -> InsideStep:
    """Op-start and communication-time errors of an emulation against its recording.

    Args:
        res: an emulation (``replay.emulate``) of a recorded run or of a slice of one.
        recorded_iterations: ``rank, iteration, ts, dur`` of the recorded run.
        emulated_iterations: ``rank, iteration, ts`` of the emulation (every rank of its world).
    """
    inputs, tl = res.inputs, res.timeline
    unit_rank = pl.Series(inputs.unit_rank.astype(np.int64))
    it_t = inputs.nodes.schema["iteration"]
    nodes = inputs.nodes.select(
        "idx",
        "kind",
        "ts",
        "iteration",
        pl.col("source_rank").cast(pl.Int64).alias("src_rank"),
        pl.col("unit")
        .replace_strict(pl.Series(range(unit_rank.len())), unit_rank, return_dtype=pl.Int64)
        .alias("unit_rank"),
    ).with_columns(pl.Series("emu", tl.start + inputs.origin))
    emu_it = emulated_iterations.select(
        pl.col("rank").cast(pl.Int64).alias("unit_rank"),
        pl.col("iteration").cast(it_t),
        pl.col("ts").alias("emu_it_ts"),
    )
    has_dev = nodes.group_by("src_rank").agg(pl.col("kind").is_in(_DEVICE).any().alias("dev"))
    rec = recorded_iterations.select(
        pl.col("rank").cast(pl.Int64).alias("src_rank"),
        pl.col("iteration").cast(it_t),
        pl.col("ts").alias("rec_it_ts"),
        pl.col("dur").cast(pl.Float64).alias("it"),
    )
    mean_it = rec.group_by("src_rank").agg(pl.col("it").mean().alias("mean_it"))
    ops = (
        nodes.filter(pl.col("ts").is_not_null())
        .join(has_dev, on="src_rank")
        .filter(pl.col("kind").is_in(_DEVICE) == pl.col("dev"))
        .join(rec, on=["src_rank", "iteration"], how="left")
        .join(emu_it, on=["unit_rank", "iteration"], how="left")
        .join(mean_it, on="src_rank", how="left")
        .with_columns(
            pl.coalesce("it", "mean_it").alias("it"),
            # from the op's iteration start where both are known, else on the run clock
            (pl.col("emu") - pl.col("emu_it_ts").fill_null(0)).alias("emu"),
            (
                pl.col("ts")
                - pl.when(pl.col("emu_it_ts").is_not_null())
                .then(pl.col("rec_it_ts"))
                .otherwise(0)
                .fill_null(0)
            ).alias("ts"),
        )
        .filter(pl.col("it") > 0)
    )
    err = ((ops["emu"] - ops["ts"]).abs() / ops["it"] * 100.0).to_numpy()
    p50 = float(np.percentile(err, 50)) if err.size else None
    p99 = float(np.percentile(err, 99)) if err.size else None

    sync = res.sync.select(pl.col("sync_idx").unique())
    comm: float | None = None
    if sync.height:
        idx = sync["sync_idx"].to_numpy().astype(np.int64)
        per = (
            pl.DataFrame(
                {
                    "unit": inputs.nodes["unit"].to_numpy()[idx],
                    "rec": inputs.nodes["dur"].fill_null(0).to_numpy()[idx].astype(np.float64),
                    "emu": (tl.end[idx] - tl.start[idx]).astype(np.float64),
                }
            )
            .group_by("unit")
            .agg(pl.col("rec").sum(), pl.col("emu").sum())
            .filter(pl.col("rec") > 0)
        )
        if per.height:
            comm = 100.0 * float(((per["emu"] - per["rec"]).abs() / per["rec"]).mean() or 0.0)  # type: ignore[arg-type]
    return InsideStep(p50, p99, comm, int(err.size))

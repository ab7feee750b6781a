"""Recorded against emulated or replayed: per-iteration time errors and per-rank peak memory.

The comparisons and the figures both validations report (``validate.emulated`` for emulated
runs, ``validate.replayed`` for replayed ones), so the two measure error the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

__all__ = ["IterationError", "RankPeak"]


@dataclass(frozen=True)
class IterationError:
    """One iteration: recorded and emulated time (mean over ranks) and the error.

    Attributes:
        iteration: the step.
        recorded_ns: mean over ranks of the recorded iteration duration.
        emulated_ns: mean over ranks of the emulated iteration duration.
        error_pct: ``100 * (emulated - recorded) / recorded`` (signed).
        max_rank_error_pct: the largest ``|error|`` of one rank's iteration, percent.
    """

    iteration: int
    recorded_ns: float
    emulated_ns: float
    error_pct: float
    max_rank_error_pct: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "iteration": self.iteration,
            "recorded_ns": round(self.recorded_ns, 1),
            "emulated_ns": round(self.emulated_ns, 1),
            "error_pct": round(self.error_pct, 6),
            "max_rank_error_pct": round(self.max_rank_error_pct, 6),
        }


@dataclass(frozen=True)
class RankPeak:
    """One rank: recorded and emulated peak ``total_allocated`` and the error.

    Attributes:
        rank: the rank.
        recorded: recorded peak (max ``total_allocated`` over its memory events), bytes.
        emulated: emulated peak (the re-timed timeline, ``replay.memory``), bytes.
        error_pct: ``100 * (emulated - recorded) / recorded`` (signed).
    """

    rank: int
    recorded: int
    emulated: int
    error_pct: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "rank": self.rank,
            "recorded": self.recorded,
            "emulated": self.emulated,
            "error_pct": round(self.error_pct, 6),
        }


def _mem_mean(errors: list[RankPeak] | None) -> float | None:
    """Mean over ranks of ``|error_pct|`` of the peaks (None: no memory compared)."""
    if not errors:
        return None
    return float(np.mean([abs(e.error_pct) for e in errors]))


def _compare_memory(emulated: pl.DataFrame, recorded: pl.DataFrame) -> list[RankPeak] | None:
    """Per rank with a recorded peak > 0: emulated vs recorded peak (None without memory)."""
    if recorded.is_empty():
        return None
    j = recorded.filter(pl.col("peak") > 0).join(
        emulated.cast({"rank": recorded.schema["rank"]}),
        on="rank",
        how="left",
        suffix="_emu",
    )
    return [
        RankPeak(
            rank=int(r),
            recorded=int(rec),
            emulated=int(emu or 0),
            error_pct=100.0 * ((emu or 0) - rec) / rec,
        )
        for r, rec, emu in j.sort("rank").select("rank", "peak", "peak_emu").iter_rows()
    ]


def _mean_abs(errors: list[IterationError] | None) -> float | None:
    """Mean over iterations of ``|error_pct|`` (None: no iteration compared)."""
    if not errors:
        return None
    return float(np.mean([abs(e.error_pct) for e in errors]))


def _mean_time_error(errors: list[IterationError] | None) -> float | None:
    """Signed error of the mean iteration time over all iterations (None: nothing to compare)."""
    if not errors:
        return None
    rec = float(np.mean([e.recorded_ns for e in errors]))
    emu = float(np.mean([e.emulated_ns for e in errors]))
    return 100.0 * (emu - rec) / rec if rec else None


def _max_rank(errors: list[IterationError] | None) -> float | None:
    """The worst one rank's ``|error|`` of any iteration, percent (None: nothing compared)."""
    if not errors:
        return None
    return float(max(e.max_rank_error_pct for e in errors))


def _compare(emulated: pl.DataFrame, recorded: pl.DataFrame) -> list[IterationError]:
    """Per iteration, the mean over ranks of both durations (``rank, iteration, dur`` each,
    joined on the ranks and iterations both have) and the worst rank's error."""
    j = emulated.select("rank", "iteration", pl.col("dur").alias("emu")).join(
        recorded.select("rank", "iteration", pl.col("dur").alias("rec")),
        on=["rank", "iteration"],
    )
    j = j.with_columns(
        ((pl.col("emu") - pl.col("rec")).abs() / pl.col("rec") * 100.0).alias("rank_err")
    )
    per = (
        j.group_by("iteration")
        .agg(
            pl.col("rec").mean().alias("rec"),
            pl.col("emu").mean().alias("emu"),
            pl.col("rank_err").max().alias("worst"),
        )
        .sort("iteration")
    )
    return [
        IterationError(
            iteration=int(row["iteration"]),
            recorded_ns=float(row["rec"]),
            emulated_ns=float(row["emu"]),
            error_pct=100.0 * (row["emu"] - row["rec"]) / row["rec"] if row["rec"] else 0.0,
            max_rank_error_pct=float(row["worst"]),
        )
        for row in per.iter_rows(named=True)
    ]

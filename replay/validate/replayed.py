"""Validation of a ``replayed`` run (``replay.hybrid``) against the recording of its ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import polars as pl
from prism_trace.replay.validate.compare import (
    IterationError,
    RankPeak,
    _compare,
    _compare_memory,
    _max_rank,
    _mean_abs,
    _mem_mean,
)

from prism_trace.errors import RunStateError

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["ReplayValidation", "validate_replayed"]


@dataclass
class ReplayValidation:
    """A ``replayed`` run against the recording of the same ranks.

    Attributes:
        replayed: the replayed run.
        recorded: the recorded run that is the ground truth (the replayed run's parent, or the
            parent of a sliced parent).
        ranks: the replayed ranks (``rank.represented_by`` is compared when they differ).
        iterations: per iteration, replayed vs recorded duration (mean over the ranks).
        memory: per rank, replayed vs recorded peak ``total_allocated`` (None without memory).
    """

    replayed: str
    recorded: str
    ranks: list[int]
    iterations: list[IterationError]
    memory: list[RankPeak] | None

    @property
    def iteration_time_error_pct(self) -> float | None:
        """Mean over iterations of ``|error_pct|``."""
        return _mean_abs(self.iterations)

    @property
    def mean_iteration_error_pct(self) -> float | None:
        """Signed error of the mean iteration time over all iterations."""
        if not self.iterations:
            return None
        rec = sum(e.recorded_ns for e in self.iterations)
        rep = sum(e.emulated_ns for e in self.iterations)
        return 100.0 * (rep - rec) / rec if rec else None

    @property
    def peak_memory_error_pct(self) -> float | None:
        """Mean over ranks of ``|error|`` of the peak memory."""
        return _mem_mean(self.memory)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {
            "replayed": self.replayed,
            "recorded": self.recorded,
            "ranks": self.ranks,
            "iteration_time_error_pct": r(self.iteration_time_error_pct),
            "mean_iteration_error_pct": r(self.mean_iteration_error_pct),
            "max_rank_error_pct": r(_max_rank(self.iterations)),
            "peak_memory_error_pct": r(self.peak_memory_error_pct),
            "iterations": [e.as_dict() for e in self.iterations],
            "memory": None if self.memory is None else [m.as_dict() for m in self.memory],
        }

    def summary(self) -> str:
        """A few lines for the CLI."""

        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.3f} %"

        lines = [
            f"replayed run {self.replayed!r} against recorded {self.recorded!r}, ranks"
            f" {self.ranks}:",
            f"  iteration time: mean |error| {pct(self.iteration_time_error_pct)} over"
            f" {len(self.iterations)} iterations, error of the mean"
            f" {pct(self.mean_iteration_error_pct)}, worst rank {pct(_max_rank(self.iterations))}",
        ]
        for e in self.iterations:
            lines.append(
                f"    iteration {e.iteration}: replayed {e.emulated_ns / 1e6:.3f} ms, recorded"
                f" {e.recorded_ns / 1e6:.3f} ms ({e.error_pct:+.3f} %)"
            )
        if self.memory is None:
            lines.append("  peak memory: n/a (no memory events)")
        else:
            lines.append(f"  peak memory: mean |error| {pct(self.peak_memory_error_pct)}")
            for m in self.memory:
                lines.append(
                    f"    rank {m.rank}: replayed {m.emulated} B, recorded {m.recorded} B"
                    f" ({m.error_pct:+.3f} %)"
                )
        return "\n".join(lines)


def validate_replayed(store: Store, *, replayed: str) -> ReplayValidation:
    """Compare a ``replayed`` run (``prism replay``) with the recording of its ranks.

    Per iteration, the replayed duration of each rank against the recorded duration of the rank
    it replays (``rank.represented_by``), averaged over the ranks; peak memory per rank: the
    replayed run's largest ``total_allocated`` against the recorded one.

    Args:
        store: an open store.
        replayed: a run of kind ``replayed``.

    Returns:
        The errors.

    Raises:
        RunStateError: not a replayed run, or no recorded run behind it.
    """
    run_id = store.require_run(replayed)
    kind = store.run_ancestry(run_id)[0].kind
    if kind != "replayed":
        msg = f"{store.path}: run {replayed!r} is {kind}; --replayed needs a replayed run"
        raise RunStateError(msg)
    recorded = store.recorded_ancestor(run_id)
    if recorded is None:
        msg = f"{store.path}: run {replayed!r} has no recorded run behind it to compare with"
        raise RunStateError(msg)
    rec_id, rec_name = recorded.run_id, recorded.name
    ranks = store.con.sql(
        "SELECT rank, coalesce(represented_by, rank) AS src FROM rank WHERE run_id = $1"
        " ORDER BY rank",
        params=[run_id],
    ).pl()
    mapping = ranks.select(pl.col("rank"), pl.col("src"))
    rep = (
        store.con.sql(
            "SELECT rank, iteration, ts, dur FROM iteration WHERE run_id = $1", params=[run_id]
        )
        .pl()
        .join(mapping, on="rank")
        .select(pl.col("src").alias("rank"), "iteration", "dur")
    )
    srcs = ranks["src"].to_list()
    rec = store.con.sql(
        "SELECT rank, iteration, dur FROM iteration WHERE run_id = $1 AND list_contains($2, rank)",
        params=[rec_id, srcs],
    ).pl()
    peaks_sql = (
        "SELECT rank, max(total_allocated)::BIGINT AS peak FROM memory WHERE run_id = $1"
        " GROUP BY rank"
    )
    rep_peaks = (
        store.con.sql(peaks_sql, params=[run_id])
        .pl()
        .join(mapping, on="rank")
        .select(pl.col("src").alias("rank"), "peak")
    )
    rec_peaks = store.con.sql(peaks_sql, params=[rec_id]).pl().filter(pl.col("rank").is_in(srcs))
    memory = _compare_memory(rep_peaks, rec_peaks) if not rep_peaks.is_empty() else None
    return ReplayValidation(
        replayed=replayed,
        recorded=rec_name,
        ranks=ranks["rank"].to_list(),
        iterations=_compare(rep, rec),
        memory=memory,
    )

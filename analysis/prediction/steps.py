"""Step times, predicted against recorded: mean, p90 and the two-sample Kolmogorov-Smirnov D.

The samples are per-rank step times: the ``iteration`` table's ``dur`` of every (rank, step)
over the ranks both runs hold and the steps they have in common, warm-up steps left out
(``sides.common_iterations``). Several predicted runs (one per seed of a variance emulation)
pool into one sample. ``D`` is the largest distance between the two samples' empirical
distribution functions: 0 when they are the same, 1 when every predicted step is shorter (or
longer) than every recorded one. Its 5 % critical value ``1.358 * sqrt((n + m) / (n m))`` (the
asymptotic one) says how large a ``D`` two samples of one distribution reach by chance. The
ranks of one step are not independent samples (a data-parallel collective ends every rank's step
together), so the critical value is also given for samples of *steps* (``ks_critical_steps_5pct``:
the steps compared, times the predicted runs): the one to read when ranks move together. Five
steps of each side reach ``D`` = 0.86 by chance; the 0.2 of a tight prediction needs some 90
steps a side.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from prism_trace.analysis.prediction.sides import RunSide

from prism_trace.store.connection import Store

__all__ = [
    "KS_C_5PCT",
    "StepTimes",
    "error_pct",
    "ks_critical",
    "ks_two_sample",
    "step_ranks",
    "step_times",
]

KS_C_5PCT = math.sqrt(-math.log(0.05 / 2) / 2)
"""``c(alpha)`` of the two-sample KS test at alpha = 5 % (1.358)."""


def ks_two_sample(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic ``D = max_x |F_a(x) - F_b(x)|``.

    Both empirical distribution functions step at the sample points, so the largest distance is
    reached at one of them: each sample is sorted once and both functions are read at every
    pooled point with a binary search (``F(x)`` = share of the sample ``<= x``).

    Raises:
        ValueError: an empty sample.
    """
    xa = np.sort(np.asarray(a, dtype=np.float64))
    xb = np.sort(np.asarray(b, dtype=np.float64))
    if xa.size == 0 or xb.size == 0:
        msg = "ks_two_sample: both samples must be non-empty"
        raise ValueError(msg)
    points = np.concatenate([xa, xb])
    fa = np.searchsorted(xa, points, side="right") / xa.size
    fb = np.searchsorted(xb, points, side="right") / xb.size
    return float(np.max(np.abs(fa - fb)))


def ks_critical(n: int, m: int) -> float:
    """The 5 % critical value of ``D`` for samples of ``n`` and ``m`` (asymptotic)."""
    return KS_C_5PCT * math.sqrt((n + m) / (n * m)) if n and m else float("nan")


def error_pct(predicted: float | None, recorded: float | None) -> float | None:
    """``100 * (predicted - recorded) / recorded``; None when either is missing or recorded
    is 0."""
    if predicted is None or recorded is None or recorded == 0:
        return None
    return 100.0 * (predicted - recorded) / recorded


@dataclass(frozen=True)
class StepTimes:
    """Per-rank step times of the prediction (pooled over its runs) and of the recording.

    Attributes:
        iterations: the steps compared.
        warmup: the steps left out as warm-up.
        ranks: how many ranks both runs hold.
        predicted_n: predicted samples (ranks x steps x runs).
        recorded_n: recorded samples (ranks x steps).
        predicted_mean_ns, predicted_p90_ns: of the predicted sample.
        recorded_mean_ns, recorded_p90_ns: of the recorded sample.
        ks_d: the two-sample KS statistic.
        ks_critical_5pct: its 5 % critical value for these sample sizes.
        ks_critical_steps_5pct: its 5 % critical value for samples of steps (steps x runs
            predicted, steps recorded), as if each step's ranks were one sample.
    """

    iterations: list[int]
    warmup: list[int]
    ranks: int
    predicted_n: int
    recorded_n: int
    predicted_mean_ns: float | None
    predicted_p90_ns: float | None
    recorded_mean_ns: float | None
    recorded_p90_ns: float | None
    ks_d: float | None
    ks_critical_5pct: float | None
    ks_critical_steps_5pct: float | None = None

    @property
    def mean_error_pct(self) -> float | None:
        """Signed error of the mean step time, percent."""
        return error_pct(self.predicted_mean_ns, self.recorded_mean_ns)

    @property
    def p90_error_pct(self) -> float | None:
        """Signed error of the p90 step time, percent."""
        return error_pct(self.predicted_p90_ns, self.recorded_p90_ns)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""

        def r(x: float | None, digits: int = 6) -> float | None:
            return None if x is None or math.isnan(x) else round(x, digits)

        return {
            "iterations": self.iterations,
            "warmup": self.warmup,
            "ranks": self.ranks,
            "predicted_n": self.predicted_n,
            "recorded_n": self.recorded_n,
            "predicted_mean_ns": r(self.predicted_mean_ns, 1),
            "predicted_p90_ns": r(self.predicted_p90_ns, 1),
            "recorded_mean_ns": r(self.recorded_mean_ns, 1),
            "recorded_p90_ns": r(self.recorded_p90_ns, 1),
            "mean_error_pct": r(self.mean_error_pct),
            "p90_error_pct": r(self.p90_error_pct),
            "ks_d": r(self.ks_d),
            "ks_critical_5pct": r(self.ks_critical_5pct),
            "ks_critical_steps_5pct": r(self.ks_critical_steps_5pct),
        }


def _durations(store: Store, run_ids: list[int], ranks: list[int], steps: list[int]) -> np.ndarray:
    rows = store.con.execute(
        "SELECT dur FROM iteration WHERE list_contains($1, run_id) AND list_contains($2, rank)"
        " AND list_contains($3, iteration)",
        [run_ids, ranks, steps],
    ).fetchall()
    return np.asarray([r[0] for r in rows], dtype=np.float64)


def step_ranks(store: Store, predicted: Sequence[RunSide], recorded: RunSide) -> list[int]:
    """The ranks with steps in every predicted run and in the recording."""
    common: set[int] | None = None
    for side in (*predicted, recorded):
        ranks = {
            int(r)
            for (r,) in store.con.execute(
                "SELECT DISTINCT rank FROM iteration WHERE run_id = ?", [side.run_id]
            ).fetchall()
        }
        common = ranks if common is None else common & ranks
    return sorted(common or ())


def step_times(
    store: Store,
    predicted: Sequence[RunSide],
    recorded: RunSide,
    iterations: list[int],
    warmup: list[int],
) -> StepTimes:
    """Mean, p90 and KS ``D`` of the per-rank step times over ``iterations``."""
    ranks = step_ranks(store, predicted, recorded)
    a = _durations(store, [s.run_id for s in predicted], ranks, iterations)
    b = _durations(store, [recorded.run_id], ranks, iterations)

    def stat(x: np.ndarray, q: float | None) -> float | None:
        if not x.size:
            return None
        return float(np.mean(x)) if q is None else float(np.percentile(x, q))

    both = bool(a.size and b.size)
    return StepTimes(
        iterations=iterations,
        warmup=warmup,
        ranks=len(ranks),
        predicted_n=int(a.size),
        recorded_n=int(b.size),
        predicted_mean_ns=stat(a, None),
        predicted_p90_ns=stat(a, 90),
        recorded_mean_ns=stat(b, None),
        recorded_p90_ns=stat(b, 90),
        ks_d=ks_two_sample(a, b) if both else None,
        ks_critical_5pct=ks_critical(a.size, b.size) if both else None,
        ks_critical_steps_5pct=ks_critical(len(iterations) * len(predicted), len(iterations))
        if both
        else None,
    )

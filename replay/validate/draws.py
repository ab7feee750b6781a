"""Do the variance mode's draws reproduce the recording? Step-time distributions compared.

Why a module of its own: the variance mode (``replay.whatif``, ``replay.des.vector``) claims that
every replica draws from the recorded distribution of its ops (per op, role and step). The check
that holds it to that: slice a recorded run from one data-parallel replica back to its own scale,
emulate it with variance under several seeds, and compare the distribution of emulated step
times (per rank and step) with the recorded one: the two-sample Kolmogorov-Smirnov statistic,
and the mean and the 90th percentile (relative errors, target 2 %).

The same slice emulated *without* variance is the baseline: the slice alone (every replica a
copy of the recorded one) is biased low, and on a recording whose steps cluster tightly (ST: an
interquartile range of 0.8 % of the step) a bias of half a percent is a KS distance of 0.47 by
itself. The baseline's figures say how much of ``D`` the draws could remove at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.driver import emulate_in_memory, temporary_slice
from prism_trace.replay.whatif.config import VarianceMode, WhatIfConfig

from prism_trace.errors import RunStateError
from prism_trace.layout.choice import infer_layout
from prism_trace.layout.mesh import ParallelAxis

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["DrawCheck", "check_draws", "ks_two_sample"]


def ks_two_sample(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov: the statistic ``D`` and its asymptotic p-value.

    ``D`` is the largest distance between the two empirical CDFs; the p-value is the
    Kolmogorov distribution's tail at ``D * sqrt(n m / (n + m))`` (a null of equal
    distributions; approximate for small samples).
    """
    a = np.sort(np.asarray(a, dtype=np.float64))
    b = np.sort(np.asarray(b, dtype=np.float64))
    if a.size == 0 or b.size == 0:
        msg = "ks_two_sample: both samples must be non-empty"
        raise ValueError(msg)
    x = np.concatenate([a, b])
    d = float(
        np.max(
            np.abs(
                np.searchsorted(a, x, side="right") / a.size
                - np.searchsorted(b, x, side="right") / b.size
            )
        )
    )
    en = np.sqrt(a.size * b.size / (a.size + b.size))
    lam = (en + 0.12 + 0.11 / en) * d
    k = np.arange(1, 101)
    p = float(np.clip(2 * np.sum((-1.0) ** (k - 1) * np.exp(-2 * (k * lam) ** 2)), 0, 1))
    return d, p if lam > 0 else 1.0


@dataclass(frozen=True)
class DrawCheck:
    """Emulated (variance mode) vs recorded step times at the recorded scale.

    Attributes:
        run: the recorded run.
        slice_ranks: the replica the slice was made from.
        seeds: emulations pooled.
        mode: the variance mode.
        recorded: per (rank, step) recorded step times, ns.
        emulated: per (rank, step, seed) emulated step times, ns.
        baseline: per (rank, step) step times of the slice emulated without variance, ns.
    """

    run: str
    slice_ranks: list[int]
    seeds: int
    mode: str
    recorded: np.ndarray
    emulated: np.ndarray
    baseline: np.ndarray

    @property
    def ks(self) -> tuple[float, float]:
        """Two-sample KS statistic and p-value."""
        return ks_two_sample(self.emulated, self.recorded)

    @property
    def mean_error_pct(self) -> float:
        """Signed error of the mean step time, %."""
        return 100.0 * (self.emulated.mean() / self.recorded.mean() - 1)

    @property
    def p90_error_pct(self) -> float:
        """Signed error of the 90th percentile of the step time, %."""
        q = 100.0 * (np.percentile(self.emulated, 90) / np.percentile(self.recorded, 90) - 1)
        return float(q)

    @property
    def baseline_ks(self) -> float:
        """KS statistic of the slice without variance against the recording."""
        return ks_two_sample(self.baseline, self.recorded)[0]

    @property
    def baseline_mean_error_pct(self) -> float:
        """Signed error of the mean step time of the slice without variance, %."""
        return 100.0 * (self.baseline.mean() / self.recorded.mean() - 1)

    @property
    def std_ratio(self) -> float:
        """Standard deviation of the emulated step times over the recorded one's."""
        return float(self.emulated.std() / self.recorded.std())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        d, p = self.ks
        return {
            "run": self.run,
            "slice_ranks": self.slice_ranks,
            "seeds": self.seeds,
            "mode": self.mode,
            "recorded_samples": int(self.recorded.size),
            "emulated_samples": int(self.emulated.size),
            "ks_statistic": round(d, 6),
            "ks_p_value": round(p, 6),
            "mean_error_pct": round(self.mean_error_pct, 4),
            "p90_error_pct": round(self.p90_error_pct, 4),
            "std_ratio": round(self.std_ratio, 4),
            "baseline_ks_statistic": round(self.baseline_ks, 6),
            "baseline_mean_error_pct": round(self.baseline_mean_error_pct, 4),
        }


def check_draws(
    store: Store,
    *,
    run: str,
    seeds: int = 5,
    mode: VarianceMode = "replica",
    config: EmulationConfig | None = None,
    sliced: bool = True,
) -> DrawCheck:
    """Slice ``run`` from its dp-0 replica to its own layout, emulate it with variance under
    ``seeds`` seeds and pool the per-rank step times; the same slice without variance is the
    baseline (see the module docstring). ``sliced=False`` emulates the recorded run itself
    instead (every rank draws, ``replay.whatif.variance.resample_durations``; ``slice_ranks`` is
    then empty): the draws without the slice's bias.

    Raises:
        RunStateError: not a recorded run with iterations and an inferable layout.
    """
    config = config or EmulationConfig()
    run_id = store.require_run(run)
    recorded = store.con.sql(
        "SELECT rank, iteration, dur FROM iteration WHERE run_id = $1", params=[run_id]
    ).pl()
    if recorded.is_empty():
        msg = f"{store.path}: run {run!r} has no `iteration` rows to compare with"
        raise RunStateError(msg)
    layout = infer_layout(store, run)
    ranks = np.unique(recorded["rank"].to_numpy())
    from_ranks = ranks[layout.coords(ranks)[ParallelAxis.DP] == 0].tolist()
    draws = []
    target = (
        temporary_slice(
            store, run=run, layout=layout, from_ranks=from_ranks, name=f"_draws_{run}_slice"
        )
        if sliced
        else contextlib.nullcontext(run)
    )
    with target as tmp:
        for seed in range(seeds):
            cfg = dataclasses.replace(
                config, what_if=WhatIfConfig(variance=True, variance_mode=mode), seed=seed
            )
            draws.append(emulate_in_memory(store, run=tmp, config=cfg)[1]["dur"])
        plain = dataclasses.replace(config, what_if=WhatIfConfig())
        baseline = emulate_in_memory(store, run=tmp, config=plain)[1]["dur"]
    return DrawCheck(
        run=run,
        slice_ranks=[int(r) for r in from_ranks] if sliced else [],
        seeds=seeds,
        mode=mode,
        recorded=recorded["dur"].cast(pl.Int64).to_numpy(),
        emulated=pl.concat(draws).cast(pl.Int64).to_numpy(),
        baseline=baseline.cast(pl.Int64).to_numpy(),
    )

"""Straggler slowdown: how much faster the step would be if every op took its typical time, and
which ops, ranks, stages or data-parallel ranks the difference comes from.

After StragglerAnalysis's what-if analysis. Three emulations of the same graph:

- the recording with every own delay set to 0 (``no-launch-delay``, their ``step_t_nodelay``),
- every op at its typical time (``no-stragglers``, ``replay.typical``; ``step_t_noblk``),
- per group G: every op typical except G's, which keep their recorded times.

The slowdown is the ratio of mean step times, ``S = T(no-launch-delay) / T(no-stragglers)``,
and a group's share ``S_G = T(typical except G) / T(no-stragglers)``: how slow the job would be
if G were its only straggler (1.0: G costs nothing; StragglerAnalysis's ``S_t`` for op types and
``S_w`` for workers). Groups are not additive: two stragglers on one pipeline overlap. The own
delays (CPU time, launches) are left out of both sides, like StragglerAnalysis's blocking
slowdown (``no-stragglers`` keeps the own time before computations, see ``replay.typical``);
``emulated / no-stragglers`` (with every own delay) is reported beside it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import polars as pl
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.frames import recorded_iterations, unit_iterations
from prism_trace.replay.emulate.load import load_run
from prism_trace.replay.emulate.prepare import prepare
from prism_trace.replay.emulate.run import run_emulation
from prism_trace.replay.emulate.values import PreparedRun
from prism_trace.replay.whatif.config import WhatIfConfig

from prism_trace.errors import RunStateError, UsageError
from prism_trace.store.connection import Store

__all__ = ["BY", "slowdown", "slowdown_note"]

By = Literal["optype", "rank", "stage", "dp_rank"]
BY: tuple[str, ...] = ("optype", "rank", "stage", "dp_rank")

_PP_COMM = {  # StragglerAnalysis groups a direction's sends and receives as one op type
    "forward-send": "forward-pp-comm",
    "forward-recv": "forward-pp-comm",
    "backward-send": "backward-pp-comm",
    "backward-recv": "backward-pp-comm",
}


def _mean_step(store: Store, inputs: PreparedRun, config: EmulationConfig) -> float:
    """Mean over iterations of the emulated step time (mean over units per iteration), ns."""
    res = run_emulation(store, inputs, config)
    it = unit_iterations(res, recorded_iterations(store, inputs))
    per = it.group_by("iteration").agg(pl.col("dur").mean())
    mean = per["dur"].mean()
    if mean is None:
        msg = (
            f"{store.path}: run {inputs.run!r} has no steps (no ProfilerStep or iteration marks),"
            " and the slowdown is a ratio of mean step times; record with a profiler schedule,"
            " or use `prism analyze ... critical-path-summary` for the whole trace"
        )
        raise RunStateError(msg)
    return float(mean)  # type: ignore[arg-type]


def _labels(store: Store, inputs: PreparedRun, by: str) -> pl.Series:
    """The group of every node for ``by``."""
    nodes = inputs.nodes
    if by == "optype":
        return nodes["name"].replace(_PP_COMM)
    rank = nodes["rank"].cast(pl.Int64)
    if by == "rank":
        return rank.cast(pl.Utf8)
    col = {"stage": "pp", "dp_rank": "dp"}[by]
    coords = store.con.sql(
        f"SELECT rank, {col} FROM rank WHERE run_id = $1 AND {col} IS NOT NULL",
        params=[inputs.run_id],
    ).pl()
    if coords.is_empty():
        msg = (
            f"{store.path}: run {inputs.run!r} has no {by} coordinates"
            " (run `prism graph` to infer the layout)"
        )
        raise RunStateError(msg)
    return (
        pl.DataFrame({"rank": rank})
        .join(coords.cast({"rank": pl.Int64}), on="rank", how="left")[col]
        .cast(pl.Utf8)
    )


def _slowdown_rows(store: Store, run: str, by: str | None) -> list[tuple[str, str, float, float]]:
    """``slowdown``'s rows: the overall ones, then one per group of ``by``, slowest first."""
    # Prepared once, as recorded: the what-ifs compared here (no-stragglers, no-launch-delay)
    # change no graph, the run stage applies them; each group's keep_recorded is an amended copy.
    inputs = prepare(store, load_run(store, run), EmulationConfig())
    ideal_cfg = EmulationConfig(what_if=WhatIfConfig(no_stragglers=True))
    ideal = _mean_step(store, inputs, ideal_cfg)
    nodelay = _mean_step(store, inputs, EmulationConfig(what_if=WhatIfConfig(no_launch_delay=True)))
    emulated = _mean_step(store, inputs, EmulationConfig())
    rows: list[tuple[str, str, float, float]] = [
        ("", "all", nodelay / ideal, nodelay),
        ("", "all+own delays", emulated / ideal, emulated),
    ]
    if by is not None:
        labels = _labels(store, inputs, by)
        per: list[tuple[str, str, float, float]] = []
        for group in sorted({g for g in labels.to_list() if g is not None}):
            keep = (labels == group).fill_null(value=False).to_numpy()
            t = _mean_step(store, dataclasses.replace(inputs, keep_recorded=keep), ideal_cfg)
            per.append((by, group, t / ideal, t))
        rows += sorted(per, key=lambda r: -r[2])
    return rows


def slowdown(store: Store, run: str, *, by: str | None = None) -> pl.DataFrame:
    """The straggler slowdown of a recorded run, overall and per group.

    Args:
        store: an open store (writable if the run has no graph yet).
        run: a recorded run.
        by: ``optype``, ``rank``, ``stage`` or ``dp_rank``; None: overall only.

    Returns:
        ``by, group, slowdown, step_ns`` (the emulated mean step, whole ns): first the overall
        rows (group ``all``: no-launch-delay over no-stragglers; ``all+own delays``: the
        emulated recording over no-stragglers), then one row per group, slowest first.

    Raises:
        UsageError: an unknown ``by``.
        RunNotFoundError: no such run.
        RunStateError: no coordinates for ``stage``/``dp_rank``.
    """
    if by is not None and by not in BY:
        msg = f"slowdown --by must be one of {', '.join(BY)}, got {by!r}"
        raise UsageError(msg)
    with store.transaction():  # a graph built for the run is kept only if this succeeds
        rows = _slowdown_rows(store, run, by)
    return pl.DataFrame(
        {
            "by": [r[0] for r in rows],
            "group": [r[1] for r in rows],
            "slowdown": np.array([r[2] for r in rows], dtype=np.float64),
            "step_ns": np.array([round(r[3]) for r in rows], dtype=np.int64),
        }
    )


def slowdown_note(frame: pl.DataFrame) -> list[str]:
    """Lines that say how to read ``slowdown``'s frame (printed beside the table).

    The bare ratio says nothing about its terms, and a ratio below 1 reads as "stragglers make
    the job faster": it means the emulation with every op at its typical time came out slower
    than the recording without its own delays, so this run's stragglers cannot be measured that
    way (typical times above the recorded ones on the path: a collective's recorded time
    includes its wait for peers, a mean over a skewed op type).
    """
    overall = frame.filter(pl.col("group") == "all")
    if overall.is_empty():
        return []
    s = float(overall["slowdown"][0])
    nodelay = int(overall["step_ns"][0])
    ideal = nodelay / s if s else float("nan")
    lines = [
        "slowdown = mean step without own delays (no-launch-delay, step_ns of `all`)"
        f" / mean step with every op at its typical time (no-stragglers, {ideal / 1e6:.3f} ms);"
        " 1.0: stragglers cost nothing, 1.25: they make the step 25 % slower"
    ]
    if s < 1.0:
        lines.append(
            f"slowdown {s:.3f} < 1: with every op at its typical time the step is slower"
            f" ({ideal / 1e6:.3f} ms) than recorded without own delays ({nodelay / 1e6:.3f} ms);"
            " the typical times exceed the recorded ones of the ops that bound the step, so no"
            " straggler cost is measured here (not a speed-up from stragglers)"
        )
    return lines

"""Communication and memory, predicted against recorded: waits per collective kind, and per rank
its communication time, its wait and its peak memory.

- *Wait* is ``comm_collective_wait``'s (analysis/sql/comm.sql): the last participant's arrival
  minus the rank's own, per call. Per collective kind and group axis, the mean over the calls of
  the compared steps. An emulated run writes its calls for its class exemplars only; the waits of
  the exemplars are those of their classes when every member of a class runs alike, but a
  variance emulation draws each replica's durations, so its exemplars' calls miss the waits the
  replicas' spread causes. The per-rank wait below reads such a run's ``rank_step`` rows
  instead, which hold every rank's.
- *Communication time* of a rank and step: the summed durations of its communication calls
  (collectives and transfers; the call's kernel when it ran on the device, else its host op).
- *Peak memory*: the largest ``total_allocated`` of the rank's ``memory`` rows (an emulated run's
  are its exemplars', re-timed).

A rank without rows of its own takes its class exemplar's (``rank.class_id``), as every rank of a
class runs its exemplar's program; its communication time is corrected by its own wait
(``_comm_and_wait``). Figures are per step: a rank's total over the compared steps divided by
their number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from prism_trace.analysis.prediction.sides import RunSide, group_axes
from prism_trace.analysis.prediction.steps import error_pct
from prism_trace.analysis.views import load_views

from prism_trace.store.connection import Store

__all__ = [
    "PEAK_TARGET_PCT",
    "KindWait",
    "RankFigures",
    "kind_waits",
    "rank_figures",
    "summary_errors",
]


@dataclass(frozen=True)
class KindWait:
    """Mean wait of one collective kind on one group axis.

    Attributes:
        kind: collective kind, or ``send``/``recv``.
        axis: the group's parallel axis.
        predicted_ns, recorded_ns: mean wait per call (None: no such call).
        predicted_calls, recorded_calls: calls averaged.
    """

    kind: str
    axis: str
    predicted_ns: float | None
    recorded_ns: float | None
    predicted_calls: int
    recorded_calls: int

    @property
    def error_pct(self) -> float | None:
        """Signed error of the mean wait, percent."""
        return error_pct(self.predicted_ns, self.recorded_ns)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "kind": self.kind,
            "axis": self.axis,
            "predicted_ns": _round(self.predicted_ns, 1),
            "recorded_ns": _round(self.recorded_ns, 1),
            "error_pct": _round(self.error_pct),
            "predicted_calls": self.predicted_calls,
            "recorded_calls": self.recorded_calls,
        }


@dataclass(frozen=True)
class RankFigures:
    """One rank: communication time, wait and peak memory, predicted and recorded.

    Attributes:
        rank: the rank.
        comm_predicted_ns, comm_recorded_ns: time in communication calls per step.
        wait_predicted_ns, wait_recorded_ns: wait in communication calls per step.
        peak_predicted, peak_recorded: peak ``total_allocated``, bytes (None: no memory rows).
    """

    rank: int
    comm_predicted_ns: float | None
    comm_recorded_ns: float | None
    wait_predicted_ns: float | None
    wait_recorded_ns: float | None
    peak_predicted: float | None
    peak_recorded: float | None

    @property
    def comm_error_pct(self) -> float | None:
        """Signed error of the communication time, percent."""
        return error_pct(self.comm_predicted_ns, self.comm_recorded_ns)

    @property
    def wait_error_pct(self) -> float | None:
        """Signed error of the wait, percent."""
        return error_pct(self.wait_predicted_ns, self.wait_recorded_ns)

    @property
    def peak_error_pct(self) -> float | None:
        """Signed error of the peak memory, percent."""
        return error_pct(self.peak_predicted, self.peak_recorded)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "rank": self.rank,
            "comm_predicted_ns": _round(self.comm_predicted_ns, 1),
            "comm_recorded_ns": _round(self.comm_recorded_ns, 1),
            "comm_error_pct": _round(self.comm_error_pct),
            "wait_predicted_ns": _round(self.wait_predicted_ns, 1),
            "wait_recorded_ns": _round(self.wait_recorded_ns, 1),
            "wait_error_pct": _round(self.wait_error_pct),
            "peak_predicted": _round(self.peak_predicted, 1),
            "peak_recorded": _round(self.peak_recorded, 1),
            "peak_error_pct": _round(self.peak_error_pct),
        }


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(x, digits)


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def kind_waits(
    store: Store,
    predicted: Sequence[RunSide],
    recorded: RunSide,
    iterations: list[int],
    *,
    drawn: bool = False,
) -> list[KindWait]:
    """Mean wait per call of each (collective kind, group axis), over the compared steps.

    ``drawn``: the prediction drew each replica's durations (variance), so a kind whose calls
    all have one participant in its rows (a communicator inside one class, the dp
    all-reduce) has an unknown wait, not 0: the replicas that made it wait are not in the rows.
    """
    load_views(store.con, names=["comm_collective_wait"])

    def per_key(sides: Sequence[RunSide]) -> dict[tuple[str, str], tuple[float, int, int]]:
        out: dict[tuple[str, str], tuple[float, int, int]] = {}
        for side in sides:
            axes = group_axes(store, side)
            rows = store.con.execute(
                "SELECT kind, group_id, sum(wait_ns)::DOUBLE, count(*)::BIGINT,"
                " count(*) FILTER (WHERE participants > 1)::BIGINT"
                " FROM comm_collective_wait WHERE run_id = ? AND list_contains(?, iteration)"
                " GROUP BY ALL",
                [side.run_id, iterations],
            ).fetchall()
            for kind, gid, total, n, shared in rows:
                key = (str(kind), axes.get(int(gid), "-") if gid is not None else "-")
                t, c, m = out.get(key, (0.0, 0, 0))
                out[key] = (t + float(total or 0), c + int(n), m + int(shared))
        return out

    def mean(
        found: dict[tuple[str, str], tuple[float, int, int]], key: tuple[str, str]
    ) -> float | None:
        if key not in found:
            return None
        total, n, shared = found[key]
        return None if drawn and not shared else total / n

    pred, rec = per_key(predicted), per_key([recorded])
    return [
        KindWait(
            kind,
            axis,
            mean(pred, k),
            mean(rec, k),
            pred.get(k, (0.0, 0, 0))[1],
            rec.get(k, (0.0, 0, 0))[1],
        )
        for k in sorted(set(pred) | set(rec))
        for kind, axis in [k]
    ]


def _own(store: Store, sql: str, side: RunSide, iterations: list[int]) -> dict[int, float]:
    """Rank -> ``sql``'s ``(rank, value)`` total over the steps, per step; ranks that have
    events but no rows get 0."""
    rows = store.con.execute(sql, [side.run_id, iterations]).fetchall()
    steps = max(len(iterations), 1)
    own = dict.fromkeys(side.with_events, 0.0)
    own.update({int(r): float(v or 0) / steps for r, v in rows})
    return own


def _source(own: dict[int, float], rank: int, cls: int | None) -> int | None:
    """The rank whose figure ``rank`` takes: its own, else its class exemplar's."""
    if rank in own:
        return rank
    if cls is not None and int(cls) in own:
        return int(cls)
    return None


_COMM = (
    "SELECT rank, sum(coalesce(kernel_dur, host_dur))::DOUBLE FROM ("
    " SELECT rank, iteration, kernel_dur, host_dur FROM collective WHERE run_id = $1"
    " UNION ALL SELECT rank, iteration, kernel_dur, host_dur FROM p2p WHERE run_id = $1)"
    " WHERE list_contains($2, iteration) GROUP BY rank"
)
_WAIT_VIEW = (
    "SELECT rank, sum(wait_ns)::DOUBLE FROM comm_collective_wait WHERE run_id = $1"
    " AND list_contains($2, iteration) GROUP BY rank"
)
_WAIT_RANK_STEP = (
    "SELECT rank, sum(wait_ns)::DOUBLE FROM rank_step WHERE run_id = $1"
    " AND list_contains($2, iteration) GROUP BY rank"
)


def _peaks(store: Store, side: RunSide) -> dict[int, float | None]:
    rows = store.con.execute(
        "SELECT rank, max(total_allocated)::DOUBLE FROM memory WHERE run_id = ?"
        " AND total_allocated IS NOT NULL GROUP BY rank",
        [side.run_id],
    ).fetchall()
    own = {int(r): float(v) for r, v in rows}
    out: dict[int, float | None] = {}
    for row in side.ranks.iter_rows(named=True):
        src = _source(own, int(row["rank"]), row["class_id"])
        out[int(row["rank"])] = None if src is None else own[src]
    return out


def _comm_and_wait(
    store: Store, side: RunSide, iterations: list[int]
) -> tuple[dict[int, float | None], dict[int, float | None]]:
    """Every rank's communication time and wait per step.

    A run with ``rank_step`` rows (an emulation) has every rank's wait there. A class member
    without calls of its own spends its exemplar's time in communication, less the exemplar's
    wait, plus its own: a call lasts from the rank's arrival to the last arrival (the wait) and
    then the transfer, which the class shares. Without variance the two waits are equal.
    """
    comm = _own(store, _COMM, side, iterations)
    every = _has_rank_step(store, side)
    wait = _own(store, _WAIT_RANK_STEP if every else _WAIT_VIEW, side, iterations)
    comm_out: dict[int, float | None] = {}
    wait_out: dict[int, float | None] = {}
    for row in side.ranks.iter_rows(named=True):
        rank, cls = int(row["rank"]), row["class_id"]
        w_src = _source(wait, rank, cls)
        wait_out[rank] = None if w_src is None else wait[w_src]
        src = _source(comm, rank, cls)
        if src is None:
            comm_out[rank] = None
        elif src != rank and every and rank in wait and src in wait:
            comm_out[rank] = comm[src] - wait[src] + wait[rank]
        else:
            comm_out[rank] = comm[src]
    return comm_out, wait_out


def _has_rank_step(store: Store, side: RunSide) -> bool:
    return bool(
        store.con.execute(
            "SELECT count(*) FROM rank_step WHERE run_id = ?", [side.run_id]
        ).fetchall()[0][0]
    )


def rank_figures(
    store: Store, predicted: Sequence[RunSide], recorded: RunSide, iterations: list[int]
) -> list[RankFigures]:
    """Per rank both runs hold: communication time and wait per step, peak memory (predicted
    figures averaged over the predicted runs)."""
    load_views(store.con, names=["comm_collective_wait"])

    def figures(side: RunSide) -> tuple[dict[int, float | None], ...]:
        return (*_comm_and_wait(store, side, iterations), _peaks(store, side))

    rec = figures(recorded)
    preds = [figures(s) for s in predicted]
    ranks = sorted(set(rec[0]).intersection(*(set(p[0]) for p in preds)))
    out = []
    for r in ranks:
        p = [_mean([pr[i].get(r) for pr in preds]) for i in range(3)]
        out.append(RankFigures(r, p[0], rec[0].get(r), p[1], rec[1].get(r), p[2], rec[2].get(r)))
    return out


PEAK_TARGET_PCT = 0.5
"""Issue 30's bound on a rank's peak-memory error from the emulator, percent."""


def summary_errors(ranks: Sequence[RankFigures]) -> dict[str, float | None]:
    """Mean and largest ``|error|`` over the ranks of each per-rank figure, percent; and how many
    ranks' peak memory is within ``PEAK_TARGET_PCT`` of the recording (of those with one): the
    largest error alone hides whether one rank or all miss."""
    out: dict[str, float | None] = {}
    for name in ("comm", "wait", "peak"):
        errs = [abs(e) for r in ranks if (e := getattr(r, f"{name}_error_pct")) is not None]
        out[f"{name}_mean_abs_error_pct"] = _round(float(np.mean(errs))) if errs else None
        out[f"{name}_max_abs_error_pct"] = _round(float(np.max(errs))) if errs else None
        if name == "peak":
            out["peak_ranks"] = len(errs)
            out["peak_ranks_within_target"] = sum(e <= PEAK_TARGET_PCT for e in errs)
    return out

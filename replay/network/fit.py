"""Fit a `NetworkModel` to nccl-tests logs: the bandwidths, latency scales and efficiencies.

The model's time is a minimum over algorithm/protocol pairs, so it is piecewise smooth at best;
the fit minimises the mean |log(model / measured)| over every result row with a derivative-free
simplex (Nelder-Mead, in log space, so every parameter stays positive). The log error weighs a
20 us latency miss and a 20 ms bandwidth miss alike, and the mean of absolute values keeps one
stalled row (nccl-tests sometimes shows a 4x outlier) from pulling the rest.

Starting values come from the logs themselves: the best busbw of one-node rows (intra), of
multi-node rows (inter: a ring's divided by the ranks per node, an all_to_all's or sendrecv's as
it is, one GPU's NIC), NCCL's own latency tables (scale 1, or the logs' own where their
smallest calls are over ten times slower: gloo, sockets). A
parameter the rows do not constrain (no multi-node log: the NIC; no one-node or NVLS-capable log:
NVLS) stays where it started; `fit_network` reports which ones the data determined by moving each
one and watching the error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from prism_trace.replay.network.model import NetworkModel, network_time_us
from prism_trace.replay.network.parse import NcclLogError, NcclTestLog, ResultRow

__all__ = [
    "FITTED_PARAMETERS",
    "FitRows",
    "fit_network",
    "fit_rows",
    "log_errors",
    "nelder_mead",
    "predict_rows",
]

FITTED_PARAMETERS = (
    "intra_gbps",
    "inter_gbps",
    "nvls_gbps",
    "base_latency_scale",
    "intra_latency_scale",
    "inter_latency_scale",
)
"""The model's parameters a fit sets from every log (the per-collective efficiencies aside)."""


@dataclass(frozen=True)
class FitRows:
    """The result rows of some logs, as arrays (one entry per row).

    Attributes:
        op: collective kind.
        size: bytes.
        ranks: participants.
        nodes: nodes.
        time_us: measured time (the faster of out-of-place and in-place).
        log: index of the row's log in ``labels``.
        labels: the logs' labels (``op@ranks r/nodes n``).
        algo: each log's forced ``NCCL_ALGO`` (None: free).
        proto: each log's forced ``NCCL_PROTO``.
    """

    op: np.ndarray
    size: np.ndarray
    ranks: np.ndarray
    nodes: np.ndarray
    time_us: np.ndarray
    log: np.ndarray
    labels: tuple[str, ...]
    algo: tuple[str | None, ...]
    proto: tuple[str | None, ...]


def fit_rows(logs: Sequence[NcclTestLog]) -> FitRows:
    """The rows of ``logs`` with a positive size and time (a row whose data check failed in
    both columns has none: `ResultRow.time_us`).

    Raises:
        NcclLogError: a log whose ranks or nodes are unknown (no device block, no mpirun line).
    """
    cols: dict[str, list] = {k: [] for k in ("op", "size", "ranks", "nodes", "time_us", "log")}
    for i, lg in enumerate(logs):
        if lg.ranks is None or lg.nodes is None:
            msg = (
                f"{lg.path}: no `# Using devices` block nor `mpirun -np N -npernode M` line:"
                " the ranks and nodes of the test are unknown, so it cannot be fitted"
            )
            raise NcclLogError(msg)
        for r in lg.rows:
            if r.size <= 0 or r.time_us <= 0:
                continue
            cols["op"].append(lg.op)
            cols["size"].append(r.size)
            cols["ranks"].append(lg.ranks)
            cols["nodes"].append(lg.nodes)
            cols["time_us"].append(r.time_us)
            cols["log"].append(i)
    return FitRows(
        op=np.array(cols["op"], dtype=object),
        size=np.array(cols["size"], dtype=np.float64),
        ranks=np.array(cols["ranks"], dtype=np.float64),
        nodes=np.array(cols["nodes"], dtype=np.float64),
        time_us=np.array(cols["time_us"], dtype=np.float64),
        log=np.array(cols["log"], dtype=np.int64),
        labels=tuple(lg.label for lg in logs),
        algo=tuple(lg.algo for lg in logs),
        proto=tuple(lg.proto for lg in logs),
    )


def predict_rows(model: NetworkModel, rows: FitRows) -> np.ndarray:
    """The model's time of every row, each log with its forced algorithm/protocol."""
    out = np.empty(rows.size.size)
    for i in np.unique(rows.log):
        sel = rows.log == i
        t, _ = network_time_us(
            model,
            rows.op[sel],
            rows.size[sel],
            rows.ranks[sel],
            rows.nodes[sel],
            algo=rows.algo[i],
            proto=rows.proto[i],
        )
        out[sel] = t
    return out


def _loss(model: NetworkModel, rows: FitRows) -> float:
    pred = predict_rows(model, rows)
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.abs(np.log(pred / rows.time_us))
    err = np.where(np.isfinite(err), err, 50.0)
    return float(err.mean())


def nelder_mead(
    f: Callable[[np.ndarray], float],
    x0: np.ndarray,
    *,
    step: float = 0.3,
    iters: int = 400,
    tol: float = 1e-7,
) -> np.ndarray:
    """Minimise ``f`` from ``x0`` with the Nelder-Mead simplex (standard coefficients).

    The dependency-free method for a loss that is a minimum of smooth pieces; ``step`` is the
    initial simplex's edge along each axis (0.3 in log space: x1.35).
    """
    x0 = np.asarray(x0, dtype=np.float64)
    dim = x0.size
    simplex = np.vstack([x0] + [x0 + step * np.eye(dim)[i] for i in range(dim)])
    vals = np.array([f(x) for x in simplex])
    for _ in range(iters):
        order = np.argsort(vals)
        simplex, vals = simplex[order], vals[order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        centroid = simplex[:-1].mean(axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(xe)
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(xc)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:  # shrink toward the best
                simplex[1:] = simplex[0] + 0.5 * (simplex[1:] - simplex[0])
                vals[1:] = [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(vals))]


def _start(rows: FitRows, logs: Sequence[NcclTestLog]) -> NetworkModel:
    """Starting values from the logs' best bus bandwidths and NCCL's latency tables."""
    best: dict[str, float] = {}
    for lg in logs:
        bw = max((_passed_busbw(r) for r in lg.rows), default=0.0)
        key = "one" if lg.nodes == 1 else "multi"
        if key == "multi" and lg.ranks_per_node and lg.op not in _PER_GPU:
            bw = bw / lg.ranks_per_node  # a ring leaves the node through its g NICs
        best[key] = max(best.get(key, 0.0), bw)
    multi_total = max(
        (
            max((_passed_busbw(r) for r in lg.rows), default=0.0)
            for lg in logs
            if (lg.nodes or 1) > 1
        ),
        default=0.0,
    )
    intra = best.get("one") or multi_total or 100.0
    inter = best.get("multi") or intra / 8.0
    rpn = [lg.ranks_per_node for lg in logs if lg.ranks_per_node]
    model = NetworkModel(
        intra_gbps=max(intra, 1e-3),
        inter_gbps=max(inter, 1e-3),
        nvls_gbps=max(intra, 1e-3),
        ranks_per_node=max(rpn) if rpn else 8,
    )
    slow = _latency_ratio(model, rows)
    if slow <= _SLOW_NETWORK:
        return model
    return replace(
        model, base_latency_scale=slow, intra_latency_scale=slow, inter_latency_scale=slow
    )


_PER_GPU = ("all_to_all", "sendrecv")
"""Kinds whose multi-node bus bandwidth is already one GPU's NIC (pairwise exchanges), not a
ring's ``g`` NICs together."""

_SLOW_NETWORK = 10.0
"""A network whose smallest calls take over ten times NCCL's latency (gloo or TCP sockets, not
NCCL's kernels) starts from its own latency: a millisecond hop is not within reach of NCCL's
microsecond tables (``_SPAN``)."""


def _passed_busbw(row: ResultRow) -> float:
    """The row's best bus bandwidth among the columns whose data check passed."""
    cols = ((row.oop_busbw, row.oop_wrong), (row.ip_busbw, row.ip_wrong))
    return max((bw or 0.0 for bw, wrong in cols if not row.column_failed(wrong)), default=0.0)


def _latency_ratio(model: NetworkModel, rows: FitRows) -> float:
    """Median, over the logs, of measured over modelled time of each log's smallest size: about
    1 on NCCL, hundreds on gloo over loopback."""
    ratios = []
    for i in np.unique(rows.log):
        sel = np.flatnonzero(rows.log == i)
        first = sel[np.argmin(rows.size[sel])]
        one = _subset(rows, np.arange(rows.size.size) == first)
        ratios.append(float(rows.time_us[first] / predict_rows(model, one)[0]))
    return float(np.median(ratios)) if ratios else 1.0


def _with(model: NetworkModel, names: Sequence[str], x: np.ndarray) -> NetworkModel:
    kw: dict[str, Any] = {k: float(math.exp(v)) for k, v in zip(names, x, strict=True)}
    return replace(model, **kw)


_PRIOR = 0.002
"""Weight of the pull toward the starting values, per (log-unit)^2: a parameter the rows do not
constrain stays put instead of drifting to 1e47 GB/s along a flat valley of the loss, while a
constrained one moves as the rows say (one row's 1 % error outweighs a x1.5 move's 0.0003)."""
_SPAN = 6.0
"""How far (log units, x400) a parameter may move from its start: no NIC of 1e-9 GB/s."""


def _fit(model: NetworkModel, names: Sequence[str], rows: FitRows) -> NetworkModel:
    x0 = np.log([float(getattr(model, k)) for k in names])
    # An efficiency above 2 is refused by the model itself: the simplex must not step there.
    top = np.array([_EFFICIENCY_CAP if k.endswith("_efficiency") else np.inf for k in names])
    lo, hi = x0 - _SPAN, np.minimum(x0 + _SPAN, np.maximum(top, x0))

    def loss(v: np.ndarray) -> float:
        v = np.clip(v, lo, hi)
        return _loss(_with(model, names, v), rows) + _PRIOR * float(np.sum((v - x0) ** 2))

    x = nelder_mead(loss, x0)
    x = nelder_mead(loss, x)  # a restart: the simplex stalls on the loss's kinks
    return _with(model, names, np.clip(x, lo, hi))


_EFFICIENCY_CAP = math.log(2.0)
"""The largest efficiency (log): `NetworkModel` refuses more than 2."""


def fit_network(logs: Sequence[NcclTestLog]) -> NetworkModel:
    """The `NetworkModel` that best fits ``logs`` (mean |log error| over their rows).

    Shared parameters first (bandwidths, latency scales; NVLS tried on and off, the better
    kept), then each collective kind's efficiency against all_reduce (fixed at 1 when the logs
    hold all_reduce, else the kind with most rows). When the anchor's logs all sit on one node,
    the NIC and the network hop are fitted last, on the other kinds that ran on one node and
    across nodes (`_fit_network_on_other_kinds`). ``determined`` lists the parameters whose
    doubling or halving (either one) moves the mean error by more than 0.01: a parameter only
    one of the two moves hurts is a bound, not a value (docs/network.md).

    Raises:
        NcclLogError: no logs, or a log without ranks (see `fit_rows`).
    """
    if not logs:
        msg = "no nccl-tests logs to fit"
        raise NcclLogError(msg)
    rows = fit_rows(logs)
    if rows.size.size == 0:
        msg = f"{logs[0].path}: no result row with a positive size and time to fit"
        raise NcclLogError(msg)
    start = _start(rows, logs)
    kinds, counts = np.unique(rows.op, return_counts=True)
    anchor = "all_reduce" if "all_reduce" in kinds else str(kinds[int(np.argmax(counts))])
    anchor_rows = _subset(rows, rows.op == anchor)
    shared = [k for k in FITTED_PARAMETERS if k != "nvls_gbps"]
    with_nvls = _fit(start, [*shared, "nvls_gbps"], anchor_rows) if anchor == "all_reduce" else None
    without = _fit(replace(start, nvls_gbps=0.0), shared, anchor_rows)
    model = without
    if with_nvls is not None and _loss(with_nvls, anchor_rows) < _loss(without, anchor_rows) - 1e-3:
        model = with_nvls
    model = _fit_efficiencies(model, rows, kinds, anchor)
    nic_measured = True
    if not np.any(anchor_rows.nodes > 1):
        model, nic_measured = _fit_network_on_other_kinds(model, rows, anchor)
    pred = predict_rows(model, rows)
    err = float(np.median(np.abs(pred / rows.time_us - 1.0)))
    determined = _determined(model, rows)
    if not nic_measured:  # an efficiency fitted across nodes only absorbs whatever the NIC is
        determined = tuple(k for k in determined if k not in ("inter_gbps", "inter_latency_scale"))
    return replace(model, fitted_from=rows.labels, fit_error=round(err, 4), determined=determined)


def log_errors(model: NetworkModel, logs: Sequence[NcclTestLog]) -> list[tuple[str, float | None]]:
    """Median |model/measured - 1| of each log's rows, as (``FILE label``, error), one entry per
    test in ``logs`` order (None: no row to compare, every one failed its data check): one log
    far off shows even where the pooled median (`NetworkModel.fit_error`) is dominated by the
    others' rows."""
    rows = fit_rows(logs)
    err = np.abs(predict_rows(model, rows) / rows.time_us - 1.0)
    out: list[tuple[str, float | None]] = []
    for i, lg in enumerate(logs):
        mine = err[rows.log == i]
        name = f"{lg.path.rsplit('/', 1)[-1]} {lg.label}"
        out.append((name, float(np.median(mine)) if mine.size else None))
    return out


def _fit_network_on_other_kinds(
    model: NetworkModel, rows: FitRows, anchor: str
) -> tuple[NetworkModel, bool]:
    """The NIC and the network hop when the anchor ran on one node only (its fit left them at
    the start): from the other kinds that ran both on one node (which pins their efficiency
    against the fitted intra-node bandwidth) and across nodes (which then measures the NIC),
    fitted together with those efficiencies on those kinds' rows. A kind seen across nodes only
    cannot tell its efficiency from the NIC, and is left to its own efficiency fit. Returns the
    model and whether any kind measured the NIC."""
    kinds = [
        str(k)
        for k in np.unique(rows.op)
        if k != anchor
        and f"{k}_efficiency" in NetworkModel.__dataclass_fields__
        and np.any((rows.op == k) & (rows.nodes == 1))
        and np.any((rows.op == k) & (rows.nodes > 1))
    ]
    if not kinds:
        return model, False
    effs = [f"{k}_efficiency" for k in kinds]
    model = _fit(
        model, ["inter_gbps", "inter_latency_scale", *effs], _subset(rows, np.isin(rows.op, kinds))
    )
    # The kinds seen across nodes only: their efficiency again, against the NIC just fitted.
    rest = np.unique(rows.op[~np.isin(rows.op, [*kinds, anchor])])
    return _fit_efficiencies(model, rows, rest, anchor), True


def _fit_efficiencies(
    model: NetworkModel, rows: FitRows, kinds: np.ndarray, anchor: str
) -> NetworkModel:
    """Each kind's bandwidth efficiency against the anchor, on its own rows (at most 2)."""
    for kind in kinds:
        if kind == anchor or f"{kind}_efficiency" not in NetworkModel.__dataclass_fields__:
            continue
        model = _fit(model, [f"{kind}_efficiency"], _subset(rows, rows.op == kind))
    return model


def _subset(rows: FitRows, keep: np.ndarray) -> FitRows:
    return replace(
        rows,
        op=rows.op[keep],
        size=rows.size[keep],
        ranks=rows.ranks[keep],
        nodes=rows.nodes[keep],
        time_us=rows.time_us[keep],
        log=rows.log[keep],
    )


def _determined(model: NetworkModel, rows: FitRows) -> tuple[str, ...]:
    """The parameters the rows constrain: moving one x2 or x0.5 costs > 0.01 mean |log err|."""
    base = _loss(model, rows)
    names = [k for k in FITTED_PARAMETERS if not (k == "nvls_gbps" and model.nvls_gbps == 0)]
    names += [k for k in model.__dataclass_fields__ if k.endswith("_efficiency")]
    out = []
    for k in names:
        v = float(getattr(model, k))
        moved = [
            _loss(replace(model, **dict[str, Any]({k: v * f})), rows)
            for f in (2.0, 0.5)
            if not (k.endswith("_efficiency") and v * f > 2.0)
        ]
        if moved and max(moved) - base > 0.01:
            out.append(k)
    return tuple(out)

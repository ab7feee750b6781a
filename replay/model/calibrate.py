"""Fit the network's latencies and bus bandwidths to a run's recorded collectives.

Each collective instance ``(group_id, seq)`` has a pure transfer time, its last arriver's duration
(``replay.model.timing.recorded_transfer``; kernels when the trace has them, else host ops), a
message size and a group. ``replay.model.cost.collective_cost`` says how many latency steps and
how many bytes on each link class that instance costs, so per link class
``time = alpha * steps + bytes / busbw`` is linear in ``(alpha, 1/busbw)``:
a two-variable non-negative least-squares fit on relative errors.

Robustness: instances of one shape (kind, size, group) are first reduced to one point, their
median; when some participants were not recorded (one rank of a job: its duration includes
waiting for the others) a low quantile instead. With ten points or more, the worst tenth by
relative residual is dropped and the fit repeated. A link class without enough data, or whose
fit leaves a term at zero, keeps the preset's value for it, and the ``Calibration`` says so.

``calibrate`` works on a frame of instances (synthetic in tests); ``calibrate_run`` reads one
from a store. ``docs/network.md`` reports what it measures on the bundled traces.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np
import polars as pl
from prism_trace.replay.model.cost import Algorithm, CollectiveCost, collective_cost
from prism_trace.replay.model.timing import recorded_transfer
from prism_trace.replay.model.topology import Topology

__all__ = [
    "Calibration",
    "LinearFit",
    "LinkFit",
    "calibrate",
    "calibrate_run",
    "collective_samples",
    "fit_alpha_beta",
    "nnls",
]

SAMPLE_SCHEMA = {
    "group_id": pl.Int64,
    "seq": pl.Int64,
    "kind": pl.Utf8,
    "msg_bytes": pl.Int64,
    "group_size": pl.Int64,
    "n_nodes": pl.Int64,
    "transfer_ns": pl.Int64,
    "complete": pl.Boolean,
}


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares ``min |a x - y|, x >= 0`` for a few columns, exactly.

    Tries every set of free columns (2**k least-squares solves, k = columns; meant for k <= 3)
    and keeps the best solution that is non-negative: the optimum of a convex problem with
    bounds is the unconstrained optimum over its free set.

    Args:
        a: ``(m, k)`` design matrix.
        y: ``(m,)`` targets.

    Returns:
        ``(k,)`` coefficients, all ``>= 0``.
    """
    a = np.asarray(a, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    k = a.shape[1]
    best, best_res = np.zeros(k), float(y @ y)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if np.any(sol < 0):
            continue
        x = np.zeros(k)
        x[cols] = sol
        r = a @ x - y
        res = float(r @ r)
        if res < best_res - 1e-12 * max(best_res, 1.0):
            best, best_res = x, res
    return best


@dataclass(frozen=True)
class LinearFit:
    """``y ≈ alpha * x_latency + inv_bw * x_bytes`` fitted on relative errors.

    Attributes:
        alpha_ns: latency per step, ns.
        inv_bw: ns per byte (``1 / bytes_per_ns``); 0 when the bandwidth term was not resolved.
        used: which points the final fit kept (after dropping the worst tenth).
        median_rel_error: median ``|model / y - 1|`` over the kept points.
        r2: coefficient of determination of ``y`` over the kept points (None: undefined).
    """

    alpha_ns: float
    inv_bw: float
    used: np.ndarray
    median_rel_error: float
    r2: float | None


def _quality(pred: np.ndarray, y: np.ndarray) -> tuple[float, float | None]:
    rel = float(np.median(np.abs(pred / y - 1.0))) if y.size else math.nan
    ss = float(((y - y.mean()) ** 2).sum()) if y.size else 0.0
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else None
    return rel, r2


def fit_alpha_beta(
    x_latency: np.ndarray,
    x_bytes: np.ndarray,
    y: np.ndarray,
    *,
    offset: np.ndarray | None = None,
    drop_worst: float = 0.1,
    min_points_to_drop: int = 10,
) -> LinearFit:
    """Fit ``y = offset + alpha * x_latency + inv_bw * x_bytes`` with ``alpha, inv_bw >= 0``.

    Residuals are relative (``(model - y) / y``), so microsecond and millisecond transfers weigh
    alike. With ``min_points_to_drop`` points or more, the ``drop_worst`` fraction with the
    largest relative residual is dropped and the fit repeated.

    Args:
        x_latency: latency steps per point.
        x_bytes: bus-bandwidth bytes per point.
        y: measured time per point, ns (> 0).
        offset: a known part of ``y`` (e.g. the other link class's latency), ns.
        drop_worst: fraction of points dropped as outliers.
        min_points_to_drop: fewest points for which outliers are dropped.

    Returns:
        The fit.
    """
    x1 = np.asarray(x_latency, dtype=np.float64)
    x2 = np.asarray(x_bytes, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    off = np.zeros_like(y) if offset is None else np.asarray(offset, dtype=np.float64)
    used = np.ones(y.size, dtype=bool)

    def solve(m: np.ndarray) -> np.ndarray:
        a = np.stack([x1[m], x2[m]], axis=1) / y[m, None]
        return nnls(a, (y[m] - off[m]) / y[m])

    coef = solve(used)
    if y.size >= min_points_to_drop and drop_worst > 0:
        rel = np.abs((off + x1 * coef[0] + x2 * coef[1]) / y - 1.0)
        drop = math.ceil(drop_worst * y.size)
        used = np.ones(y.size, dtype=bool)
        used[np.argsort(-rel, kind="stable")[:drop]] = False
        coef = solve(used)
    pred = off + x1 * coef[0] + x2 * coef[1]
    rel, r2 = _quality(pred[used], y[used])
    return LinearFit(float(coef[0]), float(coef[1]), used, rel, r2)


# -- samples -------------------------------------------------------------------------------------


def collective_samples(store: Any, run: str | int, topology: Topology) -> pl.DataFrame:
    """One row per collective instance of a run: shape and pure transfer time.

    The transfer is the last arriver's duration (``recorded_transfer``) over the instance's
    kernels when every participant has one, else over its host ops. ``complete`` is false when
    fewer participants than ``group_size`` were recorded (then the duration includes waiting).

    Args:
        store: an open ``prism_trace.store.connection.Store``.
        run: run name or id.
        topology: for the nodes a group spans (``ranks_per_node``).

    Returns:
        Columns of ``SAMPLE_SCHEMA``.
    """
    run_id = run if isinstance(run, int) else store.require_run(run)
    rows = store.con.sql(
        "SELECT c.rank, c.group_id, c.seq, c.kind, c.msg_bytes,"
        " coalesce(c.group_size, g.size) AS group_size, c.host_ts, c.host_dur,"
        " c.kernel_ts, c.kernel_dur"
        " FROM collective c LEFT JOIN comm_group g USING (run_id, group_id)"
        " WHERE c.run_id = $1 ORDER BY c.group_id, c.seq, c.rank",
        params=[run_id],
    ).pl()
    if rows.is_empty():
        return pl.DataFrame(schema=SAMPLE_SCHEMA)
    groups = store.con.sql(
        "SELECT group_id, ranks FROM comm_group WHERE run_id = $1", params=[run_id]
    ).pl()
    key = rows.select(["group_id", "seq"]).with_row_index("i")
    first = key.unique(["group_id", "seq"], keep="first", maintain_order=True)
    inst = (
        key.join(first.with_row_index("inst").drop("i"), on=["group_id", "seq"])
        .sort("i")["inst"]
        .to_numpy()
        .astype(np.int64)
    )
    n_inst = first.height
    has_kernel = (rows["kernel_ts"].is_not_null() & rows["kernel_dur"].is_not_null()).to_numpy()
    all_kernel = np.ones(n_inst, dtype=bool)
    np.logical_and.at(all_kernel, inst, has_kernel)
    use_k = all_kernel[inst]

    def col(name: str) -> np.ndarray:
        return rows[name].fill_null(0).to_numpy().astype(np.int64)

    start = np.where(use_k, col("kernel_ts"), col("host_ts"))
    dur = np.where(use_k, col("kernel_dur"), col("host_dur"))
    transfer = recorded_transfer(inst, start, dur, n_inst)
    count = np.bincount(inst, minlength=n_inst)
    rank = rows["rank"].to_numpy().astype(np.int64)
    lo = np.full(n_inst, np.iinfo(np.int64).max)
    hi = np.full(n_inst, -1, dtype=np.int64)
    np.minimum.at(lo, inst, rank)
    np.maximum.at(hi, inst, rank)

    per = (
        rows.with_columns(pl.Series("inst", inst))
        .group_by("inst")
        .agg(
            pl.col("group_id").first(),
            pl.col("seq").first(),
            pl.col("kind").first(),
            pl.col("msg_bytes").max(),
            pl.col("group_size").max(),
        )
        .sort("inst")
    )
    size = per["group_size"].fill_null(pl.Series(count)).to_numpy().astype(np.int64)
    nodes, _ = topology.group_nodes(lo, hi, size)
    members = {
        int(g): np.asarray(r, dtype=np.int64)
        for g, r in zip(groups["group_id"].to_list(), groups["ranks"].to_list(), strict=True)
        if r
    }
    if members:
        gids = sorted(members)
        flat = np.concatenate([members[g] for g in gids])
        idx = np.repeat(np.arange(len(gids)), [members[g].size for g in gids])
        g_nodes, _ = topology.group_shape(flat, idx, len(gids))
        lookup = dict(zip(gids, g_nodes.tolist(), strict=True))
        nodes = np.array(
            [lookup.get(int(g), int(v)) for g, v in zip(per["group_id"], nodes, strict=True)],
            dtype=np.int64,
        )
    return pl.DataFrame(
        {
            "group_id": per["group_id"].cast(pl.Int64),
            "seq": per["seq"].cast(pl.Int64),
            "kind": per["kind"],
            "msg_bytes": per["msg_bytes"].fill_null(-1).cast(pl.Int64),
            "group_size": size,
            "n_nodes": nodes,
            "transfer_ns": transfer,
            "complete": count >= size,
        },
        schema=SAMPLE_SCHEMA,
    )


# -- the fit -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkFit:
    """The fit of one link class (pooled over kinds, or of one kind).

    Attributes:
        link: ``intra`` or ``inter``.
        kind: the collective kind, or None for the pooled fit the topology uses.
        alpha_ns: latency per step, ns.
        gbps: bus bandwidth, GB/s per GPU.
        points: shapes (kind, size, group) fitted, after dropping outliers.
        instances: instances behind those points.
        median_rel_error: median ``|model / measured - 1|`` over the points (None: no fit).
        r2: coefficient of determination over the points (None: undefined or no fit).
        source: ``fit`` (both values fitted), ``fit+preset`` (one kept from the preset) or
            ``preset`` (too little data).
        note: why a value comes from the preset.
    """

    link: Literal["intra", "inter"]
    kind: str | None
    alpha_ns: float
    gbps: float
    points: int
    instances: int
    median_rel_error: float | None
    r2: float | None
    source: Literal["fit", "fit+preset", "preset"]
    note: str = ""


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` fitted and the topology built from it.

    Attributes:
        run: the run's name (or id as text).
        instances: usable collective instances (known size, group of 2+, transfer > 0).
        waiting_included: some instances lacked participants (one-rank recordings), so their
            points are a low quantile of durations that include waiting.
        intra: the pooled intra-node fit.
        inter: the pooled inter-node fit.
        per_kind: fits of single kinds, where a kind has enough shapes (informational).
        median_rel_error: over every usable instance, ``|model / transfer - 1|`` with the
            calibrated topology (the residual that ``scaled`` keeps per instance).
        topology: the base topology with the fitted values.
        notes: what fell back to the preset, and why.
    """

    run: str
    instances: int
    waiting_included: bool
    intra: LinkFit
    inter: LinkFit
    per_kind: tuple[LinkFit, ...]
    median_rel_error: float | None
    topology: Topology
    notes: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def _points(samples: pl.DataFrame, waiting_quantile: float) -> pl.DataFrame:
    usable = samples.filter(
        (pl.col("msg_bytes") >= 0)
        & (pl.col("group_size") >= 2)
        & (pl.col("transfer_ns") > 0)
        & pl.col("kind").is_not_null()
    )
    return (
        usable.group_by(["kind", "msg_bytes", "group_size", "n_nodes", "complete"])
        .agg(
            pl.col("transfer_ns").median().alias("median"),
            pl.col("transfer_ns").quantile(waiting_quantile, "linear").alias("low"),
            pl.len().alias("instances"),
        )
        .with_columns(
            pl.when(pl.col("complete"))
            .then(pl.col("median"))
            .otherwise(pl.col("low"))
            .cast(pl.Float64)
            .alias("t")
        )
        .sort(["kind", "group_size", "n_nodes", "msg_bytes", "complete"])
    )


def _cost(points: pl.DataFrame, topology: Topology, algorithm: Algorithm) -> CollectiveCost:
    return collective_cost(
        points["kind"].to_numpy().astype(object),
        points["msg_bytes"].to_numpy(),
        points["group_size"].to_numpy(),
        points["n_nodes"].to_numpy(),
        topology,
        algorithm=algorithm,
    )


def _separable(x1: np.ndarray, x2: np.ndarray) -> bool:
    """Whether the points tell latency from bandwidth (two independent columns)."""
    return x1.size >= 2 and np.linalg.matrix_rank(np.stack([x1, x2], axis=1)) == 2


def _fit_link(
    link: Literal["intra", "inter"],
    kind: str | None,
    x1: np.ndarray,
    x2: np.ndarray,
    y: np.ndarray,
    offset: np.ndarray,
    weight: np.ndarray,
    preset: tuple[float, float],
) -> LinkFit:
    """One link class: fit, or keep the preset's ``(alpha_ns, gbps)`` for what is unresolved."""
    alpha0, gbps0 = preset
    if not _separable(x1, x2):
        where = "one node" if link == "intra" else "several nodes"
        why = (
            f"no instance on {where}"
            if x1.size == 0
            else f"its {x1.size} shapes do not separate latency from bandwidth"
        )
        return LinkFit(link, kind, alpha0, gbps0, 0, 0, None, None, "preset", why)
    fit = fit_alpha_beta(x1, x2, y, offset=offset)
    source: Literal["fit", "fit+preset", "preset"] = "fit"
    alpha, gbps, note = fit.alpha_ns, gbps0, ""
    if fit.inv_bw > 0 and fit.alpha_ns > 0:
        gbps = 1.0 / fit.inv_bw
        rel, r2, used = fit.median_rel_error, fit.r2, fit.used
    else:
        # one term came out 0: keep the preset for it and refit the other alone
        used = fit.used
        if fit.inv_bw <= 0:
            rest = y - offset - x2 / gbps0
            alpha = max(0.0, float(np.median(rest[used] / np.maximum(x1[used], 1e-30))))
            note = "bandwidth term not resolved (messages too small): preset bandwidth"
        else:
            rest = y - offset - x1 * alpha0
            inv = max(0.0, float(np.median(rest[used] / np.maximum(x2[used], 1e-30))))
            alpha, gbps = alpha0, (1.0 / inv if inv > 0 else gbps0)
            note = "latency term not resolved: preset latency"
        source = "fit+preset"
        pred = offset + x1 * alpha + x2 / gbps
        rel, r2 = _quality(pred[used], y[used])
    return LinkFit(
        link, kind, alpha, gbps, int(used.sum()), int(weight[used].sum()), rel, r2, source, note
    )


def calibrate(
    samples: pl.DataFrame,
    base: Topology | None = None,
    *,
    run: str = "",
    waiting_quantile: float = 0.1,
    algorithm: Algorithm = "auto",
) -> Calibration:
    """Fit ``alpha`` and bus bandwidth per link class to collective instances.

    Intra-node: instances whose group lies on one node. Inter-node: groups spanning nodes, with
    the intra-node latency steps taken off at the fitted intra-node latency, and assuming the NICs
    are the bandwidth bottleneck (true for the presets' NVLink/NIC ratio). All_reduce's ring vs
    tree choice depends on the parameters, so the fit is repeated until the choice is stable.

    Args:
        samples: one row per instance (``SAMPLE_SCHEMA``; ``collective_samples``).
        base: the preset (and ``ranks_per_node``) to start from and fall back on; its bandwidth
            what-if is kept on the result.
        run: label for the result.
        waiting_quantile: quantile per shape of instances with missing participants.
        algorithm: all_reduce algorithm, as in ``TimingConfig``.

    Returns:
        The calibration.
    """
    base = base or Topology()
    topo = base.unscaled()
    pts = _points(samples, waiting_quantile)
    y = pts["t"].to_numpy()
    weight = pts["instances"].to_numpy()
    nodes = pts["n_nodes"].to_numpy()
    kinds = pts["kind"].to_numpy().astype(object)
    notes: list[str] = []
    chosen: np.ndarray | None = None
    for _ in range(4):
        cost = _cost(pts, topo, algorithm)
        one = nodes <= 1
        intra = _fit_link(
            "intra",
            None,
            cost.intra_steps[one],
            cost.intra_bytes[one],
            y[one],
            np.zeros(int(one.sum())),
            weight[one],
            (base._resolved("intra_node_latency_ns"), base._resolved("intra_node_gbps")),
        )
        off = cost.intra_steps * intra.alpha_ns
        inter = _fit_link(
            "inter",
            None,
            cost.inter_steps[~one],
            cost.inter_bytes[~one],
            y[~one],
            off[~one],
            weight[~one],
            (base._resolved("inter_node_latency_ns"), base._resolved("inter_node_gbps")),
        )
        topo = replace(
            topo,
            intra_node_latency_ns=intra.alpha_ns,
            intra_node_gbps=intra.gbps,
            inter_node_latency_ns=inter.alpha_ns,
            inter_node_gbps=inter.gbps,
        )
        algo = _cost(pts, topo, algorithm).algorithm
        if chosen is not None and np.array_equal(algo, chosen):
            break
        chosen = algo

    cost = _cost(pts, topo, algorithm)
    per_kind: list[LinkFit] = []
    for link, m_link, x1, x2, off in (
        ("intra", nodes <= 1, cost.intra_steps, cost.intra_bytes, np.zeros(y.size)),
        ("inter", nodes > 1, cost.inter_steps, cost.inter_bytes, cost.intra_steps * intra.alpha_ns),
    ):
        for kind in sorted({str(k) for k in kinds[m_link]}):
            m = m_link & (kinds == kind)
            if _separable(x1[m], x2[m]):
                f = fit_alpha_beta(x1[m], x2[m], y[m], offset=off[m])
                if f.inv_bw > 0:
                    per_kind.append(
                        LinkFit(
                            link,  # type: ignore[arg-type]
                            kind,
                            f.alpha_ns,
                            1.0 / f.inv_bw,
                            int(f.used.sum()),
                            int(weight[m][f.used].sum()),
                            f.median_rel_error,
                            f.r2,
                            "fit",
                        )
                    )
    for link_fit in (intra, inter):
        if link_fit.source != "fit":
            notes.append(f"{link_fit.link}: {link_fit.note or 'no data'} (preset {base.system!r})")

    usable = samples.filter(
        (pl.col("msg_bytes") >= 0)
        & (pl.col("group_size") >= 2)
        & (pl.col("transfer_ns") > 0)
        & pl.col("kind").is_not_null()
    )
    rel = None
    if usable.height:
        model = _cost(usable, topo, algorithm).time_ns(topo)
        rel = float(np.median(np.abs(model / usable["transfer_ns"].to_numpy() - 1.0)))
    result = replace(
        topo,
        bandwidth_scale=base.bandwidth_scale,
        intra_bandwidth_scale=base.intra_bandwidth_scale,
        inter_bandwidth_scale=base.inter_bandwidth_scale,
    )
    return Calibration(
        run=run,
        instances=usable.height,
        waiting_included=bool((~usable["complete"]).any()) if usable.height else False,
        intra=intra,
        inter=inter,
        per_kind=tuple(per_kind),
        median_rel_error=rel,
        topology=result,
        notes=tuple(notes),
    )


def calibrate_run(
    store: Any,
    run: str | int,
    *,
    base: Topology | None = None,
    waiting_quantile: float = 0.1,
    algorithm: Algorithm = "auto",
) -> Calibration:
    """``calibrate`` on a run's recorded collectives.

    Args:
        store: an open ``prism_trace.store.connection.Store``.
        run: name or id of a recorded run (for a sliced run, pass its parent: the slice keeps
            only the exemplars' collectives).
        base: preset to start from and fall back on (default ``Topology()``).
        waiting_quantile: quantile per shape of instances with missing participants.
        algorithm: all_reduce algorithm, as in ``TimingConfig``.

    Returns:
        The calibration.
    """
    base = base or Topology()
    run_id = run if isinstance(run, int) else store.require_run(run)
    rows = store.con.execute("SELECT name FROM run WHERE run_id = ?", [run_id]).fetchall()
    name = rows[0][0] if rows else str(run)
    samples = collective_samples(store, run_id, base)
    return calibrate(
        samples,
        base,
        run=str(name),
        waiting_quantile=waiting_quantile,
        algorithm=algorithm,
    )

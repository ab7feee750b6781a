"""The replica variance model, fitted: a persistent rank effect and per-op residuals, estimated on
every recorded data-parallel replica of a role, so that replicas never recorded can be drawn.

Why a module of its own: the ``iteration`` and ``op`` modes (``replay.whatif.variance``) replay
the representative's own recorded steps, so replicas differ only by which step they replay: the
persistent rank-to-rank differences (one GPU slower than another for the whole run) are not
there, and the slowest of N replicas cannot exceed what the representative showed. Here the log
duration of a computation op ``k`` of rank ``r`` in step ``t`` is

    y[r, k, t] = a[r] + g[t] + e[r, k, t]

per *group* (a role, the ranks that differ only in their dp coordinate, times a node kind: a
GPU's kernels and its host's CPU ops are different hardware): ``a`` is the rank effect, ``g``
the step's common mode (what slowed every replica of the role in that step; it stays, as in the
other modes) and ``e`` the rest: the op's own time and its deviation in that call.

``fit_variance`` estimates ``a`` per recorded rank (the duration-weighted mean log-ratio of its
ops to the same ops on the other replicas, step by step, then over steps), the spread ``sigma``
of a lognormal rank effect by the method of moments (the variance of the ``a`` across ranks less
the part the per-step noise contributes), ``g`` per step, and keeps ``e`` per recorded
(rank, step) as one vector over the ops: a drawn replica resamples whole vectors, so a rank's
slow step moves its ops together, and the draws are observed durations (heavy tails keep their
weight; nothing is inflated or assumed normal). Nothing is keyed on op names: ops match by kind,
name and order within a step. Communication (its duration is waiting, which the emulator
recomputes) and host ops whose end a ``sync`` edge holds (they waited for the device) are left
out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from prism_trace.graph.base import NODE_KINDS

__all__ = ["VarianceFit", "fit_variance", "op_order"]

_COMM = ("collective", "send", "recv")


def op_order(by: str) -> pl.Expr:
    """Each node's number among the nodes of its name and kind in its step of ``by`` (a rank or
    a unit), by recorded start: the k-th ``attn_fwd`` of step 3 matches the k-th of step 5, and
    of another rank."""
    return pl.col("ts").rank("ordinal").over(by, "iteration", "kind", "name").cast(pl.Int64)


@dataclass(frozen=True)
class VarianceFit:
    """The fitted model (see the module docstring).

    Attributes:
        sigma: per node kind (``NODE_KINDS`` order), the spread of the log rank effect pooled
            over roles; 0 where not estimable (one recorded replica per role, or one step).
        effects: ``source_rank, kind, group, q, effect``: each recorded rank's log rank effect
            per kind (relative to the mean of its role's recorded replicas), its group and its
            place ``q`` among the group's recorded replicas (by dp coordinate).
        ops: ``source_rank, kind, name, ord, iteration, op, t, eps``: each fitted node's op
            (numbered within its group), its step ``t`` (numbered within its group) and its own
            ``e``.
        pool: the ``e`` to draw from (``nan``: op absent in that recorded rank-step); group
            ``g``'s entry ``p`` (a recorded rank and step) and op
            ``k`` at ``pool_off[g] + p * n_ops[g] + k``.
        pool_off: per group, its first cell in ``pool``.
        pool_len: per group, its entries (recorded ranks x steps).
        n_ops: per group, its ops.
        n_replicas: per group, its recorded replicas ``m`` (the pool's entry ``q * steps + t``
            is replica ``q``'s step ``t``).
        replica_effect: the recorded replicas' effects, group ``g``'s replica ``q`` at
            ``replica_off[g] + q``.
        replica_off: per group, its first cell in ``replica_effect``.
        group_kind: per group, its node kind (index into ``NODE_KINDS``).
        summary: what was estimated, JSON-ready (stored with the emulated run).
    """

    sigma: np.ndarray
    effects: pl.DataFrame
    ops: pl.DataFrame
    pool: np.ndarray
    pool_off: np.ndarray
    pool_len: np.ndarray
    n_ops: np.ndarray
    n_replicas: np.ndarray
    replica_effect: np.ndarray
    replica_off: np.ndarray
    group_kind: np.ndarray
    summary: dict[str, Any]


def fit_variance(peers: pl.DataFrame) -> VarianceFit:
    """Fit the replica variance model on recorded nodes.

    Args:
        peers: the recorded nodes of every rank whose role is replayed: ``source_rank, role, dp,
            kind, name, iteration, ts, dur`` and optionally ``held`` (a ``sync`` edge holds the
            node's end). ``role`` numbers the ranks that differ only in ``dp``; communication,
            held nodes, nodes outside a step and durations <= 0 are left out here.

    Returns:
        The fit; with one recorded replica per role, ``sigma`` is 0 and the effects are 0: the
        draws are the representative's own steps, with the step's common mode kept (what the
        ``iteration`` mode draws).
    """
    keep = ~pl.col("kind").is_in(_COMM) & pl.col("iteration").is_not_null() & (pl.col("dur") > 0)
    if "held" in peers.columns:
        keep = keep & ~pl.col("held")
    d = (
        peers.filter(keep)
        .select(
            pl.col("source_rank").cast(pl.Int64),
            pl.col("role").cast(pl.Int64),
            pl.col("dp").cast(pl.Int64),
            pl.col("kind").cast(pl.Utf8),
            pl.col("name").fill_null(""),
            pl.col("iteration").cast(pl.Int64),
            pl.col("ts"),
            pl.col("dur").cast(pl.Float64),
        )
        .with_columns(op_order("source_rank").alias("ord"), pl.col("dur").log().alias("y"))
    )
    groups = (
        d.select("role", "kind")
        .unique()
        .sort("role", "kind")
        .with_row_index("group")
        .with_columns(pl.col("group").cast(pl.Int64))
    )
    d = d.join(groups, on=["role", "kind"])
    ranks = (
        d.select("group", "source_rank", "dp")
        .unique()
        .sort("group", "dp", "source_rank")
        .with_columns(
            pl.int_range(pl.len()).over("group").alias("q"),
            pl.len().over("group").alias("m"),
        )
    )
    ops = (
        d.select("group", "name", "ord")
        .unique()
        .sort("group", "name", "ord")
        .with_columns(pl.int_range(pl.len()).over("group").alias("op"))
    )
    steps = (
        d.select("group", "iteration")
        .unique()
        .sort("group", "iteration")
        .with_columns(pl.int_range(pl.len()).over("group").alias("t"))
    )
    d = (
        d.join(ranks.select("group", "source_rank", "q", "m"), on=["group", "source_rank"])
        .join(ops, on=["group", "name", "ord"])
        .join(steps, on=["group", "iteration"])
        .with_columns(
            pl.col("dur").mean().over("group", "op").alias("w"),
            pl.len().over("group", "op", "iteration").alias("n_cell"),
        )
    )
    effects, per_group = _rank_effects(d)
    d = d.join(effects.select("group", "source_rank", "effect"), on=["group", "source_rank"])
    d = _residuals(d, per_group)

    n_groups = groups.height
    m_g = ranks.group_by("group").agg(pl.col("m").first()).sort("group")["m"].to_numpy()
    t_g = steps.group_by("group").len().sort("group")["len"].to_numpy()
    k_g = ops.group_by("group").len().sort("group")["len"].to_numpy()
    pool_len = (m_g * t_g).astype(np.int64) if n_groups else np.zeros(0, np.int64)
    n_ops = k_g.astype(np.int64) if n_groups else np.zeros(0, np.int64)
    sizes = pool_len * n_ops
    pool_off = (np.cumsum(sizes) - sizes).astype(np.int64)
    pool = np.full(int(sizes.sum()), np.nan)
    g = d["group"].to_numpy()
    entry = d["q"].to_numpy() * t_g[g] + d["t"].to_numpy() if d.height else g
    cell = pool_off[g] + entry * n_ops[g] + d["op"].to_numpy()
    pool[cell] = d["eps_own"].to_numpy()

    n_replicas = m_g.astype(np.int64) if n_groups else np.zeros(0, np.int64)
    replica_off = (np.cumsum(n_replicas) - n_replicas).astype(np.int64)
    placed = ranks.join(
        effects.select("group", "source_rank", "effect"), on=["group", "source_rank"]
    )
    replica_effect = np.zeros(int(n_replicas.sum()))
    replica_effect[replica_off[placed["group"].to_numpy()] + placed["q"].to_numpy()] = placed[
        "effect"
    ].to_numpy()

    kind_code = {k: i for i, k in enumerate(NODE_KINDS)}
    group_kind = np.array([kind_code[k] for k in groups["kind"].to_list()], dtype=np.int64)
    sigma = _pooled_sigma(per_group, group_kind)
    summary = _summary(d, per_group, groups, effects, sigma, m_g, t_g)
    return VarianceFit(
        sigma=sigma,
        effects=effects.join(groups.select("group", "kind"), on="group")
        .join(ranks.select("group", "source_rank", "q"), on=["group", "source_rank"])
        .select("source_rank", "kind", "group", "q", "effect"),
        ops=d.select(
            "source_rank",
            "kind",
            "name",
            "ord",
            "iteration",
            "op",
            "t",
            pl.col("eps_own").alias("eps"),
        ),
        pool=pool,
        pool_off=pool_off,
        pool_len=pool_len,
        n_ops=n_ops,
        n_replicas=n_replicas,
        replica_effect=replica_effect,
        replica_off=replica_off,
        group_kind=group_kind,
        summary=summary,
    )


def _rank_effects(d: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Per (group, rank) the rank effect ``effect``; per group the moments ``v_between`` (of the
    effects across ranks, ``m - 1`` degrees of freedom), ``v_within`` (of a rank's per-step
    effects around its mean) and ``n_t`` (steps with a cell every rank has).

    A rank's effect in step ``t`` is the duration-weighted mean, over the ops every recorded
    replica of its role ran in that step, of its log duration less the mean of the replicas';
    its effect is the mean over steps. Weighted by the op's mean duration, so the effect is the
    one on the step's computation (a microsecond op's jitter does not outweigh a 20 ms op).

    A group with fewer than 2 such steps has no effects (0) and no moments: with one step a
    rank's persistent effect cannot be told from its deviation in that step, so the whole
    deviation stays in its residuals and replicas resample the recorded ranks whole (nothing is
    extrapolated). Ranks of one role that do different work (the sharded embeddings of DLRM's
    8 ranks, recorded for 1 step) would otherwise read as a 120 % rank effect.
    """
    bal = d.filter((pl.col("m") >= 2) & (pl.col("n_cell") == pl.col("m")))
    per_step = (
        bal.with_columns((pl.col("y") - pl.col("y").mean().over("group", "op", "t")).alias("c"))
        .group_by("group", "source_rank", "t")
        .agg(((pl.col("w") * pl.col("c")).sum() / pl.col("w").sum()).alias("a_t"))
    )
    per_rank = (
        per_step.group_by("group", "source_rank")
        .agg(
            pl.col("a_t").mean().alias("effect"),
            pl.col("a_t").var(ddof=1).fill_null(0.0).alias("v_t"),
            pl.len().alias("n_t"),
        )
        .filter(pl.col("n_t") >= 2)
    )
    per_group = per_rank.group_by("group").agg(
        ((pl.col("effect") ** 2).sum() / (pl.len() - 1)).alias("v_between"),
        pl.col("v_t").mean().alias("v_within"),
        pl.col("n_t").first(),
        pl.len().alias("m"),
    )
    every = d.select("group", "source_rank").unique()
    effects = every.join(
        per_rank.select("group", "source_rank", "effect"), on=["group", "source_rank"], how="left"
    ).with_columns(pl.col("effect").fill_null(0.0))
    return effects, per_group


def _residuals(d: pl.DataFrame, per_group: pl.DataFrame) -> pl.DataFrame:
    """``eps_own``: a node's log duration less its rank's effect and its step's common mode;
    ``dev``: the same less its op's mean (what the summary's residual spread measures).

    The common mode of step ``t`` is the duration-weighted mean, over the role's recorded ranks
    and ops in that step, of the log durations less the rank effect and the op's mean over
    steps, shrunk towards 0 by what the replicas' own noise explains (``_common_mode_shrink``).
    A drawn replica's op then takes a recorded rank-step's ``eps_own`` (an observed duration
    with its rank's effect and its step's common mode taken out): resampled observations, not a
    centred-and-inflated estimate, so heavy tails keep their weight and the op's mean stays the
    recorded one.
    """
    z = pl.col("y") - pl.col("effect")
    d = d.with_columns(z.alias("z")).with_columns(
        (pl.col("z") - pl.col("z").mean().over("group", "op")).alias("dev0")
    )
    d = d.with_columns(
        (
            (pl.col("w") * pl.col("dev0")).sum().over("group", "t")
            / pl.col("w").sum().over("group", "t")
        ).alias("g_raw")
    )
    d = d.join(_common_mode_shrink(d, per_group), on="group", how="left").with_columns(
        (pl.col("g_raw") * pl.col("shrink").fill_null(1.0)).alias("g_t")
    )
    return d.with_columns(
        (pl.col("z") - pl.col("g_t")).alias("eps_own"),
        (pl.col("dev0") - pl.col("g_t")).alias("dev"),
    )


def _common_mode_shrink(d: pl.DataFrame, per_group: pl.DataFrame) -> pl.DataFrame:
    """Per group, the share ``shrink`` of the measured common mode that is the steps' own.

    The measured ``g_t`` is the mean over the ``m`` recorded replicas of their deviations in step
    ``t``: a common mode (what slowed every replica in that step: a data loader, a host
    hiccup, a longer sequence) plus the mean of ``m`` independent per-rank deviations, whose
    variance is ``s^2 / m = v_within / (m - 1)`` (``_rank_effects``' moments). The common part's
    share of the variance across steps, ``1 - (s^2 / m) / var(g)`` (0 at least), is what every
    replica shares; the rest is noise of the few recorded replicas, which kept as common would
    move every drawn replica by the recorded ones' luck in that step. Why: a wait-mode job
    (independent noise per call, no common mode) recorded at dp 2 imposed that recording's step
    pattern on every replica at dp 16; on ST (a rank's computation per step correlates with any
    other's at 0.90-0.99) the share stays near 1. Without moments (one replica, one step) it
    is 1: nothing to tell noise from the common mode.
    """
    if per_group.is_empty() or d.is_empty():
        return pl.DataFrame(schema={"group": pl.Int64, "shrink": pl.Float64})
    var_g = (
        d.group_by("group", "t")
        .agg(pl.col("g_raw").first())
        .group_by("group")
        .agg(pl.col("g_raw").var(ddof=1).alias("var_g"))
    )
    noise = per_group.select(
        pl.col("group").cast(pl.Int64),
        (pl.col("v_within") / (pl.col("m") - 1).clip(lower_bound=1)).alias("noise"),
    )
    return (
        var_g.join(noise, on="group")
        .with_columns(
            pl.when(pl.col("var_g") > 0)
            .then((1.0 - pl.col("noise") / pl.col("var_g")).clip(0.0, 1.0))
            .otherwise(1.0)
            .alias("shrink")
        )
        .select(pl.col("group").cast(pl.Int64), "shrink")
    )


def _pooled_sigma(per_group: pl.DataFrame, group_kind: np.ndarray) -> np.ndarray:
    """Per node kind, the spread of the log rank effect: method of moments per group, pooled.

    With ``m`` replicas and ``n_t`` steps, a rank's mean effect is its true effect plus the mean
    of ``n_t`` per-step deviations: its variance across ranks is ``sigma^2 + s^2 / n_t``, where
    ``s^2`` (a per-step deviation's variance) is ``v_within * m / (m - 1)`` (the per-step
    effects are centred across the ``m`` replicas). So ``sigma^2 = v_between - v_within * m /
    ((m - 1) n_t)``, pooled over a kind's groups with weights ``m - 1``, and 0 when negative.
    """
    out = np.zeros(len(NODE_KINDS))
    if per_group.is_empty():
        return out
    g = per_group["group"].to_numpy()
    m = per_group["m"].to_numpy().astype(np.float64)
    n_t = per_group["n_t"].to_numpy().astype(np.float64)
    vb = per_group["v_between"].to_numpy()
    vw = per_group["v_within"].to_numpy()
    noise = np.where(n_t >= 2, vw * m / ((m - 1) * np.maximum(n_t, 1)), 0.0)
    s2 = vb - noise
    for k in np.unique(group_kind[g]):
        at = group_kind[g] == k
        out[k] = math.sqrt(max(0.0, float(np.sum((m[at] - 1) * s2[at]) / np.sum(m[at] - 1))))
    return out


def _summary(
    d: pl.DataFrame,
    per_group: pl.DataFrame,
    groups: pl.DataFrame,
    effects: pl.DataFrame,
    sigma: np.ndarray,
    m_g: np.ndarray,
    t_g: np.ndarray,
) -> dict[str, Any]:
    """What was estimated, per node kind: the rank effect's spread, the recorded ranks' effects,
    the per-step spread of a rank's effect, the ops' residual spread (duration-weighted RMS of
    the inflated residuals), the share of the measured common mode kept, the replicas per role
    and the steps."""
    out: dict[str, Any] = {}
    kinds = groups["kind"].to_list()
    eff = effects.join(groups.select("group", "kind"), on="group")
    for kind in sorted(set(kinds)):
        gs = [i for i, k in enumerate(kinds) if k == kind]
        rows = d.filter(pl.col("kind") == kind)
        w = rows["w"].to_numpy()
        r = rows["dev"].to_numpy()
        pg = per_group.filter(pl.col("group").is_in(gs))
        step_sd = None
        if not pg.is_empty():
            m = pg["m"].to_numpy().astype(np.float64)
            s2 = pg["v_within"].to_numpy() * m / (m - 1)
            step_sd = float(np.sqrt(np.mean(s2)))
        ke = eff.filter(pl.col("kind") == kind).sort("source_rank")
        out[kind] = {
            "sigma_rank_effect": round(float(sigma[NODE_KINDS.index(kind)]), 6),
            "rank_step_sd": None if step_sd is None else round(step_sd, 6),
            "common_mode_share": round(float(np.mean(rows["shrink"].fill_null(1.0).to_numpy())), 4)
            if rows.height
            else None,
            "residual_sd": round(float(np.sqrt(np.sum(w * r * r) / np.sum(w))), 6)
            if r.size
            else None,
            "roles": len(gs),
            "recorded_replicas": sorted({int(m_g[g]) for g in gs}),
            "steps": sorted({int(t_g[g]) for g in gs}),
            "rank_effects": {
                str(s): round(float(e), 6)
                for s, e in zip(ke["source_rank"].to_list(), ke["effect"].to_list(), strict=True)
            },
        }
    return out

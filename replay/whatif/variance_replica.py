"""The ``replica`` variance mode's draws: every replica that was not recorded draws its own rank
effect and, per step, a recorded rank-step's residuals, from the fitted model (seeded).

Why a module of its own: the model is fitted once on the recording (``replay.whatif.variance_fit``);
the draws are made for the replica vector's columns (``replica_columns``, for
``replay.des.replicas.replica_durations``) or for units of their own (``unit_durations``: the
expanded replicas, a recorded run). A node of recorded rank ``s`` takes, in a replica with rank
effect ``A`` that drew the recorded rank-step ``p`` for its step,

    dur * exp(A - a[s] + e[p, k] - e[s, k, t])

so its log duration is ``center[k, t] + A + e[p, k]``: the representative's own effect and
residual are replaced by the drawn ones, the step's common mode stays. ``A`` is normal with the
fitted spread (a lognormal speed factor), one per (unit, node kind, replica); ``p`` is one uniform
per (replica, step), shared by the classes of the replica (a recorded rank-step of the same dp
position and step in every role). A node whose op was not fitted takes the rank effect alone;
communication and held nodes keep their durations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
from prism_trace.replay.whatif.variance import _first_rows
from prism_trace.replay.whatif.variance_fit import VarianceFit, op_order

from prism_trace.graph.base import NODE_KINDS

__all__ = [
    "NodeDraws",
    "describe_fit",
    "node_draws",
    "recorded_term",
    "replica_columns",
    "unit_durations",
]

_COMM = ("collective", "send", "recv")


@dataclass(frozen=True)
class NodeDraws:
    """What every drawing node needs, row by row (``node_draws``).

    Attributes:
        rows: the nodes that draw (indices into the nodes).
        kind: node kind (index into ``NODE_KINDS``).
        group: the fit's group.
        effect: the recorded rank's own effect.
        cell0: the op's cell in the group's first pool entry (-1: op not fitted).
        eps: the node's own residual (0 where unknown).
        step: the node's step, numbered densely.
        n_steps: steps.
        t: the node's step in the fit's numbering of its group's steps (-1: op not fitted).
        q: its recorded rank's place among the group's recorded replicas (-1: not fitted).
    """

    rows: np.ndarray
    kind: np.ndarray
    group: np.ndarray
    effect: np.ndarray
    cell0: np.ndarray
    eps: np.ndarray
    step: np.ndarray
    n_steps: int
    t: np.ndarray
    q: np.ndarray


def node_draws(fit: VarianceFit, nodes: pl.DataFrame, held: np.ndarray) -> NodeDraws:
    """Look each node up in the fit: its group, its recorded rank's effect, its op and residual.

    The nodes of one ``(source_rank, node_id)`` (a class graph copied to units) share the
    lookup, done once per recorded node.

    Args:
        fit: the fitted model.
        nodes: ``source_rank, node_id, kind, name, iteration, ts`` per node.
        held: per node, whether a ``sync`` edge holds its end (its duration was waiting).
    """
    src = nodes["source_rank"].to_numpy().astype(np.int64)
    first, node_rec = _first_rows(src, nodes["node_id"].to_numpy().astype(np.int64))
    rec = (
        nodes[first]
        .select(
            pl.col("source_rank").cast(pl.Int64),
            pl.col("kind").cast(pl.Utf8),
            pl.col("name").fill_null(""),
            pl.col("iteration").cast(pl.Int64),
            "ts",
        )
        .with_row_index("r")
        .with_columns(op_order("source_rank").alias("ord"))
    )
    look = (
        rec.join(fit.effects, on=["source_rank", "kind"], how="left")
        .join(fit.ops, on=["source_rank", "kind", "name", "ord", "iteration"], how="left")
        .sort("r")
    )
    group = look["group"].fill_null(-1).to_numpy().astype(np.int64)[node_rec]
    draws = (
        (group >= 0)
        & ~nodes["kind"].is_in(_COMM).to_numpy()
        & nodes["iteration"].is_not_null().to_numpy()
        & ~np.asarray(held, dtype=bool)
    )
    rows = np.flatnonzero(draws)
    r = node_rec[rows]
    g = group[rows]
    op = look["op"].fill_null(-1).to_numpy().astype(np.int64)[r]
    code = {k: i for i, k in enumerate(NODE_KINDS)}
    kind = np.array([code[k] for k in look["kind"].to_list()], dtype=np.int64)[r]
    it = nodes["iteration"].to_numpy()[rows].astype(np.int64)
    _, step = np.unique(it, return_inverse=True)
    return NodeDraws(
        rows=rows,
        kind=kind,
        group=g,
        effect=look["effect"].fill_null(0.0).to_numpy()[r],
        cell0=np.where(op >= 0, fit.pool_off[g] + op, -1) if rows.size else op,
        eps=look["eps"].fill_null(0.0).fill_nan(0.0).to_numpy()[r],
        step=step.ravel().astype(np.int64),
        n_steps=int(np.unique(it).size),
        t=look["t"].fill_null(-1).to_numpy().astype(np.int64)[r],
        q=look["q"].fill_null(-1).to_numpy().astype(np.int64)[r],
    )


def recorded_term(
    fit: VarianceFit, nd: NodeDraws, place: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per drawing node, the log factor that turns its duration into the same op's in the recorded
    replica at ``place`` among its group's other recorded replicas (0: the first replica that is
    not the node's own rank), and whether there is one.

    The factor is ``a[s'] - a[s] + e[s', k, t] - e[s, k, t]``: with the recorded duration as the
    base, exactly the recorded replica's own duration of that op in that step (its effect alone
    where the op is missing from that rank-step). Why: a replica that was recorded is a real GPU
    of the target world; drawing it again would throw its measured speed away (a dp 2 recording
    whose second replica is slower than the first predicts dp 4 from that slow replica and
    two drawn ones, not from four drawn).

    Args:
        fit: the fitted model.
        nd: the drawing nodes.
        place: per drawing node (or one for all), the place among the recorded replicas of its
            group other than its own rank.
    """
    place = np.broadcast_to(np.asarray(place, dtype=np.int64), nd.rows.shape)
    fitted = (nd.q >= 0) & (nd.t >= 0)
    q = place + (place >= nd.q)  # skip the node's own rank
    m = fit.n_replicas[nd.group] if nd.rows.size else np.zeros(0, np.int64)
    ok = fitted & (place >= 0) & (q < m)
    if not ok.any():
        return np.zeros(nd.rows.size), ok
    g = np.where(ok, nd.group, 0)
    qq = np.where(ok, q, 0)
    a = np.where(ok, fit.replica_effect[fit.replica_off[g] + qq], 0.0)
    steps = np.where(ok, fit.pool_len[g] // np.maximum(m, 1), 0)
    cell = np.where(ok & (nd.cell0 >= 0), nd.cell0 + (qq * steps + nd.t) * fit.n_ops[g], 0)
    e = (
        np.where(ok & (nd.cell0 >= 0), fit.pool[cell], np.nan)
        if fit.pool.size
        else np.full(ok.shape, np.nan)
    )
    resid = np.where(np.isnan(e), 0.0, e - nd.eps)
    return np.where(ok, a - nd.effect + resid, 0.0), ok


def _residual_term(fit: VarianceFit, nd: NodeDraws, u: np.ndarray) -> np.ndarray:
    """``e[p, k] - e[s, k, t]`` per drawing node and column, for uniforms ``u`` per (drawing
    node, column): the drawn recorded rank-step's residual less the node's own (0 where either
    is unknown)."""
    size = fit.pool_len[nd.group][:, None]
    p = np.minimum((u * size).astype(np.int64), size - 1)
    if fit.pool.size == 0:
        return np.zeros(p.shape)
    ok = (nd.cell0 >= 0)[:, None]
    cell = np.where(ok, nd.cell0[:, None] + p * fit.n_ops[nd.group][:, None], 0)
    r = np.where(ok, fit.pool[cell], np.nan)
    return np.where(np.isnan(r), 0.0, r - nd.eps[:, None])


def replica_columns(
    nodes: pl.DataFrame,
    base: np.ndarray,
    fit: VarianceFit,
    held: np.ndarray,
    *,
    replicas: int,
    seed: int,
) -> np.ndarray:
    """``(nodes, replicas)`` durations: ``base`` in column 0 (the recording), drawn in the others.

    Args:
        nodes: the class graph's nodes: ``unit, source_rank, node_id, kind, name, iteration,
            ts``.
        base: per node, the duration the columns start from.
        fit: the fitted model.
        held: per node, whether a ``sync`` edge holds its end.
        replicas: columns.
        seed: the seed; the same seed gives the same durations.

    Columns are drawn in blocks, so the transient memory stays a few times ``nodes x block``.
    """
    n = nodes.height
    out = np.empty((n, replicas), dtype=np.int64)
    out[:] = base[:, None]
    nd = node_draws(fit, nodes, held)
    if replicas < 2 or nd.rows.size == 0:
        return out
    unit = nodes["unit"].to_numpy().astype(np.int64)[nd.rows]
    n_units = int(unit.max()) + 1
    sig = fit.sigma[nd.kind][:, None]
    b_rows = base[nd.rows].astype(np.float64)[:, None]
    rng = np.random.default_rng(seed)
    block = max(1, (1 << 21) // nd.rows.size)
    for c0 in range(1, replicas, block):
        c1 = min(replicas, c0 + block)
        z = rng.standard_normal((n_units, len(NODE_KINDS), c1 - c0))
        u = rng.random((nd.n_steps, c1 - c0))
        log_f = z[unit, nd.kind] * sig - nd.effect[:, None]
        log_f += _residual_term(fit, nd, u[nd.step])
        out[nd.rows, c0:c1] = np.rint(b_rows * np.exp(log_f)).astype(np.int64)
    # Replicas that were recorded replay their recording (``recorded_term``): column c is
    # replica c, and replica 0 is the representative itself.
    most = int(fit.n_replicas.max()) if fit.n_replicas.size else 0
    for c in range(1, min(replicas, most)):
        term, ok = recorded_term(fit, nd, np.full(nd.rows.size, c - 1))
        out[nd.rows[ok], c] = np.rint(b_rows[ok, 0] * np.exp(term[ok])).astype(np.int64)
    return out


def unit_durations(
    nodes: pl.DataFrame,
    fit: VarianceFit,
    held: np.ndarray,
    *,
    draw: np.ndarray,
    replica: np.ndarray,
    keep_effect: np.ndarray,
    seed: int,
) -> np.ndarray:
    """Per node, its duration drawn for its unit (a recorded rank, or an expanded replica).

    Args:
        nodes: ``unit, source_rank, node_id, kind, name, iteration, ts, dur``.
        fit: the fitted model.
        held: per node, whether a ``sync`` edge holds its end.
        draw: per unit, whether it draws (False: keeps the recorded durations).
        replica: per unit, its data-parallel replica: the units of one replica draw the same
            recorded rank-step per step.
        keep_effect: per unit, whether it keeps its own rank effect (a recorded rank is that
            GPU: only its residuals are drawn) instead of drawing one.
        seed: the seed.
    """
    dur = nodes["dur"].fill_null(0).to_numpy().astype(np.int64)
    draw = np.asarray(draw, dtype=bool)
    nd = node_draws(fit, nodes, held)
    unit = nodes["unit"].to_numpy().astype(np.int64)[nd.rows]
    sel = draw[unit]
    if not sel.any():
        return dur
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((draw.size, len(NODE_KINDS)))
    replica = np.asarray(replica, dtype=np.int64)
    u = rng.random((int(replica.max()) + 1, nd.n_steps))
    log_f = np.where(
        np.asarray(keep_effect, dtype=bool)[unit],
        0.0,
        z[unit, nd.kind] * fit.sigma[nd.kind] - nd.effect,
    )
    log_f += _residual_term(fit, nd, u[replica[unit], nd.step][:, None])[:, 0]
    # a virtual replica that was recorded (dp 1 .. m-1 of a sliced run) replays its recording
    virtual = ~np.asarray(keep_effect, dtype=bool)[unit] & (replica[unit] >= 1)
    term, ok = recorded_term(fit, nd, np.where(virtual, replica[unit] - 1, -1))
    log_f = np.where(ok, term, log_f)
    at = nd.rows[sel]
    dur[at] = np.rint(dur[at] * np.exp(log_f[sel])).astype(np.int64)
    return dur


def describe_fit(fit: VarianceFit) -> str:
    """One line: the rank effect's spread, the per-step and residual spreads, per node kind."""
    parts = []
    for kind, s in fit.summary.items():

        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:.2f} %"

        effects = s["rank_effects"]
        eff = ", ".join(f"{r} {100 * e:+.2f} %" for r, e in effects.items())
        if len(effects) > 8:  # a long list goes to run.config_json; the note says its range
            lo, hi = min(effects.values()), max(effects.values())
            eff = f"{len(effects)} from {100 * lo:+.2f} % to {100 * hi:+.2f} %"
        reps = "/".join(str(m) for m in s["recorded_replicas"])
        parts.append(
            f"{kind}: rank effect sigma {pct(s['sigma_rank_effect'])} ({s['roles']} roles x"
            f" {reps} recorded replicas; recorded ranks {eff}), per-step deviation"
            f" {pct(s['rank_step_sd'])}, op residual {pct(s['residual_sd'])}, common mode kept"
            f" {pct(s.get('common_mode_share'))}"
        )
    return "; ".join(parts) if parts else "nothing to fit (no computation in a step)"

"""The ``replica`` variance mode: the fit of a rank effect and residuals on the recorded
replicas (``replay.whatif.variance_fit``) and the replicas drawn from it
(``replay.whatif.variance_replica``).

What would break if the model were wrong: the fit would not recover a known rank-effect spread
(or would mistake the within-rank noise for one), the draws would not be reproducible per seed or
would not spread as fitted, a recorded rank would lose its own effect, or the old modes would
change.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from prism_trace.replay.des.replicas import replica_durations
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.driver import emulate_in_memory, emulate_run
from prism_trace.replay.whatif.config import SlowDown, WhatIfConfig, parse_what_if
from prism_trace.replay.whatif.variance_fit import VarianceFit, fit_variance
from prism_trace.replay.whatif.variance_replica import replica_columns, unit_durations

from prism_trace.store.connection import Store


def synthetic(
    *,
    roles: int,
    replicas: int,
    steps: int,
    ops: int,
    sigma_rank: float,
    sigma_op: float,
    sigma_step: float = 0.02,
    seed: int = 0,
) -> tuple[pl.DataFrame, np.ndarray]:
    """Recorded nodes of ``roles x replicas`` ranks: op ``k`` of rank ``r`` in step ``t`` lasts
    ``mu[k] * exp(a[r] + g[t] + e)`` with ``a ~ N(0, sigma_rank)`` per rank, ``g`` per step
    (the common mode) and ``e ~ N(0, sigma_op)`` per call. Returns the nodes and ``a``."""
    rng = np.random.default_rng(seed)
    n_ranks = roles * replicas
    a = rng.normal(0, sigma_rank, n_ranks)
    g = rng.normal(0, sigma_step, steps)
    mu = np.exp(rng.normal(np.log(5e6), 1.0, ops))
    r, t, k = np.meshgrid(np.arange(n_ranks), np.arange(steps), np.arange(ops), indexing="ij")
    r, t, k = r.ravel(), t.ravel(), k.ravel()
    dur = mu[k] * np.exp(a[r] + g[t] + rng.normal(0, sigma_op, r.size))
    nodes = pl.DataFrame(
        {
            "source_rank": r,
            "role": r // replicas,
            "dp": r % replicas,
            "node_id": t * ops + k,
            "kind": "host",
            "name": [f"op{x}" for x in k],
            "iteration": t + 1,
            "ts": t * 10**10 + k * 10**7,
            "dur": np.rint(dur).astype(np.int64),
        }
    )
    return nodes, a


def kind_summary(fit: VarianceFit) -> dict:
    return fit.summary["host"]


def test_the_fit_recovers_a_known_rank_effect_and_residual_spread() -> None:
    nodes, a = synthetic(roles=32, replicas=4, steps=8, ops=20, sigma_rank=0.05, sigma_op=0.10)
    fit = fit_variance(nodes)
    s = kind_summary(fit)
    assert 0.042 <= s["sigma_rank_effect"] <= 0.058
    assert 0.088 <= s["residual_sd"] <= 0.105
    assert s["recorded_replicas"] == [4]
    assert s["roles"] == 32
    # each recorded rank's effect, relative to its role's mean, is found
    eff = fit.effects.sort("source_rank")["effect"].to_numpy()
    truth = a - np.repeat(a.reshape(32, 4).mean(axis=1), 4)
    assert np.corrcoef(eff, truth)[0, 1] > 0.95
    assert np.abs(eff - truth).max() < 0.03


def test_the_within_rank_noise_is_not_taken_for_a_rank_effect() -> None:
    # No rank effect, noisy ops, few steps: the effects' raw spread is noise, which the method
    # of moments removes.
    nodes, _ = synthetic(roles=256, replicas=2, steps=4, ops=5, sigma_rank=0.0, sigma_op=0.3)
    fit = fit_variance(nodes)
    raw = float(np.sqrt(np.mean(fit.effects["effect"].to_numpy() ** 2) * 2))
    assert raw > 0.06
    assert kind_summary(fit)["sigma_rank_effect"] < 0.035


def test_one_recorded_replica_per_role_has_no_rank_effect_but_residuals() -> None:
    nodes, _ = synthetic(roles=4, replicas=1, steps=6, ops=10, sigma_rank=0.05, sigma_op=0.1)
    fit = fit_variance(nodes)
    s = kind_summary(fit)
    assert s["sigma_rank_effect"] == 0.0
    assert s["recorded_replicas"] == [1]
    assert (fit.effects["effect"] == 0).all()
    assert np.isfinite(fit.pool).sum() == nodes.height
    assert 0.07 <= s["residual_sd"] <= 0.11


def test_one_recorded_step_leaves_the_ranks_whole() -> None:
    # One step: a rank's persistent effect cannot be told from its deviation in that step (nor
    # from different work: DLRM's sharded embeddings), so nothing is extrapolated: no rank
    # effect, and each recorded rank's deviation stays in its residuals, resampled whole.
    nodes, _ = synthetic(roles=4, replicas=4, steps=1, ops=10, sigma_rank=0.3, sigma_op=0.05)
    fit = fit_variance(nodes)
    s = kind_summary(fit)
    assert s["sigma_rank_effect"] == 0.0
    assert s["rank_step_sd"] is None
    assert (fit.effects["effect"] == 0).all()
    assert fit.pool_len.tolist() == [4] * 4


def test_communication_and_held_nodes_are_left_out_of_the_fit() -> None:
    nodes, _ = synthetic(roles=8, replicas=4, steps=4, ops=10, sigma_rank=0.05, sigma_op=0.1)
    fit = fit_variance(nodes)
    rng = np.random.default_rng(5)
    waits = nodes.sample(200, seed=1).with_columns(
        pl.lit("collective").alias("kind"),
        pl.Series("dur", rng.integers(1, 10**9, 200)),
    )
    held = nodes.sample(200, seed=2).with_columns(
        pl.Series("dur", rng.integers(1, 10**9, 200)), pl.lit("blocking").alias("name")
    )
    both = pl.concat(
        [
            nodes.with_columns(held=pl.lit(value=False)),
            waits.with_columns(held=pl.lit(value=False)),
            held.with_columns(held=pl.lit(value=True)),
        ]
    )
    again = fit_variance(both)
    assert again.summary == fit.summary
    assert np.array_equal(again.pool, fit.pool, equal_nan=True)


def class_graph(nodes: pl.DataFrame) -> pl.DataFrame:
    """The dp-0 ranks' nodes as a class graph: one unit per role."""
    return (
        nodes.filter(pl.col("dp") == 0)
        .with_columns(pl.col("role").alias("unit"))
        .sort("unit", "node_id")
    )


def test_replica_draws_are_seeded_and_column_0_is_the_recording() -> None:
    nodes, _ = synthetic(roles=2, replicas=4, steps=4, ops=10, sigma_rank=0.05, sigma_op=0.1)
    fit = fit_variance(nodes)
    cls = class_graph(nodes)
    # a communication node and a held node keep their duration in every column
    cls = cls.with_columns(
        pl.when(pl.int_range(pl.len()) == 3)
        .then(pl.lit("collective"))
        .otherwise(pl.col("kind"))
        .alias("kind")
    )
    held = np.zeros(cls.height, dtype=bool)
    held[5] = True
    base = cls["dur"].to_numpy()
    a = replica_columns(cls, base, fit, held, replicas=64, seed=1)
    b = replica_columns(cls, base, fit, held, replicas=64, seed=1)
    c = replica_columns(cls, base, fit, held, replicas=64, seed=2)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.array_equal(a[:, 0], base)
    assert (a[3] == base[3]).all()
    assert (a[5] == base[5]).all()
    assert np.unique(a, axis=1).shape[1] == 64  # every replica its own


def test_replica_draws_spread_as_fitted() -> None:
    # Without op noise, a drawn replica's ops all move by its rank effect less the
    # representative's: across many replicas the spread of that log factor is the fitted sigma.
    nodes, _ = synthetic(roles=16, replicas=4, steps=4, ops=10, sigma_rank=0.05, sigma_op=0.0)
    fit = fit_variance(nodes)
    sigma = kind_summary(fit)["sigma_rank_effect"]
    cls = class_graph(nodes)
    base = cls["dur"].to_numpy()
    d = replica_columns(cls, base, fit, np.zeros(cls.height, bool), replicas=4001, seed=3)
    unit = cls["unit"].to_numpy()
    log_f = np.log(d[unit == 0, 1:] / base[unit == 0, None])
    assert np.ptp(log_f, axis=0).max() < 1e-3  # one factor per replica for all its ops
    spread = float(log_f[0].std())
    assert abs(spread - sigma) < 0.05 * sigma
    # the representative's own effect is taken out: replicas centre on the role's mean
    rep = fit.effects.filter(pl.col("source_rank") == 0)["effect"].item()
    assert abs(float(log_f[0].mean()) + rep) < 3 * sigma / np.sqrt(4000)


def test_a_recorded_rank_keeps_its_rank_effect() -> None:
    nodes, _ = synthetic(roles=2, replicas=4, steps=4, ops=10, sigma_rank=0.05, sigma_op=0.0)
    fit = fit_variance(nodes)
    units = nodes.with_columns(pl.col("source_rank").alias("unit")).sort("unit", "node_id")
    n_units = 8
    kw = {"draw": np.ones(n_units, bool), "replica": np.arange(n_units) % 4, "seed": 4}
    held = np.zeros(units.height, bool)
    kept = unit_durations(units, fit, held, keep_effect=np.ones(n_units, bool), **kw)
    # no op noise: a rank that keeps its effect and draws residuals keeps its durations
    assert np.abs(kept / units["dur"].to_numpy() - 1).max() < 1e-3
    drawn = unit_durations(units, fit, held, keep_effect=np.zeros(n_units, bool), **kw)
    assert np.abs(drawn / units["dur"].to_numpy() - 1).max() > 0.01
    again = unit_durations(units, fit, held, keep_effect=np.zeros(n_units, bool), **kw)
    assert np.array_equal(drawn, again)
    none = unit_durations(
        units, fit, held, keep_effect=np.zeros(n_units, bool), **{**kw, "draw": np.zeros(8, bool)}
    )
    assert np.array_equal(none, units["dur"].to_numpy())


def test_the_old_modes_ignore_the_fit() -> None:
    nodes, _ = synthetic(roles=2, replicas=2, steps=4, ops=6, sigma_rank=0.05, sigma_op=0.1)
    fit = fit_variance(nodes)
    cls = class_graph(nodes).with_columns(pl.lit(0).alias("track_id"))
    base = cls["dur"].to_numpy()
    for mode in ("iteration", "op"):
        kw = {"replicas": 8, "variance": True, "seed": 5, "mode": mode}
        with_fit = replica_durations(cls, base, fit=fit, **kw)  # type: ignore[arg-type]
        assert np.array_equal(with_fit, replica_durations(cls, base, **kw))  # type: ignore[arg-type]


def test_the_default_variance_mode_is_replica() -> None:
    assert WhatIfConfig(variance=True).variance_mode == "replica"
    assert parse_what_if(["variance"]).variance_mode == "replica"
    assert parse_what_if(["variance=iteration"]).variance_mode == "iteration"
    assert parse_what_if(["variance=replica"]).variance_mode == "replica"


@pytest.fixture(scope="module")
def store(sliced_sample_store: Store) -> Store:
    """The sample with its graph and the slices `s4`, `s2048`, `s16384` (`tp=2,dp=N,pp=2`)."""
    return sliced_sample_store


def test_the_fit_is_stored_with_the_emulated_run(store: Store) -> None:
    cfg = EmulationConfig(what_if=parse_what_if(["variance"]), seed=2)
    report = emulate_run(store, run="s4", out_run="e4_replica", config=cfg)
    assert any("rank effect sigma" in n for n in report.notes)
    ((text,),) = store.con.execute(
        "SELECT config_json FROM run WHERE name = 'e4_replica'"
    ).fetchall()
    fit = json.loads(text)["variance_fit"]
    # the sample: 4 roles (tp x pp) of 2 recorded replicas, host ops only
    assert fit["host"]["roles"] == 4
    assert fit["host"]["recorded_replicas"] == [2]
    assert fit["host"]["sigma_rank_effect"] > 0
    assert set(fit["host"]["rank_effects"]) == {str(r) for r in range(8)}
    assert json.loads(text)["config"]["what_if"]["variance_mode"] == "replica"


def test_recorded_and_expanded_runs_draw_in_the_replica_mode(store: Store) -> None:
    def run(name: str, what_if: WhatIfConfig, seed: int) -> pl.DataFrame:
        cfg = EmulationConfig(what_if=what_if, seed=seed)
        return emulate_in_memory(store, run=name, config=cfg)[1].sort("rank", "iteration")

    # a recorded run: every rank draws its residuals, keeping its own rank effect
    plain = run("sample", WhatIfConfig(), 0)
    a = run("sample", WhatIfConfig(variance=True), 1)
    assert a.equals(run("sample", WhatIfConfig(variance=True), 1))
    assert not a["dur"].equals(plain["dur"])
    assert not a["dur"].equals(run("sample", WhatIfConfig(variance=True), 2)["dur"])
    # a rank-targeted slow-down of communication expands replicas into units of their own
    slow = (SlowDown(factor=1.5, ranks=(9,), kinds=("collective",)),)
    res, _ = emulate_in_memory(
        store, run="s4", config=EmulationConfig(what_if=WhatIfConfig(slow=slow, variance=True))
    )
    assert res.replicas is None  # the expanded units, not the replica vector
    assert any("12 of 16 units draw their rank effect" in n for n in res.inputs.notes)
    base = run("s4", WhatIfConfig(slow=slow), 0)
    b = run("s4", WhatIfConfig(slow=slow, variance=True), 1)
    assert b.equals(run("s4", WhatIfConfig(slow=slow, variance=True), 1))
    assert not b["dur"].equals(base["dur"])


def test_replicas_that_were_recorded_replay_their_recording() -> None:
    # dp 3 recorded, emulated at dp 6: replicas 1 and 2 are the recorded GPUs (their measured
    # speed and their own steps), only replicas 3-5 draw. Drawing all five threw the recorded
    # slow replica away: a dp 2 ladder whose replicas ran 3.3 % apart predicted dp 4
    # +1.1 % where the recording grew +0.2 %.
    nodes, _ = synthetic(roles=2, replicas=3, steps=4, ops=10, sigma_rank=0.05, sigma_op=0.1)
    fit = fit_variance(nodes)
    cls = class_graph(nodes)
    base = cls["dur"].to_numpy()
    cols = replica_columns(cls, base, fit, np.zeros(cls.height, bool), replicas=6, seed=7)
    for dp in (1, 2):
        recorded = nodes.filter(pl.col("dp") == dp).sort("role", "node_id")["dur"].to_numpy()
        assert np.abs(cols[:, dp] / recorded - 1).max() < 1e-6
    for c in range(3, 6):
        for dp in range(3):
            other = nodes.filter(pl.col("dp") == dp).sort("role", "node_id")["dur"].to_numpy()
            assert np.abs(cols[:, c] / other - 1).max() > 0.01
    # the expanded units of a sliced run take the same rule: replica r < 3 is recorded rank r
    units = pl.concat(
        [cls.with_columns((pl.col("unit") * 6 + r).alias("unit")) for r in range(6)]
    ).sort("unit", "node_id")
    n_units = 12
    drawn = unit_durations(
        units,
        fit,
        np.zeros(units.height, bool),
        draw=np.arange(n_units) % 6 != 0,
        replica=np.arange(n_units) % 6,
        keep_effect=np.zeros(n_units, bool),
        seed=8,
    )
    unit = units["unit"].to_numpy()
    for u in range(n_units):
        r = u % 6
        if r < 3:
            recorded = (
                nodes.filter((pl.col("dp") == r) & (pl.col("role") == u // 6))
                .sort("node_id")["dur"]
                .to_numpy()
            )
            assert np.abs(drawn[unit == u] / recorded - 1).max() < 1e-6


def test_the_common_mode_is_what_the_replicas_share_not_their_noise() -> None:
    # No common mode (independent noise per call, as the wait-mode ladder draws): the measured
    # per-step mean of 2 replicas is their noise, and almost none of it is kept; a strong common
    # mode (every replica slowed together in a step) is kept almost whole.
    quiet, _ = synthetic(
        roles=16, replicas=2, steps=12, ops=8, sigma_rank=0.02, sigma_op=0.08, sigma_step=0.0
    )
    shared, _ = synthetic(
        roles=16, replicas=2, steps=12, ops=8, sigma_rank=0.02, sigma_op=0.02, sigma_step=0.08
    )
    assert kind_summary(fit_variance(quiet))["common_mode_share"] < 0.3
    assert kind_summary(fit_variance(shared))["common_mode_share"] > 0.9
    # so the drawn replicas, on average over many, hardly move from step to step: the recorded
    # steps' ups and downs were the two replicas' noise (kept whole, the average over 400
    # replicas moved 0.58 times as much as the representative did; now 0.20 times)
    fit = fit_variance(quiet)
    cls = class_graph(quiet)
    base = cls["dur"].to_numpy()
    cols = replica_columns(cls, base, fit, np.zeros(cls.height, bool), replicas=400, seed=9)
    step = cls["iteration"].to_numpy()
    own = np.log([base[step == t].sum() for t in np.unique(step)])
    drawn = np.log([cols[step == t, 2:].sum(axis=0).mean() for t in np.unique(step)])
    assert drawn.std() < 0.35 * own.std()

"""The variance draws against the recording (``replay.drawcheck``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prism_trace.replay.validate.draws import check_draws, ks_two_sample

from prism_trace.store.connection import Store
from tests.conftest import ingest_runs


def test_ks_two_sample() -> None:
    a = np.arange(100.0)
    assert ks_two_sample(a, a) == (0.0, 1.0)
    d, p = ks_two_sample(a, a + 1000)
    assert d == 1.0
    assert p < 1e-6
    d, _ = ks_two_sample(np.array([1.0, 2.0, 3.0, 4.0]), np.array([3.0, 4.0, 5.0, 6.0]))
    assert d == 0.5
    with pytest.raises(ValueError, match="non-empty"):
        ks_two_sample(a, np.zeros(0))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, shared_datasets: Path) -> Store:
    from prism_trace.graph.build import build_graph

    s = ingest_runs(
        tmp_path_factory.mktemp("draws") / "d.duckdb",
        {"st": [shared_datasets / "megatron-straggler-st-8rank"]},
    )
    build_graph(s, "st")
    return s  # type: ignore[return-value]


def test_st_draws_reproduce_the_recorded_mean_and_p90(store: Store) -> None:
    d = check_draws(store, run="st", seeds=2)
    assert d.slice_ranks == [0, 2, 4, 6]
    assert d.emulated.size == 2 * d.recorded.size
    assert abs(d.mean_error_pct) <= 2
    assert abs(d.p90_error_pct) <= 2
    assert store.run_id("_draws_st_slice") is None  # the slice is cleaned up


def test_st_draws_keep_the_spread_of_the_recorded_steps(store: Store) -> None:
    # The step's common mode is kept and only an op's own deviation is drawn: independent whole
    # steps per class and replica made the spread 1.25x the recorded one (std 63 vs 51 ms).
    d = check_draws(store, run="st", seeds=2, mode="op")
    assert 0.9 <= d.std_ratio <= 1.15
    assert d.emulated.max() <= 1.02 * d.recorded.max()
    # The slice without variance is the baseline: biased low, and further from the recording.
    assert d.baseline.size == d.recorded.size
    assert d.baseline_mean_error_pct < 0
    assert d.ks[0] < d.baseline_ks


def test_recorded_run_draws_keep_the_spread_too(store: Store) -> None:
    # A recorded run emulated with variance: every rank draws
    # (replay.whatif.variance.resample_durations), with the same rule as the replica vector; whole
    # steps per rank made the spread 1.35x.
    from prism_trace.replay.emulate.config import EmulationConfig
    from prism_trace.replay.emulate.driver import emulate_in_memory
    from prism_trace.replay.whatif.config import parse_what_if

    rec = store.con.sql(
        "SELECT dur FROM iteration WHERE run_id = (SELECT run_id FROM run WHERE name = 'st')"
    ).pl()["dur"]
    cfg = EmulationConfig(what_if=parse_what_if(["variance"]), seed=1)
    res, it = emulate_in_memory(store, run="st", config=cfg)
    assert res.replicas is None  # the scalar path: units are the recorded ranks
    assert 0.9 <= it["dur"].std() / rec.std() <= 1.15
    assert it["dur"].max() <= 1.02 * rec.max()
    assert not it["dur"].equals(emulate_in_memory(store, run="st")[1]["dur"])  # it did draw

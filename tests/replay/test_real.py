"""Emulating real runs: the bundled gloo sample, the Megatron ST op timeline and PARAM DLRM.

Bounds are the measured errors (benchmarks/bench_validate.py) with margin: replay is exact on the
sample and ST (0.0000 %), 0.037 % on DLRM (kernels start a few us earlier than recorded: the
graph has no launch latency).
"""

from __future__ import annotations

import pytest

from prism_trace.parallel import ParallelLayout
from prism_trace.slicing import slice_run
from prism_trace.store import Store
from replay import emulate_run, validate_run


def q(store: Store, sql: str, *params: object) -> list[tuple]:
    return store.con.execute(sql, list(params)).fetchall()


def test_sample_replay_and_slice(sample_store: Store) -> None:
    report = emulate_run(sample_store, run="sample", out_run="sample_emu")
    rid = report.run_id
    assert report.units == 8
    assert report.collective_instances > 0
    assert report.p2p_instances > 0
    # readable by the same SQL as a recorded run
    rows = q(
        sample_store,
        "SELECT e.rank, e.iteration, e.dur, r.dur FROM iteration e JOIN iteration r"
        " ON r.run_id = 1 AND r.rank = e.rank AND r.iteration = e.iteration"
        " WHERE e.run_id = ? ORDER BY e.rank, e.iteration",
        rid,
    )
    assert len(rows) == 16
    assert all(abs(emu - rec) / rec < 1e-4 for _, _, emu, rec in rows)
    (n,) = q(sample_store, "SELECT count(*) FROM collective_instance WHERE run_id = ?", rid)[0]
    assert n == report.collective_instances
    v = validate_run(sample_store, run="sample").as_dict()
    assert v["replay_iteration_time_error_pct"] < 0.01
    assert v["slice_iteration_time_error_pct"] is not None
    assert v["slice_iteration_time_error_pct"] < 8.0  # measured 4.9 % (gloo noise across replicas)
    assert v["peak_memory_error_pct"] is None
    assert q(sample_store, "SELECT count(*) FROM run WHERE name LIKE '_validate%'") == [(0,)]


@pytest.mark.shared_data
def test_st_validation(real_store: Store) -> None:
    v = validate_run(real_store, run="st", slice_ranks=[0, 2, 4, 6])
    d = v.as_dict()
    assert len(v.replay) == 32
    assert d["replay_iteration_time_error_pct"] < 0.01
    assert d["slice_iteration_time_error_pct"] < 0.1
    assert d["layout"] == "tp=1,cp=1,ep=1,dp=2,pp=4"


@pytest.mark.shared_data
def test_dlrm_replay(real_store: Store) -> None:
    v = validate_run(real_store, run="dlrm")
    assert v.as_dict()["replay_iteration_time_error_pct"] < 0.1  # measured 0.037 %


@pytest.mark.shared_data
def test_st_sliced_to_256_ranks_is_emulated_per_class(real_store: Store) -> None:
    layout = ParallelLayout.parse("dp=64,pp=4")
    slice_run(real_store, run="st", layout=layout, world=256, out_run="st256")
    report = emulate_run(real_store, run="st256", out_run="st256_emu")
    assert report.units == 4
    assert report.world_size == 256
    rid = report.run_id
    assert q(real_store, "SELECT count(DISTINCT rank) FROM iteration WHERE run_id = ?", rid) == [
        (256,)
    ]
    assert q(real_store, "SELECT count(DISTINCT rank) FROM event WHERE run_id = ?", rid) == [(4,)]
    assert q(
        real_store,
        "SELECT count(*), count(DISTINCT class_id) FROM rank WHERE run_id = ?",
        rid,
    ) == [(256, 4)]
    # members of a class share the exemplar's iterations
    spread = q(
        real_store,
        "SELECT max(i.dur) - min(i.dur) FROM iteration i JOIN rank r USING (run_id, rank)"
        " WHERE i.run_id = ? GROUP BY r.class_id, i.iteration ORDER BY 1 DESC LIMIT 1",
        rid,
    )
    assert spread == [(0,)]

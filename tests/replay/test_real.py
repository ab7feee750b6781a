"""Emulating real runs: the bundled gloo sample, the Megatron ST op timeline and PARAM DLRM.

Bounds are the measured errors (benchmarks/bench_validate.py) with margin: replay is exact on the
sample, 0.001 % on ST (clock jitter between sequential ops), 0.037 % on DLRM (kernels start a few
us earlier than recorded: the graph has no launch latency). The ST slice shows the unrecorded dp
replica's timing (0.47 %).
"""

from __future__ import annotations

import polars as pl
import pytest
from prism_trace.replay import emulate_run, validate_run

from prism_trace.layout.mesh import ParallelLayout
from prism_trace.slicing.slicer import slice_run
from prism_trace.store.connection import Store


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
    # the CPU allocator's events re-timed: replay keeps each rank's order (exact); the slice
    # replays one replica's allocations for both (1.9 %)
    assert v["peak_memory_error_pct"] == 0.0
    assert 0.0 < v["slice_peak_memory_error_pct"] < 5.0
    # inside the step: every host op of the replay where it was recorded; the slice's ops
    # depart (the other replica's timing) and so does its communication time
    assert v["replay_op_start_error_p99_pct"] < 0.01
    assert v["replay_comm_time_error_pct"] < 0.01
    assert v["slice_op_start_error_p99_pct"] > v["replay_op_start_error_p99_pct"]
    assert v["slice_comm_time_error_pct"] > 0.1
    assert q(sample_store, "SELECT count(*) FROM memory WHERE run_id = ?", rid) == q(
        sample_store, "SELECT count(*) FROM memory WHERE run_id = 1"
    )
    assert q(sample_store, "SELECT count(*) FROM run WHERE name LIKE '_validate%'") == [(0,)]


@pytest.mark.shared_data
def test_st_validation(real_store: Store) -> None:
    v = validate_run(real_store, run="st", slice_ranks=[0, 2, 4, 6])
    d = v.as_dict()
    assert len(v.replay) == 32
    assert d["replay_iteration_time_error_pct"] < 0.01  # measured 0.0009 %
    # The op-timeline graph is causal: the slice replays dp replica 0 for both replicas, so its
    # steps miss the other replica's slower moments (measured 0.47 %, always faster).
    assert 0.1 < d["slice_iteration_time_error_pct"] < 3.0
    assert all(e.error_pct < 0.05 for e in v.slice)
    assert d["peak_memory_error_pct"] is None  # the op timeline has no memory events
    assert d["layout"] == "tp=1,cp=1,ep=1,dp=2,pp=4"
    # inside the step: replay puts every compute op where it was (measured 0.0000 %), and the
    # slice's starts stay within about 1 % of the step of the recording (measured p99 0.995 %)
    assert d["replay_op_start_error_p99_pct"] < 0.01
    assert d["replay_comm_time_error_pct"] < 0.01
    assert d["slice_op_start_error_p99_pct"] < 2.0


@pytest.mark.shared_data
def test_st_waits_emerge_from_dependencies(real_store: Store) -> None:
    # Slowing the last backward-compute of the first stage delays everything downstream: its
    # embedding all-reduce partner (last stage) waits longer, the grad-norm all-reduce holds every
    # rank, and the step grows by the added time. The recorded gaps alone (the old per-lane graph)
    # would have left the other ranks unchanged.
    from prism_trace.replay.emulate.driver import emulate_in_memory

    from prism_trace.graph.build import build_graph

    if not q(
        real_store,
        "SELECT count(*) FROM graph_node n JOIN run r USING (run_id) WHERE r.name = 'st'",
    )[0][0]:
        build_graph(real_store, "st")
    res0, base = emulate_in_memory(real_store, run="st")
    (rid,) = q(real_store, "SELECT run_id FROM run WHERE name = 'st'")[0]
    ((node, step),) = q(
        real_store,
        "SELECT node_id, iteration FROM graph_node WHERE run_id = ? AND rank = 0"
        " AND name = 'backward-compute' AND iteration = 23 ORDER BY ts DESC LIMIT 1",
        rid,
    )
    extra = 50_000_000  # 50 ms
    real_store.con.execute(
        "UPDATE graph_node SET dur = dur + ? WHERE run_id = ? AND rank = 0 AND node_id = ?",
        [extra, rid, node],
    )
    try:
        res1, slow = emulate_in_memory(real_store, run="st")
    finally:
        real_store.con.execute(
            "UPDATE graph_node SET dur = dur - ? WHERE run_id = ? AND rank = 0 AND node_id = ?",
            [extra, rid, node],
        )
    b = base.filter(pl.col("iteration") == step)["dur"][0]
    s = slow.filter(pl.col("iteration") == step)["dur"][0]
    assert 0.9 * extra < s - b <= extra
    # ... and a rank of another stage (rank 4, stage 2) starts its optimizer that much later
    n = res0.inputs.nodes
    opt = n.with_row_index("i").filter(
        (pl.col("rank") == 4) & (pl.col("name") == "optimizer") & (pl.col("iteration") == step)
    )["i"][0]
    assert 0.9 * extra < res1.timeline.start[opt] - res0.timeline.start[opt] <= extra


@pytest.mark.shared_data
def test_dlrm_replay(real_store: Store) -> None:
    d = validate_run(real_store, run="dlrm").as_dict()
    assert d["replay_iteration_time_error_pct"] < 0.1  # measured 0.037 %
    # kernels start a few us early (no launch latency): p99 0.38 % of the step; NCCL time 0.12 %
    assert d["replay_op_start_error_p99_pct"] < 1.0
    assert d["replay_comm_time_error_pct"] < 1.0


@pytest.mark.shared_data
def test_dlrm_variance_slice_with_only_world_spanning_groups(real_store: Store) -> None:
    """DLRM's only axis is data parallel: no communicator is per replica, and the variance mode
    still expands the replicas (a regression: the empty axis table had the wrong dtype)."""
    v = validate_run(real_store, run="dlrm", slice_ranks=[0], variance="iteration", seeds=1)
    d = v.as_dict()
    assert 0 < d["slice_iteration_time_error_pct"] < 50  # measured 9.74 %
    assert d["variance_iteration_time_error_pct"] is not None


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

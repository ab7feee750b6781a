"""Every data-parallel replica distinct on the class graph (``replay.vector``).

What would break if the replica vector were wrong: a slow replica would not reproduce the
expanded units' times exactly, the slowest replica would not set the pace of the data-parallel
collectives independently of how many identical replicas there are, or the vector core would
disagree with the scalar core on a column.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from prism_trace.replay.des.core import CommInstances, DeadlockError, EmulatorGraph
from prism_trace.replay.des.core import emulate as emulate_scalar
from prism_trace.replay.des.replicas import replica_grid
from prism_trace.replay.des.vector import emulate_replicas
from prism_trace.replay.emulate import frames as emulate_frames
from prism_trace.replay.emulate import prepare as emulate_prepare
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.driver import emulate_in_memory, emulate_run
from prism_trace.replay.model.timing import TimingConfig
from prism_trace.replay.whatif.config import parse_what_if

from prism_trace.cli import main
from prism_trace.layout.mesh import ParallelLayout
from prism_trace.store.connection import Store


@pytest.fixture(scope="module")
def store(sliced_sample_store: Store) -> Store:
    """The sample with its graph and the slices `s4`, `s2048`, `s16384` (`tp=2,dp=N,pp=2`)."""
    return sliced_sample_store


def emulate(
    store: Store, run: str, *words: str, seed: int = 0, timing: str = "scaled"
) -> tuple[object, pl.DataFrame]:
    cfg = EmulationConfig(
        what_if=parse_what_if(list(words)), seed=seed, timing=TimingConfig(model=timing)
    )
    return emulate_in_memory(store, run=run, config=cfg)


def step_times(iters: pl.DataFrame) -> list[int]:
    return iters.group_by("iteration").agg(pl.col("dur").max()).sort("iteration")["dur"].to_list()


def test_vector_core_matches_the_scalar_core_per_column() -> None:
    """Two units joined by a shared (dp) and a per-replica instance, three replicas: each column
    equals the scalar emulation of the graph with that column's durations, except that the
    shared instance waits for the slowest column."""
    # unit 0: a(0) -> c(1, shared sync) -> b(2); unit 1: d(3) -> e(4, sync with node 1's pair).
    g = EmulatorGraph(
        unit=np.array([0, 0, 0, 1, 1]),
        dur=np.zeros(5, dtype=np.int64),
        release=np.zeros(5, dtype=np.int64),
        src=np.array([0, 1, 3]),
        dst=np.array([1, 2, 4]),
        delay=np.array([5, 0, 0]),
        from_end=np.ones(3, dtype=bool),
        holds_end=np.zeros(3, dtype=bool),
    )
    comm = CommInstances(
        node=np.array([1, 4]), instance=np.array([0, 1]), transfer=np.array([7, 3])
    )
    dur = np.array([[10, 30, 20], [0, 0, 0], [4, 4, 9], [50, 1, 2], [0, 0, 0]], dtype=np.int64)
    shared = np.array([True, False])
    vt = emulate_replicas(g, comm, dur=dur, shared=shared)
    for c in range(3):
        col = emulate_scalar(EmulatorGraph(**{**g.__dict__, "dur": dur[:, c]}), comm)
        assert vt.start[3:, c].tolist() == col.start[3:].tolist()  # unit 1: per replica
        assert vt.end[4, c] == col.end[4]
    # The shared instance: last arrival over every replica (node 1 starts at a + 5).
    assert vt.arrival[0].tolist() == [35, 35, 35]
    assert vt.end[1].tolist() == [42, 42, 42]
    assert vt.end[2].tolist() == [46, 46, 51]


def test_blocks_of_a_wide_level_and_a_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A level split into many blocks gives the same times; a cycle raises the core's error."""
    from prism_trace.replay.des import vector

    rng = np.random.default_rng(0)
    n = 40  # 40 independent chains of 2 nodes feeding one shared instance
    g = EmulatorGraph(
        unit=np.zeros(2 * n, dtype=np.int64),
        dur=np.zeros(2 * n, dtype=np.int64),
        release=np.zeros(2 * n, dtype=np.int64),
        src=np.arange(n),
        dst=np.arange(n, 2 * n),
        delay=np.ones(n, dtype=np.int64),
        from_end=np.ones(n, dtype=bool),
        holds_end=np.zeros(n, dtype=bool),
    )
    comm = CommInstances(
        node=np.arange(n, 2 * n), instance=np.zeros(n, dtype=np.int64), transfer=np.full(n, 2)
    )
    dur = rng.integers(0, 100, size=(2 * n, 5))
    whole = emulate_replicas(g, comm, dur=dur, shared=np.array([True]))
    monkeypatch.setattr(vector, "_BLOCK", 5)  # one destination per block
    split = emulate_replicas(g, comm, dur=dur, shared=np.array([True]))
    assert np.array_equal(whole.end, split.end)
    assert (whole.arrival == dur[:n].max() + 1).all()
    cyc = EmulatorGraph(**{**g.__dict__, "src": np.array([0, 1]), "dst": np.array([1, 0])})
    cyc = EmulatorGraph(
        **{**cyc.__dict__, "delay": np.zeros(2, np.int64), "from_end": np.ones(2, bool)}
        | {"holds_end": np.zeros(2, bool)}
    )
    with pytest.raises(DeadlockError, match="cycle"):
        emulate_replicas(cyc, CommInstances.empty(), dur=dur, shared=np.zeros(0, dtype=bool))


def test_a_slow_replica_reproduces_the_expanded_units_exactly(store: Store) -> None:
    words = ("slow-ranks=0,9@1.3", "slow-ops=*@1.1")
    res, vec = emulate(store, "s4", *words)
    assert res.replicas is not None  # type: ignore[attr-defined]
    eligible = emulate_prepare.vector_eligible
    try:
        emulate_prepare.vector_eligible = lambda w: False  # the expanded units instead
        res_x, exp = emulate(store, "s4", *words)
    finally:
        emulate_prepare.vector_eligible = eligible
    assert res_x.replicas is None  # type: ignore[attr-defined]
    assert vec.sort("rank", "iteration").equals(exp.sort("rank", "iteration"))


def test_one_slow_replica_sets_the_same_pace_at_8192_and_65536_ranks(store: Store) -> None:
    """All other replicas identical: the slowest of N is the slow one whatever N (transfers as
    recorded: the modelled ones grow with the data-parallel group, which is another effect)."""
    _, base = emulate(store, "s2048", timing="recorded")
    _, small = emulate(store, "s2048", "slow-ranks=13@1.5", timing="recorded")
    _, big = emulate(store, "s16384", "slow-ranks=13@1.5", timing="recorded")
    assert big.height == 65536 * 2
    assert step_times(big) == step_times(small)
    assert all(s > b for s, b in zip(step_times(small), step_times(base), strict=True))
    # Every replica waits for it at the data-parallel collectives: all ranks slow down.
    j = small.join(base, on=["rank", "iteration"], suffix="_base")
    assert (j["dur"] > j["dur_base"]).mean() > 0.99


@pytest.mark.slow
def test_every_replica_distinct_and_the_slowest_of_n_grows(store: Store) -> None:
    _, a = emulate(store, "s4", "variance=iteration", seed=3)
    _, b = emulate(store, "s4", "variance=iteration", seed=3)
    assert a.equals(b)
    res, big = emulate(store, "s2048", "variance=iteration", seed=3)
    assert np.mean(step_times(big)) > np.mean(step_times(a))
    # iteration mode: a replica draws one of the 2 recorded steps per step, the same for all
    # its classes (2**2 combinations: 4 distinct timelines, every one of them present)
    vt = res.replicas  # type: ignore[attr-defined]
    assert vt.end.shape[1] == 2048
    assert np.unique(vt.start.T, axis=0).shape[0] == 4
    # replica mode (the default): every replica draws its own rank effect, so every replica's
    # timeline differs, and the slowest of N grows with N
    _, a = emulate(store, "s4", "variance", seed=3)
    _, b = emulate(store, "s4", "variance", seed=3)
    assert a.equals(b)
    res, big = emulate(store, "s2048", "variance", seed=3)
    assert np.mean(step_times(big)) > np.mean(step_times(a))
    assert np.unique(res.replicas.start.T, axis=0).shape[0] == 2048  # type: ignore[attr-defined]
    # op mode: every op draws, so the replicas' timelines between collectives differ
    res, _ = emulate(store, "s2048", "variance=op", seed=3)
    assert np.unique(res.replicas.start.T, axis=0).shape[0] > 100  # type: ignore[attr-defined]


def test_replica_grid_and_columns() -> None:
    layout = ParallelLayout.parse("tp=2,dp=4,pp=2")
    exemplars = np.flatnonzero(layout.coords(np.arange(16))["dp"] == 0)
    reps = replica_grid(layout, exemplars, {2})
    assert reps is not None
    assert reps.replica.tolist() == [0, 2]
    assert reps.column.tolist() == [0, 0, 1, 0]
    assert (layout.coords(reps.grid[:, 3])["dp"] == 3).all()
    only0 = replica_grid(layout, exemplars, {0})
    assert only0 is not None
    assert only0.replica.tolist() == [0, 1]
    assert only0.column.tolist() == [0, 1, 1, 1]
    assert replica_grid(layout, exemplars + 1, None) is None  # not the dp-0 ranks


def test_keep_events_writes_the_named_ranks_own_events(store: Store, tmp_path: Path) -> None:
    # tp=2,dp=4,pp=2: the exemplars (dp 0) are ranks 0, 1, 8, 9; rank 3 is in rank 1's class
    cfg = EmulationConfig(what_if=parse_what_if(["slow-ranks=3@2"]), keep_events=(3, 13))
    rep = emulate_run(store, run="s4", out_run="kept", config=cfg)
    ev = store.con.sql(
        "SELECT rank, count(*) AS n FROM event WHERE run_id = ? GROUP BY rank",
        params=[rep.run_id],
    ).pl()
    assert set(ev["rank"].to_list()) == {0, 1, 8, 9, 3, 13}  # the exemplars and the two named ranks
    # rank 3 (class of rank 1) computes twice as long: most of its ops take 2x rank 1's
    ((doubled, same_ops),) = store.con.execute(
        "SELECT count(*) FILTER (WHERE a.dur > 0 AND abs(a.dur - 2 * b.dur) <= 1), count(*)"
        " FROM event a JOIN event b ON b.run_id = a.run_id AND b.event_id = a.event_id"
        " WHERE a.run_id = ? AND a.rank = 3 AND b.rank = 1",
        [rep.run_id],
    ).fetchall()
    assert same_ops == int(ev.filter(pl.col("rank") == 1)["n"].item())
    assert doubled > same_ops / 2
    cls = dict(
        store.con.execute(
            "SELECT rank, class_id FROM rank WHERE run_id = ? AND rank IN (3, 13, 5)",
            [rep.run_id],
        ).fetchall()
    )
    assert cls == {3: 3, 13: 13, 5: 1}
    out = CliRunner().invoke(
        main,
        [
            "emulate",
            str(store.path),
            "--run",
            "s4",
            "--out-run",
            "kept-cli",
            "--keep-events",
            "6..7",
            "--what-if",
            "variance",
        ],
    )
    assert out.exit_code == 0, out.output
    ((ranks,),) = store.con.execute(
        "SELECT list(DISTINCT rank ORDER BY rank) FROM event e JOIN run r USING (run_id)"
        " WHERE r.name = 'kept-cli'"
    ).fetchall()
    assert ranks == [0, 1, 6, 7, 8, 9]


@pytest.mark.parametrize("rank", [1, 10])
def test_a_failed_gpu_on_the_vector_reproduces_the_expanded_units(store: Store, rank: int) -> None:
    """remove-gpu: the failed replica is a column with more compute and its own, smaller tp
    groups' transfers; its replica 0 (rank 1) or another (rank 10) gives what the expanded
    units give, and its tp slot leaves the results."""
    res, vec = emulate(store, "s4", f"remove-gpu={rank}")
    assert res.replicas is not None  # type: ignore[attr-defined]
    assert res.inputs.failed_column is not None  # type: ignore[attr-defined]
    eligible = emulate_prepare.vector_eligible
    try:
        emulate_prepare.vector_eligible = lambda w: False
        res_x, exp = emulate(store, "s4", f"remove-gpu={rank}")
    finally:
        emulate_prepare.vector_eligible = eligible
    assert res_x.replicas is None  # type: ignore[attr-defined]
    assert res_x.inputs.size_override  # type: ignore[attr-defined]
    left = set(res.inputs.left_out)  # type: ignore[attr-defined]
    assert rank in left
    assert not left & set(vec["rank"].to_list())
    assert vec.sort("rank", "iteration").equals(exp.sort("rank", "iteration"))
    _, base = emulate(store, "s4")
    assert np.mean(step_times(vec)) > np.mean(step_times(base))
    # waits and lateness agree; the peaks are re-timed on replica 0's column in the vector
    cols = ["rank", "iteration", "comm_calls", "wait_ns", "late_ns"]
    a, b = emulate_frames._rank_step_rows(res, 1), emulate_frames._rank_step_rows(res_x, 1)
    assert a.select(cols).sort(cols).equals(b.select(cols).sort(cols))

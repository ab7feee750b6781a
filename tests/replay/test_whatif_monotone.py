"""Monotone what-ifs (issue 32): a slow-down never makes a rank's run shorter, and removing
stragglers or launch delays never makes it longer, in total and up to the end of every iteration.

Why it holds by construction for the slow-downs, the bandwidth and no-launch-delay
(docs/emulator.md, "Monotone what-ifs"): the emulator's times are longest paths in one DAG whose
weights are durations, edge delays and transfers (``replay.des.core``), so every start and end
moves the way every weight moved; these what-ifs move weights one way and keep the graph, and a
rank's step windows are anchored on its first node's release and on its end anchors, so the end
of every iteration and the total follow. ``no-stragglers`` raises ops that were faster than
their type's mean (StragglerAnalysis's rule, kept for parity on ST), so there it is checked here
on every multi-rank set, with the bound that it removes no more than the waits there were.

The what-ifs are drawn at random (seeded) on every multi-rank shared dataset and on random DAGs.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from prism_trace.replay.des.core import CommInstances, EmulatorGraph, emulate
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.driver import emulate_in_memory
from prism_trace.replay.whatif.config import parse_what_if

from prism_trace.store.connection import Store, open_store
from tests.conftest import copy_of_template

TOL_NS = 1  # rounding of a typical duration (np.rint) may move an end by a nanosecond


def _iters(store: Store, run: str, words: list[str]) -> pl.DataFrame:
    cfg = EmulationConfig(what_if=parse_what_if(words))
    _, iters = emulate_in_memory(store, run=run, config=cfg)
    return iters.select("rank", "iteration", "ts", "dur").sort("rank", "iteration")


def _check(base: pl.DataFrame, other: pl.DataFrame, sign: int, what: str) -> None:
    """``sign`` +1: ``other`` is never shorter (slow-down); -1: never longer. Per rank: its total
    (the sum of its steps) and the end of each of its iterations."""
    assert base.height == other.height > 0, what
    j = base.join(other, on=["rank", "iteration"], suffix="_w")
    assert j.height == base.height, what
    end_b = (j["ts"] + j["dur"]).to_numpy()
    end_w = (j["ts_w"] + j["dur_w"]).to_numpy()
    bad_end = np.flatnonzero(sign * (end_w - end_b) < -TOL_NS)
    assert bad_end.size == 0, f"{what}: iteration ends move the wrong way: {j[bad_end[:3]]}"
    tot = j.group_by("rank").agg(pl.col("dur").sum(), pl.col("dur_w").sum())
    bad = tot.filter(sign * (pl.col("dur_w") - pl.col("dur")) < -TOL_NS * 64)
    assert bad.is_empty(), f"{what}: rank totals move the wrong way: {bad.head(3)}"


def _random_what_ifs(rng: random.Random, names: list[str], world: int, n: int) -> list[list[str]]:
    """``n`` random slow-downs (one direction) of the kinds a user gives."""
    out = []
    for _ in range(n):
        f = round(rng.uniform(1.05, 2.0), 2)
        pick = rng.randrange(4)
        if pick == 0:
            ranks = sorted(rng.sample(range(world), rng.randint(1, max(1, world // 2))))
            out.append([f"slow-ranks={','.join(map(str, ranks))}@{f}"])
        elif pick == 1:
            out.append([f"slow-ops={rng.choice(names)}@{f}"])
        elif pick == 2:
            out.append([f"bandwidth={round(rng.uniform(0.2, 0.9), 2)}"])
        else:
            out.append([f"slow-ranks={rng.randrange(world)}@{f}", f"slow-kind=collective@{f}"])
    return out


def _names(store: Store, run: str, rng: random.Random, k: int = 6) -> list[str]:
    rows = store.con.execute(
        "SELECT DISTINCT g.name FROM graph_node g JOIN run r USING (run_id)"
        " WHERE r.name = ? AND g.kind NOT IN ('send', 'recv', 'collective') AND g.name IS NOT NULL"
        " ORDER BY 1",
        [run],
    ).fetchall()
    names = [str(r[0]) for r in rows if not any(c in str(r[0]) for c in "[]*?")]
    return rng.sample(names, min(k, len(names)))


def _world(store: Store, run: str) -> int:
    row = store.con.execute("SELECT world_size FROM run WHERE name = ?", [run]).fetchone()
    return int(row[0])


def _all_directions(store: Store, run: str, seed: int, n: int) -> None:
    rng = random.Random(seed)
    base = _iters(store, run, [])
    for words in (["no-stragglers"], ["no-launch-delay"], ["no-stragglers", "no-launch-delay"]):
        _check(base, _iters(store, run, words), -1, f"{run} {words}")
    for words in _random_what_ifs(rng, _names(store, run, rng), _world(store, run), n):
        _check(base, _iters(store, run, words), +1, f"{run} {words}")


@pytest.fixture(scope="module")
def dlrm_store(tmp_path_factory: pytest.TempPathFactory, dlrm_hta_template: Path) -> Store:
    return open_store(copy_of_template(dlrm_hta_template, tmp_path_factory, "mono-dlrm"))


@pytest.fixture(scope="module")
def st_store(tmp_path_factory: pytest.TempPathFactory, st_emulated_template: Path) -> Store:
    return open_store(copy_of_template(st_emulated_template, tmp_path_factory, "mono-st"))


@pytest.mark.shared_data
def test_dlrm_kineto_and_host_et(dlrm_store: Store) -> None:
    """DLRM, 8 ranks, Kineto + host ET, NCCL: its ranks entered the step up to 7.5 ms apart (the
    step window of a Kineto rank starts at its first op)."""
    _all_directions(dlrm_store, "dlrm", seed=1, n=6)


@pytest.mark.shared_data
def test_dlrm_no_stragglers_removes_at_most_the_waits(dlrm_store: Store) -> None:
    """Each rank's step gets shorter, by no more than the ranks waited at their collectives on
    average (each from its arrival at an NCCL kernel to the last peer's): no-stragglers removes
    waits, it does not invent speed. (With every root moved to the origin, the mean step came
    out 13 % longer.) Not each rank's own wait: a straggler waits least and gains most."""
    base = _iters(dlrm_store, "dlrm", []).group_by("rank").agg(pl.col("dur").sum())
    ns = _iters(dlrm_store, "dlrm", ["no-stragglers"]).group_by("rank").agg(pl.col("dur").sum())
    waits = pl.DataFrame(
        dlrm_store.con.execute(
            "WITH x AS (SELECT c.rank, c.kernel_ts, max(c.kernel_ts) OVER"
            " (PARTITION BY c.group_id, c.seq) AS last FROM collective c JOIN run r USING (run_id)"
            " WHERE r.name = 'dlrm') SELECT rank, sum(last - kernel_ts) AS wait FROM x GROUP BY 1"
        ).fetchall(),
        schema=["rank", "wait"],
        orient="row",
    )
    j = base.join(ns, on="rank", suffix="_ns").join(
        waits.cast({"rank": base.schema["rank"]}), on="rank"
    )
    assert j.height == 8
    gain = (j["dur"] - j["dur_ns"]).to_numpy()
    assert (gain >= 0).all(), j
    assert (gain <= j["wait"].mean()).all(), j
    assert gain.sum() > 0  # it removes something


@pytest.mark.shared_data
def test_st_op_timeline(st_store: Store) -> None:
    """ST, 8 ranks, an op timeline of 32 steps (one step window for all ranks)."""
    _all_directions(st_store, "st", seed=2, n=4)


def test_sample_and_its_slice(sliced_sample_store: Store) -> None:
    """The generated gloo sample (8 ranks, 2 steps, Kineto + ET) and its tp2 x dp2048 x pp2 slice
    (the replica vector): README's ``slow-ranks=0..3@1.2`` among them."""
    _all_directions(sliced_sample_store, "sample", seed=3, n=5)
    base = _iters(sliced_sample_store, "s2048", [])
    _check(base, _iters(sliced_sample_store, "s2048", ["slow-ranks=0..3@1.2"]), +1, "README")
    _check(base, _iters(sliced_sample_store, "s2048", ["no-stragglers"]), -1, "s2048 ns")


# -- random DAGs: the core's max-plus monotonicity, which the construction rests on -------------


def _random_dag(rng: np.random.Generator, units: int, per_unit: int, iters: int) -> tuple:
    """Units of ``per_unit`` nodes in program order, extra forward edges inside a unit, and
    collectives at the same positions on a random subset of units (one order on every unit, so
    no deadlock); ``iteration`` labels contiguous blocks of each unit's nodes."""
    n = units * per_unit
    unit = np.repeat(np.arange(units), per_unit)
    pos = np.tile(np.arange(per_unit), units)
    src, dst = [], []
    for u in range(units):
        o = u * per_unit
        src += list(range(o, o + per_unit - 1))
        dst += list(range(o + 1, o + per_unit))
        for _ in range(per_unit // 2):
            a, b = sorted(rng.choice(per_unit, 2, replace=False))
            src.append(o + a)
            dst.append(o + b)
    coll_pos = np.sort(rng.choice(np.arange(1, per_unit), per_unit // 4, replace=False))
    node, inst = [], []
    for k, p in enumerate(coll_pos):
        members = np.flatnonzero(rng.random(units) < 0.7)
        if members.size < 2:
            members = np.arange(units)
        node += [int(m) * per_unit + int(p) for m in members]
        inst += [k] * members.size
    m = len(src)
    graph = EmulatorGraph(
        unit=unit,
        dur=rng.integers(1, 1000, n),
        release=np.where(pos == 0, rng.integers(0, 500, n), 0),
        src=np.array(src),
        dst=np.array(dst),
        delay=rng.integers(0, 50, m),
        from_end=rng.random(m) < 0.9,
        holds_end=np.zeros(m, dtype=bool),
    )
    comm = CommInstances(np.array(node), np.array(inst), rng.integers(0, 800, len(node)))
    iteration = pos * iters // per_unit
    return graph, comm, iteration


def _ends(graph: EmulatorGraph, comm: CommInstances, iteration: np.ndarray) -> np.ndarray:
    """Per unit and iteration, the end of its last node (the end of the iteration)."""
    tl = emulate(graph, comm)
    key = graph.unit * (iteration.max() + 1) + iteration
    out = np.full(key.max() + 1, np.iinfo(np.int64).min)
    np.maximum.at(out, key, tl.end)
    return out


@pytest.mark.parametrize("seed", range(25))
def test_random_dags_move_one_way(seed: int) -> None:
    """Weights up (slow-downs: durations and transfers times a factor > 1, delays longer) never
    make any iteration end earlier; weights down (no-launch-delay's zero delays, transfers cut to
    their median) never later."""
    rng = np.random.default_rng(seed)
    graph, comm, iteration = _random_dag(rng, int(rng.integers(2, 9)), 24, 3)
    base = _ends(graph, comm, iteration)
    hit = rng.random(graph.n_nodes) < 0.3
    up = EmulatorGraph(
        **{**graph.__dict__, "dur": np.where(hit, np.rint(graph.dur * 1.7), graph.dur)}
    )
    comm_up = CommInstances(comm.node, comm.instance, np.rint(comm.transfer * 1.3).astype(int))
    assert (_ends(up, comm_up, iteration) >= base).all()
    down = EmulatorGraph(**{**graph.__dict__, "delay": np.zeros_like(graph.delay)})
    t = np.minimum(comm.transfer, int(np.median(comm.transfer)))
    assert (_ends(down, CommInstances(comm.node, comm.instance, t), iteration) <= base).all()

"""The DES core against a reference written from docs/emulator.md, on random graphs.

Each graph is a few units (ranks) of random shape (chains, fan-in and fan-out, host ops holding
back their end for a kernel they launched), joined by collectives over random subsets of units
and by send/receive pairs; instances are matched by the core's own ``collective_instances`` and
``p2p_instances`` from ``(group, seq)``. The reference evaluates the model's equations point by
point in a topological order from ``graphlib`` (plain Python, no numpy):

- ``S[v]`` = the recorded release of a node without a start constraint, else the max over its
  start edges of ``E[u]`` (``S[u]`` for an edge anchored at the start) plus the delay;
- ``E[v]`` = ``S[v] + dur`` (0 for a communication node), then the max with its ``sync`` edges
  and, for a communication node ``p`` of instance ``i``, ``A[i] + transfer[p]``;
- ``A[i]`` = the max of ``S`` over the instance's participants (its last arrival).

Some graphs get one extra edge from a later node of a unit to an earlier one: where that closes a
cycle the core must raise ``DeadlockError`` (the reference's ``graphlib`` finds the cycle), else
the times must agree as everywhere else.
"""

from __future__ import annotations

import graphlib
from dataclasses import dataclass, field

import numpy as np
import pytest
from prism_trace.replay.des.core import (
    CommInstances,
    DeadlockError,
    EmulatorGraph,
    collective_instances,
    emulate,
    p2p_instances,
)

Point = tuple[str, object]  # ("S", node) | ("E", node) | ("A", instance key)


@dataclass
class Edge:
    src: int
    dst: int
    delay: int
    from_end: bool = True
    holds_end: bool = False


@dataclass
class RandomJob:
    """A random job, as lists (what the reference reads) and as the core's arrays."""

    n_units: int
    unit: list[int] = field(default_factory=list)
    dur: list[int] = field(default_factory=list)
    release: list[int] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    # collectives: (node, unit, group, seq, transfer)
    # sends and receives: (node, unit, peer unit, is_send, seq, transfer)
    coll: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    p2p: list[tuple[int, int, int, bool, int, int]] = field(default_factory=list)
    groups: dict[int, list[int]] = field(default_factory=dict)

    def node(self, u: int, dur: int, release: int) -> int:
        self.unit.append(u)
        self.dur.append(dur)
        self.release.append(release)
        return len(self.unit) - 1


SHAPES = {
    # name: (units, steps, P(chain edge), max extra fan-in, P(collective), P(p2p), P(launch))
    "chains": (1, 40, 1.0, 0, 0.0, 0.0, 0.0),
    "fan": (2, 50, 0.4, 4, 0.15, 0.0, 0.2),
    "collectives": (5, 60, 0.8, 2, 0.35, 0.0, 0.1),
    "pipeline": (4, 60, 0.9, 1, 0.05, 0.35, 0.1),
    "mixed": (6, 80, 0.6, 3, 0.2, 0.2, 0.2),
}


def random_job(rng: np.random.Generator, shape: str) -> RandomJob:
    """Nodes added in one global order: edges go from earlier nodes to later ones, and every unit
    issues the communication instances in that order, so the job is acyclic (and never waits for
    an instance that some participant does not issue)."""
    max_units, steps, p_chain, fan_in, p_coll, p_p2p, p_launch = SHAPES[shape]
    job = RandomJob(n_units=int(rng.integers(1, max_units + 1)))
    own: list[list[int]] = [[] for _ in range(job.n_units)]  # each unit's nodes, in order
    group_of: dict[tuple[int, ...], int] = {}
    seq: dict[object, int] = {}

    def attach(u: int, v: int) -> None:
        """In-edges of a new node ``v`` of unit ``u`` from the unit's earlier nodes."""
        mine = own[u]
        if mine and rng.random() < p_chain:
            job.edges.append(Edge(mine[-1], v, int(rng.integers(0, 50))))
        for _ in range(int(rng.integers(0, fan_in + 1)) if mine else 0):
            src = mine[int(rng.integers(len(mine)))]
            start_anchor, sync = rng.random() < 0.2, rng.random() < 0.15
            delay = int(rng.integers(0, 100))
            job.edges.append(Edge(src, v, delay, from_end=not start_anchor, holds_end=sync))
        mine.append(v)

    def release() -> int:
        return int(rng.integers(0, 500))

    for _ in range(steps):
        r = rng.random()
        if r < p_coll:
            size = int(rng.integers(1, job.n_units + 1))
            members = tuple(sorted(rng.choice(job.n_units, size=size, replace=False).tolist()))
            g = group_of.setdefault(members, 100 + len(group_of))
            job.groups[g] = list(members)
            s = seq[g] = seq.get(g, -1) + 1
            transfer = int(rng.integers(0, 200))
            for u in members:
                v = job.node(u, int(rng.integers(0, 10_000)), release())  # dur: never used
                attach(u, v)
                skew = int(rng.integers(-20, 40)) if rng.random() < 0.3 else 0
                job.coll.append((v, u, g, s, transfer + skew))
        elif r < p_coll + p_p2p and job.n_units > 1:
            a, b = (int(x) for x in rng.choice(job.n_units, size=2, replace=False))
            s = seq[(a, b)] = seq.get((a, b), -1) + 1
            transfer = int(rng.integers(0, 200))
            send = job.node(a, int(rng.integers(0, 10_000)), release())
            attach(a, send)
            recv = job.node(b, int(rng.integers(0, 10_000)), release())
            attach(b, recv)
            eager = -int(rng.integers(0, 300)) if rng.random() < 0.2 else transfer  # eager send
            job.p2p.append((send, a, b, True, s, eager))
            job.p2p.append((recv, b, a, False, s, transfer))
        else:
            u = int(rng.integers(job.n_units))
            h = job.node(u, int(rng.integers(0, 1_000)), release())
            attach(u, h)
            if rng.random() < p_launch:
                # h launches kernel k at an offset and its end waits for k (a synchronize): the
                # sync edge points back to the earlier node, its end only
                k = job.node(u, int(rng.integers(0, 1_000)), release())
                job.edges.append(Edge(h, k, int(rng.integers(0, 20)), from_end=False))
                job.edges.append(Edge(k, h, int(rng.integers(0, 20)), holds_end=True))
                own[u].append(k)
    return job


def core_arrays(job: RandomJob) -> tuple[EmulatorGraph, CommInstances]:
    """The job as the core's arrays; instances matched by the core's own matching."""
    e = job.edges
    graph = EmulatorGraph(
        unit=np.array(job.unit, dtype=np.int64),
        dur=np.array(job.dur, dtype=np.int64),
        release=np.array(job.release, dtype=np.int64),
        src=np.array([x.src for x in e], dtype=np.int64),
        dst=np.array([x.dst for x in e], dtype=np.int64),
        delay=np.array([x.delay for x in e], dtype=np.int64),
        from_end=np.array([x.from_end for x in e], dtype=bool),
        holds_end=np.array([x.holds_end for x in e], dtype=bool),
    )
    unit_rank = np.arange(job.n_units)
    c = np.array(job.coll, dtype=np.int64).reshape(-1, 5)
    c_inst, n_coll = collective_instances(
        c[:, 0],
        c[:, 1],
        c[:, 2],
        c[:, 3],
        expected={g: np.array(m) for g, m in job.groups.items()},
        unit_rank=unit_rank,
    )
    p = np.array(job.p2p, dtype=np.int64).reshape(-1, 6)
    p_inst, _ = p2p_instances(
        p[:, 0],
        p[:, 1],
        p[:, 2],
        p[:, 3].astype(bool),
        np.full(len(p), 7),
        p[:, 4],
        unit_rank=unit_rank,
        peer_rank=p[:, 2],
    )
    comm = CommInstances(
        node=np.concatenate([c[:, 0], p[:, 0]]),
        instance=np.concatenate([c_inst, p_inst + n_coll]),
        transfer=np.concatenate([c[:, 4], p[:, 5]]),
    )
    return graph, comm


def reference(job: RandomJob) -> dict[Point, int]:
    """Every point's time from docs/emulator.md's equations, in a topological order.

    Raises:
        graphlib.CycleError: the points form a cycle (the job deadlocks).
    """
    n = len(job.unit)
    preds: dict[Point, list[tuple[Point, int]]] = {}
    for v in range(n):
        preds[("S", v)] = []
        preds[("E", v)] = [(("S", v), job.dur[v])]
    for x in job.edges:
        src = ("E" if x.from_end else "S", x.src)
        preds[("E" if x.holds_end else "S", x.dst)].append((src, x.delay))
    instances: dict[object, list[tuple[int, int]]] = {}
    for v, _, g, s, t in job.coll:
        instances.setdefault(("coll", g, s), []).append((v, t))
    for v, u, peer, is_send, s, t in job.p2p:
        sender, receiver = (u, peer) if is_send else (peer, u)
        instances.setdefault(("p2p", sender, receiver, s), []).append((v, t))
    for key, members in instances.items():
        preds[("A", key)] = [(("S", v), 0) for v, _ in members]
        for v, t in members:
            preds[("E", v)][0] = (("S", v), 0)  # a communication node's recorded dur is unused
            preds[("E", v)].append((("A", key), t))
    order = graphlib.TopologicalSorter({p: {q for q, _ in ps} for p, ps in preds.items()})
    time: dict[Point, int] = {}
    for point in order.static_order():
        ps = preds[point]
        if ps:
            time[point] = max(time[q] + w for q, w in ps)
        else:  # a start without constraints: the node's release
            time[point] = job.release[point[1]]  # type: ignore[index]
    return time


def backward_edge(rng: np.random.Generator, job: RandomJob) -> Edge | None:
    """An edge from a later node of a unit to an earlier one (a cycle when the later one depends
    on the earlier one), or None when no unit has two nodes."""
    units = [u for u in range(job.n_units) if job.unit.count(u) > 1]
    if not units:
        return None
    u = units[int(rng.integers(len(units)))]
    mine = [v for v, w in enumerate(job.unit) if w == u]
    a, b = sorted(int(x) for x in rng.choice(mine, size=2, replace=False))
    return Edge(b, a, int(rng.integers(0, 50)))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_core_times_equal_the_reference_longest_paths(shape: str) -> None:
    graphs, deadlocks = 60, 0
    for i in range(graphs):
        seed = (sorted(SHAPES).index(shape), i)
        rng = np.random.default_rng(seed)
        job = random_job(rng, shape)
        if rng.random() < 0.25 and (extra := backward_edge(rng, job)) is not None:
            job.edges.append(extra)
        graph, comm = core_arrays(job)
        try:
            want = reference(job)
        except graphlib.CycleError:
            deadlocks += 1
            with pytest.raises(DeadlockError):
                emulate(graph, comm)
            continue
        tl = emulate(graph, comm)
        n = len(job.unit)
        assert tl.start.tolist() == [want[("S", v)] for v in range(n)], seed
        assert tl.end.tolist() == [want[("E", v)] for v in range(n)], seed
        last = {("coll", g, s): v for v, _, g, s, _ in job.coll}
        last |= {("p2p", u, peer, s): v for v, u, peer, send, s, _ in job.p2p if send}
        for key, v in last.items():
            assert tl.arrival[comm.instance[comm.node == v][0]] == want[("A", key)], seed
    assert deadlocks < graphs // 2  # most graphs are acyclic: the times are what is tested

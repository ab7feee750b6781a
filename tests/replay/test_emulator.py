"""The DES core on hand-built arrays: collectives, p2p, sync edges, missing ranks, deadlock."""

from __future__ import annotations

import numpy as np
import pytest
from prism_trace.replay.des.core import (
    CommInstances,
    DeadlockError,
    EmulatorGraph,
    MissingParticipantError,
    collective_instances,
    emulate,
    p2p_instances,
)
from prism_trace.replay.model.timing import (
    AlphaBetaTransfer,
    TransferQuery,
    recorded_completion,
    recorded_transfer,
)
from prism_trace.replay.model.topology import Topology

from prism_trace.errors import PrismError


def graph(
    unit: list[int],
    dur: list[int],
    edges: list[tuple[int, int, int]] = (),  # (src, dst, delay), anchor end
    *,
    release: list[int] | None = None,
    start_anchor: list[bool] | None = None,
    sync: list[bool] | None = None,
) -> EmulatorGraph:
    n_e = len(edges)
    e = np.array(edges, dtype=np.int64).reshape(n_e, 3)
    return EmulatorGraph(
        unit=np.array(unit),
        dur=np.array(dur),
        release=np.array(release if release is not None else [0] * len(unit)),
        src=e[:, 0],
        dst=e[:, 1],
        delay=e[:, 2],
        from_end=~np.array(start_anchor if start_anchor is not None else [False] * n_e, bool),
        holds_end=np.array(sync if sync is not None else [False] * n_e, dtype=bool),
    )


def comm(nodes: list[int], instances: list[int], transfer: list[int]) -> CommInstances:
    return CommInstances(np.array(nodes), np.array(instances), np.array(transfer))


def test_chain_with_gaps_and_release() -> None:
    # rank 0: a(10) -gap 2-> b(5); rank 1: c(7) released at 100
    g = graph([0, 0, 1], [10, 5, 7], [(0, 1, 2)], release=[0, 0, 100])
    tl = emulate(g, CommInstances.empty())
    assert tl.start.tolist() == [0, 12, 100]
    assert tl.end.tolist() == [10, 17, 107]


def test_start_anchor() -> None:
    g = graph([0, 0], [10, 5], [(0, 1, 3)], start_anchor=[True])
    tl = emulate(g, CommInstances.empty())
    assert tl.start.tolist() == [0, 3]


def test_collective_completes_at_last_arrival_plus_transfer() -> None:
    # rank 0: a(10) -> C0 -> x(1); rank 1: b(30) -> C1; transfer 5
    g = graph([0, 0, 1, 1, 0], [10, 999, 30, 999, 1], [(0, 1, 0), (2, 3, 0), (1, 4, 2)])
    tl = emulate(g, comm([1, 3], [0, 0], [5, 5]))
    assert tl.arrival.tolist() == [30]
    assert tl.end[1] == tl.end[3] == 35  # the early arriver waits: its recorded 999 is ignored
    assert tl.start[1] == 10
    assert tl.start[4] == 37


def test_per_participant_completion_skew() -> None:
    # Same, but rank 0 leaves 4 ns after the last arriver's completion (gloo-like).
    g = graph([0, 0, 1, 1], [10, 0, 30, 0], [(0, 1, 0), (2, 3, 0)])
    tl = emulate(g, comm([1, 3], [0, 0], [5 + 4, 5]))
    assert tl.end[1] == 39
    assert tl.end[3] == 35


def test_p2p_completes_when_both_sides_arrived() -> None:
    # send on rank 0 at 0; recv on rank 1 after a 20 ns op; transfer 7
    g = graph([0, 1, 1], [50, 20, 50], [(1, 2, 0)])
    tl = emulate(g, comm([0, 2], [0, 0], [7, 7]))
    assert tl.end[0] == tl.end[2] == 27


def test_eager_send_never_ends_before_it_starts() -> None:
    g = graph([0, 1, 1], [5, 20, 50], [(1, 2, 0)])
    tl = emulate(g, comm([0, 2], [0, 0], [-100, 7]))  # the send recorded ending long before
    assert tl.end[0] == 0  # max(its start, last arrival + transfer)
    assert tl.end[2] == 27


def test_sync_edge_holds_back_the_end_of_dst() -> None:
    # host h(5) launches kernel k(100) at +1; sync edge k -> h, delay 3; next host op n after h.
    g = graph(
        [0, 0, 0],
        [5, 100, 2],
        [(0, 1, 1), (1, 0, 3), (0, 2, 0)],
        start_anchor=[True, False, False],
        sync=[False, True, False],
    )
    tl = emulate(g, CommInstances.empty())
    assert tl.start[0] == 0  # a sync edge does not hold back the start
    assert tl.start[1] == 1
    assert tl.end[0] == 1 + 100 + 3
    assert tl.start[2] == tl.end[0]


def test_deadlock_is_reported_not_hung() -> None:
    # rank 0: A then B; rank 1: B then A (two collectives in opposite orders).
    g = graph([0, 0, 1, 1], [1, 1, 1, 1], [(0, 1, 0), (2, 3, 0)])
    with pytest.raises(DeadlockError, match="deadlock") as exc:
        emulate(g, comm([0, 3, 1, 2], [0, 0, 1, 1], [1, 1, 1, 1]))
    assert exc.value.pending == 4
    assert isinstance(exc.value, PrismError)
    assert exc.value.waiting


def test_collective_instances_and_missing_participant() -> None:
    unit_rank = np.array([0, 1])
    expected = {7: np.array([0, 1])}
    inst, k = collective_instances(
        [10, 11, 12, 13],
        [0, 1, 0, 1],
        [7, 7, 7, 7],
        [0, 0, 1, 1],
        expected=expected,
        unit_rank=unit_rank,
    )
    assert k == 2
    assert inst.tolist() == [0, 0, 1, 1]
    with pytest.raises(MissingParticipantError) as exc:
        collective_instances(
            [10, 11, 12],
            [0, 1, 0],
            [7, 7, 7],
            [0, 0, 1],
            expected=expected,
            unit_rank=unit_rank,
        )
    err = exc.value
    assert (err.group, err.seq, err.ranks) == (7, 1, [1])
    assert "group 7, seq 1" in str(err)
    assert "recorded rank(s) 1;" in str(err)
    # partial recordings may be allowed explicitly
    _, k = collective_instances(
        [10, 11, 12],
        [0, 1, 0],
        [7, 7, 7],
        [0, 0, 1],
        expected=expected,
        unit_rank=unit_rank,
        allow_partial=True,
    )
    assert k == 2


def test_p2p_instances_pair_and_missing_partner() -> None:
    unit_rank = np.array([0, 1])
    # send 0->1 seq 0, recv 1<-0 seq 0, send 1->0 seq 0, recv 0<-1 seq 0
    inst, k = p2p_instances(
        [0, 1, 2, 3],
        [0, 1, 1, 0],
        [1, 0, 0, 1],
        [True, False, True, False],
        [5, 5, 5, 5],
        [0, 0, 0, 0],
        unit_rank=unit_rank,
        peer_rank=np.array([1, 0, 0, 1]),
    )
    assert k == 2
    assert inst[0] == inst[1] != inst[2] == inst[3]
    with pytest.raises(MissingParticipantError) as exc:
        p2p_instances(
            [0, 1, 2],
            [0, 1, 1],
            [1, 0, 0],
            [True, False, True],
            [5, 5, 5],
            [0, 0, 0],
            unit_rank=unit_rank,
            peer_rank=np.array([1, 0, 0]),
        )
    assert (exc.value.group, exc.value.seq, exc.value.ranks) == (5, 0, [0])
    assert "no matching receive on rank 0" in str(exc.value)


def test_recorded_transfer_is_the_last_arrivers_duration() -> None:
    # instance 0: rank a arrives at 0 (dur 50, waited), rank b at 40 (dur 10)
    inst = np.array([0, 0, 1])
    start = np.array([0, 40, 5])
    dur = np.array([50, 10, 3])
    assert recorded_transfer(inst, start, dur, 2).tolist() == [10, 3]
    transfer, skew = recorded_completion(inst, start, dur, 2)
    assert transfer.tolist() == [10, 3]
    assert skew.tolist() == [0, 0, 0]
    transfer, skew = recorded_completion(inst, np.array([0, 40, 5]), np.array([56, 10, 3]), 2)
    assert skew.tolist() == [6, 0, 0]  # rank a left 6 ns after rank b


def test_alpha_beta_hook() -> None:
    model = AlphaBetaTransfer(
        Topology(
            intra_node_gbps=100.0,
            intra_node_latency_ns=1000.0,
            inter_node_gbps=10.0,
            inter_node_latency_ns=5000.0,
        )
    )
    q = TransferQuery(
        kind=np.array(["all_reduce", "send", "all_gather"], dtype=object),
        msg_bytes=np.array([1_000_000, 1000, -1]),
        group_size=np.array([4, 2, 8]),
        spans_nodes=np.array([False, True, False]),
        recorded_ns=np.array([1, 2, 3]),
    )
    out = model.transfer(q)
    assert out[0] == round(6 * 1000 + 1.5 * 1_000_000 / 100.0)
    assert out[1] == round(5000 + 1000 / 10.0)
    assert out[2] == 3  # unknown size keeps the recording


def test_core_imports_no_store_no_torch() -> None:
    import ast
    from pathlib import Path

    import prism_trace.replay.des.core

    tree = ast.parse(Path(prism_trace.replay.des.core.__file__).read_text())
    mods = {
        (n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in (n.names if isinstance(n, ast.Import) else [n])
    }
    assert not mods & {"duckdb", "torch", "polars", "os", "pathlib", "random"}, mods

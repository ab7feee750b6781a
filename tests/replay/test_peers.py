"""Virtual peers' schedule (``replay.peers``) from the emulation of the bundled 8-rank sample."""

from __future__ import annotations

import pytest
from prism_trace.replay.peers import PeerSchedule, schedules_from_store


@pytest.fixture(scope="module")
def schedules(sample_store: object) -> dict[int, PeerSchedule]:
    """Rank 0's and rank 1's schedules, each with every other rank virtual."""
    return {
        r: PeerSchedule.from_store(sample_store, run="sample", rank=r)  # type: ignore[arg-type]
        for r in (0, 1)
    }


def test_calls_are_the_ranks_communication(sample_store: object, schedules: dict) -> None:
    s0 = schedules[0]
    con = sample_store.con  # type: ignore[attr-defined]
    ((n_coll,),) = con.execute("SELECT count(*) FROM collective WHERE rank = 0").fetchall()
    ((n_p2p,),) = con.execute("SELECT count(*) FROM p2p WHERE rank = 0").fetchall()
    assert len(s0.calls) == n_coll + n_p2p == 50
    assert [c.index for c in s0.calls] == list(range(50))
    assert s0.world_size == 8
    assert set(s0.iteration_start_ns) == {1, 2}
    # Every call's recorded host event is a collective or p2p row of the rank.
    events = {
        e for (e,) in con.execute("SELECT event_id FROM collective WHERE rank = 0").fetchall()
    }
    events |= {e for (e,) in con.execute("SELECT event_id FROM p2p WHERE rank = 0").fetchall()}
    assert {c.event_id for c in s0.calls} == events
    assert all(s0.by_event(c.event_id) is c for c in s0.calls)


def test_completion_at_own_arrival_is_the_emulated_end(schedules: dict) -> None:
    for s in schedules.values():
        for c in s.calls:
            assert s.completion_ns(c, c.own_arrival_ns) == c.end_ns
            # Arriving later than everyone: completes a transfer after the real arrival.
            late = max(c.own_arrival_ns, c.peers_arrival_ns) + 10_000_000
            assert s.completion_ns(c, late) == late + c.transfer_ns
            assert c.transfer_ns >= 0


def test_peers_arrival_is_the_other_ranks_arrival(schedules: dict) -> None:
    """For the tp all-reduces of ranks 0 and 1 (the only two members), each rank's peers'
    arrival is the other's own arrival, on the run clock."""
    s0, s1 = schedules[0], schedules[1]
    tp0 = s0.by_group()[(0, 1)]
    tp1 = {c.seq: c for c in s1.by_group()[(0, 1)]}
    assert len(tp0) == len(tp1) > 0
    assert [c.seq for c in tp0] == sorted(c.seq for c in tp0)
    for c in tp0:
        other = tp1[c.seq]
        base0 = s0.iteration_start_ns[c.iteration]
        base1 = s1.iteration_start_ns[other.iteration]
        assert c.peers_arrival_ns + base0 == other.own_arrival_ns + base1
        assert c.kind == other.kind == "all_reduce"


def test_real_ranks_are_not_waited_for(sample_store: object) -> None:
    both = schedules_from_store(sample_store, run="sample", ranks=[0, 1])  # type: ignore[arg-type]
    s0 = both[0]
    assert s0.real_ranks == (1,)
    for c in s0.by_group()[(0, 1)]:
        assert c.peers_arrival_ns == c.own_arrival_ns  # rank 1 synchronises for real
    # The dp and pp partners (2 and 4) stay virtual.
    assert any(c.peers_arrival_ns != c.own_arrival_ns for c in s0.calls if 4 in c.group_ranks)


def test_p2p_pairs_and_instant() -> None:
    s = PeerSchedule.instant(3, 8)
    assert s.calls == []
    assert s.by_group() == {}
    assert s.for_iteration(1) == []


def test_p2p_group_ranks_sender_first(schedules: dict) -> None:
    for c in schedules[0].calls:
        if c.is_p2p:
            assert c.peer == 4
            assert c.group_ranks == ((0, 4) if c.kind == "send" else (4, 0))

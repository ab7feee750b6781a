"""Several real ranks replayed together (``replay.real_comm`` + ``replay.hybrid``).

The planning half (``agree``) is checked on its own; the execution half on the bundled sample:
ranks 0, 1 and 4 as three processes (tensor-parallel all-reduces between 0 and 1 and pipeline
send/recv between 0 and 4 through gloo), and a data-parallel group of four in a slice of it, two
members real and two virtual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import polars as pl
import pytest

torch = pytest.importorskip("torch")

from prism_trace.replay.hybrid.options import KernelReplayOptions  # noqa: E402
from prism_trace.replay.hybrid.real_comm import RealSpec, agree, specs_for_rank  # noqa: E402
from prism_trace.replay.hybrid.replay import replay_run  # noqa: E402
from prism_trace.replay.peers import PeerSchedule  # noqa: E402
from prism_trace.replay.validate.replayed import validate_replayed  # noqa: E402

from prism_trace.errors import CollectiveMismatchError, UsageError  # noqa: E402
from prism_trace.layout.mesh import ParallelLayout  # noqa: E402
from prism_trace.slicing.slicer import slice_run  # noqa: E402

# Slow: replays ranks together in torch processes; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

FAST = KernelReplayOptions(iterations=1, warmup=0, threads=1)
CLOCK_SLACK_NS = 50_000
"""Clock reads around a call are taken a few µs before/after the call itself."""


# -- planning ---------------------------------------------------------------------------------


def _ar(unit: int, seq: int, group: tuple[int, ...] = (0, 1), nbytes: int = 64) -> RealSpec:
    return RealSpec(unit, "all_reduce", group, seq, nbytes, mixed=False)


def test_agree_fixes_sizes_groups_and_p2p_waits() -> None:
    specs = {
        0: [
            _ar(3, 0, nbytes=64),
            RealSpec(5, "send", (0, 1), 0, 100, mixed=False),
            RealSpec(6, "recv", (1, 0), 0, 100, mixed=False),
            _ar(9, 0, group=(0, 1, 2), nbytes=8),
        ],
        1: [
            _ar(2, 0, nbytes=128),
            RealSpec(4, "recv", (0, 1), 0, 80, mixed=False),
            RealSpec(7, "send", (1, 0), 0, 100, mixed=False),
            _ar(8, 0, group=(0, 1, 2), nbytes=8),
        ],
    }
    ops, subgroups = agree(specs)
    assert subgroups == [(0, 1)]  # both communicators have real members (0, 1)
    assert ops[0][3].nbytes == ops[1][2].nbytes == 128  # the largest recorded size
    assert ops[0][5].nbytes == ops[1][4].nbytes == 100
    # A batch of consecutive sends/receives is waited for once, after its last one.
    assert ops[0][5].wait_after is False
    assert ops[0][6].wait_after is True
    assert ops[1][4].wait_after is True
    assert ops[1][7].wait_after is True
    assert ops[0][5].members == (1,)


def test_agree_rejects_mismatched_collectives_and_lone_sends() -> None:
    with pytest.raises(
        CollectiveMismatchError, match=r"all_reduce seq 1 of group \[0, 1\].*missing ranks: \[1\]"
    ):
        agree({0: [_ar(1, 0), _ar(2, 1)], 1: [_ar(1, 0)]})
    with pytest.raises(CollectiveMismatchError, match="issue different collectives"):
        agree({0: [_ar(1, 0)], 1: [_ar(1, 5)]})
    with pytest.raises(CollectiveMismatchError, match=r"real ranks 0 -> 1: 1 sends but 0 receives"):
        agree({0: [RealSpec(1, "send", (0, 1), 0, 8, mixed=False)], 1: []})


@dataclass(frozen=True)
class _Call:
    kind: str
    group_ranks: tuple[int, ...]
    seq: int
    peer: int | None
    msg_bytes: int | None

    @property
    def is_p2p(self) -> bool:
        return self.kind in ("send", "recv")


def test_specs_keep_only_calls_with_another_real_rank() -> None:
    calls = [
        (0, _Call("all_reduce", (0, 1), 0, None, 8)),  # all real
        (1, _Call("all_reduce", (0, 2), 0, None, 8)),  # 2 virtual: nothing real to do
        (2, _Call("all_reduce", (0, 1, 2, 3), 0, None, 8)),  # 1 real, 2 and 3 virtual: mixed
        (3, _Call("send", (0, 1), 0, 1, 8)),
        (4, _Call("send", (0, 5), 0, 5, 8)),  # to a virtual peer
    ]
    specs = specs_for_rank(calls, 0, [0, 1])
    assert [(s.unit, s.mixed) for s in specs] == [(0, False), (2, True), (3, False)]


# -- execution ----------------------------------------------------------------------------------


def _q(store: object, sql: str) -> pl.DataFrame:
    return store.con.sql(sql).pl()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def together(sample_store: object) -> object:
    """Ranks 0, 1 (tensor parallel) and 4 (next pipeline stage of 0), one process each."""
    return replay_run(sample_store, run="sample", ranks=[0, 1, 4], out_run="rt", options=FAST)  # type: ignore[arg-type]


def test_ranks_run_together_and_are_stored(sample_store: object, together: object) -> None:
    by_rank = {r.rank: r for r in together.ranks}  # type: ignore[attr-defined]
    assert sorted(by_rank) == [0, 1, 4]
    # 0-1: 32 tensor-parallel all-reduces; 0-4: 8 sends and 8 receives each way.
    assert by_rank[0].real_calls == 32 + 16
    assert by_rank[1].real_calls == 32
    assert by_rank[4].real_calls == 16
    assert "ranks ran together" in together.notes[0]  # type: ignore[attr-defined]
    rid = "(SELECT run_id FROM run WHERE name = 'rt')"
    ranks = _q(sample_store, f"SELECT rank FROM rank WHERE run_id = {rid} ORDER BY 1")
    assert ranks["rank"].to_list() == [0, 1, 4]
    v = validate_replayed(sample_store, replayed="rt")  # type: ignore[arg-type]
    d = v.as_dict()
    assert d["ranks"] == [0, 1, 4]
    # both recorded iterations compared (how close the replay comes is a benchmark's figure)
    assert [e.iteration for e in v.iterations] == [1, 2]
    assert math.isfinite(d["iteration_time_error_pct"])


def test_real_collectives_synchronise_their_members(sample_store: object, together: object) -> None:
    """On the one clock of the run, every member of a real all-reduce leaves it after the last
    member arrived."""
    rid = "(SELECT run_id FROM run WHERE name = 'rt')"
    coll = _q(
        sample_store,
        f"SELECT c.rank, c.seq, c.host_ts, c.host_ts + c.host_dur AS host_end FROM collective c"
        f" JOIN comm_group g ON g.run_id = c.run_id AND g.group_id = c.group_id"
        f" WHERE c.run_id = {rid} AND g.ranks = [0, 1]",
    )
    per_seq = coll.group_by("seq").agg(
        pl.len().alias("n"), pl.col("host_ts").max().alias("last"), pl.col("host_end").min()
    )
    assert per_seq.height == 32
    assert (per_seq["n"] == 2).all()
    assert (per_seq["host_end"] >= per_seq["last"] - CLOCK_SLACK_NS).all()


def test_real_receives_end_after_their_sends_start(sample_store: object, together: object) -> None:
    rid = "(SELECT run_id FROM run WHERE name = 'rt')"
    p2p = _q(
        sample_store,
        f"SELECT rank, direction, peer, host_ts, host_ts + host_dur AS host_end FROM p2p"
        f" WHERE run_id = {rid} AND rank IN (0, 4) ORDER BY host_ts",
    )
    sends_0 = p2p.filter((pl.col("rank") == 0) & (pl.col("direction") == "send"))
    recvs_4 = p2p.filter((pl.col("rank") == 4) & (pl.col("direction") == "recv"))
    assert sends_0.height == recvs_4.height == 8
    assert (recvs_4["host_end"] >= sends_0["host_ts"] - CLOCK_SLACK_NS).all()


def test_mixed_group_waits_for_real_and_virtual_members(sample_store: object) -> None:
    """A data-parallel group of four in a slice (dp=4): two members real, two virtual. The real
    pair synchronises for real, and the call ends no earlier than the virtual peers allow."""
    slice_run(
        sample_store,  # type: ignore[arg-type]
        run="sample",
        layout=ParallelLayout.parse("tp=2,dp=4,pp=2"),
        world=16,
        out_run="dp4",
    )
    groups = _q(
        sample_store,
        "SELECT ranks FROM comm_group WHERE run_id = (SELECT run_id FROM run WHERE name = 'dp4')"
        " AND len(ranks) = 4 AND list_contains(ranks, 0)",
    )
    dp_group = groups["ranks"][0].to_list()
    pair = sorted(dp_group[:2])
    assert 0 in pair
    rep = replay_run(sample_store, run="dp4", ranks=pair, out_run="rdp4", options=FAST)  # type: ignore[arg-type]
    by_rank = {r.rank: r for r in rep.ranks}
    assert all(by_rank[r].real_calls == 2 for r in pair)  # the two dp all-reduces
    sched = PeerSchedule.from_store(sample_store, run="dp4", rank=0, real_ranks=pair)  # type: ignore[arg-type]
    dp_calls = [c for c in sched.calls if tuple(c.group_ranks) == tuple(dp_group)]
    assert len(dp_calls) == 2
    rid = "(SELECT run_id FROM run WHERE name = 'rdp4')"
    its = dict(
        _q(
            sample_store, f"SELECT iteration, ts FROM iteration WHERE run_id = {rid} AND rank = 0"
        ).rows()
    )
    coll = _q(
        sample_store,
        f"SELECT c.rank, c.seq, c.iteration, c.host_ts, c.host_ts + c.host_dur AS host_end"
        f" FROM collective c JOIN comm_group g ON g.run_id = c.run_id AND g.group_id = c.group_id"
        f" WHERE c.run_id = {rid} AND len(g.ranks) = 4",
    )
    assert coll.height == 4
    seqs = sorted(set(coll["seq"].to_list()))
    assert seqs == sorted(c.seq for c in dp_calls)
    for seq in seqs:
        rows = coll.filter(pl.col("seq") == seq)
        assert rows.height == 2
        assert rows["host_end"].min() >= rows["host_ts"].max() - CLOCK_SLACK_NS
        mine = rows.filter(pl.col("rank") == 0).row(0, named=True)
        call = next(c for c in dp_calls if c.seq == seq)
        start = its[mine["iteration"]]
        assert mine["host_end"] >= start + call.peers_arrival_ns + call.transfer_ns - CLOCK_SLACK_NS


def test_a_failing_rank_stops_all_with_one_line(sample_store: object) -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("two CUDA devices are present; the guard is for machines with fewer")
    with pytest.raises(UsageError, match="needs 2 GPUs") as info:
        replay_run(
            sample_store,  # type: ignore[arg-type]
            run="sample",
            ranks=[0, 1],
            out_run="rt_cuda",
            options=KernelReplayOptions(device="cuda", iterations=1, warmup=0),
        )
    assert "\n" not in str(info.value)
    assert _q(sample_store, "SELECT * FROM run WHERE name = 'rt_cuda'").is_empty()

"""The `prism` backend in one process: rank 0 of a larger world, every other rank virtual."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import prism_trace.replay.pg.backend as ppg  # noqa: E402
import prism_trace.replay.pg.base as ppg_base  # noqa: E402
import prism_trace.replay.pg.session as pg_session  # noqa: E402
import prism_trace.replay.pg.timeline as ppg_timeline  # noqa: E402
import prism_trace.replay.pg.work as ppg_work  # noqa: E402
from prism_trace.replay.peers import PeerCall, PeerSchedule  # noqa: E402
from prism_trace.replay.pg.base import ScheduleMismatchError  # noqa: E402

from prism_trace.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.torch

MS = 1_000_000


class VirtualClock:
    """The backend's clock in a test: it moves only when the backend sleeps until a call's
    completion or the test says time passed, so how long a call held rank 0 is exact."""

    def __init__(self) -> None:
        self.ns = 1_000 * MS

    def now(self) -> int:
        return self.ns

    def sleep_until(self, target_ns: int) -> None:
        self.ns = max(self.ns, target_ns)

    def advance(self, ns: int) -> None:
        """Rank 0 computes for ``ns`` before its next call."""
        self.ns += ns


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """The backend's timeline and its works on a `VirtualClock` (the real sleep is tested alone,
    in `test_sleep_until_never_returns_before_its_target`)."""
    c = VirtualClock()
    monkeypatch.setattr(ppg_timeline, "_now", c.now)
    monkeypatch.setattr(ppg_work, "_now", c.now)
    monkeypatch.setattr(ppg_work, "_sleep_until", c.sleep_until)
    return c


@contextlib.contextmanager
def prism_world(
    world_size: int, *, schedule: PeerSchedule | None = None, groups: dict | None = None
) -> Iterator[pg_session.PrismSession]:
    """Rank 0 of ``world_size`` under the `prism` backend; torch's state is reset afterwards."""
    s = ppg.configure(world_size=world_size, real_ranks=(0,), schedule=schedule, groups=groups)
    dist.init_process_group("prism", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield s
    finally:
        dist.destroy_process_group()
        pg_session.reset()


def _call(
    index: int,
    seq: int,
    *,
    kind: str = "all_reduce",
    ranks: tuple[int, ...] = (0, 1),
    group_id: int = 1,
    iteration: int = 1,
    own: int = 0,
    peers: int = 0,
    transfer: int = 0,
) -> PeerCall:
    return PeerCall(
        index=index,
        kind=kind,
        group_id=group_id,
        group_ranks=ranks,
        seq=seq,
        peer=None if kind not in ("send", "recv") else ranks[1 - ranks.index(0)],
        msg_bytes=16,
        iteration=iteration,
        own_arrival_ns=own,
        peers_arrival_ns=peers,
        transfer_ns=transfer,
        end_ns=max(own, peers) + transfer,
    )


def _schedule(calls: list[PeerCall], world_size: int = 2) -> PeerSchedule:
    its = {c.iteration for c in calls if c.iteration is not None}
    return PeerSchedule(
        run="t",
        rank=0,
        world_size=world_size,
        iteration_start_ns={i: i * 1000 * MS for i in its},
        iteration_dur_ns={i: 1000 * MS for i in its},
        calls=calls,
    )


def test_importing_the_module_registers_nothing() -> None:
    code = (
        "import torch.distributed as d, prism_trace.replay.pg.backend as ppg\n"
        "print('PRISM' in d.Backend._plugins)\n"
        "ppg.register(); ppg.register()\n"
        "print('PRISM' in d.Backend._plugins, d.Backend.backend_list.count('prism'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "True", "1"]


def test_backend_is_registered_and_only_declares_its_devices() -> None:
    ppg.register()
    assert "prism" in dist.Backend.backend_list
    assert dist.Backend._plugins["PRISM"].extended_api
    # Registering must not take cpu/cuda away from gloo/nccl.
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
    with prism_world(8):
        assert dist.get_backend() == "prism"
        assert (dist.get_rank(), dist.get_world_size()) == (0, 8)
        assert isinstance(dist.group.WORLD, ppg.PrismProcessGroup)


def test_reductions_treat_virtual_peers_as_holding_the_same_data() -> None:
    with prism_world(4):
        R = dist.ReduceOp
        expect = {R.SUM: 4 * 3.0, R.AVG: 3.0, R.MAX: 3.0, R.MIN: 3.0, R.PRODUCT: 3.0**4}
        for op, value in expect.items():
            t = torch.full((2, 3), 3.0)
            dist.all_reduce(t, op=op)
            assert torch.equal(t, torch.full((2, 3), value)), op
        i = torch.tensor([6, 7])
        dist.all_reduce(i, op=R.AVG)  # integer average rounds down
        assert i.tolist() == [6, 7]
        x = torch.tensor([5], dtype=torch.int32)
        dist.all_reduce(x, op=R.BXOR)  # even number of equal members cancel out
        assert x.item() == 0
        r = torch.ones(3)
        dist.reduce(r, dst=0)
        assert r.tolist() == [4.0] * 3
        r = torch.ones(3)
        dist.reduce(r, dst=2)  # not the root: untouched
        assert r.tolist() == [1.0] * 3


def test_gathers_scatters_and_all_to_all_have_the_real_shapes() -> None:
    with prism_world(4):
        x = torch.arange(6.0).reshape(2, 3)
        outs = [torch.empty(2, 3) for _ in range(4)]
        dist.all_gather(outs, x)
        assert all(torch.equal(o, x) for o in outs)
        flat = torch.empty(8, 3)
        dist.all_gather_single(flat, x)
        assert torch.equal(flat, x.repeat(4, 1))

        out = torch.empty(2)
        dist.reduce_scatter_single(out, torch.arange(8.0))
        assert out.tolist() == [0.0, 4.0]  # chunk 0 of each of the 4 members, summed
        out = torch.empty(2)
        dist.reduce_scatter(out, [torch.full((2,), float(i)) for i in range(4)])
        assert out.tolist() == [0.0, 0.0]

        # all_to_all: member j sends me its chunk for me; virtual members mirror rank 0.
        a2a = torch.empty(4)
        dist.all_to_all_single(a2a, torch.tensor([10.0, 11.0, 12.0, 13.0]))
        assert a2a.tolist() == [10.0] * 4
        outs = [torch.full((2,), -1.0) for _ in range(4)]
        dist.all_to_all(outs, [torch.full((2,), float(i)) for i in range(4)])
        assert all(o.tolist() == [0.0, 0.0] for o in outs)
        uneven = torch.full((5,), -1.0)
        dist.all_to_all_single(
            uneven,
            torch.arange(5.0),
            output_split_sizes=[2, 1, 1, 1],
            input_split_sizes=[2, 1, 1, 1],
        )
        # chunk 0 (2 elements) fits member 0; members 1-3 would send 2 elements into 1: untouched
        assert uneven.tolist() == [0.0, 1.0, -1.0, -1.0, -1.0]

        b = torch.arange(3.0)
        dist.broadcast(b, src=2)  # virtual root: the local tensor stays
        assert b.tolist() == [0.0, 1.0, 2.0]
        g = [torch.empty(2) for _ in range(4)]
        dist.gather(torch.ones(2), gather_list=g, dst=0)
        assert all(t.tolist() == [1.0, 1.0] for t in g)
        s = torch.full((2,), -1.0)
        dist.scatter(s, scatter_list=[torch.full((2,), float(i)) for i in range(4)], src=0)
        assert s.tolist() == [0.0, 0.0]
        s = torch.full((2,), -1.0)
        dist.scatter(s, src=3)  # virtual root: untouched
        assert s.tolist() == [-1.0, -1.0]
        dist.barrier()


def test_subgroups_device_mesh_and_p2p_span_the_whole_world() -> None:
    with prism_world(8):
        g = dist.new_group([0, 4])
        assert dist.get_process_group_ranks(g) == [0, 4]
        assert dist.new_group([1, 2]) is dist.GroupMember.NON_GROUP_MEMBER
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
        assert t.item() == 2.0
        sub, subs = dist.new_subgroups(group_size=4)
        assert dist.get_process_group_ranks(sub) == [0, 1, 2, 3]
        assert len(subs) == 2

        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        ranks = {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in ("pp", "dp", "tp")}
        assert ranks == {"pp": [0, 4], "dp": [0, 2], "tp": [0, 1]}
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh.get_group("dp"))
        assert t.item() == 2.0

        dist.send(torch.ones(3), dst=5)
        r = torch.full((3,), 7.0)
        dist.recv(r, src=5)
        assert r.tolist() == [0.0] * 3  # a virtual sender's data is zeros
        recv = torch.full((2,), 7.0)
        ops = [dist.P2POp(dist.isend, torch.ones(2), 1), dist.P2POp(dist.irecv, recv, 7)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert recv.tolist() == [0.0, 0.0]
        w = dist.isend(torch.ones(2), dst=3)
        assert w.wait()


def test_collective_completes_when_the_schedule_says(clock: VirtualClock) -> None:
    # Rank 1 (virtual) arrives 60 ms after rank 0 at call 0 and the transfer takes 5 ms; at
    # call 1 the peer (150 ms) is there before rank 0 (165 ms): only the 1 ms transfer.
    calls = [
        _call(0, 0, own=100 * MS, peers=160 * MS, transfer=5 * MS),
        _call(1, 1, own=200 * MS, peers=150 * MS, transfer=1 * MS),
    ]
    with prism_world(2, schedule=_schedule(calls)) as s:
        t0 = clock.now()
        work = dist.all_reduce(torch.ones(1), async_op=True)
        assert not work.is_completed()
        work.wait()
        # No step mark: the first scheduled call anchors the clock at its emulated arrival.
        assert s.timeline.anchored_by == "first scheduled call"
        assert clock.now() - t0 == 65 * MS  # the peer's 160 ms + 5 ms, from rank 0's 100 ms
        assert work.is_completed()
        t1 = clock.now()
        dist.all_reduce(torch.ones(1))
        assert clock.now() - t1 == 1 * MS  # the peer was already there
        rep = s.report()
        assert rep["scheduled_calls"] == 2
        assert rep["waited_ms"] == 65 + 1


def test_step_mark_anchors_the_clock_at_the_iteration_start(clock: VirtualClock) -> None:
    # The peer arrives 80 ms into the iteration; rank 0 arrives 20 ms in (its compute is
    # faster than recorded), so it waits 60 ms + transfer, not the emulated 80 - 50.
    calls = [_call(0, 0, own=50 * MS, peers=80 * MS, transfer=2 * MS)]
    with prism_world(2, schedule=_schedule(calls)) as s:
        s.timeline.mark(profiler_step=1)
        start = clock.now()
        clock.advance(20 * MS)
        dist.all_reduce(torch.ones(1))
        assert s.timeline.anchored_by == "step mark"
        assert clock.now() - start == 82 * MS


def test_virtual_peers_that_waited_for_a_late_rank_arrive_later() -> None:
    """The lag rule: a peer held back 20 ms at call 1 arrives 20 ms later at call 2."""
    calls = [
        _call(0, 0, own=10 * MS, peers=10 * MS, transfer=0),
        _call(1, 1, own=20 * MS, peers=40 * MS, transfer=0),
        _call(2, 2, own=50 * MS, peers=70 * MS, transfer=0),
    ]
    tl = ppg_timeline._Timeline(_schedule(calls), frozenset({0}))
    clock = iter([1_000 * MS, 1_050 * MS, 1_065 * MS])
    real_now = ppg_timeline._now
    try:
        ppg_timeline._now = lambda: next(clock)  # type: ignore[assignment]
        t0 = tl.collective((0, 1), "", 0, "all_reduce", 0)
        assert t0 == 1_000 * MS  # anchored: no wait
        # In emulation the peer arrives at call 1 20 ms after call 0 ended (at 10); here call 0
        # ended at the same emulated point, so the peer is due at +30 ms: rank 0 (at +50) is late.
        t1 = tl.collective((0, 1), "", 1, "all_reduce", 0)
        assert t1 == 1_050 * MS
        assert tl.lag[1] == 20 * MS  # the peer left call 1 20 ms after its emulated end
        # Call 2 at emulated +75 ms: the peer, due at 70 ms, comes 20 ms late, at 90 ms.
        t2 = tl.collective((0, 1), "", 2, "all_reduce", 0)
        assert t2 == 1_080 * MS
    finally:
        ppg_timeline._now = real_now  # type: ignore[assignment]


def test_mismatch_is_one_clear_error_and_never_a_wait() -> None:
    calls = [_call(i, seq) for i, seq in enumerate((3, 4, 6))]
    with prism_world(2, schedule=_schedule(calls)) as s:
        for _ in range(3):  # seqs 0-2: before the recorded window (a warm-up step)
            dist.all_reduce(torch.ones(1))
        dist.all_reduce(torch.ones(1))  # seq 3
        with pytest.raises(
            ScheduleMismatchError, match=r"group \[0, 1\] seq 4: .*'all_gather'.*'all_reduce'"
        ):
            dist.all_gather([torch.empty(1), torch.empty(1)], torch.ones(1))
        with pytest.raises(ScheduleMismatchError, match=r"seq 5: .*no call there"):
            dist.barrier()  # seq 5 is a hole in the recorded seqs 3..6
        assert s.report()["unscheduled_calls"] == {"all_reduce": 3}


def test_p2p_counts_from_the_first_recorded_step(clock: VirtualClock) -> None:
    calls = [
        _call(0, 0, kind="send", ranks=(0, 1), iteration=2, own=5 * MS, peers=45 * MS),
        _call(1, 1, kind="send", ranks=(0, 1), iteration=3, own=5 * MS, peers=5 * MS),
    ]
    with prism_world(2, schedule=_schedule(calls)) as s:
        s.timeline.mark(profiler_step=1)
        dist.send(torch.ones(1), dst=1)  # step 1: not recorded
        s.timeline.mark(profiler_step=2)
        t0 = clock.now()
        dist.send(torch.ones(1), dst=1)  # the recorded send #0: waits for the receiver
        assert clock.now() - t0 == 45 * MS  # step 2 opened as rank 0 sent; the receiver: 45 ms in
        with pytest.raises(ScheduleMismatchError, match=r"p2p 0->1 send #1 .* step 2 .* step 3"):
            dist.send(torch.ones(1), dst=1)  # one send too many in step 2
        assert s.report()["unscheduled_calls"] == {"send": 1}


def test_groups_with_the_same_members_are_told_apart_by_name() -> None:
    # The recorded world group (name "0") and a dp group (name "1") both have members (0, 1).
    calls = [_call(0, 0, group_id=11, kind="all_reduce", peers=50 * MS)]
    groups = {10: ("0", [0, 1]), 11: ("1", [0, 1])}
    with prism_world(2, schedule=_schedule(calls), groups=groups) as s:
        dp = dist.new_group([0, 1])
        assert dp.group_name == "1"
        dist.barrier()  # world group, seq 0: not the dp group's all_reduce at seq 0
        assert s.report()["unscheduled_calls"] == {"barrier": 1}
        dist.all_reduce(torch.ones(1), group=dp)
        assert s.report()["scheduled_calls"] == 1


def test_rank_outside_the_real_ranks_is_refused() -> None:
    ppg.configure(world_size=4, real_ranks=(1,))
    with pytest.raises(ConfigError, match=r"rank 0 is not one of the real ranks \[1\]"):
        dist.init_process_group("prism", store=dist.HashStore(), rank=0, world_size=4)
    with pytest.raises(ConfigError, match="outside a world of 4"):
        ppg.configure(world_size=4, real_ranks=(4,))
    pg_session.reset()
    assert pg_session.session() is None


def test_ddp_gradients_and_its_future_based_wait_follow_the_schedule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DDP waits on `Work.get_future()`: the future must complete when the schedule says.

    On the real clock (the future is completed by the backend's helper thread, which waits on
    it): the bucket's all-reduce slept until 60 ms after rank 0 arrived, and backward returned
    only after that sleep ended."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    slept: list[int] = []
    real_sleep_until = ppg_work._sleep_until

    def sleep_until(target_ns: int) -> None:
        real_sleep_until(target_ns)
        slept.append(target_ns)

    monkeypatch.setattr(ppg_work, "_sleep_until", sleep_until)

    # DDP's set-up: all_gather (seq 0) and two broadcasts (1, 2); its gradient bucket: seq 3.
    calls = [_call(0, 3, ranks=(0, 1, 2, 3), own=0, peers=60 * MS, transfer=0)]
    with prism_world(4, schedule=_schedule(calls, world_size=4)) as s:
        torch.manual_seed(0)
        model, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
        ref.load_state_dict(model.state_dict())
        ddp = DDP(model)
        x = torch.randn(5, 3)
        ddp(x).sum().backward()
        assert slept == [s.timeline.stats.first_arrival[1] + 60 * MS]
        ref(x).sum().backward()
        # Every virtual replica holds the same gradient: the average is the local gradient.
        assert torch.allclose(model.weight.grad, ref.weight.grad)
        assert s.report()["scheduled_calls"] == 1


def test_sleep_until_never_returns_before_its_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's real wait sleeps until its clock reaches the target, sleeps again when a
    signal wakes it early, and does not sleep for a target that has passed."""
    now = [0]
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        slept = round(seconds * 1e9)
        now[0] += slept // 2 if len(naps) == 1 else slept  # a signal cuts the first nap short

    monkeypatch.setattr(ppg_base, "_now", lambda: now[0])
    monkeypatch.setattr(ppg_base, "time", SimpleNamespace(sleep=sleep))
    ppg_base._sleep_until(100 * MS)
    assert now[0] == 100 * MS
    assert naps == [0.1, 0.05]
    ppg_base._sleep_until(50 * MS)
    assert naps == [0.1, 0.05]

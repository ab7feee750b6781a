"""The `prism` torch.distributed backend: some ranks of a job run for real, the rest are virtual.

An unmodified training script runs as rank ``r`` of a world of ``N`` although only the *selected*
ranks exist as processes. Every collective and point-to-point call returns what the real one
would return in shape and dtype, with values from one rule ("virtual members mirror real ones",
see `docs/process-group.md`), and completes (its `Work` is done) at the time the virtual peers of
a recorded run would let it complete, so that the script's own timers see faithful step times.

Use it through `prism run` (`replay.launch`), or directly::

    import prism_trace.replay.process_group as ppg
    ppg.configure(world_size=8, real_ranks=(0,), schedule=schedule)   # optional
    torch.distributed.init_process_group("prism", store=store, rank=0, world_size=8)

Timing follows `replay.peers.PeerSchedule`: a call is looked up by the member ranks of its group
and its per-group sequence number (point-to-point: by sender, receiver and the sequence number of
the pair), and waits until ``PeerSchedule.completion_ns(call, own_arrival)``. Without a schedule
the virtual peers never hold anyone back.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from prism_trace.errors import PrismError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from prism_trace.replay.peers import PeerCall, PeerSchedule

__all__ = [
    "BACKEND",
    "ENV",
    "PrismProcessGroup",
    "PrismSession",
    "ScheduleMismatchError",
    "configure",
    "register",
    "reset",
    "session",
]

BACKEND = "prism"


class ENV:
    """Environment variables that configure the backend in a process started by `prism run`."""

    SWITCH = "PRISM_PG"  # "1": `init_process_group(<any backend>)` uses `prism` (replay.launch)
    WORLD_SIZE = "PRISM_WORLD_SIZE"  # N, the emulated world
    RANKS = "PRISM_RANKS"  # comma-separated global ranks that exist as processes
    SCHEDULE = "PRISM_SCHEDULE"  # pickled PeerSchedule of this process's rank (optional)
    REPORT = "PRISM_REPORT"  # where this process writes its JSON report at exit (optional)


class ScheduleMismatchError(PrismError, RuntimeError):
    """The script issued a call that the recorded schedule does not have at that point.

    Raised at the call, on the calling rank, so nothing waits for an instance that never comes.
    """


# Schedule and torch names of the same operation, to compare a call with its recorded kind.
_KIND_ALIASES = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all",
    "alltoall_base": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}


def _kind(name: str) -> str:
    return _KIND_ALIASES.get(name.lower(), name.lower())


def _now() -> int:
    return time.perf_counter_ns()


def _sleep_until(target_ns: int) -> None:
    # time.sleep never returns early; the loop only guards against signal wake-ups.
    while (left := target_ns - _now()) > 0:
        time.sleep(left / 1e9)


# --------------------------------------------------------------------------------------------
# Timing: the schedule of one rank, aligned to the replay clock.
# --------------------------------------------------------------------------------------------


@dataclass
class _Stats:
    scheduled: int = 0
    unscheduled: Counter[str] = field(default_factory=Counter)
    waited_ns: int = 0
    first_arrival: dict[int, int] = field(default_factory=dict)  # iteration -> wall ns
    step_open: dict[int, int] = field(default_factory=dict)  # step -> wall ns of its first mark
    step_close: dict[int, int] = field(default_factory=dict)  # step -> wall ns profiler closed it
    # Per scheduled call (the first _MAX_CALLS): what was emulated and what happened, ns from
    # the emulated iteration start: [index, iteration, own, peers + lag, end, arrival, done].
    calls: list[list[int | None]] = field(default_factory=list)


_MAX_CALLS = 10_000


class _Timeline:
    """When each call of this process completes, given its schedule (see `docs/process-group.md`).

    The replay clock is tied to the emulated run clock at the start of the first scheduled
    iteration: the latest *step mark* (``torch.profiler.profile.step()`` returning, which opens
    ``ProfilerStep#<n>``, the recorded iteration; else the end of an ``Optimizer.step()``) before
    the first scheduled call is that iteration's emulated start. Without a mark, the first
    scheduled call's real arrival is taken to be its emulated arrival. After that the virtual
    peers follow their emulated arrivals, each shifted by its *lag*: how much later (or earlier)
    than emulated it left the last call it shared with this rank, because this rank arrived later
    (or earlier) there than emulated. So a rank that computes slower than recorded holds its peers
    back, and one that computes faster waits for them, as in the real job.
    """

    def __init__(
        self,
        schedule: PeerSchedule | None,
        real_ranks: frozenset[int],
        groups: Mapping[int, tuple[str, Sequence[int]]] | None = None,
    ) -> None:
        self.schedule = schedule
        self.real_ranks = real_ranks
        self.offset: int | None = None  # wall ns - run-clock ns
        self.lag: dict[int, int] = {}
        self.stats = _Stats()
        self._lock = threading.Lock()
        self._base = 0  # run-clock start of the latest iteration seen
        self._mark: int | None = None  # wall ns of the latest step mark
        self.anchored_by = ""
        calls = [c for c in (schedule.calls if schedule is not None else ()) if c.seq >= 0]
        # Communicators are told apart by their members; several with the same members (a dp
        # group that is the whole world) by their name, as torch names groups in creation order.
        names = {int(g): name for g, (name, _) in (groups or {}).items()}
        by_members: dict[tuple[int, ...], set[Any]] = {}
        for g, (_, ranks) in (groups or {}).items():
            by_members.setdefault(tuple(int(r) for r in ranks), set()).add(int(g))
        for c in calls:
            if _kind(c.kind) not in ("send", "recv"):
                by_members.setdefault(tuple(c.group_ranks), set()).add(c.group_id)
        self._named = {m for m, g in by_members.items() if len(g) > 1}
        self._coll: dict[tuple[tuple[int, ...], str, int], PeerCall] = {}
        self._coll_window: dict[tuple[tuple[int, ...], str], tuple[int, int]] = {}
        # Point-to-point seqs count per (sender, receiver, direction) from the first *recorded*
        # call (docs/schema.md), so they are counted here from the step of that first call on.
        self._p2p: dict[tuple[str, int, int, int], PeerCall] = {}
        self._p2p_first: dict[tuple[str, int, int], int] = {}
        self._p2p_count: Counter[tuple[str, int, int]] = Counter()
        self.iteration = 0  # the recorded step the script is in (from step marks)
        self._marked = False
        self._profiler_marks = False
        self._optimizer_steps: Counter[int] = Counter()
        for call in calls:
            members = tuple(call.group_ranks)
            kind = _kind(call.kind)
            if kind in ("send", "recv"):
                src, dst = members[0], members[-1]
                self._p2p[(kind, src, dst, call.seq)] = call
                if call.seq == 0:
                    self._p2p_first[(kind, src, dst)] = (
                        call.iteration if call.iteration is not None else 0
                    )
            else:
                name = (
                    names.get(call.group_id, str(call.group_id)) if members in self._named else ""
                )
                self._coll[(members, name, call.seq)] = call
                _widen(self._coll_window, (members, name), call.seq)

    def collective(
        self, members: tuple[int, ...], name: str, seq: int, kind: str, me: int
    ) -> int | None:
        """Wall time (ns) at which this rank's collective completes; None: no one to wait for.

        ``name`` (torch's group name) is used only where several recorded groups have the same
        members.

        Raises:
            ScheduleMismatchError: the schedule has another kind at (members, seq), or no call
                there although it has calls of this group before and after it.
        """
        arrival = _now()
        key = (members, name if members in self._named else "")
        call = self._coll.get((*key, seq))
        if call is None:
            window = self._coll_window.get(key)
            if window is not None and window[0] <= seq <= window[1]:
                msg = (
                    f"group {list(members)} seq {seq}: the script issued {kind!r} but the "
                    f"schedule of rank {me} has no call there (recorded seqs "
                    f"{window[0]}..{window[1]}); the script's calls differ from the recording"
                )
                raise ScheduleMismatchError(msg)
            self._unscheduled(kind)
            return None
        if _kind(call.kind) != kind:
            msg = (
                f"group {list(members)} seq {seq}: the script issued {kind!r} but the schedule "
                f"of rank {me} has {call.kind!r} there; the script's calls differ from the "
                "recording"
            )
            raise ScheduleMismatchError(msg)
        if not self._marked and call.iteration is not None:
            self.iteration = call.iteration  # no step marks: the collectives tell the step
        virtual = [r for r in members if r not in self.real_ranks]
        return self._complete(call, arrival, virtual)

    def p2p(self, kind: str, src: int, dst: int, me: int) -> int | None:
        """Like `collective` for a send or receive from ``src`` to ``dst`` (global ranks).

        The k-th call of a direction made from the step of its first recorded call on is the
        recorded call number k.

        Raises:
            ScheduleMismatchError: that recorded call belongs to another step than the one the
                script is in.
        """
        arrival = _now()
        key = (kind, src, dst)
        first = self._p2p_first.get(key)
        if first is None or self.iteration < first:
            self._unscheduled(kind)
            return None
        k = self._p2p_count[key]
        self._p2p_count[key] += 1
        call = self._p2p.get((kind, src, dst, k))
        if call is None:
            self._unscheduled(kind)
            return None
        if call.iteration is not None and call.iteration != self.iteration:
            msg = (
                f"p2p {src}->{dst} {kind} #{k} of the recording: the script issues it in step "
                f"{self.iteration} but the schedule of rank {me} has it in step "
                f"{call.iteration}; the script's calls differ from the recording"
            )
            raise ScheduleMismatchError(msg)
        peer = dst if me == src else src
        return self._complete(call, arrival, [peer] if peer not in self.real_ranks else [])

    def close_step(self) -> None:
        """The profiler is closing the current step (``profile.step()`` was entered)."""
        with self._lock:
            self.stats.step_close.setdefault(self.iteration, _now())

    def mark(self, *, profiler_step: int | None = None, optimizer: object = None) -> None:
        """A training step starts now: a profiler step opened, or an optimizer step ended.

        Args:
            profiler_step: The number of the ``ProfilerStep#`` just opened (the recorded
                iteration number of Kineto traces); once seen, optimizer steps only mark time.
            optimizer: The optimizer that stepped; the step number is the most steps any
                optimizer has taken (several optimizers per step count once).
        """
        with self._lock:
            self._mark = _now()
            self._marked = True
            if profiler_step is not None:
                self._profiler_marks = True
                self.iteration = profiler_step
            elif optimizer is not None and not self._profiler_marks:
                self._optimizer_steps[id(optimizer)] += 1
                self.iteration = max(self._optimizer_steps.values())
            self.stats.step_open.setdefault(self.iteration, self._mark)

    def _unscheduled(self, kind: str) -> None:
        with self._lock:
            self.stats.unscheduled[kind] += 1

    def _complete(self, call: PeerCall, arrival: int, virtual: Sequence[int]) -> int:
        assert self.schedule is not None
        with self._lock:
            base = self._base  # outside any iteration: from the latest iteration start
            if call.iteration is not None:
                base = self.schedule.iteration_start_ns.get(call.iteration, base)
            self._base = base
            if self.offset is None:
                if self._mark is not None and call.iteration is not None:
                    self.offset, self.anchored_by = self._mark - base, "step mark"
                else:
                    self.offset = arrival - (base + call.own_arrival_ns)
                    self.anchored_by = "first scheduled call"
            t = arrival - self.offset - base  # real arrival, ns from the emulated iteration start
            lag = max((self.lag.get(r, 0) for r in virtual), default=0)
            done = self.schedule.completion_ns(call, t - lag) + lag
            for r in virtual:
                self.lag[r] = done - call.end_ns
            target = self.offset + base + done
            st = self.stats
            st.scheduled += 1
            st.waited_ns += max(0, target - arrival)
            if call.iteration is not None:
                st.first_arrival.setdefault(call.iteration, arrival)
            if len(st.calls) < _MAX_CALLS:
                peers = call.peers_arrival_ns + lag
                row = [call.index, call.iteration, call.own_arrival_ns, peers, call.end_ns, t, done]
                st.calls.append(row)
            return target

    def report(self) -> dict[str, Any]:
        """Counts, total wait, step times (between step marks, and between first calls)."""
        st = self.stats
        its = sorted(st.first_arrival)
        marks = sorted(st.step_open)
        return {
            # Step n lasts from the mark that opened it to the mark that opened step n + 1: the
            # ProfilerStep#n span when the script profiles (what Kineto recordings call step n).
            "step_ms": {
                str(a): (st.step_close.get(a, st.step_open[b]) - st.step_open[a]) / 1e6
                for a, b in itertools.pairwise(marks)
                if b == a + 1
            },
            # The same steps as [start, end] on time.perf_counter_ns (one clock for every
            # process of the machine): what `prism run --out-run` stores as iterations.
            "step_ns": {
                str(a): [st.step_open[a], st.step_close.get(a, st.step_open[b])]
                for a, b in itertools.pairwise(marks)
                if b == a + 1
            },
            "anchored_by": self.anchored_by or None,
            "scheduled_calls": st.scheduled,
            "unscheduled_calls": dict(st.unscheduled),
            "waited_ms": st.waited_ns / 1e6,
            "iterations": its,
            # Time between the first scheduled calls of consecutive iterations: one step each.
            "iteration_ms": [
                (st.first_arrival[b] - st.first_arrival[a]) / 1e6
                for a, b in itertools.pairwise(its)
            ],
            "call_columns": ["index", "iteration", "own", "peers", "end", "arrival", "done"],
            "calls": st.calls,
        }


def _widen(windows: dict[Any, tuple[int, int]], key: Any, seq: int) -> None:
    lo, hi = windows.get(key, (seq, seq))
    windows[key] = (min(lo, seq), max(hi, seq))


# --------------------------------------------------------------------------------------------
# Session: what every group of this process shares.
# --------------------------------------------------------------------------------------------


@dataclass
class PrismSession:
    """The emulated world as this process sees it: its size, the real ranks, the timeline."""

    world_size: int
    real_ranks: frozenset[int]
    timeline: _Timeline

    def report(self) -> dict[str, Any]:
        """JSON-able summary: world, real ranks and the timeline's counts and step times."""
        return {
            "world_size": self.world_size,
            "real_ranks": sorted(self.real_ranks),
            "scheduled": self.timeline.schedule is not None
            and bool(getattr(self.timeline.schedule, "calls", ())),
            **self.timeline.report(),
        }


_SESSION: PrismSession | None = None


def configure(
    *,
    world_size: int,
    real_ranks: Sequence[int],
    schedule: PeerSchedule | None = None,
    groups: Mapping[int, tuple[str, Sequence[int]]] | None = None,
) -> PrismSession:
    """Set the world the next `init_process_group("prism", ...)` joins.

    Args:
        world_size: Ranks of the emulated job.
        real_ranks: The global ranks that run as processes (this one included); the others are
            virtual.
        schedule: This rank's `PeerSchedule` (from a recorded or emulated run); None: virtual
            peers never hold anyone back.
        groups: ``comm_group.group_id -> (name, ranks)`` of the schedule's run, to tell apart
            recorded groups with the same members by name (torch names groups "0", "1", ... in
            creation order, so the script's groups get the recorded names).

    Returns:
        The new session (replacing any earlier one).
    """
    global _SESSION
    real = frozenset(int(r) for r in real_ranks)
    bad = sorted(r for r in real if not 0 <= r < world_size)
    if bad:
        msg = f"`real_ranks` {bad} are outside a world of {world_size}"
        raise ValueError(msg)
    _SESSION = PrismSession(world_size, real, _Timeline(schedule, real, groups))
    _install_step_marks()
    return _SESSION


_MARKS_INSTALLED = False


def _optimizer_marks(optimizer: Any, *_: Any) -> None:
    if _SESSION is not None:
        _SESSION.timeline.mark(optimizer=optimizer)


def _install_step_marks() -> None:
    """Hook step boundaries once per process: profiler steps and optimizer steps."""
    global _MARKS_INSTALLED
    if _MARKS_INSTALLED:
        return
    _MARKS_INSTALLED = True
    import torch.optim.optimizer as topt
    import torch.profiler.profiler as tpp

    topt.register_optimizer_step_post_hook(_optimizer_marks)

    step = tpp.profile.step

    def marked_step(self: Any) -> None:
        if _SESSION is not None:
            _SESSION.timeline.close_step()
        step(self)
        if _SESSION is not None:  # after: the new ProfilerStep# opens at the end of step()
            _SESSION.timeline.mark(profiler_step=int(self.step_num))

    start = tpp.profile.start

    def marked_start(self: Any) -> None:
        start(self)
        if _SESSION is not None:  # start() opens ProfilerStep#<step_num> (0 at first)
            _SESSION.timeline.mark(profiler_step=int(self.step_num))

    marked_step.__doc__ = step.__doc__
    marked_start.__doc__ = start.__doc__
    tpp.profile.step = marked_step  # type: ignore[method-assign]
    tpp.profile.start = marked_start  # type: ignore[method-assign]


def reset() -> None:
    """Forget the session (the step hooks stay installed and do nothing without one)."""
    global _SESSION
    _SESSION = None


def session() -> PrismSession | None:
    """The current session, if `configure` ran or a `prism` group was created."""
    return _SESSION


def _session_from_env(rank: int, world_size: int) -> PrismSession:
    ranks = os.environ.get(ENV.RANKS)
    real = [int(r) for r in ranks.split(",") if r] if ranks else [rank]
    payload: dict[str, Any] = {}
    path = os.environ.get(ENV.SCHEDULE)
    if path:
        import pickle

        payload = pickle.loads(Path(path).read_bytes())  # written by replay.launch
    s = configure(
        world_size=world_size,
        real_ranks=real,
        schedule=payload.get("schedule"),
        groups=payload.get("groups"),
    )
    report = os.environ.get(ENV.REPORT)
    if report:
        atexit.register(_write_report, Path(report), rank)
    return s


def _write_report(path: Path, rank: int) -> None:
    if _SESSION is not None:
        path.write_text(json.dumps({"rank": rank, **_SESSION.report()}, indent=1) + "\n")


# --------------------------------------------------------------------------------------------
# Work: done when the real part is done and the virtual peers let the call complete.
# --------------------------------------------------------------------------------------------


class _Completer:
    """One daemon thread that completes futures at their due time (for `Work.get_future`)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, PrismWork]] = []
        self._cv = threading.Condition()
        self._n = 0
        self._thread: threading.Thread | None = None

    def add(self, work: PrismWork) -> None:
        with self._cv:
            self._n += 1
            heapq.heappush(self._heap, (work.target_ns or 0, self._n, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prism-pg", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                due, _, work = self._heap[0]
                left = due - _now()
                if left > 0:
                    self._cv.wait(left / 1e9)
                    continue
                heapq.heappop(self._heap)
            work.wait()


_COMPLETER = _Completer()


class PrismWork(dist._Work):  # type: ignore[misc]
    """A call in flight: waits for its real part, runs its epilogue, then sleeps until due."""

    def __init__(
        self,
        result: Any,
        *,
        target_ns: int | None,
        real: Sequence[Any] = (),
        epilogue: Callable[[], None] | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        """Set up the work.

        Args:
            result: The future's value (the output tensors).
            target_ns: Wall time (``perf_counter_ns``) at which the call completes; None: now.
            real: Works of the real part (gloo among the real members), waited first.
            epilogue: Fills the outputs from the real part's results; runs once.
            timeout: Longest allowed wait for the virtual peers (the group's timeout).
        """
        super().__init__()
        self.target_ns = target_ns
        self._result = result
        self._real = list(real)
        self._epilogue = epilogue
        self._lock = threading.Lock()
        self._done = False
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        if target_ns is not None and timeout is not None:
            limit = timeout.total_seconds() * 1e9
            if 0 < limit < target_ns - _now():
                hold = (target_ns - _now()) / 1e9
                msg = (
                    f"the virtual peers would hold this call for {hold:.1f} s, beyond the "
                    f"group's timeout of {timeout.total_seconds():g} s"
                )
                raise ScheduleMismatchError(msg)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the call completes; True."""
        with self._lock:
            if not self._done:
                for w in self._real:
                    w.wait()
                if self._epilogue is not None:
                    self._epilogue()
                if self.target_ns is not None:
                    _sleep_until(self.target_ns)
                self._done = True
                self._future.set_result(self._result)
        return True

    def is_completed(self) -> bool:
        """Whether `wait` would return at once."""
        if self._done:
            return True
        real_done = all(w.is_completed() for w in self._real)
        return real_done and (self.target_ns is None or _now() >= self.target_ns)

    def is_success(self) -> bool:
        """Calls never fail after they were issued (errors are raised at the call)."""
        return True

    def exception(self) -> None:
        """No exception: see `is_success`."""
        return None

    def result(self) -> Any:
        """The output tensors."""
        return self._result

    def get_future(self) -> torch.futures.Future[Any]:
        """A future completed at the call's completion (by a helper thread, not by waiting)."""
        if not self._done:
            if self.target_ns is None and not self._real:
                self.wait()
            else:
                _COMPLETER.add(self)
        return self._future

    def synchronize(self) -> None:
        """Same as `wait` (CPU: there is no stream to synchronize)."""
        self.wait()


# --------------------------------------------------------------------------------------------
# Data: what a call returns when some members are virtual.
# --------------------------------------------------------------------------------------------


def _op_is(op: Any, ref: Any) -> bool:
    try:
        return bool(op == ref)
    except (TypeError, RuntimeError):
        return False


def _pre(t: torch.Tensor, op: Any, count: int) -> torch.Tensor:
    """This real member's contribution when ``count`` members (itself included) hold its data."""
    R = dist.ReduceOp
    if _op_is(op, R.SUM) or _op_is(op, R.AVG):
        return t * count if count != 1 else t.clone()
    if _op_is(op, R.PRODUCT):
        return t**count if count != 1 else t.clone()
    if _op_is(op, R.BXOR):
        return t.clone() if count % 2 else torch.zeros_like(t)
    if any(_op_is(op, o) for o in (R.MIN, R.MAX, R.BAND, R.BOR)):
        return t.clone()
    msg = f"reduce op {op!r} is not supported by the `prism` backend"
    raise ValueError(msg)


def _real_op(op: Any) -> Any:
    return dist.ReduceOp.SUM if _op_is(op, dist.ReduceOp.AVG) else op


def _post(t: torch.Tensor, op: Any, n: int) -> torch.Tensor:
    if _op_is(op, dist.ReduceOp.AVG):
        return t / n if t.is_floating_point() or t.is_complex() else t.div(n, rounding_mode="floor")
    return t


@dataclass(frozen=True)
class _Members:
    """Group members, which of them are real, and whom each virtual member mirrors.

    Virtual members take the data of the real members round-robin in group order: the k-th
    virtual member (in group order) mirrors the (k mod R)-th real member. With one real member
    every virtual member holds that member's data.
    """

    ranks: tuple[int, ...]  # global ranks in group order
    me: int  # my group rank
    real_pos: tuple[int, ...]  # group ranks of the real members, ascending
    mirror: tuple[int, ...]  # group rank -> group rank of the real member it mirrors

    @classmethod
    def build(cls, ranks: tuple[int, ...], me: int, real: frozenset[int]) -> _Members:
        real_pos = tuple(i for i, r in enumerate(ranks) if r in real)
        mirror, k = [], 0
        for i, r in enumerate(ranks):
            if r in real:
                mirror.append(i)
            else:
                mirror.append(real_pos[k % len(real_pos)])
                k += 1
        return cls(ranks, me, real_pos, tuple(mirror))

    @property
    def n(self) -> int:
        return len(self.ranks)

    def count(self, pos: int) -> int:
        """How many members hold the data of real member ``pos`` (itself included)."""
        return self.mirror.count(pos)

    def real_index(self, pos: int) -> int:
        """Rank of real member ``pos`` in the real sub-group."""
        return self.real_pos.index(pos)

    def is_real(self, pos: int) -> bool:
        return self.mirror[pos] == pos


class PrismProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
    """One communicator of the emulated job, as seen by one real rank.

    Created by torch through the registered creator for the default group and for every
    `new_group` (DeviceMesh and Megatron-style subgroups included) that this rank belongs to.
    Among several real members, a gloo group over just them moves the real data.
    """

    def __init__(
        self,
        *,
        store: dist.Store,
        group_rank: int,
        group_size: int,
        ranks: tuple[int, ...],
        session: PrismSession,
        timeout: timedelta,
    ) -> None:
        """Build the group; the real members (if more than one) connect a gloo group now.

        Args:
            store: The group's store (prefixed by torch with the group name).
            group_rank: This rank in the group.
            group_size: Members.
            ranks: Global ranks of the members, in group order.
            session: The world this group belongs to.
            timeout: The group's timeout (also bounds waits for virtual peers).
        """
        # torch's stub lists only the (store, rank, size) constructor; c10d also binds (rank, size).
        super().__init__(group_rank, group_size)  # type: ignore[call-arg]
        self._session = session
        self._members = _Members.build(ranks, group_rank, session.real_ranks)
        self._timeout = timeout
        self._seq = 0
        self._name = ""
        self._desc = ""
        self._real: Any = None
        if len(self._members.real_pos) > 1:
            self._real = dist.ProcessGroupGloo(
                dist.PrefixStore("prism_real/", store),
                self._members.real_index(group_rank),
                len(self._members.real_pos),
                timeout,
            )

    # -- identity (torch asks for these) --

    def getBackendName(self) -> str:
        return BACKEND

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def __repr__(self) -> str:
        return f"PrismProcessGroup(ranks={list(self._members.ranks)}, rank={self._members.me})"

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """Global ranks of the members, in group order."""
        return self._members.ranks

    # -- timing --

    def _collective(self, kind: str) -> int | None:
        m = self._members
        seq = self._seq
        self._seq += 1
        if len(m.real_pos) == m.n:
            return None  # everyone is real: the real exchange is the timing
        return self._session.timeline.collective(m.ranks, self._name, seq, kind, m.ranks[m.me])

    def _p2p(self, kind: str, peer: int) -> int | None:
        m = self._members
        if m.is_real(peer):
            return None
        me = m.ranks[m.me]
        src, dst = (me, m.ranks[peer]) if kind == "send" else (m.ranks[peer], me)
        return self._session.timeline.p2p(kind, src, dst, me)

    def _work(
        self,
        result: Any,
        target: int | None,
        real: Sequence[Any] = (),
        epilogue: Callable[[], None] | None = None,
    ) -> PrismWork:
        return PrismWork(
            result, target_ns=target, real=real, epilogue=epilogue, timeout=self._timeout
        )

    # -- reductions --

    def _reduce_into(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        """The all-reduce result of ``t`` over the group (all members' data by the mirror rule)."""
        m = self._members
        out = _pre(t, op, m.count(m.me))
        if self._real is not None:
            self._real.allreduce([out], _all_reduce_opts(_real_op(op))).wait()
        return _post(out, op, m.n)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> PrismWork:
        target = self._collective("all_reduce")
        for t in tensors:
            t.copy_(self._reduce_into(t, opts.reduceOp))
        return self._work(tensors, target)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> PrismWork:
        target = self._collective("all_reduce")
        for t in tensors:
            t.copy_(self._reduce_into(t, opts.reduceOp))
        return self._work(tensors, target)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> PrismWork:
        target = self._collective("reduce")
        for t in tensors:
            r = self._reduce_into(t, opts.reduceOp)
            if self._members.me == opts.rootRank:
                t.copy_(r)
        return self._work(tensors, target)

    # -- gathers --

    def _gather_list(self, inp: torch.Tensor) -> list[torch.Tensor]:
        """Each member's tensor, group order (virtual members: their mirror's)."""
        m = self._members
        if self._real is None:
            return [inp] * m.n
        got = [torch.empty_like(inp) for _ in m.real_pos]
        self._real.allgather([got], [inp.contiguous()]).wait()
        return [got[m.real_index(m.mirror[j])] for j in range(m.n)]

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        target = self._collective("all_gather")
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            for o, src in zip(outs, self._gather_list(inp), strict=True):
                o.copy_(src)
        return self._work(output_tensors, target)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        return self.allgather(output_lists, input_list, opts)

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> PrismWork:
        target = self._collective("all_gather")
        self._gather_flat(output, inp)
        return self._work(output, target)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> PrismWork:
        return self._allgather_base(output, inp, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        target = self._collective("all_gather")
        for o, i in zip(outputs, inputs, strict=True):
            self._gather_flat(o, i)
        return self._work(outputs, target)

    def _gather_flat(self, output: torch.Tensor, inp: torch.Tensor) -> None:
        chunks = output.view(-1).split(inp.numel())
        for o, src in zip(chunks, self._gather_list(inp), strict=True):
            o.copy_(src.reshape(-1))

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        target = self._collective("gather")
        got = self._gather_list(input_tensors[0])
        if self._members.me == opts.rootRank:
            for o, src in zip(output_tensors[0], got, strict=True):
                o.copy_(src)
        return self._work(output_tensors, target)

    # -- scatters --

    def _reduce_scatter_one(
        self, out: torch.Tensor, chunks: Sequence[torch.Tensor], op: Any
    ) -> None:
        """``out`` = op over members j of chunk ``me`` of member j's input (mirror rule)."""
        m = self._members
        if self._real is None:
            out.copy_(_post(_pre(chunks[m.me], op, m.n), op, m.n).reshape(out.shape))
            return
        mine = m.real_index(m.me)
        parts = [chunks[p].reshape(-1) for p in m.real_pos]
        flat = self._reduce_into(torch.cat(parts), op)
        out.copy_(flat.split([p.numel() for p in parts])[mine].reshape(out.shape))

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any,
    ) -> PrismWork:
        target = self._collective("reduce_scatter")
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            self._reduce_scatter_one(out, ins, opts.reduceOp)
        return self._work(output_tensors, target)

    def _reduce_scatter_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        opts: Any,
    ) -> PrismWork:
        target = self._collective("reduce_scatter")
        chunks = inp.reshape(-1).split(output.numel())
        self._reduce_scatter_one(output, chunks, opts.reduceOp)
        return self._work(output, target)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        opts: Any,
    ) -> PrismWork:
        return self._reduce_scatter_base(output, inp, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        target = self._collective("reduce_scatter")
        for o, i in zip(outputs, inputs, strict=True):
            self._reduce_scatter_one(o, i.reshape(-1).split(o.numel()), opts.reduceOp)
        return self._work(outputs, target)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any,
    ) -> PrismWork:
        target = self._collective("scatter")
        m, root = self._members, opts.rootRank
        out = output_tensors[0]
        if m.is_real(root):
            if self._real is None:
                out.copy_(input_tensors[0][m.me])
            else:
                ins = [[input_tensors[0][p] for p in m.real_pos]] if m.me == root else []
                so = dist.ScatterOptions()
                so.rootRank = m.real_index(root)
                self._real.scatter([out], ins, so).wait()
        # A virtual root holds nothing this rank could know: the output is left as it was.
        return self._work(output_tensors, target)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> PrismWork:
        target = self._collective("broadcast")
        m = self._members
        if self._real is not None:
            bo = dist.BroadcastOptions()
            bo.rootRank = m.real_index(m.mirror[opts.rootRank])
            self._real.broadcast(tensors, bo).wait()
        # One real member: from a virtual root it keeps its own tensor (the root mirrors it).
        return self._work(tensors, target)

    # -- all-to-all --

    def _all_to_all_lists(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        """``outs[j]`` = what member j sends to me (its mirror's chunk for me, when shapes fit)."""
        m = self._members
        if self._real is None:
            got = {m.me: ins[m.me]}
        else:
            send = torch.cat([ins[p].reshape(-1) for p in m.real_pos])
            recv_sizes = [outs[p].numel() for p in m.real_pos]
            recv = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
            self._real.alltoall_base(
                recv, send, recv_sizes, [ins[p].numel() for p in m.real_pos], dist.AllToAllOptions()
            ).wait()
            got = dict(zip(m.real_pos, recv.split(recv_sizes), strict=True))
        for j, o in enumerate(outs):
            src = got[m.mirror[j]]
            if src.numel() == o.numel():  # uneven splits that do not fit: left as they were
                o.copy_(src.reshape(o.shape))

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any
    ) -> PrismWork:
        target = self._collective("all_to_all")
        self._all_to_all_lists(output_tensors, input_tensors)
        return self._work(output_tensors, target)

    def alltoall_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any,
    ) -> PrismWork:
        target = self._collective("all_to_all")
        n = self._members.n
        outs = output.split(list(output_split_sizes) or output.shape[0] // n)
        ins = inp.split(list(input_split_sizes) or inp.shape[0] // n)
        self._all_to_all_lists(outs, ins)
        return self._work(output, target)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any,
    ) -> PrismWork:
        return self.alltoall_base(output, inp, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts: Any) -> PrismWork:
        target = self._collective("barrier")
        if self._real is not None:
            self._real.barrier().wait()
        return self._work(None, target)

    # -- point to point --

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> PrismWork:
        target = self._p2p("send", dst)
        real = []
        if self._members.is_real(dst):
            real.append(self._real.send(tensors, self._members.real_index(dst), tag))
        return self._work(tensors, target, real)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> PrismWork:
        target = self._p2p("recv", src)
        real = []
        if self._members.is_real(src):
            real.append(self._real.recv(tensors, self._members.real_index(src), tag))
        else:
            for t in tensors:  # a virtual sender's data is unknown: zeros (never NaN, no denormals)
                t.zero_()
        return self._work(tensors, target, real)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> PrismWork:
        # No sequence number can be known for "any source": not timed, from a real member if any.
        if self._real is not None:
            return self._work(tensors, None, [self._real.recv_anysource(tensors, tag)])
        for t in tensors:
            t.zero_()
        return self._work(tensors, None)


def _all_reduce_opts(op: Any) -> Any:
    o = dist.AllreduceOptions()
    o.reduceOp = op
    return o


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


def _create(opts: Any, pg_options: Any) -> PrismProcessGroup:
    """The creator torch calls for every `prism` group this rank belongs to (extended API)."""
    ranks = tuple(int(r) for r in opts.global_ranks_in_group) or tuple(range(opts.group_size))
    rank = ranks[opts.group_rank]
    s = _SESSION
    if s is None:
        s = _session_from_env(rank, opts.group_size)
    if max(ranks) >= s.world_size or (
        not opts.global_ranks_in_group and opts.group_size != s.world_size
    ):
        msg = (
            f"`prism` group of {opts.group_size} ranks does not fit the configured world of "
            f"{s.world_size}; call configure(world_size=...) with the job's world size"
        )
        raise ValueError(msg)
    if rank not in s.real_ranks:
        msg = (
            f"rank {rank} is not one of the real ranks {sorted(s.real_ranks)}; "
            "pass it in configure(real_ranks=...) or PRISM_RANKS"
        )
        raise ValueError(msg)
    timeout = opts.timeout if opts.timeout.total_seconds() > 0 else timedelta(minutes=30)
    return PrismProcessGroup(
        store=opts.store,
        group_rank=opts.group_rank,
        group_size=opts.group_size,
        ranks=ranks,
        session=s,
        timeout=timeout,
    )


def register() -> None:
    """Register the `prism` backend with torch.distributed (idempotent).

    ``devices=["cpu", "cuda"]`` only declares what it accepts: torch's defaults for ``cpu``
    (gloo) and ``cuda`` (nccl) are not replaced.
    """
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


register()

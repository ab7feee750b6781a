"""The `prism` backend's timing: the schedule of one rank, aligned to the replay clock."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prism_trace.replay.pg.base import ScheduleMismatchError, _kind, _now

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from prism_trace.replay.peers import PeerCall, PeerSchedule

__all__: list[str] = []


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
        # A call whose group is unknown (None) keys as the text 'None', as it always did.
        names: dict[int | None, str] = {int(g): name for g, (name, _) in (groups or {}).items()}
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

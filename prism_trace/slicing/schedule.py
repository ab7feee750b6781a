"""Recognising a recorded step's microbatches: its pipeline schedule (1F1B, GPipe, or gradient
accumulation without a pipeline) and the periods of it that can be repeated or dropped.

Nothing here knows an op's name: a rank's step is a sequence of integer *tokens* (equal ops, equal
tokens) and, for the pipeline's send/recv, a *marker* saying which way it goes. Two spaces:

- *compute space*: the step without its pipeline send/recv. Microbatches are found here, because
  where a blocking send/recv falls between two microbatches depends on the schedule's ordering
  (the next input is often received before the last gradient is sent).
- *node space*: every node of the main track. The repeatable region found here is what
  ``rebatch`` copies or drops: equal periods, each holding one microbatch and exactly one
  send/recv of each kind the stage does per microbatch (its *quota*).

Shapes, for stage ``s`` of ``pp`` with ``m`` microbatches (``F``: a forward unit, ``B``: a
backward unit, in compute space):

- 1F1B (Megatron's non-interleaved schedule, and gradient accumulation at ``pp = 1``):
  ``pre F^a (F B)^(m-a) B^a post`` with ``a = min(pp - s - 1, m)`` warm-up forwards. The steady
  ``(F B)`` pairs are the repeatable run.
- GPipe: ``pre F^m B^m post``; both runs are repeatable.

``m`` comes from the pipeline send/recv when ``pp > 1`` (one per microbatch and direction), else
from the longest run of equal units (a last microbatch whose backward also carries the
data-parallel reductions, as DDP's does, still counts when its other ops match).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "BWD_MARKERS",
    "FWD_MARKERS",
    "RECV_NEXT",
    "RECV_PREV",
    "SEND_NEXT",
    "SEND_PREV",
    "Periods",
    "ScheduleNotRecognised",
    "StepShape",
    "recognise_step",
]

RECV_PREV, SEND_NEXT, RECV_NEXT, SEND_PREV = 1, 2, 3, 4
"""Markers of a pipeline send/recv: from/to the previous or the next stage (0: not one)."""
FWD_MARKERS = (RECV_PREV, SEND_NEXT)
"""A forward microbatch receives its input from the previous stage and sends its output on."""
BWD_MARKERS = (RECV_NEXT, SEND_PREV)
"""A backward microbatch receives its output gradient from the next stage and sends one back."""


@dataclass(frozen=True)
class Periods:
    """A repeatable region of one step: ``count`` equal periods of ``length`` main-track nodes
    from position ``start``, one microbatch each."""

    start: int
    length: int
    count: int

    @property
    def end(self) -> int:
        """The position after the region."""
        return self.start + self.length * self.count


@dataclass(frozen=True)
class StepShape:
    """One recorded step of one rank, as a schedule.

    Attributes:
        schedule: ``1f1b`` (which includes gradient accumulation without a pipeline),
            ``gpipe`` or ``interleaved`` (``interleaved``).
        microbatches: microbatches in the step.
        warmup: forwards before the first backward, less one (1F1B's warm-up), ``microbatches``
            (GPipe), or interleaved 1F1B's warm-up forwards (of every chunk).
        runs: the repeatable regions in node space (one for 1F1B and interleaved, two for GPipe).
        chunks: model chunks per stage (virtual pipeline stages; 1 but for interleaved).
        per_period: microbatches in one period of ``runs`` (``pp`` for interleaved, else 1).
    """

    schedule: str
    microbatches: int
    warmup: int
    runs: tuple[Periods, ...]
    chunks: int = 1
    per_period: int = 1


class ScheduleNotRecognised(ValueError):
    """The step fits none of the known shapes (the caller words the refusal)."""


class _Seq:
    """A token sequence with cached tests of periodicity (``[s, e)`` has period ``q``)."""

    def __init__(self, tok: np.ndarray) -> None:
        self.t = np.asarray(tok, dtype=np.int64)
        self.n = int(self.t.size)
        self._ps: dict[int, np.ndarray] = {}

    def _prefix(self, q: int) -> np.ndarray:
        ps = self._ps.get(q)
        if ps is None:
            eq = self.t[:-q] == self.t[q:] if q < self.n else np.zeros(0, dtype=bool)
            ps = np.concatenate([[0], np.cumsum(eq, dtype=np.int64)])
            self._ps[q] = ps
        return ps

    def periodic(self, s: np.ndarray, e: np.ndarray, q: int) -> np.ndarray:
        """Whether each ``[s, e)`` lies inside the sequence and has period ``q``."""
        s, e = np.asarray(s, dtype=np.int64), np.asarray(e, dtype=np.int64)
        inside = (s >= 0) & (e <= self.n) & (s <= e)
        short = e - s <= q
        ps = self._prefix(q)
        hi = np.clip(e - q, 0, ps.size - 1)
        lo = np.clip(s, 0, ps.size - 1)
        full = (ps[hi] - ps[lo]) == np.maximum(e - q - s, 0)
        return inside & (short | full)


def _candidates(seq: _Seq, m: int | None, marks: list[np.ndarray] | None = None) -> list[int]:
    """Candidate unit lengths: gaps between successive occurrences of the tokens that occur once
    per microbatch (``m`` times; without ``m``, the tokens of the three rarest counts that
    repeat), and between successive pipeline send/recv of one kind (``marks``: their positions in
    compute space), which find the units of a stage whose every op repeats per layer."""
    gaps: set[int] = set()
    for pos in marks or []:
        gaps.update(int(g) for g in np.unique(np.diff(pos)))
    values, counts = np.unique(seq.t, return_counts=True)
    if m is not None:
        pick = values[counts == m]
    else:
        rare = np.unique(counts[counts >= 2])[:3]
        pick = values[np.isin(counts, rare)]
    for v in pick[:64].tolist():
        pos = np.flatnonzero(seq.t == v)
        gaps.update(int(g) for g in np.unique(np.diff(pos)))
    return sorted(g for g in gaps if g > 0)


Unit = tuple[int, int]
"""A unit's ``[start, end)`` in compute space."""


def _tile_equal(seq: _Seq, at: int, unit: np.ndarray, times: int) -> bool:
    """Whether ``unit`` repeats ``times`` times from ``at``."""
    if times == 0:
        return True
    end = at + unit.size * times
    if at < 0 or end > seq.n:
        return False
    return bool(np.array_equal(seq.t[at:end], np.tile(unit, times)))


def _steady(seq: _Seq, m: int, a: int, cands: list[int]) -> tuple[list[Unit], ...] | None:
    """``F^a (F B)^k B^a`` with ``k = m - a >= 2`` (or ``a = 0``): (warm-up, steady, cool-down)
    units, the leftmost fit."""
    k = m - a
    for p in cands:
        if k * p > seq.n:
            continue
        starts = np.arange(0, seq.n - k * p + 1)
        ok = starts[seq.periodic(starts, starts + k * p, p)]
        for i in ok.tolist():
            steady = [(i + j * p, i + (j + 1) * p) for j in range(k)]
            if a == 0:
                return [], steady, []
            y = seq.t[i : i + p]
            for x in range(1, p):
                if _tile_equal(seq, i - a * x, y[:x], a) and _tile_equal(seq, i + k * p, y[x:], a):
                    z = p - x
                    warm = [(i - (a - j) * x, i - (a - j - 1) * x) for j in range(a)]
                    cool = [(i + k * p + j * z, i + k * p + (j + 1) * z) for j in range(a)]
                    return warm, steady, cool
    return None


def _two_runs(seq: _Seq, c: int, cands: list[int]) -> tuple[int, int, int] | None:
    """``F^c B^c`` with ``F != B``: the leftmost junction ``j`` and the unit lengths."""
    for x in cands:
        for z in cands:
            if c * (x + z) > seq.n:
                continue
            js = np.arange(c * x, seq.n - c * z + 1)
            ok = seq.periodic(js - c * x, js, x) & seq.periodic(js, js + c * z, z)
            for j in js[ok].tolist():
                if x == z and np.array_equal(seq.t[j - x : j], seq.t[j : j + z]):
                    continue  # one run, not two
                return j, x, z
    return None


def _one_f_one_b(seq: _Seq, m: int, a: int, cands: list[int]) -> tuple[list[Unit], ...] | None:
    """The 1F1B units (warm-up forwards, steady pairs, cool-down backwards), or None."""
    k = m - a
    if k >= 2 or (a == 0 and k >= 1):
        return _steady(seq, m, a, cands)
    if k == 1:  # F^a (F B) B^a = F^(a+1) B^(a+1): the steady pair is the last F and first B
        hit = _two_runs(seq, a + 1, cands)
        if hit is None:
            return None
        j, x, z = hit
        warm = [(j - (a + 1 - i) * x, j - (a - i) * x) for i in range(a)]
        cool = [(j + (i + 1) * z, j + (i + 2) * z) for i in range(a)]
        return warm, [(j - x, j + z)], cool
    return None


def _accumulation(seq: _Seq, comm: np.ndarray) -> tuple[list[Unit], ...] | None:
    """Gradient accumulation without a pipeline: the longest run of equal ``(F B)`` units (at
    least two), plus a unit right before or after it that differs only by communication (DDP's
    last backward carries the gradient reductions)."""
    best: tuple[int, int, int] | None = None  # (count, start, period)
    for p in _candidates(seq, None):
        if p >= seq.n:
            continue
        eq = np.concatenate([[False], seq.t[:-p] == seq.t[p:], [False]])
        edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
        for lo, hi in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            k = (hi - lo + p) // p  # [lo, hi + p) has period p
            if k >= 2 and (best is None or k * p > best[0] * best[2]):
                best = (k, lo, p)
    if best is None:
        return None
    k, i, p = best
    steady = [(i + j * p, i + (j + 1) * p) for j in range(k)]
    plain = seq.t[i : i + p][~comm[i : i + p]]
    extra_before: list[Unit] = []
    extra_after: list[Unit] = []
    after = _match_without_comm(seq, comm, i + k * p, plain, forward=True)
    if after is not None:
        extra_after.append((i + k * p, after))
    before = _match_without_comm(seq, comm, i, plain, forward=False)
    if before is not None:
        extra_before.append((before, i))
    return extra_before, steady, extra_after


def _match_without_comm(
    seq: _Seq, comm: np.ndarray, at: int, plain: np.ndarray, *, forward: bool
) -> int | None:
    """The other end of a unit next to ``at`` whose non-communication tokens are ``plain``."""
    idx = np.arange(at, seq.n) if forward else np.arange(at - 1, -1, -1)
    own = idx[~comm[idx]][: plain.size]
    if own.size < plain.size:
        return None
    got = seq.t[own] if forward else seq.t[own[::-1]]
    if not np.array_equal(got, plain):
        return None
    return int(own[-1]) + 1 if forward else int(own[-1])


def _marker_counts(marker: np.ndarray) -> dict[int, int]:
    return {k: int((marker == k).sum()) for k in (*FWD_MARKERS, *BWD_MARKERS)}


def _pipeline_microbatches(marker: np.ndarray) -> int:
    """``m`` from the pipeline send/recv: every kind present occurs once per microbatch."""
    counts = {k: v for k, v in _marker_counts(marker).items() if v}
    if not counts:
        msg = "no pipeline send/recv in the step"
        raise ScheduleNotRecognised(msg)
    if len(set(counts.values())) != 1:
        names = {RECV_PREV: "recv<", SEND_NEXT: "send>", RECV_NEXT: "recv>", SEND_PREV: "send<"}
        said = ", ".join(f"{names[k]} {v}" for k, v in counts.items())
        msg = f"its pipeline send/recv do not come once per microbatch ({said})"
        raise ScheduleNotRecognised(msg)
    return next(iter(counts.values()))


def _quota(marker: np.ndarray, kinds: tuple[int, ...]) -> dict[int, int]:
    """Send/recv per period: one of each kind of ``kinds`` the step uses, none of the others."""
    present = {k for k, v in _marker_counts(marker).items() if v}
    return {k: int(k in kinds) for k in present}


def _node_periods(
    tok: np.ndarray,
    marker: np.ndarray,
    cpos: np.ndarray,
    units: list[Unit],
    quota: dict[int, int],
) -> Periods | None:
    """The longest stretch of equal node-space periods over consecutive ``units``, each period
    a unit with the send/recv before it (or after it) and ``quota`` of send/recv.

    A unit spans its compute nodes and the send/recv between them; the send/recv between two
    units are a *gap*, taken with the unit after it (``lead``) or before it (``trail``).
    """
    if not units:
        return None
    n_units = len(units)
    first = [int(cpos[s]) for s, _ in units]
    last = [int(cpos[e - 1]) + 1 for _, e in units]
    best: Periods | None = None
    for lead in (True, False):
        # With the gap before it (after the previous unit's end), or after it (to the next
        # unit's start); the first unit has no gap before it, the last none after it.
        spans: list[tuple[int, int]] = [
            (last[j - 1] if lead and j > 0 else first[j], last[j])
            if lead
            else (first[j], first[j + 1] if j + 1 < n_units else last[j])
            for j in range(n_units)
        ]
        sigs = [tok[s:e].tobytes() for s, e in spans]
        ok = [_meets(marker[s:e], quota) for s, e in spans]
        j = 0
        while j < n_units:
            if not ok[j]:
                j += 1
                continue
            h = j
            while h + 1 < n_units and ok[h + 1] and sigs[h + 1] == sigs[j]:
                h += 1
            count = h - j + 1
            s0, e0 = spans[j]
            run = Periods(s0, e0 - s0, count)
            if best is None or count > best.count:
                best = run
            j = h + 1
    return best


def _meets(marker: np.ndarray, quota: dict[int, int]) -> bool:
    return all(int((marker == k).sum()) == v for k, v in quota.items())


def recognise_step(
    tokens: np.ndarray,
    marker: np.ndarray,
    comm: np.ndarray,
    *,
    stage: int,
    pp: int,
    only: str | None = None,
) -> StepShape:
    """Recognise one step of one rank (its main track's nodes, in program order).

    Args:
        tokens: one integer per node, equal for equal ops (name, or a communication op's kind,
            axis, peer offset and size; never a sequence number).
        marker: per node, which pipeline send/recv it is (``RECV_PREV``, ...; 0: none).
        comm: per node, whether it communicates (a microbatch may differ by these alone).
        stage: the rank's pipeline stage.
        pp: the pipeline's size.
        only: try this schedule alone (``1f1b`` or ``gpipe``; default: 1F1B, then GPipe).

    Raises:
        ScheduleNotRecognised: no known shape fits (the message says what was seen).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    marker = np.asarray(marker, dtype=np.int64)
    comm = np.asarray(comm, dtype=bool)
    compute = marker == 0
    cpos = np.flatnonzero(compute)
    seq = _Seq(tokens[compute])
    if pp <= 1:
        found = _accumulation(seq, comm[compute])
        if found is None:
            msg = "no repeated microbatch in the step"
            raise ScheduleNotRecognised(msg)
        before, steady, after = found
        runs = _node_periods(tokens, marker, cpos, steady, {})
        assert runs is not None
        m = len(before) + len(steady) + len(after)
        return StepShape("1f1b", m, 0, (runs,))
    m = _pipeline_microbatches(marker)
    marks = [
        np.searchsorted(cpos, np.flatnonzero(marker == k)) for k in (*FWD_MARKERS, *BWD_MARKERS)
    ]
    cands = _candidates(seq, m, [p for p in marks if p.size > 1])
    a = min(pp - stage - 1, m)
    found = _one_f_one_b(seq, m, a, cands) if m > a and only != "gpipe" else None
    if found is not None:
        _, steady, _ = found
        run = _node_periods(tokens, marker, cpos, steady, _quota(marker, FWD_MARKERS + BWD_MARKERS))
        if run is not None:
            return StepShape("1f1b", m, a, (run,))
    hit = _two_runs(seq, m, cands) if m >= 2 and only != "1f1b" else None
    if hit is not None:
        j, x, z = hit
        fwd = [(j - (m - i) * x, j - (m - i - 1) * x) for i in range(m)]
        bwd = [(j + i * z, j + (i + 1) * z) for i in range(m)]
        r1 = _node_periods(tokens, marker, cpos, fwd, _quota(marker, FWD_MARKERS))
        r2 = _node_periods(tokens, marker, cpos, bwd, _quota(marker, BWD_MARKERS))
        if r1 is not None and r2 is not None:
            return StepShape("gpipe", m, m, (r1, r2))
    msg = (
        f"stage {stage} of {pp}, {m} microbatches: neither 1F1B ({a} warm-up forwards, then"
        f" forward/backward pairs) nor GPipe (all forwards, then all backwards)"
    )
    raise ScheduleNotRecognised(msg)

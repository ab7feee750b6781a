"""Pipeline schedules as plain data: the ordered compute and point-to-point actions of one stage.

A schedule is a list of `Action`s per stage, already in the order the stage performs them, each
send and receive a separate blocking call. gloo's blocking ``send`` returns only once the peer has
posted the matching ``recv``, so the order of every stage's calls to each neighbour must
complement the neighbour's (the k-th call between two stages is a send on one side and a receive
on the other). Megatron's non-interleaved 1F1B pairs a send and a receive with the same neighbour
(``send_forward_recv_backward``, ``send_backward_recv_forward``) as one batched ``isend``/``irecv``;
here each pair becomes two blocking calls ordered by stage parity: even stages send then receive,
odd stages receive then send. Neighbouring stages have opposite parity, so every pair matches;
`check_deadlock_free` verifies that for a whole pipeline. (A line of stages whose calls complement
pairwise cannot deadlock: two neighbours waiting on each other are at the same call.)

Nothing here imports torch, so the schedules are testable on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["SCHEDULES", "Action", "Kind", "Schedule", "check_deadlock_free", "schedule"]

Schedule = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved")

Kind = Literal["fwd", "bwd", "send_fwd", "recv_fwd", "send_bwd", "recv_bwd"]
"""``fwd``/``bwd``: compute of one micro-batch; ``send_fwd``/``recv_fwd``: its activations to the
next stage / from the previous one; ``send_bwd``/``recv_bwd``: its input gradient to the previous
stage / its output gradient from the next one."""


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule: what it does, for which micro-batch, on which of the
    stage's model chunks (interleaved 1F1B: chunk ``c`` of stage ``s`` is virtual stage
    ``c * stages + s``; 0 otherwise)."""

    kind: Kind
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        """``fwd3``, ``recv_bwd0``, ``fwd3c1``...: compact enough to compare whole schedules in
        tests."""
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")


def _gpipe(stage: int, stages: int, microbatches: int) -> list[Action]:
    first, last = stage == 0, stage == stages - 1
    out: list[Action] = []
    for mb in range(microbatches):
        if not first:
            out.append(Action("recv_fwd", mb))
        out.append(Action("fwd", mb))
        if not last:
            out.append(Action("send_fwd", mb))
    for mb in reversed(range(microbatches)):
        if not last:
            out.append(Action("recv_bwd", mb))
        out.append(Action("bwd", mb))
        if not first:
            out.append(Action("send_bwd", mb))
    return out


def _one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Action]:
    """Megatron's ``forward_backward_pipelining_without_interleaving``, blocking calls by parity."""
    first, last = stage == 0, stage == stages - 1
    send_first = stage % 2 == 0
    warmup = min(stages - stage - 1, microbatches)
    steady = microbatches - warmup
    out: list[Action] = []

    def pair(send: Action | None, recv: Action | None) -> None:
        calls = [send, recv] if send_first else [recv, send]
        out.extend(a for a in calls if a is not None)

    for mb in range(warmup):
        if not first:
            out.append(Action("recv_fwd", mb))
        out.append(Action("fwd", mb))
        if not last:
            out.append(Action("send_fwd", mb))
    if steady > 0 and not first:
        out.append(Action("recv_fwd", warmup))
    for i in range(steady):
        fwd_mb, bwd_mb = warmup + i, i
        out.append(Action("fwd", fwd_mb))
        if not last:  # send_forward_recv_backward
            pair(Action("send_fwd", fwd_mb), Action("recv_bwd", bwd_mb))
        out.append(Action("bwd", bwd_mb))
        if not first:  # send_backward_recv_forward, or send_backward on the last iteration
            nxt = Action("recv_fwd", fwd_mb + 1) if i < steady - 1 else None
            pair(Action("send_bwd", bwd_mb), nxt)
    for mb in range(steady, microbatches):
        if not last:
            out.append(Action("recv_bwd", mb))
        out.append(Action("bwd", mb))
        if not first:
            out.append(Action("send_bwd", mb))
    return out


def schedule(
    kind: Schedule, *, stage: int, stages: int, microbatches: int, chunks: int = 1
) -> list[Action]:
    """The actions of pipeline stage `stage` (of `stages`) for one step of `microbatches`.

    ``gpipe``: every forward, then every backward in reverse micro-batch order. ``1f1b``:
    ``min(stages - stage - 1, microbatches)`` warm-up forwards, then alternating one forward and
    one backward, then the remaining backwards (Megatron's non-interleaved schedule).
    ``interleaved`` is planned for the whole pipeline at once (``_interleaved.stage_plan``).
    """
    if kind == "interleaved":
        msg = "interleaved 1F1B is planned for the whole pipeline: _interleaved.stage_plan"
        raise ValueError(msg)
    if chunks != 1:
        msg = f"{kind} runs one model chunk a stage, not {chunks}"
        raise ValueError(msg)
    if not 0 <= stage < stages or microbatches < 1:
        msg = f"no schedule for stage {stage} of {stages} with {microbatches} micro-batches"
        raise ValueError(msg)
    if kind == "gpipe":
        return _gpipe(stage, stages, microbatches)
    if kind == "1f1b":
        return _one_f_one_b(stage, stages, microbatches)
    msg = f"unknown schedule {kind!r}; expected one of {', '.join(SCHEDULES)}"
    raise ValueError(msg)


_PEER = {"send_fwd": 1, "recv_bwd": 1, "recv_fwd": -1, "send_bwd": -1}
_MATCH = {
    "send_fwd": "recv_fwd",
    "recv_fwd": "send_fwd",
    "send_bwd": "recv_bwd",
    "recv_bwd": "send_bwd",
}


def _peer(a: Action, stage: int, stages: int, chunks: int) -> tuple[int, Action] | None:
    """The stage and the action that complete ``a`` (a send or receive of ``stage``): the
    neighbour one stage on, its call for the same micro-batch. With ``chunks`` > 1 the pipeline
    wraps (interleaved 1F1B): the last stage's chunk ``c`` sends forward to the first stage's
    chunk ``c + 1``. None where the pipeline has no such stage."""
    step = _PEER[a.kind]
    peer, chunk = stage + step, a.chunk
    if chunks > 1 and not 0 <= peer < stages:
        peer, chunk = peer % stages, chunk + step
    if not 0 <= peer < stages or not 0 <= chunk < chunks:
        return None
    return peer, Action(_MATCH[a.kind], a.mb, chunk)  # type: ignore[arg-type]


def check_deadlock_free(plans: list[list[Action]], *, chunks: int = 1) -> None:
    """Run every stage's plan with rendezvous send/recv; raise ``ValueError`` if it gets stuck.

    A send or receive completes only together with the neighbour's matching call for the same
    micro-batch (and chunk: ``_peer``), as gloo's blocking calls do; compute actions complete at
    once. Also checks that each forward precedes its backward.
    """
    pos = [0] * len(plans)
    done_fwd: list[set[tuple[int, int]]] = [set() for _ in plans]
    while any(p < len(plan) for p, plan in zip(pos, plans, strict=True)):
        moved = False
        for s, plan in enumerate(plans):
            while pos[s] < len(plan):
                a = plan[pos[s]]
                if a.kind in ("fwd", "bwd"):
                    if a.kind == "bwd" and (a.mb, a.chunk) not in done_fwd[s]:
                        msg = f"stage {s}: backward of micro-batch {a.mb} before its forward"
                        raise ValueError(msg)
                    if a.kind == "fwd":
                        done_fwd[s].add((a.mb, a.chunk))
                    pos[s] += 1
                    moved = True
                    continue
                match = _peer(a, s, len(plans), chunks)
                if match is None:
                    msg = f"stage {s}: {a} has no peer stage {s + _PEER[a.kind]}"
                    raise ValueError(msg)
                peer, want = match
                theirs = plans[peer][pos[peer]] if pos[peer] < len(plans[peer]) else None
                if theirs != want:
                    break
                pos[s] += 1
                pos[peer] += 1
                moved = True
        if not moved:
            stuck = {s: str(plans[s][pos[s]]) for s in range(len(plans)) if pos[s] < len(plans[s])}
            msg = f"pipeline deadlocks; stages wait at {stuck}"
            raise ValueError(msg)

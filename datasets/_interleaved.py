"""Interleaved 1F1B (Megatron's ``forward_backward_pipelining_with_interleaving``), blocking calls.

Each stage holds ``chunks`` model chunks; chunk ``c`` of stage ``s`` is virtual stage
``c * stages + s``, so a micro-batch goes round the pipeline ``chunks`` times, the last stage's
chunk ``c`` handing it to the first stage's chunk ``c + 1``. Megatron's order of a stage's
compute (``virtual_order``): ``m * chunks`` forwards and as many backwards, virtual micro-batch
``k`` being micro-batch ``(k // (stages * chunks)) * stages + k % stages`` on chunk
``(k % (stages * chunks)) // stages`` (backwards: the chunks in reverse); ``(stages - s - 1) * 2
+ (chunks - 1) * stages`` warm-up forwards (all of them when ``m == stages``), then one forward
and one backward, then the remaining backwards.

Megatron exchanges each step's sends and receives as one batch of ``isend``/``irecv``. The
generator's calls are blocking (gloo's ``send`` returns once the peer has posted its ``recv``),
so each stage needs an order of its calls that complements its neighbours'. It is found here by
running the pipeline: between two computes a stage owes a *set* of calls (the sends of what it
just computed, the receives of what it computes next), any order; a call is made when the
neighbour owes its match at the same time, both sides at once. The orders this run makes replay
without deadlock (``check_deadlock_free``, with the wrap), since the run itself is one way to
complete them. Nothing here imports torch.
"""

from __future__ import annotations

from prism_trace.datasets._schedule import Action, Schedule, _peer, check_deadlock_free, schedule

__all__ = ["interleaved_plans", "stage_plan", "virtual_order"]


def virtual_order(
    stage: int, stages: int, microbatches: int, chunks: int
) -> list[tuple[str, int, int]]:
    """Megatron's compute order of ``stage``: ``(fwd|bwd, micro-batch, chunk)`` (module
    docstring).

    Raises:
        ValueError: fewer than 2 stages or chunks, or micro-batches that are not a multiple of
            the stages (Megatron's interleaved schedule requires it).
    """
    if stages < 2 or chunks < 2 or not 0 <= stage < stages:
        msg = f"no interleaved schedule for stage {stage} of {stages} with {chunks} chunks"
        raise ValueError(msg)
    if microbatches < stages or microbatches % stages:
        msg = (
            f"interleaved 1F1B needs a multiple of the {stages} stages as micro-batches,"
            f" got {microbatches}"
        )
        raise ValueError(msg)
    total = microbatches * chunks
    group = stages * chunks

    def unit(k: int, *, forward: bool) -> tuple[str, int, int]:
        chunk = (k % group) // stages
        mb = (k // group) * stages + k % stages
        return ("fwd", mb, chunk) if forward else ("bwd", mb, chunks - 1 - chunk)

    warmup = _warmup(stage, stages, microbatches, chunks)
    out = [unit(k, forward=True) for k in range(warmup)]
    for i in range(total - warmup):
        out += [unit(warmup + i, forward=True), unit(i, forward=False)]
    out += [unit(k, forward=False) for k in range(total - warmup, total)]
    return out


def _warmup(stage: int, stages: int, microbatches: int, chunks: int) -> int:
    """Megatron's warm-up forwards of ``stage``: all of them when there are as many
    micro-batches as stages."""
    total = microbatches * chunks
    if microbatches == stages:
        return total
    return min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)


def _logical(stage: int, stages: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """The stage's computes, one action per item, and the sets of calls it owes between them,
    batched as Megatron batches them: ``[calls, [compute], calls, ...]``.

    After each warm-up forward: its send and the next forward's receive (and, after the last
    warm-up forward, the first backward's gradient); after each steady forward *and* backward
    pair: both sends and both next receives; after each cool-down backward: its send and the next
    backward's receive. A receive owed for a computation is always in a set before it."""
    order = virtual_order(stage, stages, microbatches, chunks)
    first, last = (0, 0), (stages - 1, chunks - 1)
    total = microbatches * chunks
    warmup = _warmup(stage, stages, microbatches, chunks)
    fwd = [u for u in order if u[0] == "fwd"]
    bwd = [u for u in order if u[0] == "bwd"]

    def recv(u: tuple[str, int, int]) -> list[Action]:
        kind, mb, chunk = u
        if kind == "fwd":
            return [] if (stage, chunk) == first else [Action("recv_fwd", mb, chunk)]
        return [] if (stage, chunk) == last else [Action("recv_bwd", mb, chunk)]

    def send(u: tuple[str, int, int]) -> list[Action]:
        kind, mb, chunk = u
        if kind == "fwd":
            return [] if (stage, chunk) == last else [Action("send_fwd", mb, chunk)]
        return [] if (stage, chunk) == first else [Action("send_bwd", mb, chunk)]

    def compute(u: tuple[str, int, int]) -> list[Action]:
        return [Action(u[0], u[1], u[2])]  # type: ignore[arg-type]

    steady = total - warmup
    items: list[list[Action]] = [recv(fwd[0])]
    for k in range(warmup):
        calls = send(fwd[k]) + (recv(fwd[k + 1]) if k + 1 < total else [])
        if k == warmup - 1 and steady > 0:
            calls += recv(bwd[0])
        items += [compute(fwd[k]), calls]
    for i in range(steady):
        f, b = warmup + i, i
        calls = send(fwd[f]) + send(bwd[b])
        calls += recv(fwd[f + 1]) if f + 1 < total else []
        calls += recv(bwd[b + 1]) if b + 1 < total else []
        items += [compute(fwd[f]), compute(bwd[b]), calls]
    if steady == 0:  # all forwards first: the first backward's gradient before it
        items.append(recv(bwd[0]))
    for b in range(steady, total):
        calls = send(bwd[b]) + (recv(bwd[b + 1]) if b + 1 < total else [])
        items += [compute(bwd[b]), calls]
    return items


def interleaved_plans(stages: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """Every stage's actions for one step of interleaved 1F1B, its blocking calls ordered so the
    pipeline cannot deadlock (module docstring).

    Raises:
        ValueError: as ``virtual_order``; or the run of the pipeline got stuck (a schedule
            that needs calls of a later step of the neighbour: not Megatron's).
    """
    owed = [_logical(s, stages, microbatches, chunks) for s in range(stages)]
    pos = [0] * stages
    plans: list[list[Action]] = [[] for _ in range(stages)]
    while any(p < len(items) for p, items in zip(pos, owed, strict=True)):
        moved = False
        for s in range(stages):
            while pos[s] < len(owed[s]):
                here = owed[s][pos[s]]
                if here and here[0].kind in ("fwd", "bwd"):
                    plans[s].append(here[0])
                    pos[s] += 1
                    moved = True
                    continue
                for a in list(here):
                    match = _peer(a, s, stages, chunks)
                    assert match is not None, a  # _logical owes no call off the pipeline
                    peer, want = match
                    theirs = owed[peer][pos[peer]] if pos[peer] < len(owed[peer]) else []
                    if want in theirs and (theirs[0].kind not in ("fwd", "bwd")):
                        here.remove(a)
                        theirs.remove(want)
                        plans[s].append(a)
                        plans[peer].append(want)
                        moved = True
                if here:
                    break
                pos[s] += 1
                moved = True
        if not moved:
            stuck = {s: [str(a) for a in owed[s][pos[s]]] for s in range(stages)}
            msg = f"interleaved pipeline deadlocks; stages owe {stuck}"
            raise ValueError(msg)
    check_deadlock_free(plans, chunks=chunks)
    return plans


def stage_plan(
    kind: Schedule, *, stage: int, stages: int, microbatches: int, chunks: int = 1
) -> list[Action]:
    """The actions of ``stage`` for one step of any schedule: interleaved 1F1B's row of the
    pipeline's plans, else ``_schedule.schedule``'s."""
    if kind != "interleaved":
        return schedule(kind, stage=stage, stages=stages, microbatches=microbatches, chunks=chunks)
    if not 0 <= stage < stages:
        msg = f"no schedule for stage {stage} of {stages} with {microbatches} micro-batches"
        raise ValueError(msg)
    return interleaved_plans(stages, microbatches, chunks)[stage]

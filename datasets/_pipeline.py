"""One training step of one rank: its pipeline schedule's actions, with the annotated PP calls.

The compute of a micro-batch and the step's end (DP sync, optimizer) belong to a `StageWork`
(real model or wait-mode ops); this module only sequences them with the sends and receives of
the schedule (`_schedule`), so both compute modes talk to their neighbours identically.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from prism_trace.datasets._comm import Comm, CommGroup
    from prism_trace.datasets._schedule import Action

__all__ = ["Neighbours", "StageWork", "run_step"]


class StageWork(Protocol):
    """The compute side of a stage, called by `run_step`."""

    def prepare(self, step: int, mb: int) -> None:
        """Called once per micro-batch before anything else of its forward (its first recv)."""

    def forward(
        self, step: int, mb: int, x: torch.Tensor | None, *, chunk: int = 0
    ) -> torch.Tensor | None:
        """Forward of `mb` through model chunk `chunk` on the received activations `x` (None on
        the first virtual stage); returns the activations to send (None on the last)."""

    def backward(
        self, step: int, mb: int, dy: torch.Tensor | None, *, chunk: int = 0
    ) -> torch.Tensor | None:
        """Backward of `mb` through model chunk `chunk` from the received output gradient `dy`
        (None on the last virtual stage); returns the input gradient to send (None on the
        first)."""

    def finish(self, step: int) -> float | None:
        """The step's end: gradient sync and optimizer step; the loss on the last stage."""


class Neighbours:
    """The PP group and this rank's previous and next stage (global ranks; -1 where none)."""

    def __init__(self, group: CommGroup, prev: int, nxt: int) -> None:
        """Record the group and the two peers."""
        self.group, self.prev, self.next = group, prev, nxt


def run_step(
    work: StageWork,
    plan: list[Action],
    *,
    step: int,
    comm: Comm,
    pp: Neighbours,
    act_shape: tuple[int, ...],
    device: torch.device | None = None,
) -> float | None:
    """Perform `plan` (this stage's schedule) for `step`, then ``work.finish``; received
    activations and gradients land on `device` (None: torch's default, the CPU).

    Returns:
        ``work.finish``'s value: the step's loss on the last stage, None elsewhere.
    """
    # Keyed by (micro-batch, chunk): interleaved 1F1B runs each micro-batch through every chunk.
    received: dict[tuple[int, int], torch.Tensor] = {}
    to_send: dict[tuple[int, int], torch.Tensor] = {}
    grads_in: dict[tuple[int, int], torch.Tensor] = {}
    grads_out: dict[tuple[int, int], torch.Tensor] = {}
    prepared: set[int] = set()
    for a in plan:
        key = (a.mb, a.chunk)
        if a.kind in ("recv_fwd", "fwd") and a.mb not in prepared:
            work.prepare(step, a.mb)
            prepared.add(a.mb)
        if a.kind == "recv_fwd":
            received[key] = comm.recv(torch.empty(act_shape, device=device), pp.prev, pp.group)
        elif a.kind == "fwd":
            y = work.forward(step, a.mb, received.pop(key, None), chunk=a.chunk)
            if y is not None:
                to_send[key] = y
        elif a.kind == "send_fwd":
            comm.send(to_send.pop(key), pp.next, pp.group)
        elif a.kind == "recv_bwd":
            grads_in[key] = comm.recv(torch.empty(act_shape, device=device), pp.next, pp.group)
        elif a.kind == "bwd":
            dx = work.backward(step, a.mb, grads_in.pop(key, None), chunk=a.chunk)
            if dx is not None:
                grads_out[key] = dx
        else:  # send_bwd
            comm.send(grads_out.pop(key), pp.prev, pp.group)
    return work.finish(step)

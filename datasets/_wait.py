"""Wait-mode compute of one rank: the real job's ops and messages, with sleeps for the math.

`WaitStage` is the `StageWork` of ``compute = "wait"``. Where the real stage computes, it calls
one wait op per op type (``prism::embed_fwd``, ``prism::attn_fwd``, ``prism::mlp_fwd``,
``prism::head_fwd``, ``prism::loss_fwd`` and their ``*_bwd``, ``prism::optimizer_step``; see
`_ops`), which sleeps its drawn duration (`_durations`) and returns a tensor of the real output
shape; and between them it makes the real job's calls: the TP all-reduces after each attention
and MLP (and of their input gradients backward), the LM head's all-gather of the logits, the DP
gradient buckets (all-reduce, or ZeRO-1's reduce-scatter and all-gather) of the real parameter
sizes (`_model.stage_param_shapes`). No weights, no autograd. A forward's outputs are kept until
the micro-batch's backward, so the allocator sees the schedule's activation memory.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from prism_trace.datasets._durations import Durations
from prism_trace.datasets._grads import plan_buckets
from prism_trace.datasets._model import layer_numel, stage_layers, stage_param_shapes
from prism_trace.datasets._ops import straggle, wait_op

if TYPE_CHECKING:
    from prism_trace.datasets._comm import Comm, CommGroup
    from prism_trace.datasets._config import JobConfig

__all__ = ["WaitStage"]


class WaitStage:
    """One rank's stage in wait mode."""

    def __init__(
        self, cfg: JobConfig, rank: int, *, comm: Comm, tp: CommGroup, dp: CommGroup
    ) -> None:
        """Lay out the stage's layers and parameter buckets; draw the rank's speed factor."""
        self.cfg, self.rank, self.comm, self.tp, self.dp = cfg, rank, comm, tp, dp
        _, _, pp_rank = cfg.layout.coords(rank)
        # Chunk c of this stage is virtual stage c * pp + pp_rank (one chunk but interleaved).
        virtual = cfg.pp * cfg.chunks
        self.chunk_stages = [c * cfg.pp + pp_rank for c in range(cfg.chunks)]
        self.chunk_layers = [
            list(stage_layers(cfg.model.layers, virtual, v)) for v in self.chunk_stages
        ]
        self.first_stage, self.last_stage = (
            self.chunk_stages[0] == 0,
            self.chunk_stages[-1] == virtual - 1,
        )
        self.durations = Durations(cfg, rank)
        m = cfg.model
        self.act_shape = [cfg.microbatch_size, m.seq, m.hidden]
        self.logits_shape = [cfg.microbatch_size, m.seq, m.vocab // cfg.tp]
        shapes = [
            s
            for v in self.chunk_stages
            for s in stage_param_shapes(m, stage=v, stages=virtual, tp=cfg.tp)
        ]
        numels = [math.prod(s) for s in reversed(shapes)]  # synchronised last first
        self.param_numel = sum(numels)
        self.buckets = plan_buckets(
            numels, element_size=4, bucket_bytes=cfg.bucket_bytes, dp=cfg.dp if cfg.zero else 1
        )
        self.updated_numel = (
            sum(b.chunk for b in self.buckets) if cfg.zero and cfg.dp > 1 else self.param_numel
        )
        self.layer_numel = layer_numel(m)
        self._tokens = torch.zeros(cfg.microbatch_size, m.seq, dtype=torch.long)
        self._saved: dict[tuple[int, int], list[torch.Tensor]] = {}

    def state_bytes(self) -> dict[str, int]:
        """What the real job's parameters and Adam state (2 moments, fp32) would take here."""
        adam = 2 * self.updated_numel * 4 if self.cfg.optimizer == "adam" else 0
        master = self.updated_numel * 4 if self.cfg.zero and self.cfg.dp > 1 else 0
        return {"params": self.param_numel * 4, "optimizer_state": adam + master}

    def optimizer_base_ms(self) -> float:
        """This rank's optimizer-step base duration (ms): it scales with the numbers it updates."""
        return self.durations.optimizer_base_ms(self.updated_numel, self.layer_numel)

    def _op(
        self, name: str, x: torch.Tensor, shape: list[int], step: int, mb: int, layer: int = -1
    ) -> torch.Tensor:
        secs = self.durations.seconds(name, step=step, mb=mb, layer=layer)
        return wait_op(name, x, shape, secs, mb)

    def _tp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(t, self.tp) if self.cfg.tp > 1 else t

    def prepare(self, step: int, mb: int) -> None:
        """Nothing to draw: the first stage's token tensor is reused."""

    def _first(self, chunk: int) -> bool:
        return chunk == 0 and self.first_stage

    def _last(self, chunk: int) -> bool:
        return chunk == self.cfg.chunks - 1 and self.last_stage

    def forward(
        self, step: int, mb: int, x: torch.Tensor | None, *, chunk: int = 0
    ) -> torch.Tensor | None:
        """The ops and TP calls of `mb`'s forward through model chunk `chunk`; the activations
        to send (None on the last virtual stage)."""
        cfg = self.cfg
        saved: list[torch.Tensor] = []
        if self._first(chunk):
            h = self._op("embed_fwd", self._tokens, self.act_shape, step, mb)
        else:
            assert x is not None
            h = x
        for layer in self.chunk_layers[chunk]:
            saved.append(h)
            h = self._tp_all_reduce(self._op("attn_fwd", h, self.act_shape, step, mb, layer))
            saved.append(h)
            h = self._tp_all_reduce(self._op("mlp_fwd", h, self.act_shape, step, mb, layer))
        if cfg.has_straggler and cfg.straggler_factor == 1.0:
            per = cfg.microbatches * cfg.chunks
            secs = cfg.straggler_s / per if cfg.is_straggler(self.rank) else 0.0
            straggle(h, secs, cfg.straggler_spin)
        out: torch.Tensor | None = h
        if self._last(chunk):
            saved.append(h)
            logits = self._op("head_fwd", h, self.logits_shape, step, mb)
            if cfg.tp > 1:
                logits = torch.cat(self.comm.all_gather(logits, self.tp), dim=-1)
            saved.append(logits)
            saved.append(self._op("loss_fwd", logits, [], step, mb))
            out = None
        self._saved[mb, chunk] = saved
        return out

    def backward(
        self, step: int, mb: int, dy: torch.Tensor | None, *, chunk: int = 0
    ) -> torch.Tensor | None:
        """The ops and TP calls of `mb`'s backward through model chunk `chunk`; the input
        gradient to send (None on the first virtual stage)."""
        cfg = self.cfg
        saved = self._saved.pop((mb, chunk))
        if self._last(chunk):
            loss = saved[-1]
            full = [cfg.microbatch_size, cfg.model.seq, cfg.model.vocab]
            g = self._op("loss_bwd", loss, full, step, mb)
            g = g.narrow(-1, 0, self.logits_shape[-1])  # this rank's slice, as the real backward
            g = self._tp_all_reduce(self._op("head_bwd", g, self.act_shape, step, mb))
        else:
            assert dy is not None
            g = dy
        for layer in reversed(self.chunk_layers[chunk]):
            g = self._tp_all_reduce(self._op("mlp_bwd", g, self.act_shape, step, mb, layer))
            g = self._tp_all_reduce(self._op("attn_bwd", g, self.act_shape, step, mb, layer))
        del saved
        if self._first(chunk):
            self._op("embed_bwd", g, [0], step, mb)
            return None
        return g

    def finish(self, step: int) -> float | None:
        """DP gradient buckets, the optimizer step, ZeRO-1's all-gathers; no loss in wait mode."""
        cfg, n = self.cfg, self.cfg.dp
        grads = torch.zeros(0)
        sync = n > 1 or cfg.dp_sync_always  # one member: a dp=1 recording of every rank's work
        if sync:
            for b in self.buckets:
                if cfg.zero:
                    flat = torch.zeros(b.padded)
                    grads = self.comm.reduce_scatter(
                        torch.empty(b.chunk), list(flat.chunk(n)), self.dp
                    )
                else:
                    grads = self.comm.all_reduce(torch.zeros(b.numel), self.dp)
        secs = self.durations.optimizer(
            step=step, numel=self.updated_numel, block_numel=self.layer_numel
        )
        wait_op("optimizer_step", grads, [0], secs, -1)
        if cfg.zero and sync:
            for b in self.buckets:
                self.comm.all_gather(torch.zeros(b.chunk), self.dp)
        return None

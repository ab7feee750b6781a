"""Real compute of one rank: the tiny GPT stage, autograd, DP gradient sync and the optimizer.

`RealStage` is the `StageWork` of ``compute = "real"``: the forward and backward of each
micro-batch (with the ``prism::straggle`` sleep after a forward when a straggler is configured),
then at the step's end the DP gradient all-reduce in buckets and the optimizer step, or with
ZeRO-1 (`ZeroOptimizer`) the reduce-scatter, the sharded update and the all-gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from prism_trace.datasets._grads import plan_buckets
from prism_trace.datasets._model import Stage
from prism_trace.datasets._ops import straggle
from prism_trace.datasets._zero import ZeroOptimizer
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

if TYPE_CHECKING:
    from prism_trace.datasets._comm import Comm, CommGroup
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._model import TensorParallel

__all__ = ["RealStage"]


class RealStage:
    """The model stage of one rank and its optimizer, driven micro-batch by micro-batch."""

    def __init__(
        self,
        cfg: JobConfig,
        rank: int,
        *,
        comm: Comm,
        tp: TensorParallel,
        dp: CommGroup,
        device: torch.device | None = None,
    ) -> None:
        """Build this rank's stage (weights from the seeded full tensors) and its optimizer, on
        `device` (None: the CPU, every call as it always was)."""
        self.cfg, self.rank, self.comm, self.dp = cfg, rank, comm, dp
        self.device = device
        _, dp_rank, pp_rank = cfg.layout.coords(rank)
        self.dp_rank = dp_rank
        # Model chunk c of this stage is virtual stage c * pp + pp_rank of pp * chunks (Megatron's
        # interleaved layout); with one chunk, the stage itself.
        virtual = cfg.pp * cfg.chunks
        self.chunk_models = [
            Stage(cfg.model, stage=c * cfg.pp + pp_rank, stages=virtual, tp=tp)
            for c in range(cfg.chunks)
        ]
        self.stage = torch.nn.ModuleList(self.chunk_models)
        if device is not None:
            self.stage.to(device)
        self.optimizer: torch.optim.Optimizer | ZeroOptimizer
        if cfg.zero:
            self.optimizer = ZeroOptimizer(
                list(self.stage.parameters()), cfg, comm=comm, dp=dp, dp_rank=dp_rank, device=device
            )
        elif cfg.optimizer == "adam":  # fused: one op per step keeps the trace small
            self.optimizer = torch.optim.Adam(self.stage.parameters(), lr=cfg.lr, fused=True)
        else:
            self.optimizer = torch.optim.SGD(self.stage.parameters(), lr=cfg.lr)
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._by_mb: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._losses: list[float] = []
        # Per micro-batch (tokens, targets): drawn when its first action comes, read by the first
        # and the last virtual stage (interleaved: other micro-batches run in between).
        self._batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the parameters and of the optimizer state once it exists (after a step)."""
        params = sum(p.numel() * p.element_size() for p in self.stage.parameters())
        if isinstance(self.optimizer, ZeroOptimizer):
            return {"params": params, "optimizer_state": self.optimizer.state_bytes()}
        state = sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        return {"params": params, "optimizer_state": state}

    def _batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Same tokens on every TP and PP rank of one DP replica.
        m = self.cfg.model
        seed = ((self.cfg.seed * 1009 + self.dp_rank) * 1009 + step) * 1009 + mb
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(m.vocab, (self.cfg.microbatch_size, m.seq + 1), generator=gen)
        if self.device is not None:  # drawn on the host (the same tokens whatever the device)
            tokens = tokens.to(self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def prepare(self, step: int, mb: int) -> None:
        """Draw the micro-batch's tokens (every stage does, before receiving anything)."""
        if self.cfg.chunks == 1:  # one micro-batch in flight per forward: the last one's go
            self._batches.clear()
        self._batches[mb] = self._batch(step, mb)

    def forward(
        self, step: int, mb: int, x: torch.Tensor | None, *, chunk: int = 0
    ) -> torch.Tensor | None:
        """The forward of `mb` through model chunk `chunk`; the loss (kept for backward) on the
        last virtual stage."""
        cfg, m = self.cfg, self.cfg.model
        model = self.chunk_models[chunk]
        tokens, targets = self._batches[mb]
        if model.first:
            x = tokens
        else:
            assert x is not None
            x.requires_grad_()
        y = model(x)
        if cfg.has_straggler:
            per = cfg.microbatches * cfg.chunks
            secs = cfg.straggler_s / per if cfg.is_straggler(self.rank) else 0.0
            straggle(y.detach(), secs, cfg.straggler_spin)
        out: torch.Tensor | None = None
        if model.last:
            y = F.cross_entropy(y.reshape(-1, m.vocab), targets.reshape(-1)) / cfg.microbatches
            self._losses.append(y.item())
        else:
            out = y.detach()
        # Kept until the step ends, as the GPipe loop always kept its lists (the graph's saved
        # tensors go at each backward).
        self._saved.append((x, y))
        self._by_mb[mb, chunk] = (x, y)
        return out

    def backward(
        self, step: int, mb: int, dy: torch.Tensor | None, *, chunk: int = 0
    ) -> torch.Tensor | None:
        """The backward of `mb` through model chunk `chunk`; the input gradient to send (None on
        the first virtual stage)."""
        model = self.chunk_models[chunk]
        x, y = self._by_mb.pop((mb, chunk))
        if model.last:
            y.backward()
        else:
            torch.autograd.backward(y, dy)
        if model.first:
            return None
        assert x.grad is not None
        return x.grad

    def finish(self, step: int) -> float | None:
        """DP gradient sync and optimizer step (or ZeRO-1's); the summed loss on the last stage."""
        if isinstance(self.optimizer, ZeroOptimizer):
            self.optimizer.step()
        else:
            self._sync_grads()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = sum(self._losses) if self.chunk_models[-1].last else None
        self._saved, self._losses = [], []
        self._batches.clear()
        return loss

    def _sync_grads(self) -> None:
        """Average gradients over DP in buckets of about `bucket_bytes`, last parameters first."""
        if self.cfg.dp == 1 and not self.cfg.dp_sync_always:
            return
        grads = [p.grad for p in reversed(list(self.stage.parameters())) if p.grad is not None]
        numels = [g.numel() for g in grads]
        size = grads[0].element_size() if grads else 4
        for b in plan_buckets(numels, element_size=size, bucket_bytes=self.cfg.bucket_bytes, dp=1):
            bucket = [grads[i] for i in b.params]
            flat = self.comm.all_reduce(_flatten_dense_tensors(bucket), self.dp)
            flat /= self.cfg.dp
            for g_, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                g_.copy_(synced)

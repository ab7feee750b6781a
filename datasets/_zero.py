"""ZeRO-1 on the DP group for the real model: optimizer state for a 1/dp shard of each bucket.

Bucket by bucket (the DP buckets of `_grads.plan_buckets`, last parameters first), padded to
``dp`` equal chunks: the gradients are reduce-scattered over DP (each rank receives the sum of its
chunk), averaged, and the rank's optimizer (Adam or SGD, its state only for the concatenated
chunks) updates its master copy of those chunks; then every bucket's updated chunks are
all-gathered back into the parameters. Every call goes through the annotated `Comm`, with the
real byte counts. torch's ``ZeroRedundancyOptimizer`` is not used: it broadcasts parameters
through torch internals that the ``prism_comm`` annotations cannot wrap call by call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from prism_trace.datasets._grads import Bucket, plan_buckets
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

if TYPE_CHECKING:
    from prism_trace.datasets._comm import Comm, CommGroup
    from prism_trace.datasets._config import JobConfig

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer:
    """One rank's ZeRO-1 optimizer over its stage's parameters."""

    def __init__(
        self,
        params: list[nn.Parameter],
        cfg: JobConfig,
        *,
        comm: Comm,
        dp: CommGroup,
        dp_rank: int,
        device: torch.device | None = None,
    ) -> None:
        """Plan the buckets, copy this rank's chunks into the master shard, build its optimizer
        (the parameters are on `device`; None: the CPU)."""
        self.cfg, self.comm, self.dp, self.dp_rank = cfg, comm, dp, dp_rank
        self.device = device
        self.params = list(reversed(params))  # synchronised last first, as without ZeRO
        self.buckets: list[Bucket] = plan_buckets(
            [p.numel() for p in self.params],
            element_size=4,
            bucket_bytes=cfg.bucket_bytes,
            dp=cfg.dp,
        )
        with torch.no_grad():
            chunks = [self._chunk(self._flat(b, grads=False), b) for b in self.buckets]
        self.master = nn.Parameter(torch.cat(chunks).clone())
        self.inner: torch.optim.Optimizer
        if cfg.optimizer == "adam":
            self.inner = torch.optim.Adam([self.master], lr=cfg.lr, fused=True)
        else:
            self.inner = torch.optim.SGD([self.master], lr=cfg.lr)

    def _flat(self, b: Bucket, *, grads: bool) -> torch.Tensor:
        params = [self.params[i] for i in b.params]
        ts: list[torch.Tensor] = list(params)
        if grads:
            ts = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors([t.detach() for t in ts])
        return F.pad(flat, (0, b.padded - b.numel))

    def _chunk(self, padded: torch.Tensor, b: Bucket) -> torch.Tensor:
        return padded.narrow(0, self.dp_rank * b.chunk, b.chunk)

    def state_bytes(self) -> int:
        """Bytes of the master shard and of the optimizer state kept for it."""
        state = sum(
            t.numel() * t.element_size()
            for s in self.inner.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        return self.master.numel() * self.master.element_size() + state

    def step(self) -> None:
        """Reduce-scatter the gradients, update this rank's shard, all-gather the parameters."""
        n = self.cfg.dp
        parts = []
        for b in self.buckets:
            padded = self._flat(b, grads=True)
            if n == 1:
                part = padded
            else:
                part = self.comm.reduce_scatter(
                    torch.empty(b.chunk, device=self.device), list(padded.chunk(n)), self.dp
                )
                part /= n
            parts.append(part)
        self.master.grad = torch.cat(parts)
        self.inner.step()
        offset = 0
        with torch.no_grad():
            for b in self.buckets:
                mine = self.master.detach().narrow(0, offset, b.chunk)
                offset += b.chunk
                full = mine if n == 1 else torch.cat(self.comm.all_gather(mine, self.dp))
                members = [self.params[i] for i in b.params]
                flat = full.narrow(0, 0, b.numel)
                for p, new in zip(members, _unflatten_dense_tensors(flat, members), strict=True):
                    p.copy_(new)

    def zero_grad(self, *, set_to_none: bool = True) -> None:
        """Drop the parameters' and the shard's gradients."""
        for p in self.params:
            p.grad = None
        self.master.grad = None

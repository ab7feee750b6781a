"""A tiny GPT split into pipeline stages, with Megatron-style tensor-parallel linears."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from prism_trace.datasets._comm import Comm, CommGroup

__all__ = [
    "ModelConfig",
    "Stage",
    "TensorParallel",
    "layer_numel",
    "stage_layers",
    "stage_param_shapes",
]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Model dimensions."""

    vocab: int = 256
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 32
    ffn_mult: int = 4

    def check(self, *, tp: int, pp: int) -> None:
        """Raise ``ValueError`` when the model cannot be split ``tp`` ways and over ``pp`` stages.

        Called by ``generate`` before it starts any rank (a wrong layout is then refused in
        milliseconds, not after the ranks import torch) and by ``Stage`` itself.
        """
        if self.heads % tp or self.vocab % tp:
            msg = f"`heads` ({self.heads}) and `vocab` ({self.vocab}) must be multiples of tp={tp}"
            raise ValueError(msg)
        if self.layers < pp:
            msg = f"`layers` ({self.layers}) must be at least pp={pp}"
            raise ValueError(msg)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group and the calls that talk to it."""

    rank: int
    size: int
    group: CommGroup
    comm: Comm


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """Global indices of the blocks of pipeline stage `stage` (earlier stages get the extras)."""
    base, extra = divmod(layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def _block_param_shapes(cfg: ModelConfig, tp: int) -> list[tuple[int, ...]]:
    h, f = cfg.hidden, cfg.ffn_mult * cfg.hidden
    col = [(h // tp, h), (h // tp,)]
    return [
        (h,), (h,),  # ln1
        *col, *col, *col,  # q, k, v
        (h, h // tp), (h,),  # proj (row-parallel)
        (h,), (h,),  # ln2
        (f // tp, h), (f // tp,),  # fc1 (column-parallel)
        (h, f // tp), (h,),  # fc2 (row-parallel)
    ]  # fmt: skip


def stage_param_shapes(
    cfg: ModelConfig, *, stage: int, stages: int, tp: int
) -> list[tuple[int, ...]]:
    """The shapes of `Stage`'s parameters, in ``Stage.parameters()`` order, without building it.

    Wait mode sizes its DP gradient buckets and ZeRO shards from these (no weights, no math).
    """
    shapes: list[tuple[int, ...]] = []
    if stage == 0:
        shapes += [(cfg.vocab, cfg.hidden), (cfg.seq, cfg.hidden)]
    for _ in stage_layers(cfg.layers, stages, stage):
        shapes += _block_param_shapes(cfg, tp)
    if stage == stages - 1:
        shapes += [(cfg.hidden,), (cfg.hidden,), (cfg.vocab // tp, cfg.hidden), (cfg.vocab // tp,)]
    return shapes


def layer_numel(cfg: ModelConfig) -> int:
    """Parameters of one transformer layer, unsplit (the unit of the wait-mode optimizer step)."""
    return sum(math.prod(s) for s in _block_param_shapes(cfg, 1))


def _full_weight(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    # The same full tensor on every rank, so that TP shards fit together and DP replicas agree.
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "little")
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * (1.0 / math.sqrt(shape[-1]))


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient over TP backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        tp: TensorParallel = ctx.tp
        return tp.comm.all_reduce(grad.contiguous(), tp.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over TP forward (after a row-parallel linear); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return tp.comm.all_reduce(x.contiguous(), tp.group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather of the last dimension over TP forward; this rank's slice backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        ctx.width = x.shape[-1]
        return torch.cat(tp.comm.all_gather(x, tp.group), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        tp: TensorParallel = ctx.tp
        return grad.narrow(-1, tp.rank * ctx.width, ctx.width).contiguous(), None


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Megatron's `f`: enter a column-parallel region."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Megatron's `g`: leave a row-parallel region."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Concatenate the column shards of every TP rank."""
    return x if tp.size == 1 else _GatherFromTP.apply(x, tp)


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with the output features split over TP; input must be TP-replicated."""

    def __init__(self, key: str, d_in: int, d_out: int, tp: TensorParallel) -> None:
        """Take this rank's rows of the full weight named `key`."""
        super().__init__()
        width = d_out // tp.size
        rows = slice(tp.rank * width, (tp.rank + 1) * width)
        self.weight = nn.Parameter(_full_weight(key, (d_out, d_in))[rows].clone())
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features."""
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with the input features split over TP; output is all-reduced."""

    def __init__(self, key: str, d_in: int, d_out: int, tp: TensorParallel) -> None:
        """Take this rank's columns of the full weight named `key`."""
        super().__init__()
        width = d_in // tp.size
        cols = slice(tp.rank * width, (tp.rank + 1) * width)
        self.weight = nn.Parameter(_full_weight(key, (d_out, d_in))[:, cols].clone())
        self.bias = nn.Parameter(torch.zeros(d_out))
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full output, summed over TP ranks."""
        return reduce_from_tp(F.linear(x, self.weight), self.tp) + self.bias


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP, both TP-split."""

    def __init__(self, index: int, cfg: ModelConfig, tp: TensorParallel) -> None:
        """Build block `index` (global over all stages)."""
        super().__init__()
        h, key = cfg.hidden, f"block{index}"
        self.heads = cfg.heads // tp.size
        self.tp = tp
        self.ln1 = nn.LayerNorm(h)
        self.q = ColumnParallelLinear(f"{key}.q", h, h, tp)
        self.k = ColumnParallelLinear(f"{key}.k", h, h, tp)
        self.v = ColumnParallelLinear(f"{key}.v", h, h, tp)
        self.proj = RowParallelLinear(f"{key}.proj", h, h, tp)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = ColumnParallelLinear(f"{key}.fc1", h, cfg.ffn_mult * h, tp)
        self.fc2 = RowParallelLinear(f"{key}.fc2", cfg.ffn_mult * h, h, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to `[batch, seq, hidden]`."""
        b, s, _ = x.shape
        a = copy_to_tp(self.ln1(x), self.tp)
        q, k, v = (
            lin(a).view(b, s, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, -1))
        m = copy_to_tp(self.ln2(x), self.tp)
        return x + self.fc2(F.gelu(self.fc1(m)))


class Stage(nn.Module):
    """One pipeline stage: embeddings on the first, blocks, final norm and LM head on the last."""

    def __init__(self, cfg: ModelConfig, *, stage: int, stages: int, tp: TensorParallel) -> None:
        """Build the blocks of `stage` out of `stages`, sharded for `tp`."""
        super().__init__()
        cfg.check(tp=tp.size, pp=stages)
        self.first, self.last = stage == 0, stage == stages - 1
        self.tp = tp
        if self.first:
            self.tok = nn.Embedding(
                cfg.vocab, cfg.hidden, _weight=_full_weight("tok", (cfg.vocab, cfg.hidden))
            )
            self.pos = nn.Embedding(
                cfg.seq, cfg.hidden, _weight=_full_weight("pos", (cfg.seq, cfg.hidden))
            )
        self.blocks = nn.ModuleList(
            Block(i, cfg, tp) for i in stage_layers(cfg.layers, stages, stage)
        )
        if self.last:
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = ColumnParallelLinear("head", cfg.hidden, cfg.vocab, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens `[batch, seq]` (first stage) or hidden states in; hidden states or logits out."""
        if self.first:
            # device= only off the CPU: a CPU job's recorded arange call stays as it always was
            pos = (
                torch.arange(x.shape[1], device=x.device) if x.is_cuda else torch.arange(x.shape[1])
            )
            x = self.tok(x) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = gather_from_tp(self.head(copy_to_tp(self.ln_f(x), self.tp)), self.tp)
        return x

"""How long each wait-mode op sleeps: base durations per op type and their seeded random draws.

One call of op type ``op`` on ``rank`` sleeps ``base(op) x rank_factor x straggler x noise``:

- ``base``: `base_ms` of the op type, a share (`WEIGHTS`) of ``wait_ms_per_layer`` (one
  transformer layer's forward for one micro-batch at tp=1), divided by ``tp`` for the TP-split
  ops; the optimizer step scales with the parameters the rank updates (a 1/dp shard with ZeRO-1).
- ``rank_factor``: lognormal with mean 1 and ``sigma = rank_jitter``, drawn once per rank (a
  persistent speed difference between ranks, as between GPUs).
- ``straggler``: ``straggler_factor`` on the straggler (``--straggler RANK@xFACTOR``), else 1.
- ``noise``: lognormal with mean 1 and coefficient of variation ``wait_cv``, per call.

Every draw comes from its own ``random.Random`` seeded with a string of (seed, rank, step,
micro-batch, op, layer), so a recording is reproducible call by call and draws do not depend
on the order of calls or on the other ranks.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prism_trace.datasets._config import JobConfig

__all__ = ["OPTIMIZER_MS_PER_BLOCK", "TP_SPLIT", "WEIGHTS", "Durations", "base_ms"]

WEIGHTS = {
    "embed_fwd": 0.05,
    "attn_fwd": 0.45,
    "mlp_fwd": 0.55,
    "head_fwd": 0.25,
    "loss_fwd": 0.05,
    "loss_bwd": 0.05,
    "head_bwd": 0.5,
    "mlp_bwd": 1.1,
    "attn_bwd": 0.9,
    "embed_bwd": 0.1,
}
"""Per-micro-batch op types as a share of ``wait_ms_per_layer`` (attn + mlp forward = 1; a
backward takes twice its forward)."""

TP_SPLIT = frozenset(WEIGHTS) - {"loss_fwd", "loss_bwd"}
"""Op types whose work TP splits (the loss runs on the all-gathered logits on every TP rank)."""

OPTIMIZER_MS_PER_BLOCK = 0.15
"""The optimizer step, as a share of ``wait_ms_per_layer`` per one (unsplit) layer's worth of
parameters updated."""


def base_ms(cfg: JobConfig) -> dict[str, float]:
    """The base duration (ms) of every per-micro-batch op type for `cfg`, and
    ``optimizer_step``'s per one unsplit layer's worth of parameters (see `Durations.optimizer`)."""
    out = {
        op: w * cfg.wait_ms_per_layer / (cfg.tp if op in TP_SPLIT else 1)
        for op, w in WEIGHTS.items()
    }
    out["optimizer_step"] = OPTIMIZER_MS_PER_BLOCK * cfg.wait_ms_per_layer
    return out


def _lognormal_mean_one(rng: random.Random, sigma: float) -> float:
    return rng.lognormvariate(-sigma * sigma / 2, sigma) if sigma > 0 else 1.0


class Durations:
    """The sleeps of one rank of a wait-mode job."""

    def __init__(self, cfg: JobConfig, rank: int) -> None:
        """Draw the rank's persistent speed factor (from ``seed`` and `rank` only)."""
        self.cfg = cfg
        self.rank = rank
        self.base_ms = base_ms(cfg)
        self.rank_factor = _lognormal_mean_one(
            random.Random(f"prism-wait:{cfg.seed}:rank:{rank}"), cfg.rank_jitter
        )
        self.straggler = cfg.straggler_factor if cfg.is_straggler(rank) else 1.0
        self._sigma = math.sqrt(math.log1p(cfg.wait_cv**2))

    def _scaled(self, ms: float, step: int, mb: int, op: str, layer: int) -> float:
        rng = random.Random(f"prism-wait:{self.cfg.seed}:{self.rank}:{step}:{mb}:{op}:{layer}")
        noise = _lognormal_mean_one(rng, self._sigma)
        return ms / 1e3 * self.rank_factor * self.straggler * noise

    def seconds(self, op: str, *, step: int, mb: int, layer: int = -1) -> float:
        """The sleep of one call of per-micro-batch op type `op` (of global layer `layer`)."""
        return self._scaled(self.base_ms[op], step, mb, op, layer)

    def optimizer_base_ms(self, numel: int, block_numel: int) -> float:
        """The optimizer step's base (ms) for updating `numel` parameters, where one unsplit
        layer has `block_numel`."""
        return self.base_ms["optimizer_step"] * numel / block_numel

    def optimizer(self, *, step: int, numel: int, block_numel: int) -> float:
        """The sleep of the optimizer step of `step` (see `optimizer_base_ms`)."""
        ms = self.optimizer_base_ms(numel, block_numel)
        return self._scaled(ms, step, -1, "optimizer_step", -1)

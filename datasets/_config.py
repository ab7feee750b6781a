"""The generated job's configuration (`JobConfig`): layout, model, schedule, batch, compute mode.

It is what ``run.json`` stores under ``config`` and what the ladder compares to decide whether a
recording is already cached, so every field is plain JSON and ``JobConfig(**d)`` (with the model
rebuilt) restores it; fields added later have defaults that give the earlier job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from prism_trace.datasets._comm import Layout
from prism_trace.datasets._model import ModelConfig
from prism_trace.datasets._schedule import SCHEDULES, Schedule

__all__ = [
    "ALL_RANKS",
    "COMPUTE_MODES",
    "DEVICES",
    "LATER_FIELDS",
    "Compute",
    "Device",
    "JobConfig",
    "microbatches_for",
]

ALL_RANKS = -2
"""``JobConfig.straggler_rank`` for "every rank sleeps" (``--straggler all@SECONDS``)."""

Compute = Literal["real", "wait"]
COMPUTE_MODES: tuple[Compute, ...] = ("real", "wait")

Device = Literal["cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("cpu", "cuda")
"""Where the ranks compute (``--device``; ``datasets._device``)."""


def microbatches_for(global_batch: int, *, dp: int, microbatch_size: int) -> int:
    """Micro-batches per rank for a fixed global batch: ``global_batch / (dp * microbatch_size)``.

    Raises:
        ValueError: (one line) the global batch does not split evenly, or into none.
    """
    per_step = dp * microbatch_size
    if global_batch < 1 or global_batch % per_step:
        msg = (
            f"global batch {global_batch} is not a positive multiple of"
            f" dp x microbatch-size = {dp} x {microbatch_size} = {per_step}"
        )
        raise ValueError(msg)
    return global_batch // per_step


LATER_FIELDS: dict[str, object] = {"device": "cpu", "dp_sync_always": False, "chunks": 1}
"""Fields added after the bundled sample, with their defaults: `JobConfig.to_json` leaves them
out there."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Everything that defines a generated run.

    ``straggler_rank >= 0`` makes every rank call the ``prism::straggle`` op after each
    micro-batch forward; on that rank it sleeps ``straggler_s / microbatches`` seconds (so
    ``straggler_s`` per step), elsewhere it returns at once. The sleep is inside a profiled op, so
    the trace shows it as that rank's compute time; the same job with ``straggler_s = 0`` is the
    clean recording to compare with. ``straggler_rank = ALL_RANKS`` makes every rank sleep: with
    ``straggler_s = S / N`` that is the job whose every rank takes the mean (over N replicas) of
    one straggler's ``S``, the ground truth of what ``no-stragglers`` keeps by definition.
    ``straggler_spin`` busy-waits instead of sleeping (``straggle``). In wait mode
    ``straggler_factor`` (``--straggler RANK@xFACTOR``) makes the straggler's ops take FACTOR
    times as long instead.

    ``global_batch > 0`` fixes the batch of the whole job: ``microbatches`` is then
    ``global_batch / (dp * microbatch_size)`` (checked by `check`); 0 leaves ``microbatches`` per
    rank as given. ``zero = 1`` shards the optimizer state over the DP group (ZeRO-1).
    ``compute = "wait"`` replaces every compute op by a custom op that sleeps (``_waits``), with
    the ``wait_*`` and ``rank_jitter`` parameters. ``et = False`` records no execution trace.
    ``device = "cuda"`` runs the real model on the GPU (``datasets._device``).
    ``dp_sync_always`` synchronises the gradients over the DP group even at dp=1 (an all-reduce
    over one member): a 1-rank recording of the work every rank of a DP job does, which
    ``scripts/gpu-check`` compares with rank 0 of a dp=8 job under ``prism run``. These two are
    left out of `to_json` at their defaults (`LATER_FIELDS`), so a job without them has the
    ``run.json`` (and the ladder's cache key) it had before they existed.
    """

    dp: int = 2
    tp: int = 2
    pp: int = 2
    microbatches: int = 4
    microbatch_size: int = 2
    steps: int = 2
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: Literal["sgd", "adam"] = "adam"
    lr: float = 1e-3
    bucket_bytes: int = 256 * 1024
    seed: int = 0
    timeout_s: float = 60.0
    straggler_rank: int = -1
    straggler_s: float = 0.0
    straggler_spin: bool = False
    schedule: Schedule = "gpipe"
    global_batch: int = 0
    zero: int = 0
    compute: Compute = "real"
    wait_ms_per_layer: float = 20.0
    wait_cv: float = 0.05
    rank_jitter: float = 0.02
    straggler_factor: float = 1.0
    et: bool = True
    device: Device = "cpu"
    dp_sync_always: bool = False
    chunks: int = 1

    def _check_interleaved(self) -> None:
        """Interleaved 1F1B as Megatron runs it: at least 2 stages and 2 chunks, micro-batches a
        multiple of the stages, a layer for every virtual stage."""
        if self.pp < 2 or self.chunks < 2:
            msg = (
                "interleaved 1F1B needs pp >= 2 and --chunks >= 2,"
                f" got pp {self.pp}, chunks {self.chunks}"
            )
            raise ValueError(msg)
        if self.microbatches % self.pp:
            msg = (
                f"interleaved 1F1B needs micro-batches a multiple of pp {self.pp},"
                f" got {self.microbatches}"
            )
            raise ValueError(msg)
        if self.model.layers < self.pp * self.chunks:
            msg = f"{self.model.layers} layers cannot fill {self.pp * self.chunks} virtual stages"
            raise ValueError(msg)

    @property
    def layout(self) -> Layout:
        """The parallel layout (Megatron rank order)."""
        return Layout(tp=self.tp, dp=self.dp, pp=self.pp)

    @property
    def has_straggler(self) -> bool:
        """Whether a straggler (one rank, or all) is configured, even one of 0 s."""
        return self.straggler_rank >= 0 or self.straggler_rank == ALL_RANKS

    def is_straggler(self, rank: int) -> bool:
        """Whether `rank` is the (or a) configured straggler."""
        return self.straggler_rank in (rank, ALL_RANKS)

    def to_json(self) -> dict[str, object]:
        """Plain-JSON form of the config (`LATER_FIELDS` only where they are not the default)."""
        d = asdict(self)
        for name, default in LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobConfig:
        """The config of a ``run.json`` (`to_json`'s output, maybe from before a field existed)."""
        return cls(**{**d, "model": ModelConfig(**d["model"])})

    def check(self) -> None:
        """Raise ``ValueError`` (one line) when the job cannot run as configured.

        Called by ``generate`` before any rank starts.
        """
        self.model.check(tp=self.tp, pp=self.pp)
        if min(self.dp, self.tp, self.pp, self.microbatches, self.microbatch_size) < 1:
            msg = "dp, tp, pp, microbatches and microbatch-size must be at least 1"
            raise ValueError(msg)
        if self.global_batch:
            n = microbatches_for(
                self.global_batch, dp=self.dp, microbatch_size=self.microbatch_size
            )
            if n != self.microbatches:
                msg = (
                    f"global batch {self.global_batch} means {n} micro-batches per rank,"
                    f" not {self.microbatches}"
                )
                raise ValueError(msg)
        if self.schedule not in SCHEDULES:
            msg = f"unknown schedule {self.schedule!r}; expected one of {', '.join(SCHEDULES)}"
            raise ValueError(msg)
        if self.schedule == "interleaved":
            self._check_interleaved()
        elif self.chunks != 1:
            msg = f"--chunks {self.chunks} needs --schedule interleaved"
            raise ValueError(msg)
        if self.compute not in COMPUTE_MODES:
            msg = f"unknown compute {self.compute!r}; expected one of {', '.join(COMPUTE_MODES)}"
            raise ValueError(msg)
        if self.device not in DEVICES:
            msg = f"unknown device {self.device!r}; expected one of {', '.join(DEVICES)}"
            raise ValueError(msg)
        if self.device != "cpu" and self.compute != "real":
            msg = "--compute wait sleeps on the host: it runs with --device cpu only"
            raise ValueError(msg)
        if self.zero not in (0, 1):
            msg = f"zero stage {self.zero} is not supported; expected 0 or 1"
            raise ValueError(msg)
        if self.wait_ms_per_layer < 0 or self.wait_cv < 0 or self.rank_jitter < 0:
            msg = "wait-ms-per-layer, wait-cv and rank-jitter must not be negative"
            raise ValueError(msg)
        if self.straggler_factor <= 0:
            msg = f"straggler factor {self.straggler_factor:g} must be positive"
            raise ValueError(msg)
        if self.straggler_factor != 1.0 and self.compute != "wait":
            msg = "a straggler factor (RANK@xFACTOR) needs --compute wait"
            raise ValueError(msg)
        if self.straggler_rank >= self.layout.world:
            msg = (
                f"straggler rank {self.straggler_rank} is outside the world of {self.layout.world}"
            )
            raise ValueError(msg)

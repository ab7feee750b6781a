"""One rank of the generated job: GPipe over micro-batches, DP gradient all-reduce, profiling."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from prism_trace.datasets._comm import Comm, CommGroup, Layout, groups_metadata, new_groups
from prism_trace.datasets._model import ModelConfig, Stage, TensorParallel
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from prism_trace.profiling.scratch import ram_scratch_dir

__all__ = ["ALL_RANKS", "JobConfig", "run_rank"]

ALL_RANKS = -2
"""``JobConfig.straggler_rank`` for "every rank sleeps" (``--straggler all@SECONDS``)."""


@torch.library.custom_op("prism::straggle", mutates_args=())
def straggle(x: torch.Tensor, seconds: float, spin: bool) -> torch.Tensor:  # noqa: FBT001
    """A profiled op that takes ``seconds``: a straggler's slow compute (``--straggler``).

    It sleeps, or with ``spin`` busy-waits: on a host with fewer free cores than ranks a sleeping
    rank hands its core to the others, which then compute faster than in the clean recording
    (no GPU straggler does that); a spinning one keeps its core as slow compute would.
    """
    if seconds > 0 and spin:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    elif seconds > 0:
        time.sleep(seconds)
    return x.new_empty(0)


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
    ``straggler_spin`` busy-waits instead of sleeping (``straggle``).
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

    @property
    def layout(self) -> Layout:
        """The parallel layout (Megatron rank order)."""
        return Layout(tp=self.tp, dp=self.dp, pp=self.pp)

    def to_json(self) -> dict[str, object]:
        """Plain-JSON form of the config."""
        return asdict(self)


def kineto_path(out: Path, rank: int) -> Path:
    """The Kineto trace written by `rank`."""
    return out / f"rank{rank}.kineto.json.gz"


def et_path(out: Path, rank: int) -> Path:
    """The host execution trace written by `rank`."""
    return out / f"rank{rank}.et.json.gz"


def steps_path(out: Path, rank: int) -> Path:
    """The per-rank step timings, merged into ``run.json`` by the parent."""
    return out / f"rank{rank}.steps.json"


@dataclass
class _Rank:
    cfg: JobConfig
    rank: int
    comm: Comm
    tp: CommGroup
    dp: CommGroup
    pp: CommGroup
    stage: Stage
    optimizer: torch.optim.Optimizer

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.cfg.layout.coords(self.rank)

    def _batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Same tokens on every TP and PP rank of one DP replica.
        _, dp_rank, _ = self.coords
        m = self.cfg.model
        seed = ((self.cfg.seed * 1009 + dp_rank) * 1009 + step) * 1009 + mb
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(m.vocab, (self.cfg.microbatch_size, m.seq + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    def _peer(self, offset: int) -> int:
        tp_rank, dp_rank, pp_rank = self.coords
        return self.cfg.layout.rank(tp=tp_rank, dp=dp_rank, pp=pp_rank + offset)

    def train_step(self, step: int) -> float | None:
        """One GPipe step: all forwards, all backwards (reversed), DP grad sync, optimizer step.

        Returns:
            The mean loss on the last stage, None elsewhere.
        """
        cfg, m = self.cfg, self.cfg.model
        act_shape = (cfg.microbatch_size, m.seq, m.hidden)
        first, last = self.stage.first, self.stage.last
        inputs: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        losses: list[float] = []
        for mb in range(cfg.microbatches):
            tokens, targets = self._batch(step, mb)
            if first:
                x = tokens
            else:
                x = self.comm.recv(torch.empty(act_shape), self._peer(-1), self.pp)
                x.requires_grad_()
            y = self.stage(x)
            if cfg.straggler_rank >= 0 or cfg.straggler_rank == ALL_RANKS:
                mine = cfg.straggler_rank in (self.rank, ALL_RANKS)
                secs = cfg.straggler_s / cfg.microbatches if mine else 0.0
                straggle(y.detach(), secs, cfg.straggler_spin)
            if last:
                y = F.cross_entropy(y.reshape(-1, m.vocab), targets.reshape(-1)) / cfg.microbatches
                losses.append(y.item())
            else:
                self.comm.send(y.detach(), self._peer(1), self.pp)
            inputs.append(x)
            outputs.append(y)
        for x, y in zip(reversed(inputs), reversed(outputs), strict=True):
            if last:
                y.backward()
            else:
                dy = self.comm.recv(torch.empty(act_shape), self._peer(1), self.pp)
                torch.autograd.backward(y, dy)
            if not first:
                assert x.grad is not None
                self.comm.send(x.grad, self._peer(-1), self.pp)
        self._sync_grads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sum(losses) if last else None

    def _sync_grads(self) -> None:
        """Average gradients over DP in buckets of about `bucket_bytes`, last parameters first."""
        if self.cfg.dp == 1:
            return
        grads = [p.grad for p in reversed(list(self.stage.parameters())) if p.grad is not None]
        bucket: list[torch.Tensor] = []
        size = 0
        for i, g in enumerate(grads):
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= self.cfg.bucket_bytes or i == len(grads) - 1:
                flat = self.comm.all_reduce(_flatten_dense_tensors(bucket), self.dp)
                flat /= self.cfg.dp
                for g_, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                    g_.copy_(synced)
                bucket, size = [], 0


def _mine(groups: list[CommGroup], rank: int, desc: str) -> CommGroup:
    return next(g for g in groups if g.desc == desc and rank in g.ranks)


def run_rank(rank: int, cfg: JobConfig, out: Path, port: int) -> None:
    """Body of one spawned process: join the job, train `1 + steps` steps, profile the last `steps`.

    Writes `kineto_path`, `et_path` and `steps_path` for this rank.

    Args:
        rank: Global rank.
        cfg: The job.
        out: Output directory.
        port: TCP port of the rendezvous on 127.0.0.1.
    """
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    layout = cfg.layout
    timeout = timedelta(seconds=cfg.timeout_s)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=layout.world,
        timeout=timeout,
    )
    try:
        groups = new_groups(layout, timeout=timeout)
        tp_rank, dp_rank, pp_rank = layout.coords(rank)
        comm = Comm()
        tp = _mine(groups, rank, "tp")
        stage = Stage(
            cfg.model,
            stage=pp_rank,
            stages=cfg.pp,
            tp=TensorParallel(rank=tp_rank, size=cfg.tp, group=tp, comm=comm),
        )
        optimizer: torch.optim.Optimizer
        if cfg.optimizer == "adam":  # fused: one op per step keeps the trace small
            optimizer = torch.optim.Adam(stage.parameters(), lr=cfg.lr, fused=True)
        else:
            optimizer = torch.optim.SGD(stage.parameters(), lr=cfg.lr)
        dp, pp = _mine(groups, rank, "dp"), _mine(groups, rank, "pp")
        r = _Rank(cfg, rank, comm, tp, dp, pp, stage, optimizer)
        # The observer writes its uncompressed trace to a temporary file (gzipped into `out` at
        # the end): in RAM when it can, as disk writes stall the profiled ops at random.
        tempfile.tempdir = str(ram_scratch_dir() or tempfile.gettempdir())
        et = torch.profiler.ExecutionTraceObserver().register_callback(str(et_path(out, rank)))
        kineto = str(kineto_path(out, rank))
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            record_shapes=True,
            profile_memory=True,
            with_stack=False,
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=cfg.steps, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(kineto),
            execution_trace_observer=et,
        )
        prof.preset_metadata_json("prism_groups", groups_metadata(groups))
        coords = {"rank": rank, "tp_rank": tp_rank, "dp_rank": dp_rank, "pp_rank": pp_rank}
        prof.preset_metadata_json(
            "prism_layout", json.dumps({"tp": cfg.tp, "dp": cfg.dp, "pp": cfg.pp, **coords})
        )
        steps = []
        with prof:  # exiting also finalizes (gzips) the execution trace
            for step in range(1 + cfg.steps):
                start_unix_ns = time.time_ns()
                t0 = time.perf_counter_ns()
                loss = r.train_step(step)
                dur_ns = time.perf_counter_ns() - t0
                steps.append(
                    {
                        "step": step,
                        "profiled": step >= 1,
                        "start_unix_ns": start_unix_ns,
                        "dur_ns": dur_ns,
                        "loss": loss,
                    }
                )
                prof.step()
        steps_path(out, rank).write_text(json.dumps({"rank": rank, **coords, "steps": steps}))
        comm.barrier(_mine(groups, rank, "world"))
    finally:
        dist.destroy_process_group()

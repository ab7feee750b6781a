"""Where a generated rank computes (``--device cpu|cuda``): its torch device, process-group backend,
profiler activities and device-memory peak.

The default, ``cpu``, keeps every call exactly as the generator has always made it (no
``device=`` argument anywhere: the host execution trace records a call's arguments, and the
bundled sample and ladder recordings must stay what they are). ``cuda`` puts the model, the
batches and every received buffer on the rank's GPU and profiles CUDA activity too.

Backend on CUDA: NCCL when every rank has a GPU of its own; with more ranks than GPUs (two ranks
on the one GPU of a test machine) NCCL refuses (two ranks on one device), so gloo, whose
collectives stage CUDA tensors through host memory. gloo's send and receive read the tensor's
memory directly (host memory only), so a pipeline (pp > 1) on gloo is refused on CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from prism_trace.datasets._config import JobConfig

__all__ = ["backend_for", "check_device", "profiler_activities", "rank_device"]


def backend_for(cfg: JobConfig) -> str:
    """The process-group backend of the job: gloo on CPU; NCCL on CUDA when every rank has a GPU
    of its own, gloo (CUDA tensors staged through the host) when ranks share one."""
    if cfg.device != "cuda":
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= cfg.layout.world else "gloo"


def check_device(cfg: JobConfig) -> None:
    """Raise ``ValueError`` (one line) when this machine cannot run the job on ``cfg.device``.

    Called by ``generate`` before any rank starts (``JobConfig.check`` holds the rules that do
    not depend on the machine).
    """
    if cfg.device != "cuda":
        return
    if not torch.cuda.is_available():
        msg = "--device cuda: no CUDA device is available to this torch"
        raise ValueError(msg)
    if cfg.pp > 1 and backend_for(cfg) == "gloo":
        msg = (
            f"--device cuda with pp={cfg.pp} on {torch.cuda.device_count()} GPU(s): the ranks"
            " share a GPU, so they talk through gloo, whose send/recv take host memory only;"
            " use pp=1 or one GPU per rank (NCCL)"
        )
        raise ValueError(msg)


def rank_device(cfg: JobConfig, rank: int) -> torch.device | None:
    """The device of `rank`'s tensors: None on CPU (calls keep their default device, as they
    always have), else its GPU (``rank % device_count``), made the current device."""
    if cfg.device != "cuda":
        return None
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def profiler_activities(cfg: JobConfig) -> list[torch.profiler.ProfilerActivity]:
    """What the rank's profiler records: the host ops, and on CUDA the kernels and copies."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cfg.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts

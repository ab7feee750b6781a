"""One rank of the generated job: process groups, its stage's work, the profiled step loop."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from prism_trace.datasets._comm import Comm, CommGroup, groups_metadata, new_groups
from prism_trace.datasets._device import backend_for, profiler_activities, rank_device
from prism_trace.datasets._interleaved import stage_plan
from prism_trace.datasets._measure import max_rss_kb, peak_allocated
from prism_trace.datasets._model import TensorParallel
from prism_trace.datasets._ops import STATS
from prism_trace.datasets._pipeline import Neighbours, run_step
from prism_trace.datasets._real import RealStage
from prism_trace.datasets._wait import WaitStage

from prism_trace.profiling.scratch import ram_scratch_dir

if TYPE_CHECKING:
    from prism_trace.datasets._config import JobConfig

__all__ = ["et_path", "kineto_path", "run_rank", "steps_path"]


def kineto_path(out: Path, rank: int) -> Path:
    """The Kineto trace written by `rank`."""
    return out / f"rank{rank}.kineto.json.gz"


def et_path(out: Path, rank: int) -> Path:
    """The host execution trace written by `rank`."""
    return out / f"rank{rank}.et.json.gz"


def steps_path(out: Path, rank: int) -> Path:
    """The per-rank step timings, merged into ``run.json`` by the parent."""
    return out / f"rank{rank}.steps.json"


def _mine(groups: list[CommGroup], rank: int, desc: str) -> CommGroup:
    return next(g for g in groups if g.desc == desc and rank in g.ranks)


def run_rank(rank: int, cfg: JobConfig, out: Path, port: int) -> None:
    """Body of one spawned process: join the job, train `1 + steps` steps, profile the last `steps`.

    Writes `kineto_path`, `et_path` (unless ``cfg.et`` is off) and `steps_path` for this rank.

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
    device = rank_device(cfg, rank)
    dist.init_process_group(
        backend_for(cfg),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=layout.world,
        timeout=timeout,
    )
    try:
        groups = new_groups(layout, timeout=timeout)
        tp_rank, dp_rank, pp_rank = layout.coords(rank)
        comm = Comm()
        tp, dp, pp = (_mine(groups, rank, axis) for axis in ("tp", "dp", "pp"))
        work: RealStage | WaitStage
        if cfg.compute == "wait":
            work = WaitStage(cfg, rank, comm=comm, tp=tp, dp=dp)
        else:
            tp_info = TensorParallel(rank=tp_rank, size=cfg.tp, group=tp, comm=comm)
            work = RealStage(cfg, rank, comm=comm, tp=tp_info, dp=dp, device=device)
        plan = stage_plan(
            cfg.schedule,
            stage=pp_rank,
            stages=cfg.pp,
            microbatches=cfg.microbatches,
            chunks=cfg.chunks,
        )
        ring = cfg.chunks > 1  # interleaved: the last stage feeds the first stage's next chunk
        prev, nxt = pp_rank - 1, pp_rank + 1
        neighbours = Neighbours(
            pp,
            layout.rank(tp=tp_rank, dp=dp_rank, pp=prev % cfg.pp) if prev >= 0 or ring else -1,
            layout.rank(tp=tp_rank, dp=dp_rank, pp=nxt % cfg.pp) if nxt < cfg.pp or ring else -1,
        )
        act_shape = (cfg.microbatch_size, cfg.model.seq, cfg.model.hidden)
        et = None
        if cfg.et:
            # The observer writes its uncompressed trace to a temporary file (gzipped into `out`
            # at the end): in RAM when it can, as disk writes stall the profiled ops at random.
            tempfile.tempdir = str(ram_scratch_dir() or tempfile.gettempdir())
            et = torch.profiler.ExecutionTraceObserver().register_callback(str(et_path(out, rank)))
        kineto = str(kineto_path(out, rank))
        prof = torch.profiler.profile(
            activities=profiler_activities(cfg),
            record_shapes=True,
            profile_memory=True,
            with_stack=False,
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=cfg.steps, repeat=1),
            on_trace_ready=lambda _: None,  # written below, once every rank is done
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
                STATS.reset()
                if device is not None and step == 1:  # the device peak of the profiled steps
                    torch.cuda.reset_peak_memory_stats()
                start_unix_ns = time.time_ns()
                t0 = time.perf_counter_ns()
                cpu0 = time.process_time_ns()
                loss = run_step(
                    work,
                    plan,
                    step=step,
                    comm=comm,
                    pp=neighbours,
                    act_shape=act_shape,
                    device=device,
                )
                if device is not None:  # the step ends when its kernels have run
                    torch.cuda.synchronize()
                dur_ns = time.perf_counter_ns() - t0
                cpu_ns = time.process_time_ns() - cpu0
                record: dict[str, object] = {
                    "step": step,
                    "profiled": step >= 1,
                    "start_unix_ns": start_unix_ns,
                    "dur_ns": dur_ns,
                    "cpu_ns": cpu_ns,
                    "loss": loss,
                }
                if cfg.compute == "wait":
                    record["sleep_requested_ns"] = round(STATS.requested_s * 1e9)
                    record["sleep_ns"] = round(STATS.slept_s * 1e9)
                steps.append(record)
                if step == cfg.steps:
                    _yield_cpu()
                prof.step()
            cuda_peak = int(torch.cuda.max_memory_allocated()) if device is not None else None
            # No rank writes anything (the execution trace's gzip on exit, the Kineto trace)
            # while another is still in its profiled steps; the profiler records nothing now.
            comm.barrier(_mine(groups, rank, "world"))
        prof.export_chrome_trace(kineto)
        rank_record: dict[str, object] = {**coords, "steps": steps, "max_rss_kb": max_rss_kb()}
        rank_record["peak_allocated_bytes"] = peak_allocated(kineto_path(out, rank), cfg.device)
        if cuda_peak is not None:
            rank_record["cuda_max_allocated_bytes"] = cuda_peak
        rank_record["state_bytes"] = work.state_bytes()
        if isinstance(work, WaitStage):
            rank_record["wait"] = {
                "rank_factor": work.durations.rank_factor,
                "straggler_factor": work.durations.straggler,
                "optimizer_base_ms": work.optimizer_base_ms(),
            }
        steps_path(out, rank).write_text(json.dumps(rank_record))
        comm.barrier(_mine(groups, rank, "world"))
    finally:
        dist.destroy_process_group()


def _yield_cpu() -> None:
    """Run the rest of this rank's profiled window (its profiler's stop) only on CPU time that no
    other process wants: every thread of the process at ``SCHED_IDLE`` (else nice 19).

    Why: the ``prof.step()`` after the last profiled step stops the profiler (and used to write
    the trace), seconds of CPU for a rank that has finished while the other ranks are still in
    that step. With more ranks than cores (a wait-mode ladder: 64 ranks on 2 cores) that work took
    their CPU and stretched their last step (+18 % at dp 32 and +3 % at dp 16 with recorder 1, by
    the per-step means of the recordings' ``iteration`` table; the ladder's summary prints it as
    ``last step``). The traces are now written after a barrier of every rank
    (``run_rank``). Where the policy cannot change, the recording goes on as before.
    """
    tasks = Path("/proc/self/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            continue
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)

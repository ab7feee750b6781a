"""Generate a profiled multi-rank training run on CPU (gloo), or on CUDA, as a prism-trace dataset.

Run as::

    python -m prism_trace.datasets.generate --dp 2 --tp 2 --pp 2 --microbatches 4 --steps 3 \
        --out DIR

Each rank writes ``rank{r}.kineto.json.gz`` (Kineto trace of the profiled steps) and
``rank{r}.et.json.gz`` (host execution trace of the same steps); ``run.json`` holds the config
and every rank's measured step times and peak memory (ground truth for validation).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp
from prism_trace.datasets._config import (
    ALL_RANKS,
    COMPUTE_MODES,
    DEVICES,
    JobConfig,
    microbatches_for,
)
from prism_trace.datasets._device import backend_for, check_device
from prism_trace.datasets._durations import base_ms
from prism_trace.datasets._measure import PssSampler
from prism_trace.datasets._model import ModelConfig
from prism_trace.datasets._schedule import SCHEDULES
from prism_trace.datasets._train import run_rank, steps_path

__all__ = [
    "RECORDER_VERSION",
    "add_job_arguments",
    "generate",
    "job_config",
    "join_timeout_s",
    "main",
]

RECORDER_VERSION = 4
"""What a recording's ``run.json`` says of the recorder, so that a ladder re-records what an older
recorder made (``datasets.ladder``): 2, a rank that has finished its profiled steps stops its
profiler at nice 19; 3, every thread of it at ``SCHED_IDLE`` (``_train._yield_cpu``); 4, and
writes its traces only once every rank has left its profiled steps."""

PEAK_MEMORY = (
    "peak_allocated_bytes: the largest 'Total Allocated' of the Kineto trace's [memory] events"
    " within the profiled steps (bytes allocated since the profiler started recording and not"
    " yet freed; not the parameters or optimizer state allocated before)"
)


CUDA_PEAK_MEMORY = (
    "--device cuda: peak_allocated_bytes reads the GPU allocator's [memory] events only, whose"
    " totals are absolute (parameters and optimizer state included); cuda_max_allocated_bytes is"
    " torch.cuda.max_memory_allocated() over the profiled steps (reset before step 1); each"
    " step's dur_ns ends after torch.cuda.synchronize()"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_method(config: JobConfig) -> str:
    """``spawn`` for real compute, as always; ``forkserver`` for wait mode.

    A spawned rank imports torch on its own: about 3 s of CPU and 100+ MB of private memory each,
    which is what limits a many-rank wait-mode job on a few cores. The fork server imports the
    rank's module (and torch) once and forks every rank from it, so the ranks start in well under
    a second each and share the imported pages until they write to them.
    """
    if config.compute != "wait":
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload([run_rank.__module__])
    return "forkserver"


def _run_record(config: JobConfig, ranks: list[dict[str, object]]) -> dict[str, object]:
    run: dict[str, object] = {
        "config": config.to_json(),
        "world_size": config.layout.world,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "backend": backend_for(config),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "schedule": config.schedule,
        "compute": config.compute,
        "global_batch": config.global_batch or None,
        "zero": config.zero,
        "profiled_steps": "steps 1..steps; step 0 is the profiler warm-up and is not traced",
        "peak_memory": PEAK_MEMORY,
        "recorder": RECORDER_VERSION,
    }
    if config.device == "cuda":
        run["cuda_device"] = torch.cuda.get_device_name()
        run["cuda_version"] = torch.version.cuda
        run["cuda_peak_memory"] = CUDA_PEAK_MEMORY
    if config.compute == "wait":
        run["wait"] = {
            "ms_per_layer": config.wait_ms_per_layer,
            "cv": config.wait_cv,
            "rank_jitter": config.rank_jitter,
            "straggler_factor": config.straggler_factor,
            "base_ms": base_ms(config),
            "base_ms_note": "per micro-batch and call at this tp; optimizer_step per one unsplit"
            " layer's parameters updated (each rank's own is ranks[].wait.optimizer_base_ms)",
        }
    run["ranks"] = ranks
    return run


def generate(out: Path, config: JobConfig, *, join_timeout_s: float = 300.0) -> Path:
    """Run the job described by `config` with one process per rank and write its traces to `out`.

    Args:
        out: Output directory (created if missing).
        config: The job.
        join_timeout_s: Give up, killing all ranks, if the job has not finished after this long.

    Returns:
        The path of the written ``run.json``.

    Raises:
        ValueError: The job cannot run as ``config`` says (checked before any rank starts).
        RuntimeError: A rank failed, or the job did not finish in time.
    """
    try:
        config.check()
        check_device(config)
    except ValueError as exc:
        msg = f"{out}: {exc}"
        raise ValueError(msg) from None
    out.mkdir(parents=True, exist_ok=True)
    world = config.layout.world
    t0 = time.perf_counter()
    ctx = mp.start_processes(
        run_rank,
        args=(config, out, _free_port()),
        nprocs=world,
        join=False,
        start_method=_start_method(config),
    )
    deadline = time.monotonic() + join_timeout_s
    pss = PssSampler()
    pids = [p.pid for p in ctx.processes if p.pid is not None]
    try:
        while not ctx.join(timeout=1.0):
            pss.sample(pids)
            if time.monotonic() > deadline:
                msg = f"{out}: job of {world} ranks did not finish within {join_timeout_s:g} s"
                raise RuntimeError(msg)
    except mp.ProcessRaisedException as exc:
        msg = f"{out}: rank {exc.error_index} failed:\n{exc}"
        raise RuntimeError(msg) from exc
    except mp.ProcessExitedException as exc:
        msg = f"{out}: rank {exc.error_index} exited with code {exc.exit_code}"
        raise RuntimeError(msg) from exc
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    ranks = []
    for r in range(world):
        path = steps_path(out, r)
        ranks.append(json.loads(path.read_text()))
        path.unlink()
    run = _run_record(config, ranks)
    run["wall_s"] = round(time.perf_counter() - t0, 2)
    run["peak_pss_kb"] = pss.peak_kb
    path = out / "run.json"
    path.write_text(json.dumps(run, indent=1) + "\n")
    return path


def add_job_arguments(p: argparse.ArgumentParser, *, layout: bool = True) -> None:
    """Add the options that define a job (all but ``--out``); `layout` adds dp, tp and pp."""
    d, m = JobConfig(), ModelConfig()
    names = ("dp", "tp", "pp") if layout else ()
    for name in (*names, "microbatches", "microbatch_size", "steps", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("vocab", "hidden", "heads", "layers", "seq"):
        p.add_argument(f"--{name}", type=int, default=getattr(m, name))
    p.add_argument("--optimizer", choices=["sgd", "adam"], default=d.optimizer)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--bucket-bytes", type=int, default=d.bucket_bytes)
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="per-collective timeout")
    p.add_argument(
        "--straggler",
        metavar="RANK@SECONDS",
        default=None,
        help="rank RANK sleeps SECONDS per step inside its forward compute (prism::straggle);"
        " RANK@0 records the same job without the sleep, all@SECONDS makes every rank sleep;"
        " with --compute wait, RANK@xFACTOR makes RANK's ops take FACTOR times as long",
    )
    p.add_argument(
        "--straggler-spin",
        action="store_true",
        help="the straggler busy-waits instead of sleeping: it keeps its core, as slow compute"
        " would, where ranks outnumber the host's free cores",
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=d.schedule,
        help="pipeline schedule: all forwards then all backwards, Megatron's 1F1B, or its"
        " interleaved 1F1B (--chunks model chunks a stage; wait mode)",
    )
    p.add_argument(
        "--chunks",
        type=int,
        default=d.chunks,
        help="model chunks a stage (virtual pipeline stages) of --schedule interleaved",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="G",
        help="fixed global batch: micro-batches per rank = G / (dp * microbatch-size)"
        " (replaces --microbatches)",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=[0, 1],
        default=d.zero,
        help="1: ZeRO-1, optimizer state sharded over the DP group",
    )
    p.add_argument(
        "--compute",
        choices=COMPUTE_MODES,
        default=d.compute,
        help="real: the model's math; wait: one sleeping custom op per compute op",
    )
    p.add_argument(
        "--wait-ms-per-layer",
        type=float,
        default=d.wait_ms_per_layer,
        help="wait mode: ms of one layer's forward for one micro-batch at tp=1",
    )
    p.add_argument(
        "--wait-cv",
        type=float,
        default=d.wait_cv,
        help="wait mode: coefficient of variation of each call's lognormal noise",
    )
    p.add_argument(
        "--rank-jitter",
        type=float,
        default=d.rank_jitter,
        help="wait mode: sigma of each rank's persistent lognormal speed factor",
    )
    p.add_argument("--no-et", action="store_true", help="record no host execution trace")
    p.add_argument(
        "--dp-sync-always",
        action="store_true",
        help="all-reduce the gradients over the DP group even at dp=1 (one member): the work"
        " each rank of a DP job does, recorded on one rank",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default=d.device,
        help="cuda: the model, batches and messages on the GPU, CUDA activity profiled; NCCL"
        " with a GPU per rank, else gloo (staged through the host; pp=1 only)",
    )


def _straggler(text: str | None) -> tuple[int, float, float] | None:
    """(rank, seconds, factor) of a ``--straggler`` value, (-1, 0, 1) for none; None if bad."""
    if text is None:
        return -1, 0.0, 1.0
    rank_text, at, value = text.partition("@")
    factor = value.startswith("x")
    try:
        rank = ALL_RANKS if rank_text == "all" else max(int(rank_text), -1)
        number = float(value[1:] if factor else value)
    except ValueError:
        return None
    if not at or (rank < 0 and rank != ALL_RANKS) or number < 0 or (factor and number <= 0):
        return None
    return (rank, 0.0, number) if factor else (rank, number, 1.0)


def job_config(
    p: argparse.ArgumentParser, a: argparse.Namespace, *, dp: int, tp: int, pp: int
) -> JobConfig:
    """The `JobConfig` of parsed `add_job_arguments` options at the given layout; a bad value
    ends the program through ``p.error`` (one line)."""
    straggler = _straggler(a.straggler)
    if straggler is None:
        p.error(
            f"--straggler {a.straggler!r}: expected RANK@SECONDS, all@SECONDS or RANK@xFACTOR,"
            " e.g. 1@0.5"
        )
    s_rank, s_secs, s_factor = straggler
    model = replace(
        ModelConfig(), vocab=a.vocab, hidden=a.hidden, heads=a.heads, layers=a.layers, seq=a.seq
    )
    microbatches, global_batch = a.microbatches, 0
    if a.global_batch is not None:
        try:
            microbatches = microbatches_for(
                a.global_batch, dp=dp, microbatch_size=a.microbatch_size
            )
        except ValueError as exc:
            p.error(f"--global-batch: {exc}")
        global_batch = a.global_batch
    config = JobConfig(
        dp=dp,
        tp=tp,
        pp=pp,
        microbatches=microbatches,
        microbatch_size=a.microbatch_size,
        steps=a.steps,
        model=model,
        optimizer=a.optimizer,
        lr=a.lr,
        bucket_bytes=a.bucket_bytes,
        seed=a.seed,
        timeout_s=a.timeout_s,
        straggler_rank=s_rank,
        straggler_s=s_secs,
        straggler_spin=a.straggler_spin,
        schedule=a.schedule,
        chunks=a.chunks,
        global_batch=global_batch,
        zero=a.zero,
        compute=a.compute,
        wait_ms_per_layer=a.wait_ms_per_layer,
        wait_cv=a.wait_cv,
        rank_jitter=a.rank_jitter,
        straggler_factor=s_factor,
        et=not a.no_et,
        device=a.device,
        dp_sync_always=a.dp_sync_always,
    )
    try:
        config.model.check(tp=config.tp, pp=config.pp)
    except ValueError as exc:
        p.error(str(exc))
    if s_rank >= config.layout.world:
        p.error(f"--straggler rank {s_rank} is outside the world of {config.layout.world} ranks")
    try:
        config.check()
    except ValueError as exc:
        p.error(str(exc))
    return config


def _parse(argv: list[str] | None) -> tuple[Path, JobConfig]:
    p = argparse.ArgumentParser(
        prog="python -m prism_trace.datasets.generate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    add_job_arguments(p)
    a = p.parse_args(argv)
    return a.out, job_config(p, a, dp=a.dp, tp=a.tp, pp=a.pp)


def join_timeout_s(config: JobConfig) -> float:
    """How long the parent waits for a job: 4 collective timeouts, at least 120 s, and 3 s more
    per rank beyond 16 (each spawned rank imports torch; on a few cores that adds up)."""
    return max(120.0, 4 * config.timeout_s) + 3.0 * max(0, config.layout.world - 16)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    out, config = _parse(argv)
    t0 = time.perf_counter()
    path = generate(out, config, join_timeout_s=join_timeout_s(config))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 1e6:.2f} MB) in {time.perf_counter() - t0:.1f} s; see {path.name}")


if __name__ == "__main__":
    main()

"""Generate a profiled multi-rank training run on CPU (gloo) as a prism-trace dataset.

Run as::

    python -m prism_trace.datasets.generate --dp 2 --tp 2 --pp 2 --microbatches 4 --steps 3 \
        --out DIR

Each rank writes ``rank{r}.kineto.json.gz`` (Kineto trace of the profiled steps) and
``rank{r}.et.json.gz`` (host execution trace of the same steps); ``run.json`` holds the config
and every rank's measured step times (ground truth for validation).
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
from prism_trace.datasets._model import ModelConfig
from prism_trace.datasets._train import ALL_RANKS, JobConfig, run_rank, steps_path

__all__ = ["JobConfig", "ModelConfig", "generate", "main"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def generate(out: Path, config: JobConfig, *, join_timeout_s: float = 300.0) -> Path:
    """Run the job described by `config` with one process per rank and write its traces to `out`.

    Args:
        out: Output directory (created if missing).
        config: The job.
        join_timeout_s: Give up, killing all ranks, if the job has not finished after this long.

    Returns:
        The path of the written ``run.json``.

    Raises:
        ValueError: The model cannot be split as ``config`` says (checked before any rank starts).
        RuntimeError: A rank failed, or the job did not finish in time.
    """
    try:
        config.model.check(tp=config.tp, pp=config.pp)
    except ValueError as exc:
        msg = f"{out}: {exc}"
        raise ValueError(msg) from None
    out.mkdir(parents=True, exist_ok=True)
    world = config.layout.world
    ctx = mp.start_processes(
        run_rank,
        args=(config, out, _free_port()),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + join_timeout_s
    try:
        while not ctx.join(timeout=1.0):
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
    run = {
        "config": config.to_json(),
        "world_size": world,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "backend": "gloo",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "schedule": "gpipe",
        "profiled_steps": "steps 1..steps; step 0 is the profiler warm-up and is not traced",
        "ranks": ranks,
    }
    path = out / "run.json"
    path.write_text(json.dumps(run, indent=1) + "\n")
    return path


def _parse(argv: list[str] | None) -> tuple[Path, JobConfig]:
    d, m = JobConfig(), ModelConfig()
    p = argparse.ArgumentParser(
        prog="python -m prism_trace.datasets.generate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    for name in ("dp", "tp", "pp", "microbatches", "microbatch_size", "steps", "seed"):
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
        " RANK@0 records the same job without the sleep, all@SECONDS makes every rank sleep",
    )
    p.add_argument(
        "--straggler-spin",
        action="store_true",
        help="the straggler busy-waits instead of sleeping: it keeps its core, as slow compute"
        " would, where ranks outnumber the host's free cores",
    )
    a = p.parse_args(argv)
    s_rank, s_secs = -1, 0.0
    if a.straggler is not None:
        rank_text, at, secs_text = a.straggler.partition("@")
        try:
            s_rank = ALL_RANKS if rank_text == "all" else max(int(rank_text), -1)
            s_secs = float(secs_text)
        except ValueError:
            s_rank = -1
        if not at or (s_rank < 0 and s_rank != ALL_RANKS) or s_secs < 0:
            p.error(
                f"--straggler {a.straggler!r}: expected RANK@SECONDS or all@SECONDS, e.g. 1@0.5"
            )
    model = replace(m, vocab=a.vocab, hidden=a.hidden, heads=a.heads, layers=a.layers, seq=a.seq)
    config = JobConfig(
        dp=a.dp,
        tp=a.tp,
        pp=a.pp,
        microbatches=a.microbatches,
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
    )
    try:
        config.model.check(tp=config.tp, pp=config.pp)
    except ValueError as exc:
        p.error(str(exc))
    if s_rank >= config.layout.world:
        p.error(f"--straggler rank {s_rank} is outside the world of {config.layout.world} ranks")
    return a.out, config


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    out, config = _parse(argv)
    t0 = time.perf_counter()
    path = generate(out, config, join_timeout_s=max(120.0, 4 * config.timeout_s))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 1e6:.2f} MB) in {time.perf_counter() - t0:.1f} s; see {path.name}")


if __name__ == "__main__":
    main()

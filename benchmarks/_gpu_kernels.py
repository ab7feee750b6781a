"""gpu-check's kernel recordings: a 1-rank job of back-to-back matrix products sized so that each
takes about a given time on the device, and the replay overhead measured on it.

``bench_replay.py`` measures the overhead on the generator's model, whose ops vary in size; a
GPU check needs kernels of a known length (about 10 µs: launch-bound territory, and about 1 ms),
so the job here is one op, ``aten::mm`` of two n x n float32 matrices, n chosen on the device by
timing it (`calibrate`). It is profiled as the generator profiles (Kineto with shapes and memory,
the host execution trace, one warm-up step then ``steps`` profiled ones, 1 CPU thread) and written
as ``rank0.kineto.json.gz`` / ``rank0.et.json.gz``, which ``prism ingest`` reads as rank 0.

Run by ``gpu_check.py`` in a process of its own (each sub-command prints one JSON object)::

    python benchmarks/_gpu_kernels.py record --device cuda --target-us 10 --ops 200 --out DIR
    python benchmarks/_gpu_kernels.py overhead --device cuda --db DB --run RUN --pairs 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

__all__ = ["calibrate", "main", "mm_seconds", "record"]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def mm_seconds(n: int, device: str, reps: int = 0) -> float:
    """Median seconds of one ``a @ b`` of n x n float32 matrices on `device` (after a warm-up);
    on CUDA each sample is a synchronised batch of calls, so launch and kernel overlap as they
    do back to back."""
    import torch

    a = torch.rand(n, n, device=device)
    b = torch.rand(n, n, device=device)
    for _ in range(3):
        torch.mm(a, b)
    _sync(device)
    t0 = time.perf_counter()
    torch.mm(a, b)
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    batch = max(1, min(200, int(2e-3 / one)))  # ~2 ms per sample
    reps = reps or 7
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            torch.mm(a, b)
        _sync(device)
        samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples)


def calibrate(device: str, target_s: float) -> tuple[int, float]:
    """The matrix size n (a multiple of 8) whose product takes closest to `target_s`, and its
    measured time: a doubling search, then up to four cube-root estimates from the closest size
    so far; whichever measured closest."""
    n, t = 8, mm_seconds(8, device)
    tried = {n: t}
    while t < target_s and n < 16384:
        n *= 2
        t = mm_seconds(n, device)
        tried[n] = t
    for _ in range(4):  # the cube-root estimate from the closest size so far
        near = min(tried, key=lambda k: abs(tried[k] - target_s))
        est = round(near * (target_s / tried[near]) ** (1 / 3) / 8) * 8
        est = min(max(est, 8), 16384)
        if est in tried:
            break
        tried[est] = mm_seconds(est, device)
    best = min(tried, key=lambda k: abs(tried[k] - target_s))
    return best, tried[best]


def record(out: Path, device: str, n: int, ops: int, steps: int) -> dict[str, Any]:
    """Profile ``1 + steps`` steps of `ops` products of n x n matrices on `device` into `out`."""
    import tempfile

    import torch
    from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile, schedule

    from prism_trace.profiling.scratch import ram_scratch_dir

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(ram_scratch_dir() or tempfile.gettempdir())
    a = torch.rand(n, n, device=device)
    b = torch.rand(n, n, device=device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    et = ExecutionTraceObserver().register_callback(str(out / "rank0.et.json.gz"))
    kineto = str(out / "rank0.kineto.json.gz")
    prof = profile(
        activities=acts,
        record_shapes=True,
        profile_memory=True,
        schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(kineto),
        execution_trace_observer=et,
    )
    step_ns = []
    with prof:
        for _ in range(1 + steps):
            t0 = time.perf_counter_ns()
            for _ in range(ops):
                torch.mm(a, b)
            _sync(device)
            step_ns.append(time.perf_counter_ns() - t0)
            prof.step()
    return {"n": n, "ops": ops, "steps": steps, "step_ms": [t / 1e6 for t in step_ns[1:]]}


def _overhead(a: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from bench_replay import _measure

    from prism_trace.store.connection import open_store

    with open_store(a.db) as store:
        none = _measure(store, a.run, 0, a.passes, pairs=a.pairs, device=a.device)
        gaps = None
        if a.recorded_gaps:
            gaps = _measure(store, a.run, 0, a.passes, gaps="recorded", device=a.device)
    return {"gaps_none": none, "gaps_recorded": gaps}


def main(argv: list[str] | None = None) -> None:
    """``record`` (calibrate, then profile the job) or ``overhead`` (replay it): one JSON line."""
    ap = argparse.ArgumentParser(prog="_gpu_kernels.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--device", choices=["cpu", "cuda"], required=True)
    rec.add_argument("--target-us", type=float, required=True)
    rec.add_argument("--ops", type=int, required=True, help="products per step")
    rec.add_argument("--steps", type=int, default=3)
    rec.add_argument("--out", type=Path, required=True)
    ov = sub.add_parser("overhead")
    ov.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ov.add_argument("--db", type=Path, required=True)
    ov.add_argument("--run", required=True)
    ov.add_argument("--passes", type=int, default=10)
    ov.add_argument("--pairs", type=int, default=40)
    ov.add_argument("--recorded-gaps", action="store_true", help="also with the recorded gaps")
    a = ap.parse_args(argv)
    if a.what == "record":
        import torch

        torch.set_num_threads(1)
        n, secs = calibrate(a.device, a.target_us * 1e-6)
        res = record(a.out, a.device, n, a.ops, a.steps)
        res["kernel_us"] = secs * 1e6
        res["target_us"] = a.target_us
    else:
        res = _overhead(a)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

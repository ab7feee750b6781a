"""Hybrid replay of one real rank: compile its program, run the passes, and gather the result
(its real communication agreed with the other real ranks when several run together)."""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from prism_trace.replay.hybrid.blas import blas_threads, hold_blas_workspaces
from prism_trace.replay.hybrid.frames import (
    _bare_pairs,
    _first_starts,
    _memory_in_pass,
    _memory_mapped,
    _pair_figures,
    _representative,
    _result,
)
from prism_trace.replay.hybrid.load import _RankInputs
from prism_trace.replay.hybrid.options import KernelReplayOptions, RankReplay
from prism_trace.replay.hybrid.passes import (
    _call_overhead,
    _device_map,
    _Driver,
    _gaps,
    _memory_events,
    _Pass,
    _profiler,
    _sleeps,
    _unit_times,
)
from prism_trace.replay.hybrid.real_comm import RealComm, agree, specs_for_rank
from prism_trace.replay.kernels.codegen import check_program, compile_pass
from prism_trace.replay.kernels.rebuild import build_program, external_buffers, make_externals
from prism_trace.replay.kernels.units import select_units
from prism_trace.replay.memory.lifetimes import hold, recorded_frees

from prism_trace.errors import RunStateError, UsageError
from prism_trace.profiling.scratch import ram_scratch_dir
from prism_trace.profiling.torch_profiler import profiling

__all__: list[str] = []


def _replay_rank(
    inputs: _RankInputs, options: KernelReplayOptions, real: list[int] | None = None
) -> RankReplay:
    """Replay one rank; ``real``: every rank of a multi-process replay (``torch.distributed``
    initialised, this process being ``real.index(inputs.rank)``), None when it runs alone."""
    import torch

    if options.device == "cuda" and not torch.cuda.is_available():
        msg = "--device cuda: no CUDA device is available to this torch"
        raise UsageError(msg)
    dev = _device_map(inputs.ops, options.device)
    comm_events = [c.event_id for c in inputs.schedule.calls if c.event_id is not None]
    units, skipped = select_units(inputs.ops, comm_events)
    if not any(u.kind == "compute" for u in units):
        msg = f"rank {inputs.source_rank}: no compute op to replay in its host ET"
        raise RunStateError(msg)
    program = build_program(units, inputs.ops, device=dev, skipped=skipped)
    externals = make_externals(program, dev, seed=options.seed)
    with torch.no_grad():
        bad = check_program(program, externals, dev)
    if bad:
        program = build_program(
            units,
            inputs.ops,
            device=dev,
            skipped=skipped,
            unsupported={**program.unsupported, **bad},
        )
        externals = make_externals(program, dev, seed=options.seed)
    if program.unsupported and not options.substitute_recorded:
        listed = ", ".join(f"{u.name} x{u.count} ({u.reason})" for u in program.unsupported_ops())
        msg = (
            f"rank {inputs.rank}: {len(program.unsupported)} of {program.compute_units} compute"
            f" ops cannot be rebuilt: {listed}; pass --substitute-recorded to use their recorded"
            " durations"
        )
        raise RunStateError(msg)
    if options.device == "cuda":  # the recording's per-thread cuBLAS workspaces, held again
        hold_blas_workspaces(
            blas_threads(inputs.ops), torch.device("cuda", torch.cuda.current_device())
        )
    rec_ts, rec_dur, rec_its = _unit_times(program, inputs)
    held: dict[int, int] = {}
    if options.recorded_lifetimes:
        held = recorded_frees(program, rec_ts, rec_dur, inputs.allocator)
        program = hold(program, held)
    gap, tail = _gaps(program, rec_ts, rec_dur, rec_its)
    use_gaps = options.gaps == "recorded"
    fn = compile_pass(program, gaps=use_gaps, device=dev)
    bare = None
    if options.bare_passes:
        bare = compile_pass(program, gaps=False, device=dev, timed=False)
    sync = torch.cuda.synchronize if options.device == "cuda" else None
    driver = _Driver(program, inputs.schedule, gap if use_gaps else None, tail, rec_dur, sync)
    if real is not None:
        driver.real = _real_comm(inputs.rank, real, driver.calls, options.device)
    driver.quiet_views = options.instrument == "profiler"
    driver.sleep = _sleeps(options, len(real) if real is not None else 1)
    driver.buffers = external_buffers(program, externals)
    # The copies every pass restores from live in host memory: on a GPU they would count in the
    # replay's peak, which the recording never held (+15 % on the first GPU run, an H200).
    driver.pristine = [b.to("cpu", copy=True) for b in driver.buffers]

    passes: list[_Pass] = []
    mem_rows = pl.DataFrame()
    peak: int | None = None
    gc_was = gc.isenabled()
    flush = torch.set_flush_denormal(True)  # random data must not take denormal slow paths
    # The instrumentation's trace files go to RAM when it can (prism_trace.profiling.scratch:
    # disk writes of the ET observer stall profiled ops at random).
    scratch = ram_scratch_dir()
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="prism-replay-", dir=scratch) as tmp:
        trace_dir = Path(tmp)
        for _ in range(options.warmup):
            driver.run(fn, externals)
            if bare is not None:
                driver.run_bare(bare, externals)
        pairs: list[tuple[_Pass, int]] = []
        calls = None
        if use_gaps and options.call_overhead and options.instrument == "profiler":
            calls = _call_overhead(driver, fn, externals, program, options, trace_dir)
            gap = np.maximum(gap - calls.per_unit, 0)
            driver.gap = gap.tolist()
        gc.collect()
        gc.disable()
        try:
            offset = time.time_ns() - time.perf_counter_ns()
            if options.instrument == "profiler":
                prof = _profiler(options, trace_dir, memory_only=False)
                with profiling(prof):
                    for _ in range(options.iterations):
                        passes.append(driver.run(fn, externals))
                mem = _memory_events(prof, trace_dir, options.device)
            else:
                for _ in range(options.iterations):
                    if options.device == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    passes.append(driver.run(fn, externals))
                if bare is not None:
                    pairs = _bare_pairs(driver, fn, bare, externals, options.bare_passes)
                mem = None
                if options.memory and options.device == "cpu":
                    prof = _profiler(options, trace_dir, memory_only=True)
                    with profiling(prof):
                        mem_pass = driver.run(fn, externals)
                    mem = _memory_events(prof, trace_dir, options.device)
        finally:
            if gc_was:
                gc.enable()
            if flush:
                torch.set_flush_denormal(False)
        rep = _representative(passes, program, together=real is not None)
        if options.instrument == "profiler":
            mem_rows, peak = (
                _memory_in_pass(mem, rep, offset) if mem is not None else (mem_rows, None)
            )
        elif mem is not None:
            mem_rows, peak = _memory_mapped(mem, mem_pass, rep, offset)
        elif options.device == "cuda" and options.memory:
            peak = int(torch.cuda.max_memory_allocated())
    origin = None
    if real is not None:  # one clock for all: the earliest replayed start on the earliest recorded
        import torch.distributed as dist

        starts: list[Any] = [None] * len(real)
        dist.all_gather_object(starts, _first_starts(inputs, program, rep))
        origin = min(r for r, _ in starts) - min(p for _, p in starts)
    result = _result(
        inputs,
        program,
        passes,
        rep,
        gap if use_gaps else None,
        tail,
        mem_rows,
        peak,
        options.device,
        origin,
    )
    result.real_calls = len(driver.real.ops) if driver.real is not None else 0
    result.support["held_by_recording"] = len(held)
    result.wait_lead_ns = driver.lead if use_gaps else 0
    _pair_figures(result, program, pairs)
    if calls is not None:
        result.call_overhead = {
            "ns_per_pass": int(calls.per_unit.sum()),
            "matched_units": calls.matched,
            "units": calls.units,
        }
    return result


def _real_comm(rank: int, real: list[int], calls: list[Any], device: str) -> RealComm:
    """This process's real communication, agreed with the other real ranks' processes."""
    import torch.distributed as dist

    specs = specs_for_rank([(k, c) for k, c in enumerate(calls) if c is not None], rank, real)
    every: list[Any] = [None] * len(real)
    dist.all_gather_object(every, specs)
    ops, subgroups = agree(dict(zip(real, every, strict=True)))
    return RealComm(rank, real, ops[rank], subgroups, device)

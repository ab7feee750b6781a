"""Hybrid replay: real kernels for a few ranks, virtual peers for the rest → a ``replayed`` run.

``replay_run`` takes a recorded or sliced run and the ranks to run for real. For each of them it
rebuilds the compute ops from the host ET (``replay.kernels``), executes them on the device, and
replays every communication call from the peers' schedule (``replay.peers``): no data moves to a
virtual peer; the call completes when the emulator's timeline of the same run says the peers
allow (``max(real arrival, peers' arrival) + transfer``), the replay clock being aligned with the
emulated one at each iteration start. The recorded host gaps between ops (Python and framework
time outside any op) are spent as recorded (``gaps="recorded"``), since replaying kernels cannot
reproduce them. The measured run is stored as kind ``replayed`` in the same schema. See
docs/replay.md for the rules and the measured accuracy and overhead.

torch is imported inside the functions that need it, never at module import. The work is split:
``hybrid.options`` (what is asked and returned), ``hybrid.load``, ``hybrid.passes`` (the pass
driver), ``hybrid.rank`` (one rank), ``hybrid.frames`` (its results), ``hybrid.write`` and
``hybrid.together`` (several ranks in processes of their own); this module is the entry point.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.hybrid.load import _load_rank, _source_of
from prism_trace.replay.hybrid.options import KernelReplayOptions, ReplayReport
from prism_trace.replay.hybrid.rank import _replay_rank
from prism_trace.replay.hybrid.together import _replay_together
from prism_trace.replay.hybrid.write import _write
from prism_trace.replay.peers import rank_schedule

from prism_trace.errors import UsageError
from prism_trace.store.write import claim_run_name

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["replay_run"]


def replay_run(
    store: Store,
    *,
    run: str,
    ranks: list[int],
    out_run: str,
    options: KernelReplayOptions | None = None,
    replace: bool = False,
    config: EmulationConfig | None = None,
) -> ReplayReport:
    """Replay ``ranks`` of ``run`` with real kernels and virtual peers; store a ``replayed`` run.

    Several selected ranks run together by default, one process each: their communication with
    each other goes through ``torch.distributed`` (``replay.hybrid.real_comm``), and every other
    rank is a virtual peer whose timing comes from the emulation of ``run``. With
    ``options.together=False`` (or one rank) they run in this process one after the other, each
    seeing the others as virtual peers too.

    Args:
        store: an open, writable store.
        run: a recorded or sliced run whose ranks (or their representatives) have host ETs.
        ranks: the ranks to replay for real.
        out_run: name of the new run (kind ``replayed``, parent ``run``).
        options: how to replay (``KernelReplayOptions``).
        replace: overwrite an existing replayed run of that name.
        config: the emulation config for the virtual peers.

    Returns:
        What was measured and written.

    Raises:
        PrismError: no such run or rank, a rank without host ET, ops that cannot be rebuilt
            (without ``substitute_recorded``), no CUDA device for ``device="cuda"``.
    """
    import torch

    t0 = time.perf_counter()
    options = options or KernelReplayOptions()
    if not ranks:
        msg = "replay needs at least one rank (--ranks)"
        raise UsageError(msg)
    if out_run == run:
        msg = f"{store.path}: --out-run {out_run!r} is the input run itself; choose a new name"
        raise UsageError(msg)
    if options.iterations < 1 or options.warmup < 0:
        msg = "--iterations must be >= 1 and --warmup >= 0"
        raise UsageError(msg)
    if options.bare_passes and (
        options.gaps != "none"
        or options.instrument != "none"
        or (options.together and len(ranks) > 1)
    ):
        msg = (
            "bare passes measure the instrumentation against the ops alone: they need"
            " gaps='none', instrument='none' and ranks replayed alone (together=False)"
        )
        raise UsageError(msg)
    # One transaction for the command: a graph built for a recorded run without one, the dp
    # what-if's temporary re-slice (deleted before the commit) and the replayed run commit
    # together, or a refusal at any point leaves the store as it was.
    with store.transaction():
        old_id = claim_run_name(store, out_run, replace=replace, over=("replayed",))
        run_id = store.require_run(run)
        _, source_run = _source_of(store, run_id)
        # One emulation; each rank replayed alone sees every other rank, selected or not, as
        # virtual.
        from prism_trace.replay.emulate.driver import emulate_in_memory

        config = config or EmulationConfig()
        res, iters = emulate_in_memory(store, run=run, config=config)
        together = options.together and len(ranks) > 1
        schedules = {
            r: rank_schedule(
                store, res, iters, run=run, rank=r, real=list(ranks) if together else [r]
            )
            for r in ranks
        }
        inputs = [_load_rank(store, run_id, source_run, r, schedules[r]) for r in ranks]
        t_load = time.perf_counter() - t0
        torch.manual_seed(options.seed)
        threads = torch.get_num_threads()
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        try:
            if together:
                results = _replay_together(inputs, options)
            else:
                results = [_replay_rank(i, options) for i in inputs]
        finally:
            torch.set_num_threads(threads)
        t_replay = time.perf_counter() - t0 - t_load
        device_name = torch.cuda.get_device_name() if options.device == "cuda" else "cpu"
        cfg = {
            "input_run": run,
            "ranks": list(ranks),
            # The resolved config, in the sections of `prism replay --config` (replay.config_file).
            "config": {
                "kernel_replay": options.as_dict(),
                **config.as_dict(),
            },
            "torch_version": torch.__version__,
            "per_rank": [r.as_dict() for r in results],
        }
        out_id = _write(
            store,
            input_run_id=run_id,
            source_run_id=source_run,
            out_run=out_run,
            old_id=old_id,
            results=results,
            config=cfg,
            device_name=device_name,
        )
    notes = []
    if together:
        n_real = sum(r.real_calls for r in results)
        backend = "nccl" if options.device == "cuda" else "gloo"
        notes.append(
            f"ranks ran together, one process each; {n_real} of their communication calls"
            f" (counted per rank) went through torch.distributed ({backend})"
        )
    elif len(ranks) > 1:
        notes.append(
            "ranks were replayed one after the other in one process; each sees the others as"
            " virtual peers"
        )
    return ReplayReport(
        run=out_run,
        run_id=out_id,
        input_run=run,
        device=device_name,
        options=options,
        ranks=results,
        seconds={
            "load": t_load,
            "replay": t_replay,
            "total": time.perf_counter() - t0,
        },
        notes=notes,
    )

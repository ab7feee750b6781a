"""Hybrid replay of several ranks together: one process each, talking through torch.distributed."""

from __future__ import annotations

import contextlib
import pickle
import tempfile
from pathlib import Path

from prism_trace.replay.hybrid.load import _RankInputs
from prism_trace.replay.hybrid.options import KernelReplayOptions, RankReplay
from prism_trace.replay.hybrid.rank import _replay_rank

from prism_trace.errors import PrismError, ProcessFailedError, UsageError

__all__: list[str] = []


_TOGETHER_TIMEOUT_S = 300
"""How long a real rank waits for the others in one ``torch.distributed`` call before the replay
fails (their calls are checked against each other first, so this only catches a dead process)."""


def _together_worker(index: int, tmp: str) -> None:
    """One real rank of a multi-process replay (``torch.multiprocessing.spawn`` target)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    d = Path(tmp)
    inputs, options, real = pickle.loads((d / f"inputs-{index}.pkl").read_bytes())
    try:
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        torch.manual_seed(options.seed)
        backend = "gloo"
        if options.device == "cuda":
            if torch.cuda.device_count() < len(real):
                msg = (
                    f"--device cuda with {len(real)} ranks together needs {len(real)} GPUs,"
                    f" {torch.cuda.device_count()} visible; replay them one by one instead"
                )
                raise UsageError(msg)
            torch.cuda.set_device(index)
            backend = "nccl"
        dist.init_process_group(
            backend,
            init_method=(d / "rendezvous").as_uri(),
            rank=index,
            world_size=len(real),
            timeout=timedelta(seconds=_TOGETHER_TIMEOUT_S),
        )
        try:
            result = _replay_rank(inputs, options, real=real)
        finally:
            dist.destroy_process_group()
        (d / f"result-{index}.pkl").write_bytes(pickle.dumps(result))
    except PrismError as e:
        (d / f"error-{index}.txt").write_text(str(e))
        with contextlib.suppress(Exception):  # its class too, where it survives pickling
            kept = pickle.dumps(e)
            pickle.loads(kept)
            (d / f"error-{index}.pkl").write_bytes(kept)
        raise SystemExit(1) from None
    except Exception as e:  # a crash of one rank: its one line, then the others are stopped
        (d / f"error-{index}.txt").write_text(f"rank {inputs.rank}: {type(e).__name__}: {e}")
        raise SystemExit(1) from None


def _replay_together(inputs: list[_RankInputs], options: KernelReplayOptions) -> list[RankReplay]:
    """Replay the ranks as processes that run together (one each) and talk for real."""
    import torch.multiprocessing as mp

    real = [i.rank for i in inputs]
    with tempfile.TemporaryDirectory(prefix="prism-replay-together-") as tmp:
        d = Path(tmp)
        for k, i in enumerate(inputs):
            (d / f"inputs-{k}.pkl").write_bytes(pickle.dumps((i, options, real)))
        try:
            mp.spawn(_together_worker, args=(tmp,), nprocs=len(inputs), join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            # The process that failed first has the cause; the others saw their peer vanish.
            first = d / f"error-{e.error_index}.txt"
            errors = [first] if first.exists() else sorted(d.glob("error-*.txt"))
            kept = errors[0].with_suffix(".pkl") if errors else None
            if kept is not None and kept.exists():  # a refusal: raised here as its own class
                raise pickle.loads(kept.read_bytes()) from None
            msg = errors[0].read_text() if errors else f"a replay process failed: {e}"
            raise ProcessFailedError(msg) from None
        return [pickle.loads((d / f"result-{k}.pkl").read_bytes()) for k in range(len(inputs))]

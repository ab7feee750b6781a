"""The custom ops the generator profiles: ``prism::straggle`` and the wait-mode compute ops.

They are ``torch.library`` ops so that each call is one named operator in the Kineto trace and the
execution trace, with its input shapes, exactly like a real compute op. Wait-mode ops only sleep
(`precise_sleep`) and return an uninitialised tensor of the shape the real op would produce, so
the trace keeps the shapes and the allocator sees the activation memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["WAIT_OPS", "SleepStats", "precise_sleep", "straggle", "wait_op"]


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


class SleepStats:
    """What `precise_sleep` was asked for and what it took, and its running overshoot estimate.

    ``time.sleep`` wakes late, by about 0.1 ms on an idle host and by more under load. Each sleep
    asks for the remaining time less the estimated overshoot (an exponential average of the
    last ones), so the mean error stays near zero without busy-waiting (the cores are shared by
    every rank of the job).
    """

    def __init__(self) -> None:
        """Start with a 0.1 ms overshoot estimate and empty totals."""
        self.overshoot_s = 1e-4
        self.requested_s = 0.0
        self.slept_s = 0.0
        self.calls = 0

    def reset(self) -> None:
        """Zero the totals (not the estimate)."""
        self.requested_s = self.slept_s = 0.0
        self.calls = 0


STATS = SleepStats()

_MAX_OVERSHOOT_S = 5e-4
"""Late wake-ups beyond this count as this much in the estimate: on a loaded host a few wake-ups
come tens of ms late, and an estimate that followed them would cut the next sleeps short."""


def precise_sleep(seconds: float) -> None:
    """Sleep `seconds`, compensating ``time.sleep``'s overshoot (see `SleepStats`)."""
    if seconds <= 0:
        return
    t0 = time.perf_counter()
    end = t0 + seconds
    remaining = seconds
    while remaining > STATS.overshoot_s:
        ask = remaining - STATS.overshoot_s
        before = time.perf_counter()
        time.sleep(ask)
        after = time.perf_counter()
        late = (after - before) - ask
        STATS.overshoot_s += 0.1 * (min(max(late, 0.0), _MAX_OVERSHOOT_S) - STATS.overshoot_s)
        remaining = end - after
    STATS.requested_s += seconds
    STATS.slept_s += time.perf_counter() - t0
    STATS.calls += 1


WAIT_OPS = (
    "embed_fwd",
    "attn_fwd",
    "mlp_fwd",
    "head_fwd",
    "loss_fwd",
    "loss_bwd",
    "head_bwd",
    "mlp_bwd",
    "attn_bwd",
    "embed_bwd",
    "optimizer_step",
)
"""The wait-mode op types, each registered as ``prism::<name>``."""


def _wait_kernel(x: torch.Tensor, shape: list[int], seconds: float, mb: int) -> torch.Tensor:
    """Every wait op's body: sleep `seconds`, return an empty float32 tensor of `shape`."""
    precise_sleep(seconds)
    return torch.empty(shape)  # float32 whatever the input (the embedding's is token ids)


# Defined with a plain `torch.library.Library` fragment rather than `torch.library.custom_op`:
# the op is the same in the traces (name, schema, inputs), but a call costs about 0.1 ms of CPU
# after the sleep instead of 0.18 ms (custom_op's Python wrappers run with cold caches after every
# wake-up), and with tens of ranks on a few cores that CPU time is what stretches the steps.
_LIB = torch.library.Library("prism", "FRAGMENT")
_OPS: dict[str, Callable[..., torch.Tensor]] = {}
for _name in WAIT_OPS:
    _LIB.define(f"{_name}(Tensor x, int[] shape, float seconds, int mb) -> Tensor")
    _LIB.impl(_name, _wait_kernel, "CompositeExplicitAutograd")
    _OPS[_name] = getattr(torch.ops.prism, _name).default


def wait_op(name: str, x: torch.Tensor, shape: list[int], seconds: float, mb: int) -> torch.Tensor:
    """Call the wait op ``prism::<name>`` on `x` (micro-batch `mb`; -1 for per-step ops)."""
    return _OPS[name](x, shape, seconds, mb)

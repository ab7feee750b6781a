"""`prism_trace.profiling.torch_profiler.profiling`: a profiler starts without loading torch's
compiler."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = """
import sys, torch
from torch.profiler import ProfilerActivity, profile
from prism_trace.profiling.torch_profiler import profiling
with profiling(profile(activities=[ProfilerActivity.CPU], profile_memory=True)) as prof:
    torch.ones(64).sum()
names = {e.name for e in prof.events()}
print("inductor" if "torch._inductor" in sys.modules else "no-inductor")
print("summed" if "aten::sum" in names else sorted(names))
print("lazy-kept" if "_inductor" in torch._lazy_modules else "lazy-lost")
"""


@pytest.mark.torch
def test_profiling_records_without_importing_the_compiler() -> None:
    """A fresh process (this one may have loaded the compiler already): the profile records the
    op, torch._inductor stays unloaded, and torch still offers it lazily afterwards."""
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert out == ["no-inductor", "summed", "lazy-kept"], out


def test_profiling_without_torch_is_the_plain_context() -> None:
    """Core code: with no torch in ``sys.modules`` it is ``with prof`` and nothing else."""
    from contextlib import nullcontext

    from prism_trace.profiling.torch_profiler import profiling

    with profiling(nullcontext(7)) as value:
        assert value == 7

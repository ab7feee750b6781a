"""Starting a torch profiler without loading torch's compiler (a second or more per process).

Core code: it never imports torch (``tests/test_layering.py``); it finds the module the caller
already imported in ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TypeVar

__all__ = ["profiling"]

T = TypeVar("T")


@contextlib.contextmanager
def profiling(prof: AbstractContextManager[T]) -> Iterator[T]:
    """``with prof:`` for a ``torch.profiler.profile``, started without importing the compiler.

    torch 2.x's ``profile.prepare_trace`` asks ``hasattr(torch, "_inductor")`` to read one
    CUDA-graphs flag of the compiler. ``torch`` loads ``_inductor`` lazily on first access to that
    attribute, so the question imports the compiler and ``torch._dynamo``: 1.3-1.5 s of CPU in
    each replay process. (A training process loads them anyway: torch's optimizers import
    ``torch._dynamo`` on their first parameter group, which is why the dataset generator does
    not use this.) While the profiler starts, ``_inductor`` is not offered lazily, so the answer is
    whether the compiler is already loaded, which is what the flag needs: a process that never
    imported the compiler has compiled nothing with CUDA graphs. Only the start is covered; the
    profiled block and the exit see torch as it was.
    """
    torch = sys.modules.get("torch")
    lazy = getattr(torch, "_lazy_modules", None)
    hide = isinstance(lazy, set) and "_inductor" in lazy and "torch._inductor" not in sys.modules
    with contextlib.ExitStack() as stack:
        if hide:
            lazy.discard("_inductor")  # type: ignore[union-attr]
        try:
            entered = stack.enter_context(prof)
        finally:
            if hide:
                lazy.add("_inductor")  # type: ignore[union-attr]
        yield entered

"""Where instrumentation writes its throwaway files: memory, not disk, when the machine allows.

PyTorch's ``ExecutionTraceObserver`` appends a JSON record to its output file for every operator,
on the thread that runs the operator. On a disk-backed ``/tmp`` those writes stall at random when
the kernel flushes dirty pages: in the replay-accuracy benchmark (2-rank gloo, 1 thread per rank)
one profiled iteration of 80 ms took up to 50 % longer for no reason of its own. Writing the
uncompressed trace to a RAM-backed directory (``/dev/shm`` on Linux) removes those stalls, so the
instrumentation costs the same per operator in a recording and in a replay of it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["ram_scratch_dir"]

#: RAM-backed directories to try, in order.
_RAM_DIRS = (Path("/dev/shm"),)

#: Less free space than this and the disk is used after all (a long trace could fill the RAM).
_MIN_FREE_BYTES = 1 << 30


def ram_scratch_dir() -> Path | None:
    """A writable RAM-backed directory with at least 1 GiB free, or ``None``.

    ``None`` also when the user set ``TMPDIR``: their choice of scratch space wins.
    """
    if os.environ.get("TMPDIR"):
        return None
    for d in _RAM_DIRS:
        if d.is_dir() and os.access(d, os.W_OK | os.X_OK):
            try:
                if shutil.disk_usage(d).free >= _MIN_FREE_BYTES:
                    return d
            except OSError:
                continue
    return None

"""How much memory DuckDB may use while ingesting, and where a trace's work tables live.

One policy for the driver's store connection, the worker processes and the Kineto reader's work
database, so that an ingest's memory is bounded whatever the size of its traces (DuckDB spills
past its limit) and yet a large trace's sorts and joins do not spill when the machine has room.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from prism_trace.errors import ConfigError

__all__ = [
    "ENV",
    "LIMIT_MIN",
    "ingest_memory_limit",
    "memory_limit_for",
    "size_bytes",
    "worker_limit",
    "works_on_disk",
]

ENV = "PRISM_INGEST_MEMORY_LIMIT"
"""The variable that sets the ingest's memory limit (a size such as ``2GB``)."""
LIMIT_MIN = 512 << 20
"""The least limit chosen for a machine, and the least share of a worker."""
LIMIT_MAX = 2 << 30
"""The most limit chosen for a machine: past it a 1 GB trace gained nothing more."""
LIMIT_SET_MIN = 256e6
"""The least ``PRISM_INGEST_MEMORY_LIMIT`` accepted: below it even a small trace's load, whose
``read_json`` takes a 32 MB buffer a thread, runs out of memory."""
WORK_ON_DISK_BYTES = 256 << 20
"""A Kineto trace under this many JSON bytes is always worked on in memory (``works_on_disk``)."""


def memory_limit_for(ram_bytes: int | None) -> int:
    """DuckDB's memory limit while ingesting, for a machine of ``ram_bytes`` (None: unknown).

    A sixteenth of the machine's memory, at least 512 MiB and at most 2 GiB: bounded whatever
    the size of the trace (DuckDB spills past it), yet not so low that a large trace's sorts
    and joins spill when the machine has room. On 24 GB of RAM the limit is ~1.5 GB; a 1 GB
    Kineto file took 25.7 s under 512 MiB, 22.2 s under 1 GiB and 20.2 s under 2 GiB (peak
    0.93, 1.30 and 2.19 GB; ``benchmarks/bench_ingest_scale.py --memory-limits
    512MiB,1GiB,2GiB``).
    """
    if ram_bytes is None or ram_bytes <= 0:
        return LIMIT_MIN
    return max(LIMIT_MIN, min(LIMIT_MAX, ram_bytes // 16))


def _ram_bytes() -> int | None:
    """The memory this process may have: the machine's, or its cgroup's limit where lower (a
    container on a large host sees the host's RAM in ``sysconf``). None where neither says."""
    try:
        ram: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        ram = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            ram = int(text) if ram is None else min(ram, int(text))
        break
    return ram


def ingest_memory_limit() -> int:
    """DuckDB's memory limit while ingesting, in bytes: ``PRISM_INGEST_MEMORY_LIMIT`` (at least
    256 MB) where set, else ``memory_limit_for`` this machine. A lower limit set on the store's
    connection by its caller is kept instead (``ingest._ingest_settings``).

    Raises:
        ConfigError: the variable is set to something that is not such a size.
    """
    text = os.environ.get(ENV)
    if not text:
        return memory_limit_for(_ram_bytes())
    size = size_bytes(text)
    if not LIMIT_SET_MIN <= size < float("inf"):
        msg = f"{ENV}={text[:40]!r}: expected a size of at least 256MB, such as 2GB"
        raise ConfigError(msg)
    return int(size)


def worker_limit(limit: float, workers: int) -> int:
    """Each of ``workers`` processes' DuckDB limit, out of the ingest's ``limit``: its share,
    but at least ``LIMIT_MIN`` (or ``limit``, if lower), under which a worker's reads spill or
    fail. So N workers hold up to ``max(limit, N * LIMIT_MIN)``, beside the driver's ``limit``
    while it appends their parts: shared where the limit allows, not N times it."""
    return int(max(min(limit, LIMIT_MIN), limit // max(1, workers)))


def works_on_disk(json_bytes: int, memory_limit: float) -> bool:
    """Whether a Kineto trace of ``json_bytes`` (guessed) is worked on in a database file, not
    in memory: when it is larger than the memory limit it is read under (and than
    ``WORK_ON_DISK_BYTES``). In memory is faster (nothing compressed and written), and DuckDB
    spills an in-memory database past its limit too; a file keeps a trace several times the
    limit compressed on disk, where the spill would be as large as the tables. A 1 GB file under
    a 1.5 GB limit: 20.6 and 20.8 s in memory, 23.2 and 22.8 s on disk, alternating, peaks
    1.75 GB both ways (``bench_ingest_scale.py --work-db-pairs 2``).
    """
    return json_bytes >= max(WORK_ON_DISK_BYTES, memory_limit)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT]?)(i?)B|bytes?)\s*$", re.IGNORECASE)


def size_bytes(text: str) -> float:
    """Bytes of a DuckDB size setting (``18.8 GiB``, ``512MB``); infinite when not one."""
    m = _SIZE_RE.match(text)
    if m is None:
        return float("inf")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return float(m.group(1)) * (1024 if m.group(3) else 1000) ** power

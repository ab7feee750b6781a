"""Memory measures of a recording: the allocator peak a trace shows, and the host memory it took.

- `peak_allocated`: the largest ``Total Allocated`` of the ``[memory]`` events inside the
  profiled steps of a Kineto trace. On CPU the profiler counts the bytes allocated since it
  started recording (``ProfilerStep#1``) and not yet freed; tensors allocated before (parameters,
  optimizer state created in the warm-up step) are not in it.
- `max_rss_kb`: the process's peak resident set (``ru_maxrss``).
- `PssSampler`: the summed proportional set size of the job's processes (shared pages counted
  once across them), sampled by the parent while the job runs; what tells how many ranks fit.
"""

from __future__ import annotations

import gzip
import resource
from pathlib import Path

import orjson

__all__ = ["PssSampler", "max_rss_kb", "peak_allocated"]


def peak_allocated(kineto: Path, device: str = "cpu") -> int | None:
    """Peak ``Total Allocated`` (bytes) over the profiled steps of a Kineto trace; None if the
    trace has no memory events there. ``device="cuda"``: of the GPU's allocator only (``Device
    Type`` 1; its totals are absolute, parameters and optimizer state included); ``cpu``: every
    event, as a CPU-only trace has always been read."""
    raw = kineto.read_bytes()
    data = orjson.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    events = data.get("traceEvents", [])
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        return None
    lo = min(float(e["ts"]) for e in steps)
    hi = max(float(e["ts"]) + float(e.get("dur", 0)) for e in steps)
    peaks = [
        int(e["args"]["Total Allocated"])
        for e in events
        if e.get("name") == "[memory]"
        and lo <= float(e["ts"]) <= hi
        and "Total Allocated" in e.get("args", {})
        and (device == "cpu" or e["args"].get("Device Type") == 1)
    ]
    return max(peaks) if peaks else None


def max_rss_kb() -> int:
    """This process's peak resident set size in kB (Linux ``ru_maxrss``)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _pss_kb(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


class PssSampler:
    """The peak, over `sample` calls, of the summed PSS of a set of processes."""

    def __init__(self) -> None:
        """No sample yet."""
        self.peak_kb = 0

    def sample(self, pids: list[int]) -> None:
        """Add one sample: the current summed PSS of `pids` (gone processes count 0)."""
        self.peak_kb = max(self.peak_kb, sum(_pss_kb(p) for p in pids))

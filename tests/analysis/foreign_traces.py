"""Traces unlike the project's own, made from the shared public ones by small, documented edits.

Each generator reads a trace in ../shared/datasets and writes a variant that reproduces what a
user's trace from another tool or version looks like: ProfilerStep annotations added to (or kept
from) a single-GPU trace, CUDA synchronisation events as recent Kineto records them. Nothing is
copied into the repository; the tests call these on the fly.
"""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path
from typing import Any

__all__ = ["load_trace", "resnet_steps", "with_cuda_sync", "write_trace"]

_DATALOADER = "enumerate(DataLoader)"


def load_trace(path: Path) -> dict[str, Any]:
    """A Kineto JSON document (gzipped or not)."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    doc: dict[str, Any] = json.loads(raw)
    return doc


def write_trace(doc: dict[str, Any], out: Path) -> Path:
    """Write ``doc`` as plain JSON to ``out``."""
    out.write_text(json.dumps(doc))
    return out


def resnet_steps(shared: Path, out: Path, *, steps: int = 5, profiler_steps: bool = True) -> Path:
    """PARAM's single-GPU ResNet Kineto trace cut to its first ``steps`` training steps.

    The trace has no ProfilerStep; its steps are marked by the data loader's annotation. With
    ``profiler_steps`` a ``ProfilerStep#i`` user annotation spans each step (from one data-loader
    call to the next), as torch.profiler's schedule writes them; without, the cut trace keeps no
    step marks at all (a trace recorded without a schedule). Its first step waits 1.9 s on the
    data loader and its GPU trails the host by about a step: a host-bound start, then a device
    that works through the previous step's kernels while the host launches the next.
    """
    doc = load_trace(shared / "param-resnet-et" / "resnet_kineto.json.gz")
    events = doc["traceEvents"]
    marks = sorted(
        (e for e in events if str(e.get("name", "")).startswith(_DATALOADER)),
        key=lambda e: e["ts"],
    )
    bounds = [m["ts"] for m in marks[: steps + 1]]
    cut = bounds[-1]
    correlations = {
        e["args"]["correlation"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and e.get("ts", cut) < cut
        and "correlation" in e.get("args", {})
    }
    kept = [
        e
        for e in events
        if e.get("ph") != "X"
        or (
            e["ts"] < cut
            if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset")
            else e.get("args", {}).get("correlation") in correlations
        )
    ]
    if profiler_steps:
        pid, tid = marks[0]["pid"], marks[0]["tid"]
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            kept.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": f"ProfilerStep#{i}",
                    "pid": pid,
                    "tid": tid,
                    "ts": a - 1,
                    "dur": b - a,
                    "args": {},
                }
            )
    doc["traceEvents"] = kept
    return write_trace(doc, out)


def with_cuda_sync(src: Path, out: Path, *, stream: int, tail_us: int) -> Path:
    """``src`` with CUDA synchronisation events as Kineto >= 2.1 records them (``cuda_sync``).

    After every ``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaEventSynchronize``
    runtime call a sync event on the device (``Stream Sync`` on ``stream``, ``Context Sync`` and
    ``Event Sync`` on stream -1) spans from the call's start to its end, with the call's
    correlation. A last ``Stream Sync`` of ``tail_us`` µs after the last device op, launched by a
    new runtime call at the same time, makes the device's busy span end later than its last
    kernel: the shape that made a window without syncs short.
    """
    doc = load_trace(src)
    events = doc["traceEvents"]
    dev = [e for e in events if e.get("cat") == "kernel" and "stream" in e.get("args", {})]
    pid = dev[0]["pid"]
    kinds = {
        "cudaStreamSynchronize": ("Stream Sync", stream),
        "cudaDeviceSynchronize": ("Context Sync", -1),
        "cudaEventSynchronize": ("Event Sync", -1),
    }
    added = []
    for e in events:
        kind = kinds.get(str(e.get("name")))
        if e.get("cat") == "cuda_runtime" and kind and "correlation" in e.get("args", {}):
            added.append(_sync(pid, kind, e["ts"], e["dur"], e["args"]["correlation"]))
    # HTA keeps the device work launched before the last profiler step (when there are two or
    # more): the tail sync is launched just before it, so both windows should hold it.
    steps = [e["ts"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    cutoff = max(steps) if len(steps) >= 2 else float("inf")
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and e["ts"] < cutoff]
    launched = {e.get("args", {}).get("correlation") for e in runtime}
    kept = [e for e in dev if e["args"].get("correlation") in launched]
    last = max(kept, key=lambda e: e["ts"] + e["dur"])
    host = max(runtime, key=lambda e: e["ts"])
    t = last["ts"] + last["dur"]
    corr = max(e.get("args", {}).get("correlation", 0) for e in events) + 1
    tail_call = {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaStreamSynchronize",
        "pid": host["pid"],
        "tid": host["tid"],
        "ts": host["ts"],
        "dur": 1,
        "args": {"correlation": corr, "cbid": 131},
    }
    added += [tail_call, _sync(pid, ("Stream Sync", stream), t, tail_us, corr)]
    doc["traceEvents"] = events + added
    return write_trace(doc, out)


def _sync(pid: Any, kind: tuple[str, int], ts: Any, dur: Any, corr: int) -> dict[str, Any]:
    name, stream = kind
    return {
        "ph": "X",
        "cat": "cuda_sync",
        "name": name,
        "pid": pid,
        "tid": stream if stream >= 0 else 0,
        "ts": ts,
        "dur": dur,
        "args": {
            "cuda_sync_kind": name.split()[0].lower(),
            "stream": stream,
            "correlation": corr,
            "device": 0,
            "context": 1,
        },
    }

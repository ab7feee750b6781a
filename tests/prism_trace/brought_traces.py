"""Traces users bring, built from real public ones: the formats of other devices, older PyTorch
versions and single-GPU jobs, made by rewriting what those writers write differently.

Each function takes a Kineto trace (a dict, as ``load`` reads it) and returns a rewritten copy;
none copies data into the repository. What each rewrite reproduces:

- ``as_mtia``: Meta's MTIA: device ops of category ``mtia_ccp_events``, runtime calls of
  ``mtia_runtime`` (the launch ``runFunction - job_prep_and_submit_for_execution``).
- ``as_amd``: ROCm: ``hip*`` runtime calls (``hipLaunchKernel``, ``hipMemcpyAsync``,
  ``hipStreamSynchronize``) of category ``hip_runtime``.
- ``with_string_streams``: older Kineto: a device track's ``tid`` is ``"stream 7"``, its stream
  id in ``args.stream`` only.
- ``as_pt23_comms``: PyTorch 2.3: ``record_param_comms`` name their group by ``Process Group
  ID`` (an integer), not ``Process Group Name``; ``wait`` calls state no ranks.
- ``as_old_gloo``: older PyTorch on CPU with gloo: no ``record_param_comms``, no ``c10d::`` op,
  only ``gloo:<op>`` spans on the gloo worker threads.
- ``with_profiler_steps``: ``ProfilerStep#N`` spans over a single-GPU trace that has none (from
  its data-loader marks), as ``torch.profiler.schedule`` writes them.
- ``with_memory_records``: ``[memory]`` instants (``profile_memory=True``).
"""

from __future__ import annotations

import copy
import gzip
import itertools
import json
import re
from pathlib import Path
from typing import Any

__all__ = [
    "as_amd",
    "as_mtia",
    "as_old_gloo",
    "as_pt23_comms",
    "load",
    "save",
    "with_memory_records",
    "with_profiler_steps",
    "with_string_streams",
]

Trace = dict[str, Any]


def load(path: Path) -> Trace:
    """A Kineto trace file (gzip or not) as a dict."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def save(trace: Trace, path: Path) -> Path:
    """Write ``trace`` to ``path`` (gzip when the name ends ``.gz``); returns ``path``."""
    text = json.dumps(trace).encode()
    path.write_bytes(gzip.compress(text, 1) if path.suffix == ".gz" else text)
    return path


def _events(trace: Trace) -> list[dict[str, Any]]:
    return trace["traceEvents"]


_MTIA_LAUNCH = "runFunction - job_prep_and_submit_for_execution"


def as_mtia(trace: Trace) -> Trace:
    """Device ops as MTIA's ``mtia_ccp_events`` (copies keep their ``Memcpy``/``Memset``
    names), runtime calls as ``mtia_runtime``, kernel launches as MTIA's launch call."""
    out = copy.deepcopy(trace)
    for e in _events(out):
        cat = e.get("cat")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            e["cat"] = "mtia_ccp_events"
        elif cat in ("cuda_runtime", "cuda_driver"):
            e["cat"] = "mtia_runtime"
            if e.get("name") in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"):
                e["name"] = _MTIA_LAUNCH
            else:
                e["name"] = re.sub(r"^cu(da)?", "mtia", e.get("name", ""))
    out.pop("deviceProperties", None)
    return out


def as_amd(trace: Trace, *, category: str = "hip_runtime") -> Trace:
    """Runtime calls renamed ``cuda*`` -> ``hip*`` under ``category`` (ROCm's Kineto writes
    ``hip_runtime`` in newer releases, ``cuda_runtime`` in older ones)."""
    out = copy.deepcopy(trace)
    for e in _events(out):
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            e["cat"] = category
            e["name"] = re.sub(r"^cu(da)?", "hip", e.get("name", ""))
    return out


def with_string_streams(trace: Trace) -> Trace:
    """Device tracks' ``tid`` as ``"stream N"`` (N from ``args.stream``), as older Kineto wrote."""
    out = copy.deepcopy(trace)
    device = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
    tracks: dict[tuple[Any, Any], Any] = {}
    for e in _events(out):
        if e.get("cat") in device and "stream" in e.get("args", {}):
            tracks[(e["pid"], e["tid"])] = e["args"]["stream"]
    for e in _events(out):
        key = (e.get("pid"), e.get("tid"))
        if key in tracks:
            e["tid"] = f"stream {tracks[key]}"
    return out


def as_pt23_comms(trace: Trace, *, group_id: int = 94_733_712_617_296) -> Trace:
    """``record_param_comms`` as PyTorch 2.3 writes them: the group as ``Process Group ID`` (the
    process group object's address), no name, description or ranks; and a ``wait`` call of that
    group, with no ranks, after each collective."""
    out = copy.deepcopy(trace)
    waits = []
    for e in _events(out):
        if e.get("name") != "record_param_comms":
            continue
        args = e.setdefault("args", {})
        for key in ("Process Group Name", "Process Group Description", "Process Group Ranks"):
            args.pop(key, None)
        args["Process Group ID"] = group_id
        wait = copy.deepcopy(e)
        wait["ts"] = e["ts"] + e["dur"] + 1
        wait["dur"] = 2
        wait["args"] = {
            "Collective name": "wait",
            "Process Group ID": group_id,
            "Group size": args.get("Group size"),
            "In msg nelems": 0,
            "Out msg nelems": 0,
            "dtype": args.get("dtype", "Float"),
        }
        waits.append(wait)
    _events(out).extend(waits)
    for e in _events(out):  # the NCCL kernels' copies of the call's args
        if e.get("cat") == "kernel" and "Process Group Name" in e.get("args", {}):
            for key in ("Process Group Name", "Process Group Description", "Process Group Ranks"):
                e["args"].pop(key, None)
            e["args"]["Process Group ID"] = group_id
    return out


def as_old_gloo(trace: Trace) -> Trace:
    """Only the ``gloo:<op>`` spans of the worker threads say a call happened: the generator's
    ``prism_comm:`` marks, ``record_param_comms`` and the ``c10d::`` ops are dropped, and the
    trace's header says nothing of its groups."""
    out = copy.deepcopy(trace)
    out["traceEvents"] = [
        e
        for e in _events(out)
        if not (
            e.get("name", "").startswith(("prism_comm:", "c10d::"))
            or e.get("name") == "record_param_comms"
        )
    ]
    for key in ("prism_groups", "prism_layout"):
        out.pop(key, None)
    info = out.get("distributedInfo")
    if isinstance(info, dict):
        info.pop("pg_config", None)
        info.pop("pg_count", None)
    return out


def with_profiler_steps(trace: Trace, *, mark: str = "enumerate(DataLoader)") -> Trace:
    """``ProfilerStep#N`` spans on the main thread, from each ``mark`` to the next (the last to
    the thread's end), as ``torch.profiler`` writes them around ``step()`` calls."""
    out = copy.deepcopy(trace)
    marks = sorted(
        (e for e in _events(out) if e.get("ph") == "X" and e.get("name", "").startswith(mark)),
        key=lambda e: e["ts"],
    )
    pid, tid = marks[0]["pid"], marks[0]["tid"]
    end = max(
        e["ts"] + e.get("dur", 0)
        for e in _events(out)
        if e.get("ph") == "X" and e.get("pid") == pid and e.get("tid") == tid
    )
    bounds = [e["ts"] for e in marks] + [end + 1]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        _events(out).append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{i + 1}",
                "pid": pid,
                "tid": tid,
                "ts": a,
                "dur": b - a - 1,
                "args": {},
            }
        )
    return out


def with_memory_records(trace: Trace, *, every: int = 50, nbytes: int = 1 << 20) -> Trace:
    """A ``[memory]`` allocation at the start of every ``every``-th host op of the main thread
    and its free at the op's end (device 0), as ``profile_memory=True`` records them."""
    out = copy.deepcopy(trace)
    ops = [e for e in _events(out) if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
    total = 0
    records = []
    for k, e in enumerate(sorted(ops, key=lambda e: e["ts"])[::every]):
        for ts, delta in ((e["ts"], nbytes), (e["ts"] + e.get("dur", 0), -nbytes)):
            total += delta
            records.append(
                {
                    "ph": "i",
                    "cat": "cpu_instant_event",
                    "s": "t",
                    "name": "[memory]",
                    "pid": e["pid"],
                    "tid": e["tid"],
                    "ts": ts,
                    "args": {
                        "Total Reserved": 64 << 20,
                        "Total Allocated": total,
                        "Bytes": delta,
                        "Addr": 0x7F0000000000 + k * nbytes,
                        "Device Type": 1,
                        "Device Id": 0,
                    },
                }
            )
    _events(out).extend(records)
    return out

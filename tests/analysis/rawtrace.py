"""Independent reference computations from raw Kineto JSON, with plain Python interval unions.

Deliberately simple and separate from the SQL: parse the file, classify kernels with the regular
expressions of HTA 0.5.0's ``get_kernel_type`` (copied, so the suite needs no HTA; the HTA parity
test checks the types against HTA itself), and merge intervals with a loop.
"""

from __future__ import annotations

import gzip
import itertools
import json
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
# hta/utils/utils.py: NCCL_KERNEL_RE, MEMORY_KERNEL_RE, NCCL_COMPUTE_KERNEL_RE (used with match).
_COMM = re.compile(r"^nccl.*Kernel")
_MEMORY = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")


@dataclass
class DeviceOp:
    ts: int
    end: int
    name: str
    kernel_type: str
    stream: int
    launch_ts: int | None


@dataclass
class RawRank:
    steps: dict[int, tuple[int, int]] = field(default_factory=dict)  # iteration -> (ts, end)
    ops: list[DeviceOp] = field(default_factory=list)  # launched inside a step
    comm_calls: list[int] = field(default_factory=list)  # record_param_comms starts, in order
    comm_kernels: list[int] = field(default_factory=list)  # NCCL kernel starts, in order


def kernel_type(name: str, cat: str) -> str:
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memory"
    if _COMM.match(name):
        return "comm"
    if _MEMORY.match(name):
        return "memory"
    return "other" if _NOT_COMPUTE.match(name) else "compute"


def load(path: Path) -> RawRank:
    doc = json.loads(gzip.decompress(path.read_bytes()), parse_float=Decimal)
    base = int(doc.get("baseTimeNanoseconds", 0))

    def ns(x: object) -> int:
        return base + int(Decimal(str(x)) * 1000)

    out = RawRank()
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    for e in events:
        m = _STEP.match(e.get("name", ""))
        if m and e.get("cat") in ("user_annotation", "cpu_op"):
            it = int(m.group(1))
            if it not in out.steps or ns(e["ts"]) < out.steps[it][0]:
                out.steps[it] = (ns(e["ts"]), ns(e["ts"]) + int(Decimal(str(e["dur"])) * 1000))
    launch: dict[int, int] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            c = e["args"]["correlation"]
            launch[c] = min(launch.get(c, ns(e["ts"])), ns(e["ts"]))

    def step_of(t: int) -> int | None:
        for it, (s, end) in out.steps.items():
            if s <= t < end:
                return it
        return None

    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            ts = ns(e["ts"])
            lt = launch.get(e.get("args", {}).get("correlation"))
            if step_of(lt if lt is not None else ts) is None and out.steps:
                continue
            dur = int(Decimal(str(e["dur"])) * 1000)
            out.ops.append(
                DeviceOp(
                    ts,
                    ts + dur,
                    e["name"],
                    kernel_type(e["name"], e["cat"]),
                    int(e["args"]["stream"]),
                    lt,
                )
            )
    # Old-style collectives: a record_param_comms op enclosing an ``nccl:<op>`` annotation.
    marks = [(e["tid"], ns(e["ts"])) for e in events if str(e.get("name", "")).startswith("nccl:")]
    for e in events:
        if e.get("name") == "record_param_comms":
            s, end = ns(e["ts"]), ns(e["ts"]) + int(Decimal(str(e["dur"])) * 1000)
            if any(t == e["tid"] and s <= m < end for t, m in marks):
                out.comm_calls.append(s)
    out.comm_calls.sort()
    out.comm_kernels = sorted(
        ns(e["ts"]) for e in events if e.get("cat") == "kernel" and _COMM.match(e.get("name", ""))
    )
    return out


def union(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) intervals: sort, then merge with a loop."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def clip(ops: list[DeviceOp], lo: int, hi: int, types: set[str]) -> list[tuple[int, int]]:
    return [
        (max(o.ts, lo), min(o.end, hi))
        for o in ops
        if o.kernel_type in types and o.ts < hi and o.end > lo
    ]


def temporal(r: RawRank, lo: int, hi: int) -> dict[str, int]:
    """Exclusive parts of [lo, hi) with precedence compute > comm > memory > other."""
    u1 = union(clip(r.ops, lo, hi, {"compute"}))
    u2 = union(clip(r.ops, lo, hi, {"compute", "comm"}))
    u3 = union(clip(r.ops, lo, hi, {"compute", "comm", "memory"}))
    u4 = union(clip(r.ops, lo, hi, {"compute", "comm", "memory", "other"}))
    return {
        "compute_ns": u1,
        "comm_ns": u2 - u1,
        "memory_ns": u3 - u2,
        "other_ns": u4 - u3,
        "idle_ns": (hi - lo) - u4,
    }


def overlap(r: RawRank, lo: int, hi: int) -> tuple[int, int]:
    """(union of comm, time comm and compute both run) inside [lo, hi)."""
    comm = clip(r.ops, lo, hi, {"comm"})
    comp = clip(r.ops, lo, hi, {"compute"})
    return union(comm), union(comm) + union(comp) - union(comm + comp)


def idle(r: RawRank, threshold: int) -> dict[tuple[int, str], int]:
    """HTA's idle categories per stream, summed gaps."""
    out: dict[tuple[int, str], int] = {}
    for stream in {o.stream for o in r.ops}:
        ops = sorted((o for o in r.ops if o.stream == stream), key=lambda o: (o.ts, o.end))
        for prev, cur in itertools.pairwise(ops):
            gap = cur.ts - prev.end
            if cur.launch_ts is not None and cur.launch_ts > prev.end:
                cat = "host_wait"
            elif gap < threshold:
                cat = "kernel_wait"
            else:
                cat = "other"
            out[(stream, cat)] = out.get((stream, cat), 0) + gap
    return out

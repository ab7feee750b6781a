"""Which allocations of a Kineto trace are never freed in it, and inside which op they were made.

Why: two recordings of one CPU job peak differently (docs/predict.md, peak memory) because frees
are missing from the trace: the CPU profiler records memory per thread, so a block another
thread frees (a gloo worker releasing the copy a collective made of its input) stays in
``Total Allocated``. Per rank this prints the peak ``Total Allocated``, the net bytes the trace
leaves allocated per thread, the blocks allocated again at an address the trace never freed
(they were freed unseen), the blocks never freed at all, and for both the op (and its parents)
that made them; and the peak with the unseen frees inferred (``inferred_peak``): a block freed
unseen, and a block never freed of a size this rank is seen to free unseen, is taken as freed at
the end of the first ``c10d::`` call that ends after its allocation (no later than its address's
next allocation). A candidate rule for ingest: on the ZeRO-1 twins it puts 7 of 8 ranks of each
pair on one value (docs/predict.md, peak memory).

Usage::

    python benchmarks/missing_frees.py RECORDING_DIR [--ranks 0,1]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
from pathlib import Path
from typing import Any

import orjson


def _load(path: Path) -> list[dict[str, Any]]:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    events = orjson.loads(data)["traceEvents"]
    return [e for e in events if isinstance(e, dict)]


def _enclosing(ops: dict[Any, list[dict[str, Any]]], event: dict[str, Any]) -> str:
    """The innermost three ops of the event's thread that contain it, outermost first."""
    around = [
        o
        for o in ops.get(event.get("tid"), [])
        if o["ts"] <= event["ts"] <= o["ts"] + o.get("dur", 0)
    ]
    around.sort(key=lambda o: -o.get("dur", 0))
    return " > ".join(str(o["name"])[:40] for o in around[-3:]) or "(no op)"


def inferred_peak(mem: list[dict[str, Any]], events: list[dict[str, Any]]) -> int:
    """The peak of the running sum of ``Bytes`` with the unseen frees inferred (module
    docstring)."""
    ends = sorted(
        e["ts"] + e.get("dur", 0)
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("c10d::")
    )

    def next_end(ts: float) -> float | None:
        i = bisect.bisect_right(ends, ts)
        return ends[i] if i < len(ends) else None

    live: dict[Any, tuple[float, int]] = {}
    rows: list[tuple[float, int]] = []
    unseen: set[int] = set()
    for m in mem:
        a = m["args"]
        addr, b, ts = a.get("Addr"), int(a["Bytes"]), m["ts"]
        if b > 0:
            if addr in live:
                t0, b0 = live.pop(addr)
                end = next_end(t0)
                rows.append((min(end if end is not None else ts, ts) - 1e-3, -b0))
                unseen.add(b0)
            live[addr] = (ts, b)
            rows.append((ts, b))
        elif live.pop(addr, None) is not None:
            rows.append((ts, b))
    for t0, b0 in live.values():
        end = next_end(t0)
        if b0 in unseen and end is not None:
            rows.append((end - 1e-3, -b0))
    rows.sort(key=lambda r: (r[0], -r[1]))
    level = peak = 0
    for _, b in rows:
        level += b
        peak = max(peak, level)
    return peak


def report(path: Path) -> list[str]:
    """The lines for one rank's trace."""
    events = _load(path)
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    ops: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ops[e.get("tid")].append(e)
    live: dict[Any, dict[str, Any]] = {}
    unseen: collections.Counter[tuple[int, str]] = collections.Counter()
    net: collections.Counter[Any] = collections.Counter()
    peak = 0
    for m in mem:
        a = m["args"]
        peak = max(peak, int(a.get("Total Allocated", 0)))
        net[m.get("tid")] += int(a["Bytes"])
        addr = a.get("Addr")
        if a["Bytes"] > 0:
            if addr in live:
                old = live[addr]
                unseen[int(old["args"]["Bytes"]), _enclosing(ops, old)] += 1
            live[addr] = m
        else:
            live.pop(addr, None)
    never = collections.Counter(
        (int(m["args"]["Bytes"]), _enclosing(ops, m)) for m in live.values()
    )
    lines = [
        f"{path.name}: peak Total Allocated {peak} B, inferred_peak {inferred_peak(mem, events)} B;"
        " net bytes left per thread "
        + ", ".join(f"{tid}: {b:+d}" for tid, b in sorted(net.items(), key=lambda x: str(x[0])))
    ]
    lines.append(f"  allocated again at an address never freed: {sum(unseen.values())} blocks")
    lines += [f"    {n} x {b} B in {where}" for (b, where), n in unseen.most_common(6)]
    lines.append(f"  never freed in the trace: {sum(never.values())} blocks")
    lines += [f"    {n} x {b} B in {where}" for (b, where), n in never.most_common(6)]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recording", type=Path, help="a folder of rank*.kineto.json(.gz)")
    ap.add_argument("--ranks", default=None, help="comma-separated ranks (default: all)")
    a = ap.parse_args()
    files = sorted(a.recording.glob("rank*.kineto.json*"), key=lambda p: p.name)
    if a.ranks:
        want = {f"rank{r}." for r in a.ranks.split(",")}
        files = [f for f in files if any(f.name.startswith(w) for w in want)]
    for f in files:
        print("\n".join(report(f)))


if __name__ == "__main__":
    main()

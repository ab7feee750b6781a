"""Which allocations of a Kineto trace are never freed in it, and inside which op they were made.

Why: two recordings of one CPU job peak differently (docs/predict.md, peak memory) because frees
are missing from the trace: the CPU profiler records memory per thread, so a block another
thread frees (a gloo worker releasing the copy a collective made of its input) stays in
``Total Allocated``. Per rank this prints the peak ``Total Allocated``, the net bytes the trace
leaves allocated per thread, the blocks allocated again at an address the trace never freed
(they were freed unseen), the blocks never freed at all, and for both the op (and its parents)
that made them; and the peak ingest stores, with those frees inferred
(``prism_trace.formats.unseen_frees``, docs/ingest.md): on the dp 2 ZeRO-1 twins it puts 7 of 8
ranks of the pair on one value (docs/predict.md, peak memory).

Usage::

    python benchmarks/missing_frees.py RECORDING_DIR [--ranks 0,1]
"""

from __future__ import annotations

import argparse
import collections
import gzip
from pathlib import Path
from typing import Any

import orjson

from prism_trace.formats.kineto.reader import read_kineto


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


def ingested_peak(path: Path) -> tuple[int, int]:
    """The peak ``total_allocated`` ingest stores for the trace, with the unseen frees inferred
    (``prism_trace.formats.unseen_frees``), and how many frees it inferred."""
    mem = read_kineto(path).memory
    if mem.is_empty():
        return 0, 0
    return int(mem["total_allocated"].max() or 0), int(mem["inferred"].sum())


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
    ingested, inferred = ingested_peak(path)
    lines = [
        f"{path.name}: peak Total Allocated {peak} B, ingested peak {ingested} B"
        f" ({inferred} frees inferred);"
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

"""Peak memory of `prism run --world N` against a recording at N: does the real rank allocate the
target's shards?

Issue 30's bound: the real rank's peak within 0.01 % of the recorded one, since under `prism run`
it runs the unmodified script at the target world and allocates what a rank of that world
allocates (ZeRO-1's optimizer shards are 1/N of the state). For each job (plain DP, ZeRO-1) and
world N it:

1. records the real job at dp N (tp = pp = 1, gloo on CPU) with the generator, ``--repeat``
   times;
2. runs rank 0 of the same configuration twice under `prism run --world N --ranks 0` (instant
   virtual peers), its script the generator's own rank entry (``bench_run_accuracy.py rank``);
3. compares rank 0's peak allocated bytes: the profiler's largest ``Total Allocated`` inside the
   profiled steps (``datasets._measure.peak_allocated``), the recordings' from ``run.json`` and
   the runs' from ``rank0.steps.json``, against the least recorded peak.

A recording's CPU peak is the rank's own tensors plus whatever gloo's worker thread holds at that
moment (its copies of a call's buffers, freed when the thread gets to it), so recordings of one
job differ by up to tens of per cent; the least of several is the least disturbed. Under `prism
run` the rank's own tensors are real and there is no gloo worker, so its peak is steady. On a
GPU `scripts/gpu-check` compares ``cuda_max_allocated`` (benchmarks/results/gpu-check_h200-*:
exact at dp 8).

Usage::

    python benchmarks/bench_run_memory.py                 # dp 2 and 4, plain and ZeRO-1
    python benchmarks/bench_run_memory.py --worlds 2 --no-note
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import host_kind, run, write_note  # noqa: E402

# A real job small enough for 4 ranks on 2 cores; Adam, so that ZeRO-1 has state to shard.
JOB = ["--tp", "1", "--pp", "1", "--steps", "3", "--microbatches", "2", "--optimizer", "adam"]
JOB += ["--no-et"]


def _record(out: Path, dp: int, zero: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "prism_trace.datasets.generate", "--dp", str(dp), *JOB]
    cmd += ["--zero", str(zero), "--out", str(out)]
    run(cmd)
    return json.loads((out / "run.json").read_text())


def _prism_run(recording: Path, out: Path, world: int) -> dict[str, Any]:
    entry = [sys.executable, str(HERE / "bench_run_accuracy.py"), "rank"]
    entry += ["--config", str(recording / "run.json"), "--out", str(out)]
    cmd = [sys.executable, "-m", "prism_trace.cli", "run", "--world", str(world), "--ranks", "0"]
    cmd += ["--timeout-s", "300", "--", *entry]
    run(cmd)
    return json.loads((out / "rank0.steps.json").read_text())


def _pct(a: int | None, b: int | None) -> float | None:
    return None if not a or not b else 100.0 * (a - b) / b


def measure(worlds: list[int], work: Path, repeat: int) -> list[dict[str, Any]]:
    """Every (job, world): rank 0's peak in ``repeat`` recordings and in two `prism run`s."""
    rows = []
    for zero in (0, 1):
        for n in worlds:
            recs = [_record(work / f"z{zero}-dp{n}-r{i}", n, zero) for i in range(repeat)]
            peaks = [r["ranks"][0]["peak_allocated_bytes"] for r in recs]
            mine = [
                _prism_run(work / f"z{zero}-dp{n}-r0", work / f"run-z{zero}-dp{n}-{i}", n).get(
                    "peak_allocated_bytes"
                )
                for i in range(2)
            ]
            row = {
                "job": "ZeRO-1" if zero else "DP",
                "world": n,
                "recorded": peaks,
                "recorded_min": min(peaks),
                "prism_run": mine,
            }
            row["run_pct"] = _pct(mine[0], min(peaks))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The peaks side by side, and how each moves with the world."""

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{v:+.4f} %"

    lines = [
        "| job | world | recorded peaks (B) | least recorded (B) | prism run peaks (B) |"
        " prism run vs least recorded |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['job']} | {r['world']} | {', '.join(map(str, r['recorded']))} | {r['recorded_min']}"
        f" | {', '.join(map(str, r['prism_run']))} | {pct(r['run_pct'])} |"
        for r in rows
    ]
    # What follows the world: each peak's change from the smallest world.
    lines += [
        "",
        "| job | worlds | least recorded peak moves (B) | prism run peak moves (B) |",
        "|---|---|---|---|",
    ]
    for job in dict.fromkeys(r["job"] for r in rows):
        mine = [r for r in rows if r["job"] == job and r["prism_run"][0] is not None]
        for r in mine[1:]:
            lines.append(
                f"| {job} | {mine[0]['world']} -> {r['world']}"
                f" | {r['recorded_min'] - mine[0]['recorded_min']}"
                f" | {r['prism_run'][0] - mine[0]['prism_run'][0]} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Measure, print and (unless --no-note) write benchmarks/results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated dp sizes")
    ap.add_argument("--repeat", type=int, default=4, help="recordings of each (job, world)")
    ap.add_argument("--no-note", action="store_true")
    a = ap.parse_args()
    worlds = [int(x) for x in a.worlds.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-run-memory-") as tmp:
        rows = measure(worlds, Path(tmp), a.repeat)
    text = table(rows)
    print(text)
    if not a.no_note:
        note = write_note(
            "run-memory",
            host_kind(),
            title="Peak memory of `prism run --world N` against a recording at N",
            command=(
                f"python benchmarks/bench_run_memory.py --worlds {a.worlds} --repeat {a.repeat}"
            ),
            body=text,
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()

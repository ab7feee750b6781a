"""Test-suite time: how long pytest takes, in wall time and in CPU time, and how busy the host was.

Runs ``python -m pytest <pytest args> -q -p no:cacheprovider --durations=N`` once in the repo root
and times it. Wall time alone misleads on a shared machine, so the note also gives the CPU time of
pytest and every process it waited for (``RUSAGE_CHILDREN``: the xdist workers, the CLI
subprocesses, the torch ranks), the load average sampled every 2 s during the run, and the pass/fail
counts from pytest's last line. Each run appends one row (with its label) to
``results/test-time_<host>_<date>.md``, so a before/after pair lands in one note; the slowest
tests of the latest run are printed, not noted.

Usage::

    python benchmarks/bench_test_time.py --label "not slow, -n 2" -- -m "not slow" -n 2
    python benchmarks/bench_test_time.py --label full -- -n 2
    python benchmarks/bench_test_time.py --label full --save-file-seconds -- -n auto --dist loadfile
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from _common import HERE, REPO, host_kind

FILE_SECONDS = REPO / "tests" / "file_seconds.json"

HEADER = (
    "# Test-suite time\n\n"
    "Each row is one `python benchmarks/bench_test_time.py --label LABEL -- ARGS` run: "
    "`python -m pytest ARGS -q -p no:cacheprovider --durations=N` in the repo root. CPU time is "
    "user + system of pytest and every process it waited for (xdist workers, CLI subprocesses, "
    "torch ranks); load is the 1-minute load average sampled every 2 s during the run (the host "
    "is shared, so compare CPU time when load differs).\n\n"
    "| finished (UTC) | label | pytest args | result | wall | CPU (user+sys)"
    " | load min/mean/max |\n"
    "|---|---|---|---|---|---|---|\n"
)


def _file_seconds(junit: Path) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown of its tests), costliest first."""
    per: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        # A test class's name is the last part; the module path is the lower-case parts.
        module = [p for p in parts if not p[:1].isupper()]
        file = "/".join(module) + ".py"
        per[file] = per.get(file, 0.0) + float(case.get("time") or 0.0)
    return {f: round(t, 1) for f, t in sorted(per.items(), key=lambda kv: -kv[1])}


def _mmss(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def main() -> None:
    """Run pytest once, print its slowest tests and append the timing row to the note."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True, help="what this run is (e.g. 'before, not slow')")
    ap.add_argument("--durations", type=int, default=25)
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    ap.add_argument(
        "--save-file-seconds",
        action="store_true",
        help=f"write each test file's summed seconds to {FILE_SECONDS.relative_to(REPO)} (the"
        " order in which tests/conftest.py hands files to the workers: the costliest first)",
    )
    ap.add_argument("pytest_args", nargs="*", help="after --: arguments passed to pytest")
    args = ap.parse_args()

    cmd = [sys.executable, "-m", "pytest", *args.pytest_args, "-q", "-p", "no:cacheprovider"]
    cmd.append(f"--durations={args.durations}")
    junit = Path(tempfile.mkdtemp()) / "junit.xml"
    if args.save_file_seconds:
        cmd.append(f"--junitxml={junit}")
    loads: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            loads.append(os.getloadavg()[0])
            done.wait(2.0)

    sampler = threading.Thread(target=sample, daemon=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    sampler.start()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    out = proc.stdout.splitlines()
    slow = [ln for ln in out if re.match(r"^[0-9.]+s (call|setup|teardown) ", ln)]
    summary = next(
        (ln.strip("= ") for ln in reversed(out) if re.search(r"\d+ (passed|failed)", ln)), ""
    )
    summary = re.sub(r" in [0-9.]+s.*$", "", summary) or f"no summary (rc {proc.returncode})"
    print("\n".join(slow))
    if proc.returncode not in (0, 1):
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
    load = f"{min(loads):.2f} / {sum(loads) / len(loads):.2f} / {max(loads):.2f}"
    print(f"{args.label}: {summary}; wall {_mmss(wall)}; CPU {_mmss(cpu)}; load {load}")
    if args.save_file_seconds and junit.exists():
        FILE_SECONDS.write_text(json.dumps(_file_seconds(junit), indent=1) + "\n")
        print(f"file seconds written to {FILE_SECONDS.relative_to(REPO)}")
    if args.no_note:
        return
    note = HERE / "results" / f"test-time_{host_kind(args.host_kind)}_{dt.date.today()}.md"
    if not note.exists():
        note.write_text(HEADER)
    when = dt.datetime.now(dt.timezone.utc).strftime("%H:%M")
    pyargs = shlex.join(args.pytest_args) or "(none)"
    with note.open("a") as fh:
        fh.write(
            f"| {when} | {args.label} | `{pyargs}` | {summary} | {_mmss(wall)} | {_mmss(cpu)}"
            f" | {load} |\n"
        )
    print(f"noted in {note.relative_to(REPO)}")


if __name__ == "__main__":
    main()

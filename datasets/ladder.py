"""Record one job at several scales: every (tp, dp, pp) of the given lists, each in its own folder.

Run as::

    python -m prism_trace.datasets.ladder --out DIR --dp 2,4,8,16 --pp 1,2,4 --compute wait \
        --global-batch 64 --repeat 2

Each recording goes to ``DIR/<name>/`` with a name that encodes the config
(``tp1-dp4-pp2-1f1b-wait-gb64-zero1-s2``, ``-r1`` and up for repeats). A folder whose
``run.json`` holds the same config is kept (``cached``); one with another config is recorded
again. ``--repeat N`` records the same job (same seed, so the same wait-mode draws) N times: the
spread between them is the machine's noise floor. Every other option is the generator's; the
ladder's defaults differ in ``--layers`` (8, so that pp up to 8 fits) and ``--tp`` (1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from prism_trace.datasets._config import JobConfig
from prism_trace.datasets.generate import (
    RECORDER_VERSION,
    add_job_arguments,
    generate,
    job_config,
    join_timeout_s,
)

__all__ = ["Recording", "main", "recording_name", "summary"]


def recording_name(cfg: JobConfig, repeat: int = 0) -> str:
    """The folder name of a recording: layout, schedule, compute, batch, ZeRO, steps, repeat."""
    batch = f"gb{cfg.global_batch}" if cfg.global_batch else f"mb{cfg.microbatches}"
    schedule = cfg.schedule if cfg.chunks == 1 else f"{cfg.schedule}-v{cfg.chunks}"
    parts = [f"tp{cfg.tp}", f"dp{cfg.dp}", f"pp{cfg.pp}", schedule, cfg.compute, batch]
    if cfg.zero:
        parts.append(f"zero{cfg.zero}")
    parts.append(f"s{cfg.steps}")
    if repeat:
        parts.append(f"r{repeat}")
    return "-".join(parts)


class Recording:
    """One planned recording: its folder and config."""

    def __init__(self, folder: Path, cfg: JobConfig) -> None:
        """Remember where and what."""
        self.folder, self.cfg = folder, cfg

    def clear(self) -> None:
        """Delete the files a recording writes (only those) from `folder`."""
        if self.folder.is_dir():
            for pattern in (
                "run.json",
                "rank*.kineto.json.gz",
                "rank*.et.json.gz",
                "rank*.steps.json",
            ):
                for f in self.folder.glob(pattern):
                    f.unlink()

    def cached(self) -> bool:
        """Whether `folder` already holds a complete recording of this very config."""
        path = self.folder / "run.json"
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return bool(
            run.get("config") == json.loads(json.dumps(self.cfg.to_json()))
            and run.get("recorder") == RECORDER_VERSION
        )


def summary(run_json: Path) -> str:
    """One line about a recording: ranks, mean and p90 step time (ms), the cores its ranks kept
    busy in the profiled steps (CPU time / wall time, summed over ranks: near the host's core
    count, the recording measures the host, not the job), wall time and host memory (PSS)."""
    run = json.loads(run_json.read_text())
    durs = sorted(
        s["dur_ns"] / 1e6 for r in run["ranks"] for s in r["steps"] if s.get("profiled", True)
    )
    p90 = durs[min(len(durs) - 1, int(0.9 * len(durs)))] if durs else float("nan")
    mean = statistics.fmean(durs) if durs else float("nan")
    wall = run.get("wall_s")
    pss = run.get("peak_pss_kb")
    busy = sum(_busy(r["steps"]) for r in run["ranks"])
    return (
        f"{run['world_size']:3d} ranks  step mean {mean:8.1f} ms  p90 {p90:8.1f} ms"
        f"  last step {_last_step_pct(run['ranks']):+5.1f} %"
        f"  cores busy {busy:4.1f}  wall {wall if wall is not None else float('nan'):6.1f} s"
        f"  host PSS {(pss or 0) / 1e6:5.2f} GB"
    )


def _last_step_pct(ranks: list[dict[str, Any]]) -> float:
    """The last profiled step's mean over ranks against the median of the steps between the first
    and the last, percent: a recorder that lets finished ranks work while others are still in
    their last step shows here (recorder 1: +18 % at 64 ranks on 2 cores)."""
    steps = [[s["dur_ns"] for s in r["steps"] if s.get("profiled", True)] for r in ranks]
    n = min((len(s) for s in steps), default=0)
    if n < 3:
        return float("nan")
    means = [statistics.fmean(s[i] for s in steps) for i in range(n)]
    middle = statistics.median(means[1:-1])
    return 100.0 * (means[-1] - middle) / middle


def _busy(steps: list[dict[str, object]]) -> float:
    """CPU time over wall time of one rank's profiled steps (0 when not recorded)."""
    prof = [s for s in steps if s.get("profiled", True) and "cpu_ns" in s]
    wall = sum(int(s["dur_ns"]) for s in prof)  # type: ignore[call-overload]
    return sum(int(s["cpu_ns"]) for s in prof) / wall if wall else 0.0  # type: ignore[call-overload]


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        msg = f"{text!r}: expected positive integers like 2,4,8"
        raise argparse.ArgumentTypeError(msg)
    return values


def _plan(argv: list[str] | None) -> list[Recording]:
    p = argparse.ArgumentParser(
        prog="python -m prism_trace.datasets.ladder", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, required=True, help="folder of the recordings")
    p.add_argument("--dp", type=_ints, default=[2, 4], help="comma-separated dp sizes")
    p.add_argument("--pp", type=_ints, default=[2], help="comma-separated pp sizes")
    p.add_argument("--tp", type=_ints, default=[1], help="comma-separated tp sizes")
    p.add_argument("--repeat", type=int, default=1, help="recordings of each job (noise floor)")
    add_job_arguments(p, layout=False)
    p.set_defaults(layers=8)
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error("--repeat must be at least 1")
    plan = []
    for tp in a.tp:
        for pp in a.pp:
            for dp in a.dp:
                cfg = job_config(p, a, dp=dp, tp=tp, pp=pp)
                for k in range(a.repeat):
                    plan.append(Recording(a.out / recording_name(cfg, k), cfg))
    return plan


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: record (or find cached) every recording of the ladder."""
    plan = _plan(argv)
    width = max(len(r.folder.name) for r in plan)
    for rec in plan:
        if rec.cached():
            print(f"{rec.folder.name:{width}s}  {summary(rec.folder / 'run.json')}  (cached)")
            continue
        rec.clear()  # another config's or an unfinished recording's files
        t0 = time.perf_counter()
        path = generate(rec.folder, rec.cfg, join_timeout_s=join_timeout_s(rec.cfg))
        took = time.perf_counter() - t0
        print(
            f"{rec.folder.name:{width}s}  {summary(path)}  (recorded in {took:.0f} s)", flush=True
        )


if __name__ == "__main__":
    main()

"""Accuracy of `prism run`: step times of one real rank whose peer is virtual, against a recording.

1. Records a real gloo job of 2 ranks (dp=2, tp=pp=1, 1 thread per rank: the generator's
   default) with ``python -m prism_trace.datasets.generate``; ``run.json`` holds every rank's
   measured step times (``time.perf_counter_ns`` around the unmodified ``train_step``). Then
   records it once more: that second recording against the first is the machine's noise floor.
2. ``prism ingest`` + ``prism graph`` it into a temporary store (run ``rec``).
3. Runs rank 0 of the same, unmodified training code (``datasets._train.run_rank``) under
   ``prism run --world 2 --ranks 0 --db DB --run rec`` (rank 1 virtual, following the emulated
   timeline of the recording), and once more without ``--db``/``--run`` (instant peers), each
   ``--repeat`` times.
4. Compares rank 0's step times measured by the script itself (profiled steps 1..steps) with the
   recorded ones: per step ``(replayed - recorded) / recorded``; the table gives the mean
   |error| over steps and the error of the mean step time, and the backend's own step times
   (``step_ms``, between profiler steps) stored as a replayed run (``prism run --out-run``,
   ``replay.launched_run``) and compared with the trace's ``ProfilerStep#`` spans by
   ``prism validate --replayed``. Target: <= 5 % on CPU.

Everything runs on CPU: on a shared machine the load during the recording and during the replay
differ, and rank 0's own compute time (which is real) moves with it; compare with the noise floor.

Usage::

    python benchmarks/bench_run_accuracy.py                  # 8 steps, 3 repeats, writes a note
    python benchmarks/bench_run_accuracy.py --steps 4 --repeat 1 --no-note
    python benchmarks/bench_run_accuracy.py rank --config RUN_JSON --out DIR   # the rank entry

The ``rank`` sub-command is what ``prism run`` starts: it rebuilds the recorded ``JobConfig``
from ``run.json`` and calls ``datasets._train.run_rank`` for ``$RANK``, exactly as the
generator's spawned processes do (its ``init_process_group("gloo", init_method=...)`` is
untouched; the launcher's shim routes it to the `prism` backend).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def rank_entry(config: Path, out: Path) -> None:
    """Train one rank of the recorded job: the generator's own entry, unmodified."""
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._model import ModelConfig
    from prism_trace.datasets._train import run_rank

    d = json.loads(config.read_text())["config"]
    cfg = JobConfig(**{**d, "model": ModelConfig(**d["model"])})
    out.mkdir(parents=True, exist_ok=True)
    run_rank(int(os.environ["RANK"]), cfg, out, 0)


def _steps(path: Path, rank: int) -> list[int]:
    """Profiled step durations (ns) of ``rank`` from ``run.json`` or ``rank<r>.steps.json``."""
    d = json.loads(path.read_text())
    if "ranks" in d:
        d = next(r for r in d["ranks"] if r["rank"] == rank)
    return [s["dur_ns"] for s in d["steps"] if s["profiled"]]


def _errors(replayed: list[int], recorded: list[int]) -> tuple[float, float, list[float]]:
    per = [100.0 * (a - b) / b for a, b in zip(replayed, recorded, strict=True)]
    mean_abs = statistics.fmean(abs(e) for e in per)
    of_mean = 100.0 * (statistics.fmean(replayed) / statistics.fmean(recorded) - 1.0)
    return mean_abs, of_mean, per


def _prism(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "prism_trace.cli", *args], check=True, cwd=REPO)


def main() -> None:
    """Record, replay rank 0 with a virtual rank 1, and print (and note) the step-time errors."""
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        ap = argparse.ArgumentParser(prog="bench_run_accuracy.py rank")
        ap.add_argument("--config", type=Path, required=True, help="run.json of the recording")
        ap.add_argument("--out", type=Path, required=True)
        a = ap.parse_args(sys.argv[2:])
        rank_entry(a.config, a.out)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="keep everything here")
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()

    sys.path.insert(0, str(HERE))
    from _common import host_kind, table, write_note
    from prism_trace.replay.pg.launch import launch

    load_before = os.getloadavg()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-run-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rec, db = work / "rec", work / "rec.duckdb"
        gen = [
            sys.executable,
            "-m",
            "prism_trace.datasets.generate",
            "--dp",
            "2",
            "--tp",
            "1",
            "--pp",
            "1",
        ]
        # Recorded twice: the second recording of the same job against the first is the noise
        # floor of this machine (no replay can be closer to the first recording than that).
        for out_dir in (rec, work / "rec2"):
            subprocess.run(
                [*gen, "--steps", str(args.steps), "--out", str(out_dir)],
                check=True,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        db.unlink(missing_ok=True)
        _prism("ingest", str(rec), "--db", str(db), "--run", "rec", "--quiet")
        _prism("graph", str(db), "--run", "rec")
        recorded = _steps(rec / "run.json", 0)
        rerecorded = _steps(work / "rec2" / "run.json", 0)
        from prism_trace.replay.pg.launched_run import write_launched_run
        from prism_trace.replay.validate.replayed import validate_replayed

        from prism_trace.store.connection import open_store

        results: dict[str, list[tuple[float, float, list[float], list[int], float]]] = {}
        backend_err: list[float] = []
        for mode in ("schedule", "instant"):
            for i in range(args.repeat):
                out = work / f"replay-{mode}-{i}"
                cmd = [sys.executable, str(Path(__file__).resolve()), "rank"]
                cmd += ["--config", str(rec / "run.json"), "--out", str(out)]
                peers = {"db": db, "run": "rec"} if mode == "schedule" else {}
                res = launch(cmd, world_size=2, ranks=[0], capture=True, timeout_s=300, **peers)
                if res.returncode:
                    log = (res.ranks[0].report or {}).get("log", "")
                    raise SystemExit(f"rank 0 failed under prism run ({mode}):\n{log[-3000:]}")
                replayed = _steps(out / "rank0.steps.json", 0)
                rep = res.ranks[0].report or {}
                waited = float(rep.get("waited_ms", 0.0))
                if mode == "schedule":  # stored as a replayed run: what `prism validate` says
                    with open_store(db) as store:
                        write_launched_run(
                            store,
                            run="rec",
                            out_run=f"live-{i}",
                            result=res,
                            command=cmd,
                            replace=True,
                        )
                        v = validate_replayed(store, replayed=f"live-{i}")
                    backend_err.append(float(v.iteration_time_error_pct or 0.0))
                results.setdefault(mode, []).append(
                    (*_errors(replayed, recorded), replayed, waited)
                )

        rows = [
            ("load average before (1, 5, 15 min)", " ".join(f"{x:.2f}" for x in load_before)),
            ("recorded rank-0 step times (ms)", " ".join(f"{t / 1e6:.1f}" for t in recorded)),
            ("re-recorded (ms)", " ".join(f"{t / 1e6:.1f}" for t in rerecorded)),
        ]
        floor = _errors(rerecorded, recorded)
        rows.append(
            (
                "re-recording: mean |step error| / error of mean",
                f"{floor[0]:.2f} % / {floor[1]:+.2f} % (noise floor of this machine)",
            )
        )
        summary: dict[str, float] = {}
        for mode, runs in results.items():
            for i, (mean_abs, of_mean, _, replayed, waited) in enumerate(runs):
                rows.append(
                    (
                        f"{mode} #{i}: step times (ms)",
                        " ".join(f"{t / 1e6:.1f}" for t in replayed),
                    )
                )
                rows.append(
                    (
                        f"{mode} #{i}: mean |step error| / error of mean / waited",
                        f"{mean_abs:.2f} % / {of_mean:+.2f} % / {waited:.1f} ms",
                    )
                )
            summary[mode] = statistics.median(r[0] for r in runs)
            summary[f"{mode}_of_mean"] = statistics.median(r[1] for r in runs)
        rows.append(
            (
                "median over repeats: mean |step error|",
                f"schedule {summary['schedule']:.2f} % (target <= 5 %), "
                f"instant {summary['instant']:.2f} %",
            )
        )
        rows.append(
            (
                "median over repeats: error of mean step",
                f"schedule {summary['schedule_of_mean']:+.2f} %, "
                f"instant {summary['instant_of_mean']:+.2f} %",
            )
        )
        rows.append(
            (
                "prism run --out-run + prism validate --replayed (schedule)",
                " / ".join(f"{e:.2f} %" for e in backend_err) + " mean |step error|",
            )
        )
        text = table(rows)
        print(text)
        if not args.no_note:
            cmd_line = f"python benchmarks/bench_run_accuracy.py --steps {args.steps} --repeat"
            cmd_line += f" {args.repeat}"
            note = write_note(
                "run-accuracy",
                host_kind(args.host_kind),
                title="prism run: rank 0 of a 2-rank gloo dp job with rank 1 virtual",
                command=cmd_line,
                body="```\n" + text + "\n```",
            )
            print(f"wrote {note}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What-ifs against a truth that really happened (issue 32): a straggler job and its clean twin.

The generator's wait mode (``python -m prism_trace.datasets.ladder --compute wait``) records a
pipeline x data-parallel job whose compute ops sleep seeded durations, so that 16 ranks share 2
cores without competing for them. Every draw is seeded by (seed, rank, step, micro-batch, op,
layer), so two recordings of one config differ only by the host's scheduling, and
``--straggler RANK@xFACTOR`` makes exactly one rank's ops FACTOR times as long: the *slow*
recording and its *clean* twin (the same job without ``--straggler``) are the same job but for
that one rank.

Two what-ifs are checked against the other twin:

- ``no-stragglers`` on a slow recording predicts the clean job's mean step;
- ``slow-ranks=RANK@FACTOR`` on a clean recording predicts the slow job's mean step.

The twins are recorded in turns (slow, clean, slow, clean, ...) so that a drift of the host
touches both, and each is recorded ``--repeat`` times: the spread of one twin's recordings is the
noise floor, what one recording says of another of the same job. The step is the mean over every
rank and every profiled step of the ``iteration`` table (what ``prism emulate`` prints).

Usage::

    python benchmarks/bench_whatif_truth.py --truth /work/ladder-truth        # writes a note
    python benchmarks/bench_whatif_truth.py --truth DIR --repeat 3 --no-note

Recordings are cached in ``--truth`` (``slow/``, ``clean/``; the ladder reuses a folder that holds
a complete recording of the same config), never in the repository.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import WAIT_JOB, host_kind, run, write_note  # noqa: E402

DEFAULT_TRUTH = Path(
    os.environ.get("PRISM_WHATIF_TRUTH", Path.home() / ".cache" / "prism-trace" / "whatif-truth")
)

# The ladder benchmark's wait-mode job (benchmarks/bench_predict.py): 2 layers a stage, 4
# micro-batches a rank, 50 ms a layer's forward, 6 profiled steps, 1F1B, gloo on CPU.
JOB = [*WAIT_JOB, "--microbatches", "4"]


def record(truth: Path, *, dp: int, pp: int, rank: int, factor: float, repeat: int) -> dict:
    """Record (or reuse) both twins ``repeat`` times, in turns; the folders of each twin."""
    twins = {"slow": ["--straggler", f"{rank}@x{factor:g}"], "clean": []}
    for k in range(1, repeat + 1):
        for twin, extra in twins.items():
            cmd = [
                sys.executable, "-m", "prism_trace.datasets.ladder", "--out", str(truth / twin),
                "--tp", "1", "--dp", str(dp), "--pp", str(pp), "--repeat", str(k), *JOB, *extra,
            ]  # fmt: skip
            for line in run(cmd).splitlines():
                if line.startswith("tp") and "(cached)" not in line:
                    print(f"  {twin}: {line}", flush=True)
    out: dict[str, list[Path]] = {}
    for twin in twins:
        here = (truth / twin).iterdir()
        folders = sorted(p for p in here if (p / "run.json").is_file() and f"dp{dp}-" in p.name)
        out[twin] = folders[:repeat]
    return out


def record_tp8(truth: Path, *, rank: int, factor: float) -> Path:
    """A Kineto TP8 recording (tp8 x dp1 x pp1, wait compute, gloo) with rank ``rank`` slow."""
    cmd = [
        sys.executable, "-m", "prism_trace.datasets.ladder", "--out", str(truth / "tp8"),
        "--tp", "8", "--dp", "1", "--pp", "1", "--heads", "8", *JOB,
        "--straggler", f"{rank}@x{factor:g}",
    ]  # fmt: skip
    for line in run(cmd).splitlines():
        if line.startswith("tp") and "(cached)" not in line:
            print(f"  tp8: {line}", flush=True)
    return next(p for p in sorted((truth / "tp8").iterdir()) if (p / "run.json").is_file())


def waits_removed(folder: Path, work: Path) -> dict:
    """On one recording: each rank's step total, replayed and without stragglers, and the time
    the ranks waited at their collectives (each from its arrival to the last peer's, summed over
    its collectives; the mean over ranks): no-stragglers should shorten each rank by at least 0
    and at most that mean wait, the time there was to remove. (Not each rank's own wait: the
    straggler waits least and gains most, since its own ops are what becomes typical.)"""
    import polars as pl
    from prism_trace.replay.emulate.config import EmulationConfig
    from prism_trace.replay.emulate.driver import emulate_in_memory
    from prism_trace.replay.whatif.config import WhatIfConfig

    from prism_trace import ingest, open_store

    with open_store(work / "tp8.duckdb") as store:
        ingest(store, [folder], run="tp8", progress=False)
        totals = {}
        for key, cfg in (
            ("replay", EmulationConfig()),
            ("ns", EmulationConfig(what_if=WhatIfConfig(no_stragglers=True))),
        ):
            _, iters = emulate_in_memory(store, run="tp8", config=cfg)
            totals[key] = dict(iters.group_by("rank").agg(pl.col("dur").sum()).iter_rows())
        rows = store.con.execute(
            "WITH x AS (SELECT c.rank, coalesce(c.kernel_ts, c.host_ts) AS t,"
            " max(coalesce(c.kernel_ts, c.host_ts)) OVER (PARTITION BY c.group_id, c.seq) AS last"
            " FROM collective c JOIN run r USING (run_id) WHERE r.name = 'tp8')"
            " SELECT rank, sum(last - t) FROM x GROUP BY 1 ORDER BY 1"
        ).fetchall()
    wait = statistics.mean(int(w) for _, w in rows)
    gain = [totals["replay"][r] - totals["ns"][r] for r in totals["replay"]]
    return {
        "ranks": len(gain),
        "replay_ms": statistics.mean(totals["replay"].values()) / 1e6,
        "ns_ms": statistics.mean(totals["ns"].values()) / 1e6,
        "min_gain_ms": min(gain) / 1e6,
        "max_gain_ms": max(gain) / 1e6,
        "wait_ms": wait / 1e6,
        "within": all(0 <= g <= wait for g in gain),
    }


def _mean_step(store: object, run: str) -> float:
    """Mean over every rank and step of ``run``'s iterations, ms."""
    row = store.con.execute(  # type: ignore[attr-defined]
        "SELECT avg(i.dur) / 1e6 FROM iteration i JOIN run r USING (run_id) WHERE r.name = ?",
        [run],
    ).fetchone()
    return float(row[0])


def measure(folders: dict[str, list[Path]], *, rank: int, factor: float, work: Path) -> dict:
    """Ingest every recording; run the what-ifs; every figure the table shows."""
    from prism_trace.replay.emulate.config import EmulationConfig
    from prism_trace.replay.emulate.driver import emulate_run
    from prism_trace.replay.whatif.config import parse_what_if

    from prism_trace import ingest, open_store

    out: dict = {"recorded": {}, "replay": {}, "whatif": {}}
    with open_store(work / "truth.duckdb") as store:
        for twin, paths in folders.items():
            for i, folder in enumerate(paths):
                name = f"{twin}-{i}"
                ingest(store, [folder], run=name, progress=False)
                out["recorded"][name] = _mean_step(store, name)
                emulate_run(store, run=name, out_run=f"{name}-replay", config=EmulationConfig())
                out["replay"][name] = _mean_step(store, f"{name}-replay")
                word = "no-stragglers" if twin == "slow" else f"slow-ranks={rank}@{factor:g}"
                cfg = EmulationConfig(what_if=parse_what_if([word]))
                emulate_run(store, run=name, out_run=f"{name}-whatif", config=cfg)
                out["whatif"][name] = (word, _mean_step(store, f"{name}-whatif"))
    return out


def _pct(a: float, b: float) -> float:
    return (a / b - 1) * 100


def table(fig: dict) -> tuple[str, dict]:
    """The result table and the headline figures."""
    rec = fig["recorded"]
    truth = {
        t: statistics.mean(v for k, v in rec.items() if k.startswith(t)) for t in ("slow", "clean")
    }
    lines = [
        "| recording | recorded step | replayed | what-if | predicted | target (other twin, mean)"
        " | error | error vs each recording of the other twin |",
        "|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for name, (word, pred) in fig["whatif"].items():
        other = "clean" if name.startswith("slow") else "slow"
        err = _pct(pred, truth[other])
        worst = max(worst, abs(err))
        each = ", ".join(f"{_pct(pred, v):+.2f} %" for k, v in rec.items() if k.startswith(other))
        lines.append(
            f"| {name} | {rec[name]:.1f} ms | {fig['replay'][name]:.1f} ms | `{word}` |"
            f" {pred:.1f} ms | {truth[other]:.1f} ms | {err:+.2f} % | {each} |"
        )
    floors = {}
    for t in ("slow", "clean"):
        v = [x for k, x in rec.items() if k.startswith(t)]
        floors[t] = (max(v) - min(v)) / statistics.mean(v) * 100 if len(v) > 1 else float("nan")
    text = "\n".join(lines) + (
        f"\n\nNoise floor (spread of one twin's recordings, max - min over mean): slow"
        f" {floors['slow']:.2f} %, clean {floors['clean']:.2f} %. Worst |error| {worst:.2f} %"
        f" (goal <= 4 %). The straggler costs {_pct(truth['slow'], truth['clean']):+.2f} % of the"
        " clean step.\n"
    )
    mono = all(
        (pred <= fig["replay"][n] if n.startswith("slow") else pred >= fig["replay"][n])
        for n, (_, pred) in fig["whatif"].items()
    )
    return text, {"worst": worst, "floors": floors, "monotone": mono}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--truth", type=Path, default=DEFAULT_TRUTH, help="recordings (a cache)")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=5, help="the slow rank")
    ap.add_argument("--factor", type=float, default=1.5, help="its ops take this much longer")
    ap.add_argument("--repeat", type=int, default=2, help="recordings of each twin (>= 2)")
    ap.add_argument("--no-note", action="store_true", help="do not write benchmarks/results")
    a = ap.parse_args()
    t0 = time.perf_counter()
    folders = record(a.truth, dp=a.dp, pp=a.pp, rank=a.rank, factor=a.factor, repeat=a.repeat)
    tp8 = record_tp8(a.truth, rank=3, factor=a.factor)
    with tempfile.TemporaryDirectory() as tmp:
        fig = measure(folders, rank=a.rank, factor=a.factor, work=Path(tmp))
        w = waits_removed(tp8, Path(tmp))
    text, head = table(fig)
    text += (
        f"\nKineto TP8 (tp8 x dp1 x pp1, wait compute, gloo, rank 3's ops {a.factor:g}x, 6 steps):"
        f" total per rank replayed {w['replay_ms']:.1f} ms, no-stragglers {w['ns_ms']:.1f} ms"
        f" (mean over ranks); each rank shortened by {w['min_gain_ms']:.1f} to"
        f" {w['max_gain_ms']:.1f} ms, against {w['wait_ms']:.1f} ms waited at the collectives"
        f" (mean over ranks, from each arrival to the last peer's); within [0, waits]:"
        f" {w['within']}.\n"
    )
    print(text)
    print(f"monotone (no-stragglers <= replay, slow-ranks >= replay): {head['monotone']}")
    if not a.no_note:
        command = (
            f"python benchmarks/bench_whatif_truth.py --truth {a.truth} --dp {a.dp} --pp {a.pp}"
            f" --rank {a.rank} --factor {a.factor:g} --repeat {a.repeat}"
        )
        body = (
            f"tp1 x dp{a.dp} x pp{a.pp}, wait compute, gloo, 1F1B; rank {a.rank}'s ops take"
            f" {a.factor:g}x (`--straggler {a.rank}@x{a.factor:g}`) in the slow twin; each twin"
            f" recorded {a.repeat} times, in turns where the cache did not hold them already"
            " (each folder's run.json has its time). The step is the mean over every rank and"
            " profiled step.\n\n"
            f"{text}\nMonotone (no-stragglers <= replay, slow-ranks >= replay): {head['monotone']}."
            f"\n\n{time.perf_counter() - t0:.0f} s in all."
        )
        note = write_note(
            "whatif-truth" if a.dp == 8 else f"whatif-truth-dp{a.dp}",
            host_kind(),
            title="What-ifs against a recorded straggler and its clean twin",
            command=command,
            body=body,
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()

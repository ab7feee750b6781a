"""What-ifs that remove stragglers, against ground truth.

``--source st`` (default): the shared Megatron ST op timeline against StragglerAnalysis's own
figures in ``result-ST.json``: the ``no-stragglers`` / ``no-launch-delay`` step times against
``step_t_noblk`` / ``step_t_nodelay`` (mean |per-step error|), and ``prism analyze slowdown --by
optype|stage|dp_rank`` against ``blocking_decompose_by_*`` (largest |difference|).

``--source generated``: records the same small gloo job three times with the trace generator,
clean (``--straggler R@0``), with rank R sleeping ``--seconds`` per step inside its forward, and
clean again (the two clean runs bracket the machine's drift), then emulates ``no-stragglers`` on
the straggler recording and compares its mean step with the clean recordings' mean step.

Run from the repository root::

    python benchmarks/bench_stragglers.py [--source st|generated] [--seconds 0.3] [--rank 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
from _common import dataset, host_kind, table, write_note
from prism_trace.replay.emulate import emulate_in_memory
from prism_trace.replay.emulate_types import EmulationConfig
from prism_trace.replay.slowdown import slowdown
from prism_trace.replay.whatif import WhatIfConfig

from prism_trace.ingest import ingest
from prism_trace.store import Store, open_store


def _emulated_steps(store: Store, run: str, **what_if: bool) -> dict[int, float]:
    """Seconds per iteration (the longest rank), emulated with the given what-if flags."""
    cfg = EmulationConfig(what_if=WhatIfConfig(**what_if))
    _, iters = emulate_in_memory(store, run=run, config=cfg)
    per = iters.group_by("iteration").agg(pl.col("dur").max())
    return {int(i): d / 1e9 for i, d in per.iter_rows()}


def _recorded_steps(store: Store, run: str) -> dict[int, float]:
    rows = store.con.execute(
        "SELECT iteration, max(dur) FROM iteration JOIN run USING (run_id) WHERE run.name = ?"
        " GROUP BY iteration",
        [run],
    ).fetchall()
    return {int(i): d / 1e9 for i, d in rows}


def bench_st() -> tuple[list[tuple[str, str]], str]:
    st = dataset("megatron-straggler-st-8rank")
    want = json.loads((st / "result-ST.json").read_text())
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(Path(tmp) / "st.duckdb")
        ingest(store, [st], run="st", progress=False)
        replay = _emulated_steps(store, "st")
        rec = _recorded_steps(store, "st")
        err = statistics.fmean(abs(replay[s] / rec[s] - 1) for s in rec) * 100
        rows.append(("replay: mean |step error| vs recorded", f"{err:.3f} %"))
        for flag, key in (("no_stragglers", "step_t_noblk"), ("no_launch_delay", "step_t_nodelay")):
            t0 = time.perf_counter()
            got = _emulated_steps(store, "st", **{flag: True})
            secs = time.perf_counter() - t0
            ref = {int(k): v for k, v in want[key].items()}
            err = statistics.fmean(abs(got[s] / v - 1) for s, v in ref.items()) * 100
            mean = statistics.fmean(got[s] for s in ref)
            rows.append(
                (
                    f"{flag.replace('_', '-')}: mean |step error| vs {key}",
                    f"{err:.2f} % (mean step {mean:.4f} s vs {statistics.fmean(ref.values()):.4f}"
                    f" s; {secs:.2f} s to emulate)",
                )
            )
        for by in ("optype", "stage", "dp_rank"):
            out = slowdown(store, "st", by=by)
            got_s = dict(zip(out["group"].to_list(), out["slowdown"].to_list(), strict=True))
            ref_s = want[f"blocking_decompose_by_{by}"]
            worst = max(ref_s, key=lambda g: abs(got_s.get(g, float("inf")) - ref_s[g]))
            diff = abs(got_s.get(worst, float("inf")) - ref_s[worst])
            rows.append(
                (
                    f"slowdown --by {by}: largest |S - StragglerAnalysis|",
                    f"{diff:.4f} ({worst}: {got_s.get(worst, float('nan')):.4f} vs"
                    f" {ref_s[worst]:.4f}; {len(ref_s)} groups)",
                )
            )
        overall = dict(zip(out["group"].to_list(), out["slowdown"].to_list(), strict=True))
        rows.append(
            (
                "slowdown (all): no-launch-delay / no-stragglers",
                f"{overall['all']:.4f} vs blocking_slowdown {want['blocking_slowdown']:.4f}",
            )
        )
        store.close()
    return rows, "ST op timeline vs StragglerAnalysis (result-ST.json)"


def _generate(out: Path, args: argparse.Namespace, seconds: float) -> float:
    from prism_trace.datasets.generate import main as generate_main

    t0 = time.perf_counter()
    job = f"--dp {args.dp} --tp {args.tp} --pp {args.pp} --microbatches {args.microbatches}"
    job += f" --steps {args.steps} --straggler {args.rank}@{seconds}"
    generate_main([*job.split(), "--out", str(out)])
    return time.perf_counter() - t0


def bench_generated(args: argparse.Namespace) -> tuple[list[tuple[str, str]], str]:
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = open_store(root / "g.duckdb")
        runs = (("clean", 0.0), ("straggler", args.seconds), ("clean2", 0.0))
        for name, secs in runs:
            _generate(root / name, args, secs)
            ingest(store, [root / name], run=name, progress=False)
        mean = {n: statistics.fmean(_recorded_steps(store, n).values()) for n, _ in runs}
        clean = (mean["clean"] + mean["clean2"]) / 2
        pred = statistics.fmean(_emulated_steps(store, "straggler", no_stragglers=True).values())
        own = statistics.fmean(_emulated_steps(store, "clean", no_stragglers=True).values())
        rows += [
            (
                "job",
                f"dp {args.dp} tp {args.tp} pp {args.pp}, {args.microbatches} micro-batches,"
                f" {args.steps} steps; rank {args.rank} sleeps {args.seconds} s per step",
            ),
            ("clean recordings: mean step", f"{mean['clean']:.4f} s, {mean['clean2']:.4f} s"),
            ("straggler recording: mean step", f"{mean['straggler']:.4f} s"),
            ("no-stragglers on the straggler recording", f"{pred:.4f} s"),
            ("  error vs the clean recordings' mean", f"{(pred / clean - 1) * 100:+.2f} %"),
            ("no-stragglers on the first clean recording", f"{own:.4f} s"),
        ]
        store.close()
    return rows, "no-stragglers on a recorded straggler vs the clean recording (generator)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", choices=["st", "generated"], default="st")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument("--host", default=None, help="host label in the result file name")
    args = p.parse_args()
    rows, title = bench_st() if args.source == "st" else bench_generated(args)
    body = table(rows)
    print(body)
    command = "python benchmarks/bench_stragglers.py " + " ".join(sys.argv[1:])
    theme = f"stragglers-{args.source}"
    if args.source == "generated":
        theme += f"-dp{args.dp}tp{args.tp}pp{args.pp}"
    note = write_note(
        theme,
        host_kind(args.host),
        title=title,
        command=command.strip(),
        body=f"```\n{body}\n```",
    )
    print(f"wrote {note}")


if __name__ == "__main__":
    main()

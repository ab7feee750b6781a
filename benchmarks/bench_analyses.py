"""Pipeline bubbles, critical path and run diff: wall time on the 8-rank real sets and the sample.

Ingests ``megatron-straggler-st-8rank``, ``param-dlrm-8rank`` and ``datasets/sample`` into a
temporary store, emulates each (which also builds its execution graph), then times every analysis
on the recorded and on the emulated run, each on a freshly opened read-only store so that loading
the SQL views is included (target: <= 2 s each). Prints a table; ``--note`` also writes
``results/analyses_<host>_<date>.md``. A script, not a test: no asserts on timings.

Usage::

    python benchmarks/bench_analyses.py [--note] [--repeat 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import REPO, dataset, host_kind, write_note
from prism_trace.analysis import (
    bubble_summary,
    bubbles,
    critical_path,
    critical_path_summary,
    run_diff,
)
from prism_trace.replay import emulate_run

from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store

SETS = {
    "st": "megatron-straggler-st-8rank",
    "dlrm": "param-dlrm-8rank",
    "sample": None,
}

ANALYSES: dict[str, Callable[[Store, str], object]] = {
    "bubbles (per stage)": lambda s, r: bubble_summary(s, r),
    "bubble windows": lambda s, r: bubbles(s, r),
    "critical path (rows)": lambda s, r: critical_path(s, r),
    "critical path summary": lambda s, r: critical_path_summary(s, r),
    "diff recorded vs emulated": lambda s, r: run_diff(s, r.removesuffix("_emu"), r),
}


def _time(db: Path, fn: Callable[[Store, str], object], run: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        with open_store(db, read_only=True) as store:  # fresh connection: views loaded again
            t0 = time.perf_counter()
            fn(store, run)
            best = min(best, time.perf_counter() - t0)
    return best


def _findings(db: Path) -> list[str]:
    """The figures docs/analysis.md quotes: ST per stage, ST and DLRM paths."""
    import polars as pl

    with open_store(db, read_only=True) as store:
        st = bubble_summary(store, "st")
        cp = critical_path_summary(store, "st")
        dl = critical_path(store, "dlrm")
    out = ["ST per stage: head ms per rank-step, bubble %, mean compute op ms"]
    for r in st.iter_rows(named=True):
        per = r["ranks"] * r["iterations"]
        out.append(
            f"  stage {r['stage']}: head {r['head_ns'] / per / 1e6:.0f} ms,"
            f" bubble {r['bubble_pct']:.1f} %, busy {r['busy_ns'] / per / 1e6:.0f} ms per step"
        )
    out.append(
        f"ST path_pct {cp['path_pct'].min():.2f}-{cp['path_pct'].max():.2f} %,"
        f" top op {cp['top_op'].mode().to_list()}"
    )
    runs = dl.with_columns((pl.col("rank") != pl.col("rank").shift(1)).alias("chg")).filter(
        pl.col("chg").fill_null(value=True)
    )
    out.append(
        "DLRM path ranks in order: "
        + " -> ".join(f"{r} ({n})" for r, n in zip(runs["rank"], runs["reason"], strict=True))
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--note", action="store_true", help="Write a dated note to results/.")
    parser.add_argument("--repeat", type=int, default=3, help="Best of this many runs.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "a.duckdb"
        with open_store(db) as store:
            for run, name in SETS.items():
                path = REPO / "datasets" / "sample" if name is None else dataset(name)
                ingest(store, [path], run=run, progress=False)
                emulate_run(store, run=run, out_run=f"{run}_emu")
        lines = [
            "| analysis | " + " | ".join(f"{r} | {r}_emu" for r in SETS) + " |",
            "|---|" + "---|" * (2 * len(SETS)),
        ]
        for label, fn in ANALYSES.items():
            cells = []
            for run in SETS:
                for r in (run, f"{run}_emu"):
                    if label.startswith("diff") and r == run:
                        cells.append("—")
                        continue
                    target = f"{run}_emu" if label.startswith("diff") else r
                    cells.append(f"{_time(db, fn, target, args.repeat):.2f} s")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += ["", *_findings(db)]
    body = "\n".join(lines)
    print(body)
    if args.note:
        note = write_note(
            "analyses",
            host_kind(),
            title="Bubbles, critical path and run diff: wall time (best of repeats, views loaded)",
            command="python benchmarks/bench_analyses.py --note",
            body=body,
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()

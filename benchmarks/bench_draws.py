"""Draws benchmark: do the variance mode's draws reproduce the recorded step-time distribution?

Ingests ``megatron-straggler-st-8rank`` (and the bundled ``datasets/sample``), slices each from
its dp-0 replica back to its recorded layout, emulates it in the variance mode under ``--seeds``
seeds (``replay.drawcheck``) and compares the pooled per-rank step times with the recorded ones:
two-sample KS statistic (and p-value), mean and p90 errors, the spread (emulated std over
recorded std), and the same figures for the slice without variance (what the draws start from).
A second row per set emulates the recorded run itself with variance (every rank draws): the draws
without the slice's bias.
Target: mean and p90 within 2 %.
Prints a table and writes ``results/draws_<host>_<date>.md`` unless ``--no-note``.

Usage::

    python benchmarks/bench_draws.py
    python benchmarks/bench_draws.py --seeds 10 --mode op --no-note
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import REPO, SHARED, host_kind, table, write_note

SETS = (
    ("st", SHARED / "megatron-straggler-st-8rank"),
    ("sample", REPO / "datasets" / "sample"),
)


def main() -> None:
    """Run the check on each set and print (and note) the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--mode", choices=("replica", "iteration", "op"), default="replica")
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()

    from prism_trace.replay.validate.draws import check_draws

    from prism_trace.graph.build import build_graph
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    rows = []
    with tempfile.TemporaryDirectory() as tmp, open_store(Path(tmp) / "d.duckdb") as store:
        for name, path in SETS:
            if not path.exists():
                rows.append((name, f"skipped: {path} absent"))
                continue
            ingest(store, [path], run=name, progress=False)
            build_graph(store, name)
            for sliced in (True, False):
                d = check_draws(
                    store, run=name, seeds=args.seeds, mode=args.mode, sliced=sliced
                ).as_dict()
                ok = abs(d["mean_error_pct"]) <= 2 and abs(d["p90_error_pct"]) <= 2
                what = f"slice from {d['slice_ranks']}" if sliced else "the recorded run itself"
                rows.append(
                    (
                        name if sliced else f"{name}, recorded",
                        f"KS D {d['ks_statistic']:.3f} (p {d['ks_p_value']:.3f});"
                        f" mean {d['mean_error_pct']:+.2f} %, p90 {d['p90_error_pct']:+.2f} %,"
                        f" std x{d['std_ratio']:.2f}; without variance KS D"
                        f" {d['baseline_ks_statistic']:.3f},"
                        f" mean {d['baseline_mean_error_pct']:+.2f} %"
                        f" ({d['recorded_samples']} recorded vs {d['emulated_samples']} emulated"
                        f" rank-steps, {what}); mean/p90 <= 2 %: {'met' if ok else 'MISSED'}",
                    )
                )
    text = table(rows)
    print(text)
    if args.no_note:
        return
    note = write_note(
        f"draws_{args.mode}",
        host_kind(args.host_kind),
        title=f"variance draws vs the recording ({args.mode} mode, {args.seeds} seeds)",
        command=f"python benchmarks/bench_draws.py --seeds {args.seeds} --mode {args.mode}",
        body=f"```\n{text}\n```",
    )
    print(f"note: {note}")


if __name__ == "__main__":
    main()

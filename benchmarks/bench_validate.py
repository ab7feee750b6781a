"""Validation benchmark: replay and slice fidelity of the emulator on the real 8-rank sets.

Ingests ``megatron-straggler-st-8rank`` (slice from ranks 0,2,4,6: the dp_rank 0 replica),
``param-dlrm-8rank`` and the bundled gloo ``datasets/sample`` (slice from their dp-coordinate-0
ranks) into a temporary store and runs ``validate_run`` on each. Targets: replay error <= 0.1 %
on all three, slice error <= 3 % on ST. Prints a table (mean |iteration-time error| over
iterations, and the worst single rank-iteration; the peak-memory error of replay and slice, mean
|error| over ranks, where the run has memory events) and writes
``results/validate_<host>_<date>.md`` unless ``--no-note``.

Usage::

    python benchmarks/bench_validate.py
    python benchmarks/bench_validate.py --completion common --no-note
    python benchmarks/bench_validate.py --variance iteration --seeds 5

``--variance`` adds the variance-mode check of the slice (``prism validate --variance``): the
mean-iteration-time error (signed) of the deterministic slice and of the variance mode, and the
variance mode's mean |per-iteration error|.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import REPO, SHARED, host_kind, write_note

SETS = (
    ("st", SHARED / "megatron-straggler-st-8rank", [0, 2, 4, 6], 0.1, 3.0),
    ("dlrm", SHARED / "param-dlrm-8rank", None, 0.1, None),
    ("sample", REPO / "datasets" / "sample", None, 0.1, None),
)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f} %"


def main() -> None:
    """Run the validations and print (and note) the errors."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--completion", choices=("per_rank", "common"), default="per_rank")
    ap.add_argument("--variance", choices=("replica", "iteration", "op"), default=None)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()

    from prism_trace.replay.emulate.config import CompletionConfig, EmulationConfig
    from prism_trace.replay.validate.emulated import validate_run

    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    config = EmulationConfig(completion=CompletionConfig(rule=args.completion))
    header = (
        "set",
        "iters",
        "replay err",
        "replay worst",
        "slice from",
        "slice err",
        "slice worst",
        "peak mem replay",
        "peak mem slice",
        "targets",
    )
    if args.variance:
        header = (*header, "slice mean-iter", f"{args.variance} err", f"{args.variance} mean-iter")
    rows = [header]
    for name, path, ranks, replay_target, slice_target in SETS:
        if not path.is_dir():
            rows.append((name, "-", "missing", *[""] * (len(header) - 4), str(path)))
            continue
        with tempfile.TemporaryDirectory() as tmp, open_store(Path(tmp) / "v.duckdb") as store:
            ingest(store, [path], run=name, progress=False)
            rep = validate_run(
                store,
                run=name,
                slice_ranks=ranks,
                config=config,
                variance=args.variance,
                seeds=args.seeds,
            )
        d = rep.as_dict()
        met = [
            f"replay <= {replay_target} %: "
            + ("met" if d["replay_iteration_time_error_pct"] <= replay_target else "MISSED")
        ]
        if slice_target is not None and d["slice_iteration_time_error_pct"] is not None:
            ok = d["slice_iteration_time_error_pct"] <= slice_target
            met.append(f"slice <= {slice_target} %: {'met' if ok else 'MISSED'}")
        rows.append(
            (
                name,
                str(len(rep.replay)),
                _pct(d["replay_iteration_time_error_pct"]),
                _pct(d["replay_max_rank_error_pct"]),
                ",".join(map(str, rep.slice_ranks or [])),
                _pct(d["slice_iteration_time_error_pct"]),
                _pct(d["slice_max_rank_error_pct"]),
                _pct(d["peak_memory_error_pct"]),
                _pct(d["slice_peak_memory_error_pct"]),
                "; ".join(met),
            )
            + (
                (
                    _pct(d["slice_mean_iteration_time_error_pct"]),
                    _pct(d["variance_iteration_time_error_pct"]),
                    _pct(d["variance_mean_iteration_time_error_pct"]),
                )
                if args.variance
                else ()
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
    print(f"completion model: {args.completion}")
    print(table)
    if args.no_note:
        return
    note = write_note(
        "validate" + (f"_variance_{args.variance}" if args.variance else ""),
        host_kind(args.host_kind),
        title="validate: emulator replay and slice fidelity on the 8-rank sets",
        command=f"python benchmarks/bench_validate.py --completion {args.completion}"
        + (f" --variance {args.variance} --seeds {args.seeds}" if args.variance else ""),
        body=f"```\n{table}\n```\n\n"
        "Errors: mean over iterations of |emulated - recorded| / recorded of the iteration time"
        " (mean over ranks); worst: the largest error of one rank's iteration; peak mem: mean"
        " over ranks of |emulated - recorded| / recorded of the peak `total_allocated` (n/a:"
        " no memory events in the recording).",
    )
    print(f"note: {note}")


if __name__ == "__main__":
    main()

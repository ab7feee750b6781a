"""Replay accuracy on CPU: a real 2-rank gloo run, rank 0 replayed with rank 1 as a virtual peer.

1. Record a real gloo run of 2 ranks on all ranks with the dataset generator
   (``datasets.generate``; one process and ``torch.set_num_threads(1)`` per rank, so the two
   ranks can have a core each), layout ``--layout`` (default ``pp=2``: rank 0 waits for rank 1's
   pipeline stage, so the virtual peer's timing matters).
2. Ingest it and build its graph.
3. Replay rank 0 alone (``replay_run``, 1 thread), rank 1 virtual, once per ``--instrument``:
   ``none`` (the ops as they are) and ``profiler`` (under the recording's instrumentation, whose
   per-op cost every recorded duration includes; docs/replay.md).
4. ``validate_replayed``: iteration-time error per iteration and of the mean, and peak-memory
   error, against the recording. Target on CPU: <= 5 %.

``--repeat N`` makes N fresh recordings and replays each: the machine's speed drifts by tens of
per cent within seconds on a shared host (``bench_machine_drift.py``), so one recording's figure
is one draw; the summary gives each recording's errors and their medians.

``--ranks 0,1`` replays both ranks for real instead, together (one process each, their
communication through gloo, ``replay.real_comm``): no virtual peer is left, so this measures the
kernel replay and the real communication alone.

Prints a table and writes ``results/replay-accuracy_<host>_<date>.md`` unless ``--no-note``.

Usage::

    python benchmarks/bench_replay_accuracy.py
    python benchmarks/bench_replay_accuracy.py --layout dp=2 --steps 4 --iterations 5
    python benchmarks/bench_replay_accuracy.py --layout dp=2 --steps 5 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _common import host_kind, table, write_note


def _layout(spec: str) -> dict[str, int]:
    out = {"dp": 1, "tp": 1, "pp": 1}
    for part in spec.split(","):
        k, _, v = part.partition("=")
        out[k.strip()] = int(v)
    if out["dp"] * out["tp"] * out["pp"] != 2:
        raise SystemExit(f"--layout {spec}: the experiment is 2 ranks")
    return out


def _record_and_replay(
    root: Path, args: argparse.Namespace, lay: dict[str, int], ranks: list[int]
) -> tuple[list[tuple[str, str]], dict[str, dict]]:
    """One fresh recording under ``root``, replayed once per ``--instrument``: rows, results."""
    from dataclasses import replace

    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._model import ModelConfig
    from prism_trace.datasets.generate import generate
    from prism_trace.replay.hybrid.options import KernelReplayOptions
    from prism_trace.replay.hybrid.replay import replay_run
    from prism_trace.replay.validate.replayed import validate_replayed

    from prism_trace.graph.build import build_graph
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    root.mkdir(parents=True, exist_ok=True)
    rec_dir = root / "recording"
    t0 = time.perf_counter()
    cfg = JobConfig(
        **lay,
        steps=args.steps,
        microbatches=args.microbatches,
        model=replace(ModelConfig(), hidden=args.hidden),
    )
    generate(rec_dir, cfg)
    t_gen = time.perf_counter() - t0
    store = open_store(root / "acc.duckdb")
    ingest(store, [rec_dir], run="rec", progress=False, replace=True)
    build_graph(store, "rec")
    rows: list[tuple[str, str]] = [
        ("recording", f"{args.layout}, {args.steps} profiled steps, generated in {t_gen:.1f} s"),
    ]
    results = {}
    for inst in [s for s in args.instrument.split(",") if s]:
        opts = KernelReplayOptions(
            iterations=args.iterations,
            warmup=args.warmup,
            threads=1,
            instrument=inst,  # type: ignore[arg-type]
        )
        rep = replay_run(
            store, run="rec", ranks=ranks, out_run=f"rep-{inst}", options=opts, replace=True
        )
        v = validate_replayed(store, replayed=f"rep-{inst}")
        r = rep.ranks[0]
        results[inst] = {"replay": rep.as_dict(), "validation": v.as_dict()}
        its = ", ".join(
            f"#{e.iteration} {e.emulated_ns / 1e6:.1f}/{e.recorded_ns / 1e6:.1f} ms"
            f" ({e.error_pct:+.2f} %)"
            for e in v.iterations
        )
        rows += [
            (f"[{inst}] supported ops", f"{r.support['supported']}/{r.support['compute_units']}"),
            (f"[{inst}] iterations replayed/recorded", its),
            (
                f"[{inst}] iteration-time error",
                f"mean |error| {v.iteration_time_error_pct:.2f} %,"
                f" error of the mean {v.mean_iteration_error_pct:+.2f} %",
            ),
            (
                f"[{inst}] peak memory error",
                "n/a"
                if v.peak_memory_error_pct is None
                else ", ".join(
                    f"rank {m.rank} {m.emulated} / {m.recorded} B ({m.error_pct:+.2f} %)"
                    for m in v.memory  # type: ignore[union-attr]
                ),
            ),
            (
                f"[{inst}] op / comm / gap time",
                f"{r.op_ns / 1e6:.1f} / {r.comm_ns / 1e6:.1f} /"
                f" {r.gap_ns / 1e6:.1f} ms (representative pass)",
            ),
        ]
        if r.call_overhead:  # the calibration ran (--instrument profiler)
            c = r.call_overhead
            rows.append(
                (
                    f"[{inst}] call cost outside the spans",
                    f"{c['ns_per_pass'] / 1e6:.1f} ms per pass taken off the recorded gaps"
                    f" ({c['matched_units']}/{c['units']} ops matched)",
                )
            )
    store.close()
    (root / "results.json").write_text(json.dumps(results, indent=1))
    return rows, results


def _summary(runs: list[dict[str, dict]]) -> list[tuple[str, str]]:
    """Per instrument, each recording's mean |error| and error of the mean, and their medians."""
    rows = []
    for inst in runs[0]:
        vals = [r[inst]["validation"] for r in runs]
        abs_err = [v["iteration_time_error_pct"] for v in vals]
        mean_err = [v["mean_iteration_error_pct"] for v in vals]
        mem = [v["peak_memory_error_pct"] for v in vals if v["peak_memory_error_pct"] is not None]
        means = ", ".join(f"{x:+.2f}" for x in mean_err)
        rows.append(
            (
                f"[{inst}] over {len(runs)} recordings",
                f"mean |error| median {statistics.median(abs_err):.2f} %"
                f" ({', '.join(f'{x:.2f}' for x in abs_err)}); error of the mean median"
                f" {statistics.median(mean_err):+.2f} % ({means})"
                + (f"; peak memory |error| median {statistics.median(mem):.3f} %" if mem else ""),
            )
        )
    return rows


def main() -> None:
    """Record, replay, validate, ``--repeat`` times; print (and note) the errors."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="pp=2", help="2 ranks: pp=2, dp=2 or tp=2")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps of the recording")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=3, help="measured replay passes")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--instrument", default="none,profiler")
    ap.add_argument("--ranks", default="0", help="ranks replayed for real: 0 or 0,1 (together)")
    ap.add_argument("--repeat", type=int, default=1, help="fresh recordings, each replayed")
    ap.add_argument("--keep", type=Path, default=None, help="keep the recordings and stores here")
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()

    lay = _layout(args.layout)
    base = args.keep or Path(tempfile.mkdtemp(prefix="prism-replay-acc-"))
    ranks = [int(r) for r in args.ranks.split(",")]
    rows: list[tuple[str, str]] = []
    runs = []
    for i in range(args.repeat):
        r_rows, results = _record_and_replay(base / f"rec{i}", args, lay, ranks)
        prefix = f"#{i + 1} " if args.repeat > 1 else ""
        rows += [(prefix + k, v) for k, v in r_rows]
        runs.append(results)
    if args.repeat > 1:
        rows += _summary(runs)
    body = table(rows)
    print(body)
    if not args.no_note:
        cmd = "python benchmarks/bench_replay_accuracy.py " + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in (
                ("layout", args.layout),
                ("steps", args.steps),
                ("iterations", args.iterations),
                ("ranks", args.ranks),
                ("repeat", args.repeat),
            )
        )
        together = len(ranks) > 1
        note = write_note(
            "replay-accuracy-"
            + args.layout.replace("=", "").replace(",", "-")
            + ("-together" if together else ""),
            host_kind(args.host_kind),
            title="Replay accuracy: 2-rank gloo run, "
            + ("both ranks replayed together" if together else "rank 0 replayed, rank 1 virtual"),
            command=cmd,
            body="```\n" + body + "\n```",
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()

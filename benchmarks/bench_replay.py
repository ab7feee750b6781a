"""Replay overhead: time the replay machinery adds between ops, against the ops' own time.

``replay_run`` executes a rank's ops as generated straight-line code; between two ops it reads
the clock, drops dead tensors and rebuilds the occasional view. With ``gaps="none"`` (ops back to
back) every ns between the end of one unit and the start of the next is machinery; the figure is
``sum(between) / sum(op time)`` per measured pass (``RankReplay.overhead_pct_passes``), the median
over passes reported. Target: <= 2 %. On a shared host the OS preempts the replay a few times
per pass, on a different unit each time; the *typical* figure
(``RankReplay.overhead_typical_pct``) takes each unit's median over the passes before summing,
which keeps what every pass pays and drops those preemptions.

The instrumentation alone (``KernelReplayOptions.bare_passes``): the same ops, views, allocations
and frees rendered without clock reads or hooks (the *bare* pass), alternating with timed passes
that run their ops back to back (the virtual peers not waited for); the timed pass's wall time
beyond the bare one's (less its communication spans), as % of the bare one, median over the pairs.
This is the cost of timing every op, apart from the views and frees that executing the ops needs.
Their op time also shows how much slower the same ops run in the measured passes, each burst of
ops coming after a wait for the virtual peers (the sample waits ~0.5 s per pass).

Also with ``gaps="recorded"`` (the default of ``prism replay``): the replay spends the recorded host
gap before each op, counted from the end of the previous op, so its own work between ops (clock
reads, frees, views) happens inside that gap; what it adds to the timeline is only the time
*beyond* the recorded gap (``max(between - gap, 0)``), the second figure per set.

Sets: rank 0 of the bundled sample (tiny ops: hidden 64, median op a few us) and a generated
1-rank run of a larger model (``--hidden``, ``--seq``), where ops take tens of us, as in real
training. 1 CPU thread.

Usage::

    python benchmarks/bench_replay.py
    python benchmarks/bench_replay.py --passes 20 --hidden 512 --no-note
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from _common import REPO, host_kind, table, write_note


def _measure(
    store: object,
    run: str,
    rank: int,
    passes: int,
    gaps: str = "none",
    wait: str = "auto",
    pairs: int = 0,
    device: str = "cpu",
) -> dict[str, float]:
    """The overhead figures of replaying `rank` of `run` on `device` (``scripts/gpu-check``
    measures GPU kernels with it)."""
    from prism_trace.replay.hybrid.options import KernelReplayOptions
    from prism_trace.replay.hybrid.replay import replay_run

    opts = KernelReplayOptions(
        iterations=passes,
        warmup=2,
        gaps=gaps,  # type: ignore[arg-type]
        memory=False,
        threads=1,
        wait=wait,  # type: ignore[arg-type]
        bare_passes=pairs,
        device=device,  # type: ignore[arg-type]
    )
    rep = replay_run(
        store,
        run=run,
        ranks=[rank],
        out_run=f"{run}-overhead",
        options=opts,  # type: ignore[arg-type]
        replace=True,
    )
    r = rep.ranks[0]
    ov = r.overhead_pct_passes
    # The same ops' recorded durations (they include the recording's profiler and ET observer).
    ((rec_ns,),) = store.con.execute(  # type: ignore[attr-defined]
        "SELECT sum(rec.dur) FROM event rp JOIN run p ON p.run_id = rp.run_id"
        " JOIN et_op o ON o.run_id = p.parent_run_id AND o.rank = rp.rank"
        " AND o.node_id = rp.event_id JOIN event rec ON rec.run_id = o.run_id"
        " AND rec.rank = o.rank AND rec.event_id = o.event_id"
        " WHERE rp.run_id = ? AND rp.category = 'cpu_op'",
        [rep.run_id],
    ).fetchall()
    units = r.support["compute_units"] + r.support["comm_units"]
    inst = r.instrumentation_pct_passes or [0.0]
    bare = statistics.median(r.bare_ns) if r.bare_ns else 0.0
    return {
        "instr_pct": statistics.median(inst),
        "instr_min": min(inst),
        "instr_max": max(inst),
        "bare_ms": bare / 1e6,
        "paired_op_ms": statistics.median(r.paired_op_ns) / 1e6 if r.paired_op_ns else 0.0,
        "instr_ns_per_unit": statistics.median(inst) * bare / 100 / max(units, 1),
        "ops": r.support["compute_units"],
        "op_ms": r.op_ns / 1e6,
        "median_pct": statistics.median(ov),
        "typical_pct": r.overhead_typical_pct,
        "min_pct": min(ov),
        "max_pct": max(ov),
        "per_op_ns": r.overhead_ns / max(r.support["compute_units"], 1),
        "recorded_op_ms": (rec_ns or 0) / 1e6,
    }


def main() -> None:
    """Measure and print (and note) the overhead."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument(
        "--pairs",
        type=int,
        default=100,
        help="timed/bare pass pairs (KernelReplayOptions.bare_passes)",
    )
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--wait", default="auto", help="KernelReplayOptions.wait: auto (spins here), spin or sleep"
    )
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()

    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._model import ModelConfig
    from prism_trace.datasets.generate import generate

    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    tmp = Path(tempfile.mkdtemp(prefix="prism-replay-bench-"))
    store = open_store(tmp / "b.duckdb")
    ingest(store, [REPO / "datasets" / "sample"], run="sample", progress=False)
    t0 = time.perf_counter()
    model = replace(ModelConfig(), hidden=args.hidden, seq=args.seq)
    generate(tmp / "big", JobConfig(dp=1, tp=1, pp=1, steps=2, microbatches=2, model=model))
    ingest(store, [tmp / "big"], run="big", progress=False)
    rows: list[tuple[str, str]] = []
    for label, run in (
        ("sample rank 0 (hidden 64)", "sample"),
        (f"1-rank hidden {args.hidden} seq {args.seq}", "big"),
    ):
        m = _measure(store, run, 0, args.passes, wait=args.wait, pairs=args.pairs)
        g = _measure(store, run, 0, args.passes, gaps="recorded", wait=args.wait)
        rows.append(
            (
                label,
                f"{m['ops']:.0f} ops, {m['op_ms']:.1f} ms of op time per pass (recorded, with the"
                f" profiler: {m['recorded_op_ms']:.1f} ms); machinery"
                f" {m['median_pct']:.2f} % of op time (median of {args.passes} passes; min"
                f" {m['min_pct']:.2f}, max {m['max_pct']:.2f}; typical {m['typical_pct']:.2f});"
                f" {m['per_op_ns']:.0f} ns per op",
            )
        )
        rows.append(
            (
                "  instrumentation vs bare pass",
                f"{m['bare_ms']:.1f} ms per bare pass (ops, views, frees; no clock, no hooks);"
                f" the timed pass (peers not waited for: {m['paired_op_ms']:.1f} ms of op time)"
                f" spends {m['instr_pct']:.2f} % more (median of {args.pairs} alternating pairs;"
                f" min {m['instr_min']:.2f}, max {m['instr_max']:.2f});"
                f" {m['instr_ns_per_unit']:.0f} ns per unit",
            )
        )
        rows.append(
            (
                "  with recorded gaps (default)",
                f"{g['op_ms']:.1f} ms of op time per pass; beyond the recorded gaps"
                f" {g['median_pct']:.2f} % of op time (median; min"
                f" {g['min_pct']:.2f}, max {g['max_pct']:.2f}; typical {g['typical_pct']:.2f});"
                f" {g['per_op_ns']:.0f} ns per op",
            )
        )
    store.close()
    body = table(rows)
    print(body)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if not args.no_note:
        note = write_note(
            "replay-overhead" + ("" if args.wait == "auto" else f"-{args.wait}"),
            host_kind(args.host_kind),
            title="Replay machinery overhead (gaps none and recorded, 1 thread)",
            command=f"python benchmarks/bench_replay.py --passes {args.passes} --pairs {args.pairs}"
            f" --hidden {args.hidden} --seq {args.seq} --wait {args.wait}",
            body="```\n" + body + "\n```",
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()

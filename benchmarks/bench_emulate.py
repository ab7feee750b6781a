"""Emulation benchmark: the 8-rank Megatron op timeline sliced to 8192 ranks (dp=2048,pp=4).

Ingests ``megatron-straggler-st-8rank`` into a temporary store, builds its graph, slices it to
``dp=2048,pp=4`` (world 8192), then times ``emulate_run`` on the sliced run ``--repeat`` times
(each into a fresh run name, so every repetition writes everything). Target: at most 30 s.
Prints a table (with events/s: nodes of the whole world, i.e. class nodes x class members, per
second of the DES core and of the whole call) and writes ``results/emulate_<host>_<date>.md``
unless ``--no-note``.

Usage::

    python benchmarks/bench_emulate.py
    python benchmarks/bench_emulate.py --dp 4096 --repeat 3 --no-note
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import dataset, host_kind, table, write_note

TARGET_S = 30.0


def main() -> None:
    """Run the benchmark and print (and note) the timings."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2048, help="target data-parallel size (pp stays 4)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()

    from prism_trace.graph import build_graph
    from prism_trace.ingest import ingest
    from prism_trace.parallel import ParallelLayout
    from prism_trace.slicing import slice_run
    from prism_trace.store import open_store
    from replay.run import emulate_run

    st = dataset("megatron-straggler-st-8rank")
    layout = ParallelLayout.parse(f"dp={args.dp},pp=4")
    with tempfile.TemporaryDirectory() as tmp, open_store(Path(tmp) / "b.duckdb") as store:
        ingest(store, [st], run="st", progress=False)
        build_graph(store, "st")
        t = time.perf_counter()
        slice_run(store, run="st", layout=layout, world=layout.world_size, out_run="big")
        slice_s = time.perf_counter() - t
        times = []
        report = None
        for i in range(args.repeat):
            t = time.perf_counter()
            report = emulate_run(store, run="big", out_run=f"emu{i}")
            times.append(time.perf_counter() - t)
        ((n_iter,),) = store.con.execute(
            "SELECT count(*) FROM iteration WHERE run_id = ?", [report.run_id]
        ).fetchall()
    assert report is not None
    best = min(times)
    core = report.seconds["emulate"]
    rows = [
        (f"slice to {layout.world_size} ranks", f"{slice_s:.2f} s"),
        (f"emulate_run (best of {args.repeat})", f"{best:.2f} s"),
        ("emulate_run, all repetitions", ", ".join(f"{x:.2f}" for x in times) + " s"),
        (
            "  of which load / DES core / write (last run)",
            f"{report.seconds['load']:.2f} / {core:.3f} / {report.seconds['write']:.2f} s",
        ),
        (
            "units (classes) / nodes simulated / world events",
            f"{report.units} / {report.nodes} / {report.represented_events:,}",
        ),
        (
            "instances: collectives / send-recv pairs; DES rounds",
            f"{report.collective_instances} / {report.p2p_instances}; {report.rounds}",
        ),
        ("events/s, DES core", f"{report.represented_events / core:,.0f}"),
        ("events/s, whole emulate_run", f"{report.represented_events / best:,.0f}"),
        ("rows written: event / iteration", f"{report.events_written} / {n_iter}"),
        ("target", f"<= {TARGET_S:.0f} s: {'met' if best <= TARGET_S else 'MISSED'}"),
    ]
    text = table(rows)
    print(text)
    if args.no_note:
        return
    note = write_note(
        "emulate",
        host_kind(args.host_kind),
        title=f"emulate: megatron-straggler-st-8rank sliced to dp={args.dp},pp=4"
        f" ({layout.world_size} ranks)",
        command=f"python benchmarks/bench_emulate.py --dp {args.dp} --repeat {args.repeat}",
        body=f"```\n{text}\n```",
    )
    print(f"note: {note}")


if __name__ == "__main__":
    main()

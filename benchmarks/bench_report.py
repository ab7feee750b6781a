"""Report and Perfetto-export benchmark: the bundled sample, its 8192-rank emulation, and DLRM.

Ingests ``datasets/sample`` (and ``param-dlrm-8rank`` when the shared datasets are present),
slices the sample to ``tp=2,dp=2048,pp=2`` (world 8192) and emulates it, then times
``write_report`` and ``export_perfetto`` on each run and, when playwright and Chromium are
installed, how long headless Chromium takes to render each report. The 8192-rank report's
times are also given as a ratio to the sample's, measured in the same run: a report draws one
lane group per class, so the ratio stays near 1 (tests/analysis/test_report.py checks what is
drawn; the time is measured only here). A script, not a test.

Usage::

    python benchmarks/bench_report.py [--keep DIR] [--note]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from datetime import date
from pathlib import Path

from _common import HERE, REPO, SHARED

CHROMIUM = os.environ.get("PRISM_CHROMIUM", "/usr/bin/chromium")


def render_seconds(html: Path, profile: Path) -> float | None:
    """Seconds from navigation until every plotly graph of ``html`` is drawn, or None."""
    try:
        from playwright.sync_api import sync_playwright
        from prism_trace.analysis.report.html import DRAWN_JS
    except ImportError:
        return None
    if not Path(CHROMIUM).exists():
        return None
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"],
        )
        page = ctx.new_page()
        t0 = time.perf_counter()
        page.goto(html.resolve().as_uri(), wait_until="load", timeout=120_000)
        page.wait_for_function(DRAWN_JS, timeout=120_000)
        seconds = time.perf_counter() - t0
        ctx.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, default=None, help="Write the outputs here and keep.")
    parser.add_argument("--note", action="store_true", help="Write a dated note to results/.")
    args = parser.parse_args()

    from prism_trace.analysis.report.html import write_report
    from prism_trace.replay import emulate_run

    from prism_trace.export.perfetto import export_perfetto
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.slicer import slice_run
    from prism_trace.store.connection import open_store

    lines = [
        "| run | lanes / world | report MiB | report s | render s | perfetto MiB | export s |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        store = open_store(Path(tmp) / "b.duckdb")
        ingest(store, [REPO / "datasets" / "sample"], run="sample", progress=False)
        slice_run(
            store,
            run="sample",
            layout=ParallelLayout.parse("tp=2,dp=2048,pp=2"),
            world=8192,
            out_run="sample8192",
        )
        emulate_run(store, run="sample8192", out_run="sample8192_emu")
        runs = ["sample", "sample8192_emu"]
        if (SHARED / "param-dlrm-8rank").is_dir():
            ingest(store, [SHARED / "param-dlrm-8rank"], run="dlrm", progress=False)
            runs.append("dlrm")
        times: dict[str, tuple[float, float | None]] = {}
        for i, run in enumerate(runs):
            rep = write_report(store, run=run, out=out / f"{run}.html")
            exp = export_perfetto(store, run=run, out=out / f"{run}.json.gz")
            render = render_seconds(out / f"{run}.html", Path(tmp) / f"profile{i}")
            world = store.con.execute(
                "SELECT world_size FROM run WHERE name = ?", [run]
            ).fetchall()[0][0]
            print(rep.summary())
            times[run] = (rep.seconds, render)
            lines.append(
                f"| {run} | {rep.lane_groups} / {world} | {rep.bytes / 2**20:.1f} |"
                f" {rep.seconds:.2f} | {'n/a' if render is None else f'{render:.1f}'} |"
                f" {exp['bytes'] / 2**20:.2f} | {exp['seconds']:.2f} |"
            )
        store.close()
    (big_s, big_r), (small_s, small_r) = times["sample8192_emu"], times["sample"]
    ratio = f"\nsample8192_emu / sample (one run): report {big_s / small_s:.2f}x"
    if big_r is not None and small_r is not None:
        ratio += f", render {big_r / small_r:.2f}x"
    table = "\n".join(lines) + "\n" + ratio
    print(table)
    if args.note:
        machine = f"{platform.machine().replace('_', '-')}-{os.cpu_count()}cpu"
        note = HERE / "results" / f"report_{machine.lower()}_{date.today().isoformat()}.md"
        note.write_text(
            f"# Report and Perfetto export, {machine}, {date.today().isoformat()}\n\n"
            "`python benchmarks/bench_report.py --note`: `write_report` (HTML, plotly.js and the"
            " figures packed) and `export_perfetto` (`.json.gz`) per run; render = headless"
            " Chromium from navigation until every graph is drawn (unpacking included).\n\n"
            + table
            + "\n"
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()

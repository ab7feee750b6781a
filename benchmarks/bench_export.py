"""Chakra export benchmark: the Megatron ST op timeline sliced to 8192 ranks, one .et per rank.

Ingests ``megatron-straggler-st-8rank``, slices it to ``dp=2048,pp=4`` (world 8192), then times
``prism export chakra`` into a temporary folder and reports files, nodes, bytes and seconds. A
script, not a test.

Usage::

    python benchmarks/bench_export.py [--dp 2048] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _common import dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2048, help="Target data-parallel size (pp=4).")
    parser.add_argument("--keep", type=Path, default=None, help="Write the files here and keep.")
    args = parser.parse_args()

    from prism_trace.export.chakra.writer import export_chakra
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.slicer import slice_run
    from prism_trace.store.connection import open_store

    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp) / "et"
        store = open_store(Path(tmp) / "b.duckdb")
        ingest(store, [dataset("megatron-straggler-st-8rank")], run="st", progress=False)
        world = args.dp * 4
        slice_run(
            store,
            run="st",
            layout=ParallelLayout.parse(f"dp={args.dp},pp=4"),
            world=world,
            out_run="big",
        )
        t0 = time.perf_counter()
        report = export_chakra(store, run="big", out_dir=out)
        seconds = time.perf_counter() - t0
        files = sorted(out.glob("*.et"))
        size = sum(f.stat().st_size for f in files)
        print(report.summary())
        print(
            f"export of {world} ranks: {len(files)} files, {size / 1e6:.0f} MB,"
            f" {seconds:.1f} s ({len(files) / seconds:.0f} files/s) on {os.cpu_count()} cores"
        )
        store.close()


if __name__ == "__main__":
    main()

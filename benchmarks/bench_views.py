"""CPU cost of creating the analysis views: all of them, against only what one reader names.

Why: creating a view binds its query, and a view over views re-binds the chain below it, so the
loader creates only the objects a query or an analysis names (and those they read). This measures
both on the bundled sample's store and over its Parquet export, where every bind lists files.
Each figure is the median CPU time of ``--repeat`` loads, each on a fresh connection.

Run: ``python benchmarks/bench_views.py``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import duckdb
from _common import host_kind, write_note
from prism_trace.analysis import views
from prism_trace.datasets import SAMPLE

from prism_trace.export.parquet import export_parquet, open_parquet
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import open_store

# The object each reader needs: a plain query of a table, and the view behind each analysis word.
READERS: dict[str, list[str] | None] = {
    "every object (before)": None,
    "query of a table (`FROM iteration`)": [],
    "temporal": ["breakdown_temporal"],
    "skew": ["comm_collective_skew"],
    "idle": ["breakdown_idle_at"],
    "bubbles": ["pipeline_bubble_at"],
}


def _cpu(load: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        load()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _rows(open_con: Callable[[], duckdb.DuckDBPyConnection], repeat: int) -> list[float]:
    out = []
    for names in READERS.values():

        def load(names: list[str] | None = names) -> None:
            con = open_con()
            views.load_views(con, names=names)
            con.close()

        out.append(_cpu(load, repeat))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--host", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "s.duckdb"
        with open_store(db) as store:
            ingest(store, [SAMPLE], run="sample", progress=False)
            export_parquet(store, Path(tmp) / "pq", runs=["sample"])
        on_store = _rows(lambda: duckdb.connect(str(db), read_only=True), args.repeat)
        with open_parquet(str(Path(tmp) / "pq")) as pq:
            on_parquet = _rows(lambda: pq.con.cursor(), args.repeat)
    lines = [
        "| reader | objects created | CPU s, store | CPU s, Parquet export |",
        "|---|---|---|---|",
    ]
    for (label, names), a, b in zip(READERS.items(), on_store, on_parquet, strict=True):
        lines.append(f"| {label} | {len(views._needed(names))} | {a:.3f} | {b:.3f} |")
    worst = max(on_store[1:])
    lines.append("")
    lines.append(
        f"- every object / the costliest single reader: store {on_store[0] / worst:.1f}x,"
        f" Parquet {on_parquet[0] / max(on_parquet[1:]):.1f}x"
    )
    body = "\n".join(lines)
    print(body)
    note = write_note(
        "views",
        host_kind(args.host),
        title="Creating the analysis views: all, or what a reader names",
        command="python benchmarks/bench_views.py",
        body=f"Median CPU time of {args.repeat} loads, each on a fresh connection.\n\n{body}",
    )
    print(note)


if __name__ == "__main__":
    main()

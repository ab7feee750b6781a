"""Where the Kineto reader's time goes: per stage and per statement, over one or more files.

The reader runs as ingest's workers run it (``stage_kineto`` on one connection, a work database
attached per file, the events fetched and dropped: no store). Each stage of ``_Reader`` and each
statement it runs is timed (wall clock, so run it on a quiet machine); the statements are keyed
by their first words. On a small trace nearly all of a statement's time is DuckDB planning it,
which is why the reader's cost is per file, not per event (docs/ingest.md, "Cost per file").

Usage::

    python benchmarks/profile_kineto.py /tmp/d32/*.json.gz          # 32 small ranks
    python benchmarks/profile_kineto.py big_trace.json --top 15      # one large file
    python benchmarks/profile_kineto.py --batch /tmp/d32/*.json.gz  # the batch reader
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb

from prism_trace.formats.kineto import batch as kineto_batch
from prism_trace.formats.kineto import reader as kineto

_STAGES = (
    "load",
    "build_tracks",
    "keep_side_records",
    "build_events",
    "assign_iterations",
    "memory",
    "flows",
    "comms",
    "comm_groups",
    "ranks_frame",
)
_STATEMENTS = ("sql", "rows", "frame", "load_files")
# The batch reader's own stages (``--batch``); its statements run through ``_Reader``'s.
_BATCH_STAGES = (
    "load",
    "build_tracks",
    "keep_side_records",
    "build_events",
    "assign_iterations",
    "batch_memory",
    "batch_flows",
    "batch_pids",
)


def _timed(table: dict[str, float], key: Callable[..., str], fn: Callable[..., Any]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[key(*args)] += time.perf_counter() - t0

    return wrapper


@contextlib.contextmanager
def _instrumented() -> Iterator[tuple[dict[str, float], dict[str, float]]]:
    """Wrap the reader's stages and statement runners; put them back afterwards."""
    stages: dict[str, float] = collections.defaultdict(float)
    statements: dict[str, float] = collections.defaultdict(float)
    saved = {n: getattr(kineto._Reader, n) for n in (*_STAGES, *_STATEMENTS)}
    batch = kineto_batch._BatchReader
    saved_batch = {n: batch.__dict__.get(n) for n in _BATCH_STAGES}
    for n in _STAGES:
        setattr(kineto._Reader, n, _timed(stages, lambda *_a, n=n: n, saved[n]))
    for n in _BATCH_STAGES:
        setattr(batch, n, _timed(stages, lambda *_a, n=n: n, getattr(batch, n)))
    for n in _STATEMENTS:
        setattr(
            kineto._Reader,
            n,
            _timed(
                statements,
                lambda _self, q, *_a, n=n: f"{n}: " + " ".join(str(q).split())[:70],
                saved[n],
            ),
        )
    try:
        yield stages, statements
    finally:
        for n, fn in saved.items():
            setattr(kineto._Reader, n, fn)
        for n, own in saved_batch.items():
            if own is None:
                delattr(batch, n)
            else:
                setattr(batch, n, own)


def profile(files: list[Path], top: int, *, batch: bool = False) -> str:
    """Read ``files`` instrumented (one by one, or in batches as ingest does); the report."""
    from prism_trace.ingestion.append import _EVENT_BATCH_ROWS
    from prism_trace.ingestion.memory import ingest_memory_limit

    # Under the ingest's memory limit, as ingest reads (a large trace's sorts spill past it).
    con = duckdb.connect(config={"memory_limit": f"{ingest_memory_limit()}B"})
    fetched = [0.0]

    def drop(_rank: int, rel: duckdb.DuckDBPyRelation) -> None:
        """The events as ingest takes them: Arrow batches (into the store there), here dropped."""
        t = time.perf_counter()
        for _batch in rel.to_arrow_reader(_EVENT_BATCH_ROWS):
            pass
        fetched[0] += time.perf_counter() - t

    step = kineto_batch.BATCH_FILES if batch else 1
    with _instrumented() as (stages, statements):
        t0 = time.perf_counter()
        for i in range(0, len(files), step):
            cur = con.cursor()
            cur.execute(f"ATTACH ':memory:' AS work{i}")
            cur.execute(f"USE work{i}")
            if batch:
                part = files[i : i + step]
                got = kineto_batch.try_read_kineto_batch(part, ranks=[None] * len(part), con=cur)
                if got is None:
                    raise SystemExit(f"{part[0]}: the batch fell back to the per-file reader")
            else:
                kineto.stage_kineto(files[i], con=cur, events_into=drop)
            cur.execute("USE memory")
            cur.execute(f"DETACH work{i}")
            cur.close()
        total = time.perf_counter() - t0
    n = len(files)
    mb = sum(f.stat().st_size for f in files) / 1e6
    out = [f"{n} file(s), {mb:.1f} MB on disk: {total:.2f} s, {total / n * 1e3:.0f} ms a file"]
    if not batch:
        stages["events fetch (Arrow, sorted by event_id)"] = fetched[0]
    out.append("stages, ms a file:")
    out += [f"  {v / n * 1e3:8.1f}  {k}" for k, v in sorted(stages.items(), key=lambda kv: -kv[1])]
    rest = total - sum(stages.values())
    what = "splitting the arrays, the frames cut into files" if batch else "splitting the array"
    out.append(f"  {rest / n * 1e3:8.1f}  (the rest: {what})")
    ranked = sorted(statements.items(), key=lambda kv: -kv[1])
    out.append(f"statements: {len(statements)} kinds; the {top} slowest, ms a file:")
    out += [f"  {v / n * 1e3:8.1f}  {k}" for k, v in ranked[:top]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=12, help="statements listed")
    ap.add_argument(
        "--batch", action="store_true", help="the batch reader (kineto_batch), as ingest reads"
    )
    args = ap.parse_args(argv)
    print(profile(args.files, args.top, batch=args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())

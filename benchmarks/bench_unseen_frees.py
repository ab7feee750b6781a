"""What inferring the frees a trace missed costs at ingest (``prism_trace.formats.unseen_frees``).

A synthetic rank of ``--rows`` allocator events (4 KiB blocks over 5000 addresses, allocated and
freed in turn, 1 % of the frees dropped as a worker thread's would be) and 10000 communication
calls; prints the rows, the frees inferred and the best of ``--repeat`` timings. Beside a 1 GB
Kineto file's ~20 s ingest (docs/ingest.md) this is the share the rule adds.

Usage::

    python benchmarks/bench_unseen_frees.py [--rows 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import polars as pl

from prism_trace.formats.unseen_frees import infer_unseen_frees


def synthetic(rows: int, seed: int = 0) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """``(memory, calls, steps)`` of one rank (module docstring)."""
    rng = np.random.default_rng(seed)
    half = rows // 2
    addr = np.repeat(rng.integers(0, 5000, half) * 512, 2)
    nbytes = np.tile(np.array([4096, -4096]), half)
    keep = ~((rng.random(2 * half) < 0.01) & (nbytes < 0))
    n = 2 * half
    memory = pl.DataFrame(
        {
            "rank": np.zeros(n, np.int32),
            "ts": np.arange(n, dtype=np.int64) * 100,
            "device_type": ["cuda"] * n,
            "device_id": np.zeros(n, np.int32),
            "addr": addr,
            "bytes": nbytes,
            "total_allocated": np.cumsum(nbytes),
            "total_reserved": np.zeros(n, np.int64),
            "iteration": np.ones(n, np.int32),
        }
    ).filter(pl.Series(keep))
    calls = pl.DataFrame(
        {"rank": np.zeros(10_000, np.int32), "end": np.sort(rng.integers(0, n * 100, 10_000))}
    )
    steps = pl.DataFrame(
        {"rank": [0], "iteration": [1], "ts": [0], "dur": [n * 100]},
        schema={"rank": pl.Int32, "iteration": pl.Int32, "ts": pl.Int64, "dur": pl.Int64},
    )
    return memory, calls, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    memory, calls, steps = synthetic(a.rows)
    best, inferred = float("inf"), 0
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        out = infer_unseen_frees(memory, calls, steps)
        best = min(best, time.perf_counter() - t0)
        inferred = int(out["inferred"].sum())
    print(f"{memory.height} memory rows, {inferred} frees inferred: best {best:.2f} s")


if __name__ == "__main__":
    main()

"""Frees a trace did not record are inferred at ingest from the trace's own evidence, and only
then (``prism_trace.formats.unseen_frees``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from prism_trace.formats.base import FRAME_SCHEMAS
from prism_trace.formats.kineto.batch import try_read_kineto_batch
from prism_trace.formats.kineto.reader import read_kineto
from prism_trace.formats.unseen_frees import infer_unseen_frees
from tests.prism_trace.test_kineto import write_trace

A, B, C = 0x1000, 0x2000, 0x3000


def memory(rows: list[tuple[int, int, int]], *, device: str = "cpu") -> pl.DataFrame:
    """``(ts, addr, bytes)`` rows with the allocator's running total, as a trace records them."""
    total, out = 0, []
    for ts, addr, b in rows:
        total += b
        out.append((0, ts, device, -1, addr, b, total, None, 1))
    recorded = {c: t for c, t in FRAME_SCHEMAS["memory"].items() if c != "inferred"}
    return pl.DataFrame(out, schema=recorded, orient="row")


def calls(*ends: int) -> pl.DataFrame:
    return pl.DataFrame(
        {"rank": [0] * len(ends), "end": list(ends)}, schema={"rank": pl.Int32, "end": pl.Int64}
    )


NO_STEPS = pl.DataFrame(
    schema={"rank": pl.Int32, "iteration": pl.Int32, "ts": pl.Int64, "dur": pl.Int64}
)


def test_a_trace_with_every_free_recorded_is_unchanged() -> None:
    mem = memory(
        [(10, A, 100), (20, B, 50), (30, A, -100), (40, A, 100), (50, A, -100), (60, B, -50)]
    )
    got = infer_unseen_frees(mem, calls(35, 55), NO_STEPS)
    assert_frame_equal(got.drop("inferred"), mem)
    assert not got["inferred"].any()


def test_a_block_allocated_again_at_a_live_address_was_freed_at_the_next_call_end() -> None:
    # A (100 B) handed to a collective that ends at 25; the trace never frees it, and A is
    # allocated again at 40: a 100 B peak of 200 B recorded is one of 100 B.
    mem = memory([(10, A, 100), (20, B, 10), (40, A, 100), (50, A, -100), (60, B, -10)])
    got = infer_unseen_frees(mem, calls(5, 25, 45), NO_STEPS)
    freed = got.filter(pl.col("inferred"))
    assert freed.select("ts", "addr", "bytes").rows() == [(26, A, -100)]
    assert got["ts"].to_list() == [10, 20, 26, 40, 50, 60]
    assert got["total_allocated"].to_list() == [100, 110, 10, 110, 10, 0]
    assert mem["total_allocated"].max() == 210
    assert got["total_allocated"].max() == 110


def test_without_a_call_the_free_is_at_the_next_allocation() -> None:
    mem = memory([(10, A, 100), (40, A, 100), (50, A, -100)])
    got = infer_unseen_frees(mem, calls(), NO_STEPS)
    assert got.select("ts", "bytes", "inferred", "total_allocated").rows() == [
        (10, 100, False, 100),
        (40, -100, True, 0),
        (40, 100, False, 100),
        (50, -100, False, 0),
    ]


def test_a_never_freed_block_is_freed_only_at_a_size_the_rank_loses_unseen() -> None:
    # A is lost unseen (allocated again while live) at 64 B; the last A and the 64 B block at C
    # are never freed: freed at the next call after each; B (a long-lived 32 B block, a size
    # never lost) stays.
    mem = memory([(1, B, 32), (10, A, 64), (20, A, 64), (30, C, 64)])
    got = infer_unseen_frees(mem, calls(15, 35), NO_STEPS)
    assert got.filter(pl.col("inferred")).select("ts", "addr", "bytes").rows() == [
        (16, A, -64),
        (36, A, -64),
        (36, C, -64),
    ]
    assert got["total_allocated"][-1] == 32
    # A never-freed block with no call after it has no evidence of when: kept.
    kept = infer_unseen_frees(mem, calls(15), NO_STEPS)
    assert kept.filter(pl.col("inferred"))["addr"].to_list() == [A]


def test_devices_are_apart_and_inferred_rows_take_their_step() -> None:
    cpu = memory([(10, A, 100), (40, A, 100)])
    cuda = memory([(12, A, 7), (45, A, -7)], device="cuda")
    mem = pl.concat([cpu, cuda]).sort("ts")
    steps = pl.DataFrame(
        {"rank": [0, 0], "iteration": [1, 2], "ts": [0, 20], "dur": [20, 30]},
        schema={"rank": pl.Int32, "iteration": pl.Int32, "ts": pl.Int64, "dur": pl.Int64},
    )
    got = infer_unseen_frees(mem, calls(30), steps)
    freed = got.filter(pl.col("inferred"))
    assert freed.select("ts", "device_type", "bytes", "iteration").rows() == [(31, "cpu", -100, 2)]
    # The CUDA rows' totals are their own: a CPU free does not lower them.
    assert got.filter(pl.col("device_type") == "cuda")["total_allocated"].to_list() == [7, 0]


def _gloo_like_trace(path: Path, freed_seen: bool) -> Path:
    """Two steps of a rank that hands a 4 KiB bucket to ``c10d::allreduce_`` each step; the
    block's free is recorded only when ``freed_seen``."""
    host = {"pid": 10, "tid": 10}
    ev: list[dict[str, Any]] = []
    total = 0

    def mem(ts: int, b: int, addr: int) -> None:
        nonlocal total
        total += b
        ev.append(
            {
                "ph": "i",
                "cat": "cpu_instant_event",
                "name": "[memory]",
                **host,
                "ts": ts,
                "s": "t",
                "args": {
                    "Bytes": b,
                    "Total Allocated": total,
                    "Total Reserved": 0,
                    "Device Type": 0,
                    "Device Id": -1,
                    "Addr": addr,
                },
            }
        )

    for step, t0 in ((1, 1000), (2, 2000)):
        ev.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step}",
                **host,
                "ts": t0,
                "dur": 900,
            }
        )
        ev.append(
            {"ph": "X", "cat": "cpu_op", "name": "aten::empty", **host, "ts": t0 + 10, "dur": 5}
        )
        mem(t0 + 11, 4096, A)
        ev.append(
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "c10d::allreduce_",
                **host,
                "ts": t0 + 100,
                "dur": 200,
                "args": {"Input Dims": [[1024]], "Input type": ["float"]},
            }
        )
        if freed_seen:
            mem(t0 + 250, -4096, A)
        ev.append(
            {"ph": "X", "cat": "cpu_op", "name": "aten::mul", **host, "ts": t0 + 400, "dur": 50}
        )
        mem(t0 + 410, 512, B + step)
        mem(t0 + 440, -512, B + step)
    return write_trace(path, ev, distributedInfo={"rank": 0, "world_size": 2, "backend": "gloo"})


@pytest.mark.parametrize("batch", [False, True], ids=["per-file", "batch"])
def test_ingest_infers_the_free_a_gloo_worker_made(tmp_path: Path, batch: bool) -> None:
    for d in ("seen", "unseen"):
        (tmp_path / d).mkdir()
    seen = _gloo_like_trace(tmp_path / "seen" / "rank0.json", freed_seen=True)
    unseen = _gloo_like_trace(tmp_path / "unseen" / "rank0.json", freed_seen=False)

    def read(path: Path, other: Path) -> pl.DataFrame:
        if not batch:
            return read_kineto(path).memory
        with duckdb.connect() as con:
            got = try_read_kineto_batch([path, other], ranks=[None, None], con=con)
        assert got is not None, "the batch fell back to the per-file reader"
        return got[0].memory

    rec, got = read(seen, unseen), read(unseen, seen)
    assert not rec["inferred"].any()
    freed = got.filter(pl.col("inferred"))
    # The first bucket is lost unseen (allocated again at its address); the second, never freed,
    # is of the size lost: both freed 1 ns after the end of their step's allreduce.
    assert freed.select("ts", "bytes", "iteration").rows() == [
        (1300 * 1000 + 1, -4096, 1),
        (2300 * 1000 + 1, -4096, 2),
    ]

    # Each step peaks at one bucket, as in the trace whose frees were recorded (the trace itself
    # says two buckets and the 512 B in step 2).
    def peaks(m: pl.DataFrame) -> list[int]:
        by_step = m.group_by("iteration").agg(pl.col("total_allocated").max())
        return by_step.sort("iteration")["total_allocated"].to_list()

    assert peaks(got) == peaks(rec) == [4096, 4096]
    # The recorded totals are the stored ones less the inferred frees before them.
    lowered = pl.when(pl.col("inferred")).then(pl.col("bytes")).otherwise(0).cum_sum()
    raw = got.select(pl.col("total_allocated") - lowered).to_series()
    assert raw.filter(~got["inferred"]).max() == 4096 + 4096 + 512
    assert got["total_allocated"][-1] == 0

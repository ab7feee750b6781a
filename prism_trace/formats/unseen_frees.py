"""Frees a trace did not record, inferred from its own evidence, so that peak memory means the
same thing on every recording of a job.

Why: the profiler records memory per thread. A block whose last reference another thread drops
(gloo's worker releasing the buffers a collective was handed and the copies it made of them, or
NCCL's watchdog releasing what it stashed for a call) is freed where the profiler does not look,
so ``total_allocated`` never comes down by it. Which thread lets go last is timing: two
recordings of one ZeRO-1 job on gloo peaked 35-122 % apart per rank on the same work
(``benchmarks/missing_frees.py``, docs/predict.md), and a prediction cannot meet a target that
luck moves.

The evidence, per (rank, device):

- **An allocation at an address still live** proves the block there was freed unseen. It is taken
  as freed just after the end of the first communication call (a ``collective`` or ``p2p``: its
  host op, or its kernel where that ends later) that ends after its allocation, and no later than
  the address's next allocation: the call's inputs and the backend's copies are let go of when
  the call completes.
- **A block never freed in the trace** is taken as freed the same way only when this rank is seen
  to lose blocks of exactly its size unseen (the buffers of one bucket size, step after step);
  any other block left allocated at the end of a trace (a model's weights, an optimizer state,
  an allocation freed after the profiler stopped) stays as recorded.

Nothing is inferred in a trace where no address is allocated twice while live: a trace with
every free recorded is unchanged. Each inferred free is a ``memory`` row with ``inferred`` true
(recorded rows false), the block's address and negative size, and the step of its time; the
``total_allocated`` of every row after it is lowered by the bytes inferred freed so far, so the
recorded value is ``total_allocated - sum(bytes of the inferred rows before it)``. On the ZeRO-1
twins the rule puts 7 of 8 ranks (dp 2) and 14 of 16 (dp 4) of the two recordings on one peak,
where the raw peaks differ by up to 2x.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:
    from prism_trace.formats.base import TraceTables

__all__ = ["infer_unseen_frees", "with_unseen_frees"]

_DEVICE = ["rank", "device_type", "device_id"]


def infer_unseen_frees(
    memory: pl.DataFrame, calls: pl.DataFrame, steps: pl.DataFrame
) -> pl.DataFrame:
    """``memory`` with the unseen frees added (module docstring) and an ``inferred`` column.

    Args:
        memory: ``memory`` rows of one trace (``rank, ts, device_type, device_id, addr, bytes,
            total_allocated, total_reserved, iteration``), in recorded order.
        calls: ``rank, end``: the end (ns) of each communication call (its host op's, or its
            kernel's where later).
        steps: ``rank, iteration, ts, dur``: the trace's steps, to give an inferred row its step.

    Returns:
        The rows, recorded and inferred, sorted by ``(rank, ts)`` (recorded order kept among
        rows of one time), with ``inferred`` and the lowered ``total_allocated``.
    """
    mem = memory.with_columns(
        pl.lit(value=False).alias("inferred"), pl.int_range(pl.len(), dtype=pl.Int64).alias("_o")
    )
    freed = _unseen(mem, calls)
    if freed.is_empty():
        return mem.drop("_o")
    freed = _with_steps(freed, steps)
    both = pl.concat([mem, freed.select(mem.columns).cast(mem.schema)])
    # An inferred free sorts before a recorded row of the same time (``_o`` = -1): the block is
    # gone before anything else happens at that instant (after its allocation, if at its time).
    both = both.sort("rank", "ts", "_o", maintain_order=True)
    inferred_bytes = pl.when(pl.col("inferred")).then(pl.col("bytes")).otherwise(0)
    lowered = inferred_bytes.cum_sum().over(_DEVICE)
    return both.with_columns(
        pl.when(pl.col("inferred") | pl.col("total_allocated").is_not_null())
        .then(pl.col("total_allocated").forward_fill().over(_DEVICE) + lowered)
        .alias("total_allocated"),
        pl.col("total_reserved").forward_fill().over(_DEVICE),
    ).drop("_o")


def with_unseen_frees(tables: TraceTables) -> TraceTables:
    """``tables`` with its ``memory`` through ``infer_unseen_frees`` (its own calls and steps)."""
    if tables.memory.is_empty():
        return tables
    calls = [
        f.select(
            pl.col("rank").cast(pl.Int32),
            pl.max_horizontal(
                pl.col("host_ts") + pl.col("host_dur"),
                pl.col("kernel_ts") + pl.col("kernel_dur")
                if "kernel_ts" in f.columns and "kernel_dur" in f.columns
                else pl.lit(None, pl.Int64),
            )
            .cast(pl.Int64)
            .alias("end"),
        )
        for f in (tables.collectives, tables.p2p)
        if "host_ts" in f.columns and "host_dur" in f.columns
    ]
    tables.memory = infer_unseen_frees(
        tables.memory,
        pl.concat(calls) if calls else pl.DataFrame(schema={"rank": pl.Int32, "end": pl.Int64}),
        tables.iterations,
    )
    return tables


def _unseen(mem: pl.DataFrame, calls: pl.DataFrame) -> pl.DataFrame:
    """The inferred frees: ``rank, ts, device_type, device_id, addr, bytes`` (< 0), ``_o`` = -1,
    ``inferred`` true; ``total_allocated``, ``total_reserved`` and ``iteration`` null."""
    key = [*_DEVICE, "addr"]
    allocs = (
        mem.filter(pl.col("addr").is_not_null())
        .sort([*key, "_o"])
        .with_columns(
            pl.col("bytes").shift(-1).over(key).alias("_next_bytes"),
            pl.col("ts").shift(-1).over(key).alias("_next_ts"),
        )
        .filter(pl.col("bytes") > 0)
    )
    # Freed unseen: the address's next event allocates again. Never freed: no next event.
    again = allocs.filter(pl.col("_next_bytes") > 0)
    if again.is_empty():
        return pl.DataFrame()
    sizes = again.select(*_DEVICE, "bytes").unique()
    never = allocs.filter(pl.col("_next_bytes").is_null()).join(
        sizes, on=[*_DEVICE, "bytes"], how="semi", nulls_equal=True
    )
    ends = (
        calls.select(pl.col("rank").cast(mem.schema["rank"]), pl.col("end").cast(pl.Int64))
        .drop_nulls()
        .sort("rank", "end")
    )
    blocks = (
        pl.concat([again, never])
        .sort("ts")
        .join_asof(
            ends.rename({"end": "_call_end"}).with_columns(pl.col("_call_end").alias("ts")),
            on="ts",
            by="rank",
            strategy="forward",
            allow_exact_matches=False,
            check_sortedness=False,
        )
    )
    # The free lands 1 ns after the call's end: the block was held across the call (as the
    # memory model of a resized collective reads it, ``replay.memory.scale``) and replay moves it
    # with the call's end; never before the allocation, never after the address is allocated
    # again.
    at = pl.min_horizontal(pl.col("_call_end") + 1, pl.col("_next_ts"))
    return blocks.filter(
        pl.col("_call_end").is_not_null() | pl.col("_next_ts").is_not_null()
    ).select(
        "rank",
        pl.max_horizontal(at, pl.col("ts")).alias("ts"),
        "device_type",
        "device_id",
        "addr",
        (-pl.col("bytes")).alias("bytes"),
        pl.lit(None, pl.Int64).alias("total_allocated"),
        pl.lit(None, pl.Int64).alias("total_reserved"),
        pl.lit(None, pl.Int32).alias("iteration"),
        pl.lit(value=True).alias("inferred"),
        # At its own allocation's time it must still follow that allocation.
        pl.when(pl.max_horizontal(at, pl.col("ts")) == pl.col("ts"))
        .then(pl.col("_o"))
        .otherwise(-1)
        .alias("_o"),
    )


def _with_steps(freed: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """Each inferred free's step: the step whose span holds its time (as the reader gives a
    recorded row's)."""
    if steps.is_empty():
        return freed
    s = steps.select(
        pl.col("rank").cast(freed.schema["rank"]),
        pl.col("ts").cast(pl.Int64),
        (pl.col("ts") + pl.max_horizontal(pl.col("dur"), pl.lit(1))).alias("_step_end"),
        pl.col("iteration").alias("_step"),
    ).sort("ts")
    out = freed.sort("ts").join_asof(
        s, on="ts", by="rank", strategy="backward", check_sortedness=False
    )
    return out.with_columns(
        pl.when(pl.col("ts") < pl.col("_step_end")).then(pl.col("_step")).alias("iteration")
    ).drop("_step_end", "_step")

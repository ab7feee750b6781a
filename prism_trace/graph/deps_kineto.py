"""Cross-stream waits of Kineto traces that have no ``cuda_sync`` flows.

A ``cudaStreamWaitEvent`` makes a stream wait for an event recorded on another stream, i.e. for
the kernels enqueued there before the ``cudaEventRecord``. Recent Kineto versions emit that as a
``cuda_sync`` flow (``graph._wait_edges``); older traces only show the runtime calls, without
the event or the streams. The wait is still visible on the device timeline: a kernel K that
starts *later* than both its launch and its stream predecessor allow, *exactly* when a kernel J
on another stream of the rank ends, after a ``cudaStreamWaitEvent`` issued between J's launch
and K's launch, waited for J. This module recovers those waits as ``wait`` edges ``J → K``
(anchor ``end``; the delay is K's start minus J's end, the few µs the GPU takes to resolve it).

Without the edge a replay starts K as soon as its launch and stream allow: behind a long NCCL
kernel, tens of ms early. A kernel that waits for its *peers* (an NCCL kernel that started on
time) is not affected: its start is explained by its launch, and its duration is recomputed by
the emulator from the peers' arrivals.
"""

from __future__ import annotations

import polars as pl

__all__ = ["EXACT_NS", "inferred_stream_waits"]

EXACT_NS = 5_000
"""How close K's start must follow J's end, and how much later than its launch and stream
predecessor allow it must start, to count as a wait (GPU-side event resolution is 1-3 µs)."""


def inferred_stream_waits(
    dev: pl.DataFrame, wait_calls: pl.DataFrame, *, exact_ns: int = EXACT_NS
) -> pl.DataFrame:
    """Wait edges between device nodes of different streams, inferred from the timeline.

    Args:
        dev: device nodes, ``rank, node_id, track_id, ts, dur`` and ``lts`` (the ts of the
            runtime call that launched it; null when the launch is not in the trace).
        wait_calls: ``rank, ts`` of the ranks' ``cudaStreamWaitEvent`` calls.
        exact_ns: the tolerance of "exactly when" and of "later than allowed".

    Returns:
        ``rank, src, dst, kind, anchor, delay`` (kind ``wait``, anchor ``end``).
    """
    empty = pl.DataFrame(
        schema={
            "rank": pl.Int32,
            "src": pl.Int64,
            "dst": pl.Int64,
            "kind": pl.Utf8,
            "anchor": pl.Utf8,
            "delay": pl.Int64,
        }
    )
    if dev.is_empty() or wait_calls.is_empty():
        return empty
    d = (
        dev.select(
            pl.col("rank").cast(pl.Int32),
            pl.col("node_id").cast(pl.Int64),
            "track_id",
            pl.col("ts").cast(pl.Int64),
            (pl.col("ts") + pl.col("dur").fill_null(0)).cast(pl.Int64).alias("end"),
            pl.col("lts").cast(pl.Int64),
        )
        .filter(pl.col("ts").is_not_null())
        .sort("rank", "track_id", "ts", "node_id")
        .with_columns(pl.col("end").shift(1).over("rank", "track_id").alias("pred_end"))
    )
    ready = pl.max_horizontal(pl.col("pred_end"), pl.col("lts"))
    late = d.filter(ready.is_not_null() & (pl.col("ts") - ready > exact_ns))
    if late.is_empty():
        return empty
    ends = d.select(
        "rank",
        pl.col("node_id").alias("src"),
        pl.col("track_id").alias("src_track"),
        pl.col("end").alias("src_end"),
        pl.col("lts").alias("src_lts"),
    ).sort("src_end")
    # J: the device node that ended last at or before K's start (within the tolerance).
    pairs = late.sort("ts").join_asof(
        ends,
        left_on="ts",
        right_on="src_end",
        by="rank",
        strategy="backward",
        tolerance=exact_ns,
        check_sortedness=False,
    )
    pairs = pairs.filter(
        pl.col("src").is_not_null() & (pl.col("src_track") != pl.col("track_id"))
    ).with_columns(pl.coalesce("lts", "ts").alias("k_launch"))
    # Evidence: a cudaStreamWaitEvent after J's launch and at or before K's launch.
    calls = wait_calls.select(
        pl.col("rank").cast(pl.Int32), pl.col("ts").cast(pl.Int64).alias("call_ts")
    ).sort("call_ts")
    pairs = pairs.sort("k_launch").join_asof(
        calls,
        left_on="k_launch",
        right_on="call_ts",
        by="rank",
        strategy="backward",
        check_sortedness=False,
    )
    found = pairs.filter(
        pl.col("call_ts").is_not_null()
        & (pl.col("src_lts").is_null() | (pl.col("call_ts") >= pl.col("src_lts")))
    )
    return found.select(
        "rank",
        pl.col("src").cast(pl.Int64),
        pl.col("node_id").alias("dst").cast(pl.Int64),
        pl.lit("wait").alias("kind"),
        pl.lit("end").alias("anchor"),
        (pl.col("ts") - pl.col("src_end")).clip(lower_bound=0).cast(pl.Int64).alias("delay"),
    ).sort("rank", "dst")

"""Memory replay: each rank's recorded allocation timeline re-timed onto the emulated timeline.

The ``memory`` table holds one row per allocator event (``bytes`` > 0 allocates, < 0 frees, and
``total_allocated`` after it). A memory event happens inside some op of its rank, so it moves
with that op: ``retime_memory`` maps each event to the node that *encloses* it in the recording
(a host-side node whose recorded ``[ts, ts + dur]`` contains the event's ``ts``; of several, the
one that started last) and shifts it by that node's emulated start minus its recorded start. An
event between nodes follows the node that ended last before it (shifted by the change of its
end); one before every node follows the first node. The emulated ``total_allocated`` is then
recomputed per (rank, device) as the running sum of ``bytes`` in *emulated* order from the
recorded level before the first event, so a reordering of allocations and frees (ops that
overlap differently) changes the peak.

Scale-dependent state (sliced runs). Megatron's distributed optimizer shards the fp32 main
parameters and the optimizer moments over the data-parallel group: each rank holds
``S / dp`` bytes of that state. A rank that held ``b`` bytes at the recorded DP degree ``dp_rec``
holds ``b * dp_rec / dp_tgt`` at the target degree, so its whole timeline (the state lives for the
whole run) moves by ``optimizer_shard_delta(b, dp_rec, dp_tgt)``. ``b`` comes from
``MemoryConfig.optimizer_state_bytes`` or from the represented rank's ``rank.args``
(``optimizer_state_bytes``). None of the bundled recordings has it (the op timeline and DLRM have
no memory events; the gloo sample's are CPU allocator events of a run without a distributed
optimizer), so for them the rule is a no-op.
"""

from __future__ import annotations

import polars as pl

__all__ = ["MEMORY_COLUMNS", "memory_peaks", "optimizer_shard_delta", "retime_memory"]

MEMORY_COLUMNS = (
    "rank",
    "ts",
    "device_type",
    "device_id",
    "addr",
    "bytes",
    "total_allocated",
    "total_reserved",
    "iteration",
)
"""Columns of a ``memory`` row (less ``run_id``), as ``retime_memory`` returns them."""


def optimizer_shard_delta(state_bytes: int, dp_recorded: int, dp_target: int) -> int:
    """Change of a rank's distributed-optimizer shard when the DP degree changes.

    Args:
        state_bytes: the rank's optimizer-state bytes at the recorded DP degree (0: unknown).
        dp_recorded: recorded data-parallel size.
        dp_target: emulated data-parallel size.

    Returns:
        ``round(state_bytes * dp_recorded / dp_target) - state_bytes`` (0 when nothing changes).
    """
    if state_bytes <= 0 or dp_recorded <= 0 or dp_target <= 0 or dp_recorded == dp_target:
        return 0
    return round(state_bytes * dp_recorded / dp_target) - int(state_bytes)


def retime_memory(
    memory: pl.DataFrame,
    nodes: pl.DataFrame,
    *,
    delta: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Move each unit's memory events with the nodes that enclose them; recompute the totals.

    Args:
        memory: ``unit`` + ``MEMORY_COLUMNS`` less ``rank`` (recorded ``ts``, ``bytes``,
            ``total_allocated``, ...), ``ts`` on the run clock.
        nodes: ``unit, rec_ts, rec_end, emu_ts, emu_end, host`` (recorded and emulated times on
            the same clock; ``host``: a node that can allocate, i.e. not a device kernel).
        delta: ``unit, delta``: bytes added to every total of a unit (scale-dependent state).

    Returns:
        ``unit`` + ``MEMORY_COLUMNS`` less ``rank``, re-timed and sorted by ``(unit, ts)``, with
        ``total_allocated`` the running sum in emulated order.
    """
    cols = [c for c in MEMORY_COLUMNS if c != "rank"]
    if memory.is_empty():
        return memory.select("unit", *cols)
    mem = memory.with_row_index("_i").with_columns(pl.col("ts").alias("_mts"))
    host = nodes.filter(pl.col("host"))
    by_start = host.select(
        "unit",
        pl.col("rec_ts").alias("_mts"),
        pl.col("rec_end").alias("_s_end"),
        (pl.col("emu_ts") - pl.col("rec_ts")).alias("_s_shift"),
    ).sort("unit", "_mts")
    by_end = host.select(
        "unit",
        pl.col("rec_end").alias("_mts"),
        (pl.col("emu_end") - pl.col("rec_end")).alias("_e_shift"),
    ).sort("unit", "_mts")
    first = (
        host.sort("unit", "rec_ts")
        .group_by("unit", maintain_order=True)
        .agg((pl.col("emu_ts") - pl.col("rec_ts")).first().alias("_f_shift"))
    )
    mem = mem.sort("unit", "_mts")
    mem = mem.join_asof(by_start, on="_mts", by="unit", strategy="backward", check_sortedness=False)
    mem = mem.join_asof(by_end, on="_mts", by="unit", strategy="backward", check_sortedness=False)
    mem = mem.join(first, on="unit", how="left")
    shift = (
        pl.when(pl.col("_s_end").is_not_null() & (pl.col("_s_end") >= pl.col("_mts")))
        .then(pl.col("_s_shift"))
        .otherwise(pl.coalesce("_e_shift", "_f_shift", pl.lit(0, pl.Int64)))
    )
    mem = mem.with_columns((pl.col("ts") + shift).alias("ts"))
    # The level before each (unit, device)'s first recorded event, then the running sum in the
    # emulated order (ties keep the recorded order).
    key = ["unit", "device_type", "device_id"]
    base = (
        mem.sort("_i")
        .group_by(key, maintain_order=True)
        .agg((pl.col("total_allocated") - pl.col("bytes")).first().alias("_base"))
    )
    mem = mem.join(base, on=key, how="left", nulls_equal=True).sort("unit", "ts", "_i")
    mem = mem.with_columns(
        (pl.col("_base").fill_null(0) + pl.col("bytes").fill_null(0).cum_sum().over(key)).alias(
            "total_allocated"
        )
    )
    if delta is not None and not delta.is_empty():
        mem = mem.join(delta.select("unit", "delta"), on="unit", how="left").with_columns(
            pl.col("total_allocated") + pl.col("delta").fill_null(0)
        )
    return mem.select("unit", *cols)


def memory_peaks(memory: pl.DataFrame, by: str = "rank") -> pl.DataFrame:
    """Peak ``total_allocated`` per ``by`` (over devices): ``by, peak``."""
    if memory.is_empty():
        return pl.DataFrame(schema={by: memory.schema.get(by, pl.Int64), "peak": pl.Int64})
    return memory.group_by(by).agg(pl.col("total_allocated").max().cast(pl.Int64).alias("peak"))

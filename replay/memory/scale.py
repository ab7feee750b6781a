"""Memory of a sliced run at its target scale: allocations whose size follows the data-parallel
degree resized, and the allocations of repeated or dropped microbatches repeated or dropped.

Both work on the recorded allocator events of the rank a unit replays (``memory`` rows with a
``unit``), before they are re-timed (``retime``).

**Shards** (``rescale_shards``). A reduce-scatter or all-gather on a group that the slice resizes
(``n`` recorded members, ``n'`` target ones) moves one buffer of ``M = msg_bytes`` bytes, of which
each rank holds a shard ``S = min(in_bytes, out_bytes) = M / n`` (the recorded call's own sizes).
Allocations of exactly ``S`` bytes (or ``S`` rounded up to the CUDA allocator's 512-byte blocks)
are the call's, by when they live:

- *held across the call* (allocated after the previous such call on the rank ended, before this
  one starts, freed after it ends): the call's input and output tensors. Their count says which
  they are: at least ``n`` are a per-rank list of ``n`` shards (``all_gather``'s output list,
  ``reduce_scatter``'s input list; the list's total, the whole buffer, does not change with
  ``n``), the latest ``n`` allocated; the others are the rank's own shard (``reduce_scatter``'s
  output, ``all_gather``'s input), resized to ``S * n / n'``.
- *made inside the call* (the backend's staging buffers, freed as it returns or a little after):
  ``n - 1`` of them are one per peer, as a ring algorithm stages (gloo's reduce-scatter), and
  their total becomes ``(n' - 1) * S'`` (spread over the same buffers); any other count is
  resized per buffer to ``S * n / n'``.

An allocation is counted for the first call it qualifies for. Its free (the next event at its
address on its device) changes with it, and every later ``total_allocated`` of the device moves by
the change. Measured on a ZeRO-1 ladder (gloo, CPU, docs/slicing.md): recorded at dp 2, resized to
dp 4, every such allocation matches the dp 4 recording's count and size.

**Copies** (``follow_copies``). A slice at a fixed global batch repeats or drops whole
microbatches (``prism_trace.slicing.rebatch``); a copy of an op keeps the op's ``event_id``. Each
memory event is anchored to the recorded op it happened in or after (``retime``'s rule: the op
that encloses it and started last, else the one that ended last before it, else the first), and
appears once per node of the unit that replays that op: never for a dropped op, once per copy of
a repeated one. Copies are told apart on a virtual recorded clock: copy ``c`` of every op (and
the events anchored to it) is moved ``c`` spans of the unit's recording later, so ``retime``
anchors each event to its own copy.
"""

from __future__ import annotations

import numpy as np
import polars as pl

__all__ = ["anchor_copies", "follow_copies", "rescale_shards"]

_CUDA_BLOCK = 512


def _split(total: int, parts: int) -> np.ndarray:
    """``total`` bytes over ``parts`` buffers, as even as whole bytes allow."""
    out = np.full(parts, total // parts, dtype=np.int64)
    out[: total % parts] += 1
    return out


def _new_sizes(
    alloc_ts: np.ndarray,
    free_ts: np.ndarray,
    size: np.ndarray,
    calls: pl.DataFrame,
    copies: np.ndarray | None = None,
) -> np.ndarray:
    """Per allocation, its size at the target scale (module docstring); ``copies``: per
    allocation, how many nodes of the unit replay the op that made it (None: one each)."""
    new = size.copy()
    taken = np.zeros(size.size, dtype=bool)
    prev_end = np.iinfo(np.int64).min
    for ts, end, shard, n, n_new in calls.select("ts", "end", "shard", "n", "n_new").iter_rows():
        if n == n_new or n < 1 or n_new < 1 or shard <= 0:
            prev_end = max(prev_end, end)
            continue
        fits = ~taken & ((size == shard) | (size == -(-shard // _CUDA_BLOCK) * _CUDA_BLOCK))
        held = np.flatnonzero(fits & (alloc_ts >= prev_end) & (alloc_ts < ts) & (free_ts > end))
        inside = np.flatnonzero(fits & (alloc_ts >= ts) & (alloc_ts <= end))
        own = np.rint(size * (n / n_new)).astype(np.int64)
        if held.size >= n:
            latest = held[np.argsort(alloc_ts[held], kind="stable")][held.size - n :]
            rest = np.setdiff1d(held, latest)
            new[rest] = own[rest]
            if copies is not None and int(copies[latest].sum()) != n:
                new[latest] = own[latest]  # made per member: the slice repeated their ops
        else:
            new[held] = own[held]
        if inside.size and inside.size == n - 1 and n > 1:
            per_peer = round(int(size[inside[0]]) * n / n_new)
            new[inside] = _split((n_new - 1) * per_peer, n - 1)
        else:
            new[inside] = own[inside]
        taken[held] = True
        taken[inside] = True
        prev_end = max(prev_end, end)
    return new


def rescale_shards(
    memory: pl.DataFrame, calls: pl.DataFrame, copies: pl.DataFrame | None = None
) -> pl.DataFrame:
    """The unit's recorded allocator events with the shard allocations of resized calls resized.

    Args:
        memory: ``unit`` + ``MEMORY_COLUMNS`` less ``rank``, the recorded events.
        calls: per unit, its reduce-scatters and all-gathers: ``unit, ts, end, shard, n, n_new``
            (recorded span, ``min(in_bytes, out_bytes)``, recorded and target group size).
        copies: ``anchor_copies``' frame for ``memory`` (same rows): per event, how many nodes
            replay its op; None when every op is replayed once.

    Returns:
        ``memory`` with ``bytes`` and ``total_allocated`` changed where a shard was resized
        (same rows, same order).
    """
    if memory.is_empty() or calls.is_empty():
        return memory
    parts = []
    mem = memory.with_row_index("_row")
    if copies is not None:
        mem = mem.with_columns(copies["_k"])
    for (unit,), part in mem.group_by(["unit"], maintain_order=True):
        own = calls.filter(pl.col("unit") == unit).sort("ts")
        parts.append(_rescale_unit(part, own) if own.height else part)
    return pl.concat(parts).sort("_row").drop("_row", "_k", strict=False)


def _rescale_unit(part: pl.DataFrame, calls: pl.DataFrame) -> pl.DataFrame:
    """``rescale_shards`` for one unit's events."""
    part = part.sort("ts", "_row")
    k = part["_k"].to_numpy().astype(np.int64) if "_k" in part.columns else None
    ts = part["ts"].to_numpy().astype(np.int64)
    nbytes = part["bytes"].fill_null(0).to_numpy().astype(np.int64)
    addr = part["addr"].fill_null(-1).to_numpy().astype(np.int64)
    dev = (
        part.select(
            pl.concat_str(
                pl.col("device_type").fill_null(""),
                pl.col("device_id").cast(pl.Utf8).fill_null(""),
                separator="/",
            )
        )
        .to_series()
        .to_numpy()
    )
    # Pair each allocation with the next event at its address on its device (its free).
    alloc = np.flatnonzero((nbytes > 0) & (addr >= 0))
    free_of = np.full(alloc.size, -1, dtype=np.int64)
    open_at: dict[tuple[object, int], int] = {}
    where = {int(a): i for i, a in enumerate(alloc.tolist())}
    for i in range(ts.size):
        if addr[i] < 0:
            continue
        key = (dev[i], int(addr[i]))
        if nbytes[i] < 0 and key in open_at:
            j = open_at.pop(key)
            if nbytes[j] == -nbytes[i]:
                free_of[where[j]] = i
        elif nbytes[i] > 0:
            open_at[key] = i
    never = np.iinfo(np.int64).max
    free_ts = np.where(free_of >= 0, ts[np.maximum(free_of, 0)], never)
    sizes = _new_sizes(ts[alloc], free_ts, nbytes[alloc], calls, None if k is None else k[alloc])
    changed = np.flatnonzero(sizes != nbytes[alloc])
    if changed.size == 0:
        return part
    new = nbytes.copy()
    new_size = sizes[changed]
    new[alloc[changed]] = new_size
    freed = free_of[changed]
    new[freed[freed >= 0]] = -new_size[freed >= 0]
    delta = new - nbytes
    shift = (
        pl.DataFrame({"dev": dev, "d": delta})
        .select(pl.col("d").cum_sum().over("dev"))["d"]
        .to_numpy()
    )
    return part.with_columns(
        pl.Series("bytes", new, dtype=part.schema["bytes"]),
        (pl.col("total_allocated") + pl.Series(shift)).cast(part.schema["total_allocated"]),
    )


def _anchors(mem_ts: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per event, the index of the op it is anchored to (``retime``'s rule)."""
    by_start = np.argsort(starts, kind="stable")
    by_end = np.argsort(ends, kind="stable")
    out = np.full(mem_ts.size, by_start[0], dtype=np.int64)
    j = np.searchsorted(ends[by_end], mem_ts, side="right") - 1
    hit = j >= 0
    out[hit] = by_end[j[hit]]
    j = np.searchsorted(starts[by_start], mem_ts, side="right") - 1
    cand = by_start[np.maximum(j, 0)]
    inside = (j >= 0) & (starts[cand] <= mem_ts) & (ends[cand] >= mem_ts)
    out[inside] = cand[inside]
    return out


def _paired_allocs(part: pl.DataFrame) -> np.ndarray:
    """Per event of one unit (in ``part``'s order), the row of the allocation it frees, or -1.

    A free is the next event at an allocation's address on its device, of minus its size.
    """
    order = np.argsort(part["ts"].to_numpy(), kind="stable")
    nbytes = part["bytes"].fill_null(0).to_numpy().astype(np.int64)
    addr = part["addr"].fill_null(-1).to_numpy().astype(np.int64)
    dev = part["device_type"].fill_null("").to_list()
    dev_id = part["device_id"].fill_null(-1).to_list()
    out = np.full(part.height, -1, dtype=np.int64)
    open_at: dict[tuple[object, object, int], int] = {}
    for i in order.tolist():
        if addr[i] < 0:
            continue
        key = (dev[i], dev_id[i], int(addr[i]))
        if nbytes[i] < 0 and key in open_at:
            j = open_at.pop(key)
            if nbytes[j] == -nbytes[i]:
                out[i] = j
        elif nbytes[i] > 0:
            open_at[key] = i
    return out


def anchor_copies(
    memory: pl.DataFrame, recorded: pl.DataFrame, nodes: pl.DataFrame
) -> pl.DataFrame:
    """Per memory event (``memory``'s rows, in order), the recorded op it is anchored to and how
    many nodes of its unit replay that op: ``_ev`` (null: no op to anchor to) and ``_k`` (1 for an
    event without an op; 0 for one whose op was dropped).

    Args:
        memory: ``unit`` + ``MEMORY_COLUMNS`` less ``rank``, the recorded events.
        recorded: the recorded ops of each unit's rank that can allocate: ``unit, event_id,
            rec_ts, rec_end``.
        nodes: the units' graphs: ``unit, event_id`` (one row per node).
    """
    counts = (
        nodes.drop_nulls("event_id")
        .group_by("unit", "event_id")
        .len("_k")
        .select("unit", pl.col("event_id").alias("_ev"), pl.col("_k").cast(pl.Int64))
    )
    ev = np.full(memory.height, -1, dtype=np.int64)
    has = np.zeros(memory.height, dtype=bool)
    rows = memory.with_row_index("_row")
    for (unit,), part in rows.group_by(["unit"], maintain_order=True):
        ops = recorded.filter((pl.col("unit") == unit) & pl.col("rec_ts").is_not_null())
        if ops.is_empty():
            continue
        at = _anchors(
            part["ts"].to_numpy().astype(np.int64),
            ops["rec_ts"].to_numpy().astype(np.int64),
            ops["rec_end"].to_numpy().astype(np.int64),
        )
        idx = part["_row"].to_numpy()
        ev[idx] = ops["event_id"].to_numpy()[at]
        has[idx] = True
    out = pl.DataFrame(
        {
            "unit": memory["unit"],
            "_ev": pl.Series(ev, dtype=pl.Int64).scatter(np.flatnonzero(~has), None),
        }
    ).join(counts.cast({"unit": memory.schema["unit"]}), on=["unit", "_ev"], how="left")
    return out.select(
        "_ev",
        pl.when(pl.col("_ev").is_null()).then(1).otherwise(pl.col("_k").fill_null(0)).alias("_k"),
    )


def follow_copies(
    memory: pl.DataFrame, recorded: pl.DataFrame, nodes: pl.DataFrame
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Memory events and nodes on a virtual recorded clock where every copy of an op has its own
    span (module docstring).

    An event appears once per node replaying its op. A free whose op is replayed fewer times
    (but at least once) than its allocation's appears as often as the allocation, the extra ones
    with the free op's last copy: the per-member outputs of a list collective, allocated by
    repeated ops, are freed together by one later op, and a copy must not leak. (A free whose op
    was dropped goes with it: a dropped microbatch drops as many allocations as frees.)

    Args:
        memory: ``unit`` + ``MEMORY_COLUMNS`` less ``rank``, the recorded events.
        recorded: the recorded ops of each unit's rank that can allocate: ``unit, event_id,
            rec_ts, rec_end``.
        nodes: ``retime``'s nodes frame plus ``event_id`` and ``node_id`` (the unit's graph).

    Returns:
        ``(memory, nodes)`` for ``retime.retime_memory``: each event once per node replaying its
        anchor op, ``ts`` moved with the copy; ``rec_ts``/``rec_end`` moved likewise.
    """
    copies = nodes.with_columns(
        pl.col("node_id").rank("ordinal").over("unit", "event_id").cast(pl.Int64).sub(1).alias("_c")
    )
    span = (
        pl.concat(
            [
                recorded.select(
                    "unit", pl.col("rec_ts").alias("lo"), pl.col("rec_end").alias("hi")
                ),
                memory.select("unit", pl.col("ts").alias("lo"), pl.col("ts").alias("hi")),
            ]
        )
        .group_by("unit")
        .agg((pl.col("hi").max() - pl.col("lo").min() + 1).alias("_span"))
    )
    k = anchor_copies(memory, recorded, nodes)["_k"].to_numpy().astype(np.int64)
    times = k.copy()  # how many times each event appears: its allocation's count for a free
    mem = memory.with_row_index("_row")
    for (_,), part in mem.group_by(["unit"], maintain_order=True):
        idx = part["_row"].to_numpy()
        alloc = _paired_allocs(part)
        frees = np.flatnonzero(alloc >= 0)
        k_free, k_alloc = k[idx[frees]], k[idx[alloc[frees]]]
        more = (k_alloc > k_free) & (k_free >= 1)
        times[idx[frees[more]]] = k_alloc[more]
    mem = (
        mem.with_columns(pl.Series("_k", k), pl.int_ranges(0, pl.Series("_n", times)).alias("_c"))
        .explode("_c")
        .drop_nulls("_c")
        .with_columns(pl.min_horizontal("_c", pl.max_horizontal(pl.col("_k") - 1, 0)).alias("_c"))
        .join(span, on="unit", how="left")
    )
    cols = [c for c in memory.columns]
    mem = (
        mem.with_columns(pl.col("ts") + pl.col("_c") * pl.col("_span").fill_null(0))
        .sort("unit", "ts", "_row", "_c")
        .select(cols)
    )
    moved = (
        copies.join(span, on="unit", how="left")
        .with_columns(
            (pl.col("rec_ts") + pl.col("_c") * pl.col("_span").fill_null(0)).alias("rec_ts"),
            (pl.col("rec_end") + pl.col("_c") * pl.col("_span").fill_null(0)).alias("rec_end"),
        )
        .drop("_c", "_span")
    )
    return mem, moved

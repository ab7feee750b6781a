"""Emulation, the run's memory: the recorded allocator events of each unit's rank, at the target
scale for a sliced run (``replay.memory.scale``) and re-timed on the emulated clock."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.load import _fetch
from prism_trace.replay.emulate.values import EmulationResult, LoadedRun
from prism_trace.replay.memory.retime import (
    MEMORY_COLUMNS,
    backend_worker_ops,
    memory_peaks,
    optimizer_shard_delta,
    retime_memory,
)

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["rank_peaks", "with_memory"]


_DEVICE_KINDS = ("kernel", "memcpy", "memset")


def with_memory(
    store: Store,
    res: EmulationResult,
    config: EmulationConfig,
    group_sizes: Mapping[int, int] | None = None,
) -> EmulationResult:
    """``res`` with its ``memory``: every unit's memory events re-timed onto its emulated nodes.

    Reads only the recording (``source_run_id``), so ``store`` may be a second connection that
    does not see the command's uncommitted writes (``write``'s reader); ``group_sizes``: the
    input run's communicators' sizes, for a sliced run's shards (read from ``store`` if None).
    """
    return dataclasses.replace(res, memory=_memory(store, res, config, group_sizes))


def _memory(
    store: Store,
    res: EmulationResult,
    config: EmulationConfig,
    group_sizes: Mapping[int, int] | None = None,
) -> pl.DataFrame:
    """Every unit's memory events re-timed onto its emulated nodes (``replay.memory``)."""
    inputs, tl = res.inputs, res.timeline
    units = pl.DataFrame(
        {"unit": np.arange(inputs.unit_rank.size, dtype=np.int64), "rank": inputs.unit_source}
    )
    mem = _fetch(
        store.con,
        f"SELECT {', '.join(MEMORY_COLUMNS)} FROM memory"
        " WHERE run_id = $1 AND list_contains($2, rank)",
        [inputs.source_run_id, inputs.unit_source.tolist()],
    )
    # A rank recorded without [memory] events gets a timeline derived from its host ET.
    from prism_trace.replay.memory.host_et import et_memory

    derived = et_memory(
        store.con, inputs.source_run_id, sorted(set(inputs.unit_source.tolist()) - set(mem["rank"]))
    )
    if not derived.is_empty():
        mem = pl.concat([mem, derived.cast(mem.schema)])
    if mem.is_empty():
        return pl.DataFrame(
            schema={"unit": pl.Int64, **{c: t for c, t in mem.schema.items() if c != "rank"}}
        )
    mem = mem.join(units.cast({"rank": mem.schema["rank"]}), on="rank").drop("rank")
    n = inputs.nodes
    rec_end = n["ts"] + n["dur"].fill_null(0)
    host = (
        ~n["kind"].is_in(_DEVICE_KINDS)
        if inputs.source_format != "op_timeline"
        else pl.Series([True] * n.height, dtype=pl.Boolean)
    )
    # A backend's worker ops float free of the call they serve: nothing is anchored to them.
    worker = backend_worker_ops(
        n.select("unit", "track_id", "kind", pl.col("ts").alias("rec_ts")).with_columns(
            rec_end=rec_end
        )
    )
    nodes = pl.DataFrame(
        {
            "unit": n["unit"],
            "node_id": n["node_id"],
            "event_id": n["event_id"],
            "rec_ts": n["ts"],
            "rec_end": rec_end,
            "emu_ts": tl.start + inputs.origin,
            "emu_end": tl.end + inputs.origin,
            "host": host & ~worker,
        }
    ).filter(pl.col("rec_ts").is_not_null())
    if inputs.kind == "sliced":
        mem, nodes = _at_target_scale(store, inputs, mem, nodes, units, group_sizes)
    dp_rec, dp_tgt = inputs.dp_sizes
    delta = None
    if dp_rec != dp_tgt:
        if config.memory.optimizer_state_bytes is not None:
            state = units.with_columns(
                pl.lit(int(config.memory.optimizer_state_bytes), pl.Int64).alias("state")
            )
        else:
            args = _fetch(
                store.con,
                "SELECT rank, TRY_CAST(json_extract(args, '$.optimizer_state_bytes') AS BIGINT)"
                " AS state FROM rank WHERE run_id = $1 AND list_contains($2, rank)",
                [inputs.source_run_id, inputs.unit_source.tolist()],
            )
            state = units.join(args.cast({"rank": pl.Int64}), on="rank", how="left")
        delta = state.select(
            "unit",
            pl.col("state")
            .fill_null(0)
            .map_elements(
                lambda b: optimizer_shard_delta(int(b), dp_rec, dp_tgt), return_dtype=pl.Int64
            )
            .alias("delta"),
        )
    return retime_memory(mem, nodes, delta=delta)


def _at_target_scale(
    store: Store,
    inputs: LoadedRun,
    mem: pl.DataFrame,
    nodes: pl.DataFrame,
    units: pl.DataFrame,
    group_sizes: Mapping[int, int] | None,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """A sliced run's recorded memory at its target scale (``replay.memory.scale``): shards of
    resized reduce-scatters and all-gathers resized, and, when the slice repeated or dropped
    microbatches, each event once per node replaying its op.

    Reads the recording only (``store`` may not see the slice: the dp what-if's re-slice is not
    committed); the slice's side comes from ``inputs`` and ``group_sizes`` (its communicators'
    sizes; read from ``store`` when not given).
    """
    from prism_trace.replay.memory.scale import anchor_copies, follow_copies, rescale_shards

    graph = inputs.recorded_graph
    recorded = None
    if graph is not None and _microbatches_changed(inputs, graph):
        worker = backend_worker_ops(
            graph.select(pl.col("rank").alias("unit"), "track_id", "kind", "rec_end").with_columns(
                rec_ts=graph["ts"]
            )
        )
        recorded = (
            graph.filter(
                pl.col("event_id").is_not_null()
                & pl.col("ts").is_not_null()
                & ~pl.col("kind").is_in(_DEVICE_KINDS)
                & ~worker
            )
            .select("rank", "event_id", pl.col("ts").alias("rec_ts"), "rec_end")
            .join(units.cast({"rank": graph.schema["rank"]}), on="rank")
            .drop("rank")
        )
    sources = inputs.unit_source.tolist()
    calls = _fetch(
        store.con,
        'SELECT c.rank, c.event_id, c.host_ts AS ts, c.host_ts + c.host_dur AS "end",'
        " least(c.in_bytes, c.out_bytes) AS shard, coalesce(c.group_size, g.size) AS n"
        " FROM collective c LEFT JOIN comm_group g USING (run_id, group_id)"
        " WHERE c.run_id = $1 AND list_contains($2, c.rank)"
        " AND c.kind IN ('reduce_scatter', 'all_gather') AND c.in_bytes <> c.out_bytes"
        " AND c.host_ts IS NOT NULL AND c.event_id IS NOT NULL",
        [inputs.source_run_id, sources],
    )
    if calls.height:
        if group_sizes is None:
            group_sizes = dict(
                store.con.execute(
                    "SELECT group_id, size FROM comm_group WHERE run_id = ?", [inputs.run_id]
                ).fetchall()
            )
        target = (
            inputs.nodes.select("unit", "event_id", "group_id")
            .drop_nulls()
            .unique(["unit", "event_id"])
            .with_columns(
                pl.col("group_id")
                .replace_strict(group_sizes or {}, default=None, return_dtype=pl.Int64)
                .alias("n_new")
            )
        )
        calls = (
            calls.join(units.cast({"rank": calls.schema["rank"]}), on="rank")
            .join(target.cast({"event_id": calls.schema["event_id"]}), on=["unit", "event_id"])
            .drop_nulls("n_new")
            .select("unit", "ts", "end", "shard", "n", "n_new")
        )
        # Shard lists made by per-member ops that the slice repeated follow them one by one.
        copies = None if recorded is None else anchor_copies(mem, recorded, nodes)
        mem = rescale_shards(mem, calls, copies)
    if recorded is None:
        return mem, nodes
    return follow_copies(mem, recorded, nodes)


def _microbatches_changed(inputs: LoadedRun, graph: pl.DataFrame) -> bool:
    """Whether a unit replays a recorded op twice, or fewer ops than its rank recorded (a slice
    that repeated or dropped microbatches, ``prism_trace.slicing.rebatch``); ``graph`` is the
    representatives' recorded graph (``LoadedRun.recorded_graph``)."""
    n = inputs.nodes.filter(pl.col("event_id").is_not_null())
    if n.select("unit", "event_id").is_duplicated().any():
        return True
    recorded = dict(graph.group_by("rank").len().iter_rows())
    per_unit = np.bincount(inputs.nodes["unit"].to_numpy(), minlength=inputs.unit_source.size)
    return any(
        recorded.get(int(src), 0) not in (0, int(k))
        for src, k in zip(inputs.unit_source.tolist(), per_unit.tolist(), strict=True)
    )


def _memory_rows(res: EmulationResult, run_id: int) -> pl.DataFrame:
    """The re-timed memory of the units as ``memory`` rows of the emulated run."""
    mem = res.memory
    if mem is None or mem.is_empty():
        return pl.DataFrame()
    ranks = res.inputs.unit_rank
    return mem.with_columns(
        pl.lit(run_id, pl.Int32).alias("run_id"),
        pl.Series("rank", ranks[mem["unit"].to_numpy()].astype(np.int32)),
    ).drop("unit")


def rank_peaks(res: EmulationResult) -> pl.DataFrame:
    """Emulated peak ``total_allocated`` of every rank of the world (``rank, peak``); members of
    a class share their exemplar's. Empty without memory events."""
    if res.memory is None or res.memory.is_empty():
        return pl.DataFrame(schema={"rank": pl.Int64, "peak": pl.Int64})
    per_unit = memory_peaks(res.memory, by="unit")
    return (
        res.inputs.rank_unit.filter(
            (pl.col("unit") >= 0) & ~pl.col("rank").is_in(list(res.inputs.left_out))
        )
        .join(per_unit, on="unit")
        .select("rank", "peak")
        .sort("rank")
    )

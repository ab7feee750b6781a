"""Emulation, results as frames: iterations, per-rank steps, events, communication rows (the
memory: ``run_memory``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
from prism_trace.replay.des.core import Timeline
from prism_trace.replay.des.vector import kineto_iterations
from prism_trace.replay.emulate.load import _fetch, _rank_lookup
from prism_trace.replay.emulate.rank_step import rank_step_rows, rank_steps
from prism_trace.replay.emulate.values import EmulationResult, LoadedRun

from prism_trace.query.steps import WHOLE_TRACE, WHOLE_TRACE_NAME

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["all_iterations", "recorded_iterations", "unit_iterations"]


def unit_iterations(res: EmulationResult, rec_iter: pl.DataFrame) -> pl.DataFrame:
    """Emulated iterations per unit (``unit, iteration, ts, dur, name``; ts on the run clock).

    Op timelines (``source_format = 'op_timeline'``): the recorded iteration is one window shared
    by all ranks (``step_t_base``: from the step's start to the end of its last op on any rank),
    and its margins around one rank's ops are waits for other ranks. The emulated iteration is the
    same kind of window computed from emulated ops only: it ends at the end of the step's last op
    on any unit and starts where the previous step ended (the first one at its recorded start).
    Nothing recorded is added, so every change in the ops shows.

    Other formats (Kineto ``ProfilerStep#``, per rank): an iteration keeps the recorded margins
    around its nodes (host time of the step annotation outside any node). It ends as long after
    its *end anchor* (the node that ended last inside the recorded iteration) as recorded, and
    starts where the unit's previous iteration ended plus the recorded gap between the two; the
    first one starts as long before its first node (by recorded start) as recorded. Without a
    recorded iteration it spans its nodes.
    """
    inputs, tl = res.inputs, res.timeline
    nodes = inputs.nodes.select("unit", "iteration", "ts", "dur")
    if rec_iter.is_empty() and inputs.source_format != "op_timeline":
        # No step recorded (no ProfilerStep): the whole trace is one window per rank, spanning
        # its nodes, as ``step_windows`` reads the recording.
        nodes = nodes.with_columns(pl.col("iteration").fill_null(WHOLE_TRACE))
    nodes = nodes.with_columns(
        (pl.col("ts") + pl.col("dur").fill_null(0)).alias("rec_end"),
        pl.Series("emu_s", tl.start),
        pl.Series("emu_e", tl.end),
    )
    src = pl.DataFrame({"unit": np.arange(inputs.unit_rank.size), "rank": inputs.unit_source})
    rec = rec_iter.join(src.cast({"rank": rec_iter.schema["rank"]}), on="rank").select(
        "unit",
        "iteration",
        (pl.col("ts") - inputs.origin).alias("it_ts"),
        (pl.col("ts") + pl.col("dur") - inputs.origin).alias("it_end"),
        "name",
    )
    j = (
        nodes.filter(pl.col("iteration").is_not_null())
        .with_columns(
            (pl.col("ts") - inputs.origin).alias("ts"), (pl.col("rec_end") - inputs.origin)
        )
        .join(
            rec.cast({"iteration": nodes.schema["iteration"]}), on=["unit", "iteration"], how="left"
        )
    )
    inside = pl.col("rec_end") <= pl.col("it_end")
    agg = j.group_by("unit", "iteration").agg(
        pl.col("ts").min().alias("first_ts"),
        pl.col("emu_s").filter(pl.col("ts") == pl.col("ts").min()).min().alias("a_s"),
        pl.col("rec_end").filter(inside).max().alias("in_end"),
        pl.col("rec_end").max().alias("all_end"),
        pl.col("emu_s").min().alias("emu_min"),
        pl.col("emu_e").max().alias("emu_max"),
        pl.col("it_ts").first(),
        pl.col("it_end").first(),
        pl.col("name").first(),
    )
    recorded = pl.col("it_ts").is_not_null()
    if inputs.source_format == "op_timeline":
        # One window per step for every rank, like the recording's: from the end of the previous
        # step (over all ranks) to the end of this step's last op on any rank.
        steps = (
            agg.group_by("iteration")
            .agg(
                pl.col("emu_max").max().alias("e"),
                pl.col("it_ts").min(),
                pl.col("first_ts").min(),
                pl.col("emu_min").min(),
            )
            .sort(pl.col("it_ts").fill_null(pl.col("first_ts")), "iteration")
            .with_columns(pl.col("e").shift(1).alias("prev_e"))
            .select(
                "iteration",
                "e",
                pl.coalesce("prev_e", "it_ts", "emu_min").alias("s"),
            )
        )
        out = agg.select("unit", "iteration", "name").join(steps, on="iteration", how="left")
    else:
        end_node = (
            j.join(agg.select("unit", "iteration", "in_end", "all_end"), on=["unit", "iteration"])
            .filter(pl.col("rec_end") == pl.coalesce("in_end", "all_end"))
            .group_by("unit", "iteration")
            .agg(pl.col("emu_e").max().alias("a_e"), pl.col("rec_end").first().alias("a_end"))
        )
        agg = agg.join(end_node, on=["unit", "iteration"], how="left")
        out = (
            agg.with_columns(
                pl.when(recorded & pl.col("a_s").is_not_null())
                .then(pl.col("a_s") - (pl.col("first_ts") - pl.col("it_ts")))
                .otherwise(pl.col("emu_min"))
                .alias("s0"),
                pl.when(pl.col("it_end").is_not_null() & pl.col("a_e").is_not_null())
                .then(pl.col("a_e") + (pl.col("it_end") - pl.col("a_end")))
                .otherwise(pl.col("emu_max"))
                .alias("e"),
            )
            .sort("unit", pl.col("it_ts").fill_null(pl.col("first_ts")), "iteration")
            .with_columns(
                pl.col("e").shift(1).over("unit").alias("prev_e"),
                pl.col("it_end").shift(1).over("unit").alias("prev_it_end"),
            )
            .with_columns(
                # Steps follow one another: a step starts where the previous one ended (plus the
                # recorded gap), so that a lane drifting early cannot stretch the next step.
                pl.when(
                    recorded & pl.col("prev_e").is_not_null() & pl.col("prev_it_end").is_not_null()
                )
                .then(pl.col("prev_e") + (pl.col("it_ts") - pl.col("prev_it_end")))
                .otherwise(pl.col("s0"))
                .alias("s")
            )
        )
    return out.select(
        "unit",
        "iteration",
        (pl.col("s") + inputs.origin).alias("ts"),
        (pl.col("e") - pl.col("s")).alias("dur"),
        pl.when(pl.col("iteration") == WHOLE_TRACE)
        .then(pl.lit(WHOLE_TRACE_NAME))
        .otherwise(pl.col("name"))
        .alias("name"),
    ).sort("unit", "iteration")


def _rank_step_rows(res: EmulationResult, run_id: int) -> pl.DataFrame:
    """``rank_step`` rows of every rank of the world (``replay.rank_step``): from the replica
    vector's columns, or from the units (class members share their unit's)."""
    inputs, s = res.inputs, res.sync
    if s.is_empty() and (res.memory is None or res.memory.is_empty()):
        return pl.DataFrame()
    if res.replicas is not None:
        start, arrival = res.replicas.start, res.replicas.arrival
    else:
        start, arrival = res.timeline.start, res.timeline.arrival
    steps = rank_steps(
        start,
        arrival,
        sync_node=s["sync_idx"].to_numpy(),
        instance=s["instance"].to_numpy(),
        unit=s["unit"].to_numpy(),
        iteration=s["iteration"].fill_null(-1).to_numpy(),
        shared=res.shared,
    )
    if inputs.grid is not None:
        rank_of, column_of = inputs.grid.grid, inputs.grid.column
    else:  # a unit's class members, -1 padded
        ru = inputs.rank_unit.filter(
            (pl.col("unit") >= 0) & ~pl.col("rank").is_in(list(inputs.left_out))
        ).sort("unit", "rank")
        unit = ru["unit"].to_numpy().astype(np.int64)
        pos = np.arange(unit.size) - np.searchsorted(unit, unit)
        rank_of = np.full((inputs.unit_rank.size, int(pos.max(initial=0)) + 1), -1, np.int64)
        rank_of[unit, pos] = ru["rank"].to_numpy()
        column_of = np.zeros(rank_of.shape[1], dtype=np.int64)
    peaks = None
    if res.memory is not None and not res.memory.is_empty():
        peaks = (
            res.memory.filter(pl.col("iteration").is_not_null())
            .group_by("unit", "iteration")
            .agg(pl.col("total_allocated").max().alias("peak"))
        )
    rows = rank_step_rows(steps, rank_of=rank_of, column_of=column_of, peaks=peaks)
    if inputs.left_out:
        rows = rows.filter(~pl.col("rank").is_in(list(inputs.left_out)))
    return rows.with_columns(run_id=pl.lit(run_id, pl.Int32))


def _rank_iterations(res: EmulationResult, per_unit: pl.DataFrame) -> pl.DataFrame:
    """Iterations of every rank of the world (members of a class share their exemplar's);
    ranks a what-if left out (a removed GPU) have none."""
    ru = res.inputs.rank_unit.filter(
        (pl.col("unit") >= 0) & ~pl.col("rank").is_in(list(res.inputs.left_out))
    )
    return (
        ru.join(per_unit, on="unit")
        .select(
            pl.col("rank").cast(pl.Int32),
            pl.col("iteration").cast(pl.Int32),
            pl.col("ts").cast(pl.Int64),
            pl.col("dur").cast(pl.Int64),
            pl.col("name").cast(pl.Utf8),
        )
        .sort("rank", "iteration")
    )


def all_iterations(res: EmulationResult, rec_iter: pl.DataFrame) -> pl.DataFrame:
    """Every rank's iterations (``rank, iteration, ts, dur, name``): its unit's, or its replica's
    column's (``replay.vector``); ``rec_iter``: ``recorded_iterations``."""
    if res.replicas is not None:
        return _replica_iterations(res, rec_iter)
    return _rank_iterations(res, unit_iterations(res, rec_iter))


def _replica_iterations(res: EmulationResult, rec_iter: pl.DataFrame) -> pl.DataFrame:
    """Iterations of every rank when every replica is distinct (``replay.vector``).

    Op timelines: one window per step for the whole world (``unit_iterations``), over every
    replica's ops: the earliest start and the latest end of each node across the replicas.
    Per-rank step annotations: ``vector.kineto_iterations``, replica by replica.
    """
    inputs, vt, reps_ = res.inputs, res.replicas, res.inputs.grid
    assert vt is not None
    assert reps_ is not None
    grid, column = reps_.grid, reps_.column
    if inputs.source_format == "op_timeline":
        tl = Timeline(vt.start.min(axis=1), vt.end.max(axis=1), vt.arrival[:, 0], vt.rounds)
        per_unit = unit_iterations(dataclasses.replace(res, timeline=tl), rec_iter)
        reps = grid.shape[1]
        rows = per_unit["unit"].to_numpy().astype(np.int64)
        frame = per_unit.select("iteration", "name")[np.repeat(np.arange(per_unit.height), reps)]
        rank = grid[rows].ravel()
        ts = np.repeat(per_unit["ts"].to_numpy(), reps)
        dur = np.repeat(per_unit["dur"].to_numpy(), reps)
    else:
        src = pl.DataFrame({"unit": np.arange(inputs.unit_rank.size), "rank": inputs.unit_source})
        rec = rec_iter.join(src.cast({"rank": rec_iter.schema["rank"]}), on="rank").select(
            "unit",
            "iteration",
            (pl.col("ts") - inputs.origin).alias("it_ts"),
            (pl.col("ts") + pl.col("dur") - inputs.origin).alias("it_end"),
            "name",
        )
        groups, ts_m, dur_m = kineto_iterations(inputs.nodes, rec, inputs.origin, vt.start, vt.end)
        reps = grid.shape[1]
        rows = groups["unit"].to_numpy().astype(np.int64)
        frame = groups.select("iteration", "name")[np.repeat(np.arange(groups.height), reps)]
        rank = grid[rows].ravel()
        ts, dur = ts_m[:, column].ravel(), dur_m[:, column].ravel()
    out = frame.with_columns(
        pl.Series("rank", rank.astype(np.int32)),
        pl.Series("ts", ts.astype(np.int64)),
        pl.Series("dur", dur.astype(np.int64)),
    )
    if inputs.left_out:  # a failed GPU's tp slot (remove-gpu) leaves the results
        out = out.filter(~pl.col("rank").is_in(list(inputs.left_out)))
    return out.select(
        "rank",
        pl.col("iteration").cast(pl.Int32),
        "ts",
        "dur",
        pl.col("name").cast(pl.Utf8),
    ).sort("rank", "iteration")


def recorded_iterations(store: Store, inputs: LoadedRun) -> pl.DataFrame:
    """The recorded iterations of the ranks the units replay (``rank, iteration, ts, dur,
    name``), read from the recording (``source_run_id``) only, like ``with_memory``."""
    return _fetch(
        store.con,
        "SELECT rank, iteration, ts, dur, name FROM iteration"
        " WHERE run_id = $1 AND list_contains($2, rank)",
        [inputs.source_run_id, inputs.unit_source.tolist()],
    )


def _kept(res: EmulationResult, keep: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(rank, unit, column)`` of each rank of ``keep`` that is not a unit itself (a class
    member: its events are its unit's, from its replica's column when replicas are distinct)."""
    inputs = res.inputs
    want = np.array(sorted(set(keep) - set(inputs.unit_rank.tolist())), dtype=np.int64)
    want = want[(want >= 0) & (want < inputs.world_size)]
    unit = _rank_lookup(inputs.rank_unit, want)
    out = []
    for r, u in zip(want.tolist(), unit.tolist(), strict=True):
        if u < 0 or r in inputs.left_out:
            continue
        col = 0
        if inputs.grid is not None:
            col = int(inputs.grid.column[int(np.flatnonzero(inputs.grid.grid[u] == r)[0])])
        out.append((r, u, col))
    return out


def _event_frame(res: EmulationResult, run_id: int, keep: tuple[int, ...] = ()) -> pl.DataFrame:
    """Every unit's events, and those of the ranks of ``keep`` (``_kept``)."""
    inputs, tl = res.inputs, res.timeline
    n = inputs.nodes
    own = _unit_events(res, run_id, tl.start, tl.end, None)
    extra = []
    for r, u, col in _kept(res, keep):
        if res.replicas is not None:
            start, end = res.replicas.start[:, col], res.replicas.end[:, col]
        else:
            start, end = tl.start, tl.end
        rows = np.flatnonzero(n["unit"].to_numpy() == u)
        extra.append(
            _unit_events(res, run_id, start, end, rows).with_columns(rank=pl.lit(r, pl.Int32))
        )
    return pl.concat([own, *extra]) if extra else own


def _unit_events(
    res: EmulationResult, run_id: int, start: np.ndarray, end: np.ndarray, rows: np.ndarray | None
) -> pl.DataFrame:
    inputs = res.inputs
    n = inputs.nodes if rows is None else inputs.nodes[rows]
    if rows is not None:
        start, end = start[rows], end[rows]
    tl = Timeline(start, end, np.zeros(0, dtype=np.int64), 0)
    return pl.DataFrame(
        {
            "run_id": np.full(n.height, run_id, dtype=np.int32),
            "rank": n["rank"].to_numpy().astype(np.int32),
            "event_id": n["node_id"].to_numpy().astype(np.int64),
            "track_id": n["track_id"],
            "category": n["category"],
            "name": n["name"].fill_null(n["kind"]),
            "ts": tl.start + inputs.origin,
            "dur": tl.end - tl.start,
            "iteration": n["iteration"],
            "depth": np.zeros(n.height, dtype=np.int32),
        }
    )


def _comm_frames(res: EmulationResult, run_id: int, g_size: dict[int, int]) -> tuple[Any, Any]:
    inputs, tl = res.inputs, res.timeline
    s = res.sync
    origin = inputs.origin
    host = s["host_idx"].to_numpy()
    has_k = s["kernel_idx"].is_not_null().to_numpy()
    kidx = s["kernel_idx"].fill_null(0).to_numpy()
    node_ids = inputs.nodes["node_id"].to_numpy()
    base = pl.DataFrame(
        {
            "run_id": np.full(s.height, run_id, dtype=np.int32),
            "rank": s["rank"].to_numpy().astype(np.int32),
            "event_id": s["node_id"].to_numpy().astype(np.int64),
            "group_id": s["group_id"],
            "seq": s["seq"],
            "host_ts": tl.start[host] + origin,
            "host_dur": tl.end[host] - tl.start[host],
            "kernel_event_id": node_ids[kidx].astype(np.int64),
            "kernel_ts": tl.start[kidx] + origin,
            "kernel_dur": tl.end[kidx] - tl.start[kidx],
            "iteration": s["iteration"],
            "_has_k": has_k,
            "_kind": s["kind"],
            "comm_kind": s["comm_kind"],
            "msg_bytes": s["msg_bytes"],
            "peer": s["peer"],
        }
    )
    k_cols = ("kernel_event_id", "kernel_ts", "kernel_dur")
    base = base.with_columns(
        [pl.when(pl.col("_has_k")).then(pl.col(c)).otherwise(None).alias(c) for c in k_cols]
    )
    sizes = pl.DataFrame(
        {"group_id": list(g_size.keys()), "group_size": list(g_size.values())},
        schema={"group_id": pl.Int32, "group_size": pl.Int32},
    )
    coll = (
        base.filter(pl.col("_kind") == "collective")
        .join(sizes, on="group_id", how="left")
        .with_columns(pl.col("comm_kind").alias("kind"))
    )
    p2p = base.filter(pl.col("_kind") != "collective").with_columns(
        pl.col("_kind").alias("direction"), pl.col("msg_bytes").alias("bytes")
    )
    return coll, p2p

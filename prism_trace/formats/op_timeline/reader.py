"""Megatron-style op-timeline reader: one parquet of every rank's timed ops → the contract's frames.

The input (as published with ByteDance-Seed/StragglerAnalysis) is ``trace-<trial>.parquet``
with columns ``dp_rank, stage, rank, step, optype, start_ts, duration`` (+ ``seq_id, mc, mb_id,
gmc``), ``meta-<trial>.yaml`` beside it (``dp_size``, ``pp_size``, ``tp_size``, ``world_size``) and
optionally ``result-<trial>.json`` (``step_t_base``: the recorded time of each step, seconds). One
file holds all ranks, so the frames carry many ranks.

Clock. ``start_ts`` is in seconds relative to the start of its step, on one clock shared by all
ranks (the earliest op of a step starts at 0 on some rank). The recorded steps are usually a sample
(e.g. 23, 25, 33, ...), so they are laid back to back on one run clock: the first recorded step
starts at 0 and each next recorded step starts where the previous one ends, i.e. after
``step_t_base`` of the previous step (or, without it, after the latest op end over all ranks,
whichever is larger). Gaps between non-consecutive step numbers are not represented. Times are
rounded to integer ns from the float32 seconds of the file (whose resolution is ~0.24 us at 2 s),
with ``dur = round(end) - round(start)``.

Mapping:

- ``events``: one per op; ``name`` = optype; ``category`` ``compute`` for ``*-compute``,
  ``optimizer`` and ``gc``, ``comm`` for p2p, collectives and ``optimizer-clip-main-grad`` (its
  grad-norm all-reduce makes it a sync point: it ends within ~1 ms on all ranks), else ``other``;
  ``iteration`` = step; ``args`` = JSON of step, seq_id, mc, mb_id, gmc, dp_rank, stage.
- ``tracks``: the lanes of the source tool's Chrome timeline, per rank: ``compute`` (tid 0),
  ``pp-comm`` (tid 1: sends/receives), ``dp-comm`` (tid 3: collectives and clip-main-grad), ``misc``
  (tid 4: anything else). Ops of one rank overlap (a send runs beside a compute), so a single track
  per rank would not nest.
- ``iterations``: one per (rank, step): ``ts`` = the step's start, ``dur`` = ``step_t_base`` when
  present, else the latest op end of the step over all ranks.
- ``collectives`` (``seq`` per (rank, group) in time order, bytes unknown):
  ``params-all-gather`` (all_gather), ``grads-reduce-scatter`` (reduce_scatter) and other
  ``*-all-reduce``/``*-all-gather``/``*-reduce-scatter`` over the DP group ``dp_stage<s>``;
  ``embedding-grads-all-reduce`` over the embedding group ``embd_dp<d>`` (stage 0 and the last stage
  at one dp_rank); ``layernorm-grads-all-reduce`` over the TP group ``tp_stage<s>_dp<d>``
  (Megatron all-reduces layernorm grads across TP; with tp 1 it is a one-rank group, and the data
  agree: ~40 us, no alignment with any other rank).
- ``p2p``: ``forward-send`` goes to the next stage, ``backward-send`` to the previous one, and the
  receives come from the opposite side; the peer is the rank of that stage at the same dp_rank,
  ``group_name`` = ``pp_dp<d>``, ``seq`` per (rank, peer, direction) in time order, bytes unknown.
- ``comm_groups``: ``dp_stage<s>`` (description ``dp``), ``pp_dp<d>`` (``pp``), ``embd_dp<d>``
  (``embd``) and, when used, ``tp_stage<s>_dp<d>`` (``tp``), all backend ``nccl``.
- ``ranks``: ``args`` JSON with ``dp_rank``, ``stage`` and the coordinates ``dp``, ``pp``, ``tp``.

Rank layout. The ``rank`` column is trusted; the data follow Megatron's order (tp fastest, then dp,
then pp): ``rank = (stage * dp_size + dp_rank) * cp_size * tp_size``, where ``cp_size`` is the
meta's ``cp_size`` or ``dsp_size`` (context parallelism). The file usually holds one rank per
(dp_rank, stage) cell, i.e. one per TP/CP group; the groups ``tp_stage<s>_dp<d>`` and (cp > 1)
``cp_stage<s>_dp<d>`` still list the peers, whose timing is their recorded partner's. Ranks of
(dp_rank, stage) cells absent from the file are filled in with that formula so that groups list
the whole world. A file whose ranks are the cell indices ``stage * dp_size + dp_rank`` while the
meta says tp or cp > 1 (a logger that numbered the ranks it recorded) is renumbered by the
formula.

This module maps the ops to the frames (clock, events, tracks, iterations, ranks); the input's
files are read and checked in ``files``, op types classified in ``ops``, and the layout, groups
and calls built in ``comms``.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from prism_trace.errors import TraceFormatError
from prism_trace.formats.base import TraceTables
from prism_trace.formats.op_timeline.comms import _collectives, _groups, _layout, _p2p
from prism_trace.formats.op_timeline.files import (
    _ARG_COLUMNS,
    _check_duplicates,
    _locate,
    _read_meta,
    _read_parquet,
    _read_step_base,
)
from prism_trace.formats.op_timeline.ops import _LANES, _category_lane

__all__ = ["read_op_timeline"]


def read_op_timeline(path: Path, *, rank: int | None = None) -> TraceTables:
    """Read a Megatron-style op timeline (all ranks of a job) into the contract's frames.

    Args:
        path: the ``trace-<trial>.parquet`` file, or the folder holding it with its meta yaml.
        rank: keep only this rank's rows (all ranks when None); groups still list every member.

    Returns:
        The conformed frames of every rank in the file (or of ``rank``), with ``world_size`` from
        the meta yaml, else dp * pp * tp.

    Raises:
        MissingFieldError: the parquet lacks a required column.
        TraceFormatError: the file is unreadable, has nulls or bad types, its rank layout is
            inconsistent, a p2p op has no peer stage, or ``rank`` is not in the file.
    """
    path = Path(path)
    parquet, meta_path, result_path = _locate(path)
    meta = _read_meta(meta_path)
    step_base = _read_step_base(result_path)
    df = _read_parquet(parquet)
    if df.is_empty():
        msg = f"{parquet}: op timeline has no rows"
        raise TraceFormatError(msg)

    layout = _layout(df, meta, parquet)
    _check_duplicates(parquet, df)
    if layout["renumber"]:
        # The file numbers its (dp_rank, stage) cells 0.. although each stands for a TP x CP
        # group: the global rank of the recorded one is the cell index times tp * cp.
        df = df.with_columns(
            (
                (pl.col("stage").cast(pl.Int64) * layout["dp"] + pl.col("dp_rank"))
                * (layout["tp"] * layout["cp"])
            )
            .cast(df.schema["rank"])
            .alias("rank")
        )
        layout = _layout(df, meta, parquet)
    dp_size, pp_size, tp_size, cp_size = layout["dp"], layout["pp"], layout["tp"], layout["cp"]
    cell_rank: dict[tuple[int, int], int] = layout["cells"]  # (dp_rank, stage) -> rank
    world_size = int(meta.get("world_size") or dp_size * pp_size * tp_size * cp_size)
    top = int(df["rank"].max())  # type: ignore[arg-type]
    if top >= world_size:
        msg = f"{parquet}: rank {top} is not below the world size {world_size} ({meta_path})"
        raise TraceFormatError(msg)

    # clock: recorded steps back to back
    df = df.with_columns(
        (pl.col("start_ts") * 1e9).round().cast(pl.Int64).alias("_s"),
        ((pl.col("start_ts") + pl.col("duration")) * 1e9).round().cast(pl.Int64).alias("_e"),
    )
    ends = df.group_by("step").agg(pl.col("_e").max().alias("end")).sort("step")
    step_start: dict[int, int] = {}
    step_dur: dict[int, int] = {}
    t = 0
    for step, end in ends.iter_rows():
        base = step_base.get(step)
        rec = round(base * 1e9) if base is not None else None
        step_start[step] = t
        step_dur[step] = rec if rec is not None else end
        t += max(rec or 0, end)
    steps = pl.DataFrame(
        {"step": list(step_start), "_step_ts": list(step_start.values())},
        schema={"step": pl.Int64, "_step_ts": pl.Int64},
    )

    cats = {o: _category_lane(o) for o in df["optype"].unique().to_list()}
    df = (
        df.join(steps, on="step", how="left")
        .with_columns(
            (pl.col("_step_ts") + pl.col("_s")).alias("ts"),
            (pl.col("_e") - pl.col("_s")).alias("dur"),
            pl.col("optype")
            .replace_strict({o: c for o, (c, _) in cats.items()}, return_dtype=pl.Utf8)
            .alias("category"),
            pl.col("optype")
            .replace_strict(
                {o: _LANES[lane] for o, (_, lane) in cats.items()}, return_dtype=pl.Int32
            )
            .alias("track_id"),
        )
        .sort("rank", "ts", "dur", "optype", maintain_order=True)
        .with_columns(pl.int_range(pl.len(), dtype=pl.Int64).over("rank").alias("event_id"))
    )
    args_cols = ["step", *(c for c in _ARG_COLUMNS if c in df.columns), "dp_rank", "stage"]
    events = df.select(
        "rank",
        "event_id",
        "track_id",
        "category",
        pl.col("optype").alias("name"),
        "ts",
        "dur",
        pl.col("step").cast(pl.Int32).alias("iteration"),
        pl.struct(args_cols).struct.json_encode().alias("args"),
    )

    tracks = (
        df.select("rank", "track_id")
        .unique()
        .with_columns(
            pl.lit("thread").alias("kind"),
            pl.col("track_id").cast(pl.Int64).alias("tid"),
            pl.col("track_id")
            .replace_strict({v: k for k, v in _LANES.items()}, return_dtype=pl.Utf8)
            .alias("name"),
        )
        .sort("rank", "track_id")
    )

    iterations = (
        df.select("rank", "step")
        .unique()
        .with_columns(
            pl.col("step").replace_strict(step_start, return_dtype=pl.Int64).alias("ts"),
            pl.col("step").replace_strict(step_dur, return_dtype=pl.Int64).alias("dur"),
            pl.format("step#{}", pl.col("step")).alias("name"),
            pl.col("step").cast(pl.Int32).alias("iteration"),
        )
        .drop("step")
        .sort("rank", "iteration")
    )

    groups = _groups(cell_rank, dp_size, pp_size, tp_size, cp_size)
    collectives, used_tp = _collectives(df, groups)
    p2p = _p2p(df, cell_rank, pp_size, parquet)
    comm_groups = pl.DataFrame(
        # One-rank tp groups only when used; wider ones always, as they carry the tp size of a
        # recording of one rank per TP group (the peers are not in the file).
        [
            {"name": n, **g}
            for n, g in groups.items()
            if g["description"] != "tp" or n in used_tp or tp_size > 1
        ],
        schema={
            "name": pl.Utf8,
            "description": pl.Utf8,
            "backend": pl.Utf8,
            "size": pl.Int32,
            "ranks": pl.List(pl.Int32),
        },
    )

    ranks = (
        df.select("rank", "dp_rank", "stage")
        .unique()
        .sort("rank")
        .with_columns(
            pl.lit("nccl").alias("backend"),
            pl.struct(
                "dp_rank",
                "stage",
                pl.col("dp_rank").alias("dp"),
                pl.col("stage").alias("pp"),
                pl.lit(0).alias("tp"),
                pl.lit(0).alias("cp"),
            )
            .struct.json_encode()
            .alias("args"),
        )
        .drop("dp_rank", "stage")
    )

    tables = TraceTables(
        path=parquet,
        format="op_timeline",
        world_size=world_size,
        ranks=ranks,
        tracks=tracks,
        events=events,
        collectives=collectives,
        p2p=p2p,
        iterations=iterations,
        comm_groups=comm_groups,
    )
    if rank is not None:
        if rank not in set(ranks["rank"].to_list()):
            msg = f"{parquet}: rank {rank} is not in the op timeline (ranks {tables.rank_ids})"
            raise TraceFormatError(msg)
        for name in ("ranks", "tracks", "events", "collectives", "p2p", "iterations"):
            frame: pl.DataFrame = getattr(tables, name)
            setattr(tables, name, frame.filter(pl.col("rank") == rank))
    return tables.conform()

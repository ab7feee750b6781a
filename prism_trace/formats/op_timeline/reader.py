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
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import polars as pl
import yaml

from prism_trace.errors import MissingFieldError, TraceFormatError
from prism_trace.formats.base import TraceTables
from prism_trace.limits import (
    INT64_MAX,
    MAX_RANKS,
    check_count,
    check_regular_file,
    check_world_size,
)

__all__ = ["REQUIRED_COLUMNS", "read_op_timeline", "sniff_op_timeline"]

REQUIRED_COLUMNS = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration")
"""Columns an op-timeline parquet must have."""

_ARG_COLUMNS = ("seq_id", "mc", "mb_id", "gmc")

_INTEGER = (
    pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt8, pl.UInt16, pl.UInt32, pl.UInt64,
)  # fmt: skip
_TIMES = ("start_ts", "duration")
# The parquet types each column may have; bools, structs, lists and strings for numbers are
# refused rather than cast.
_COLUMN_KINDS: dict[str, tuple[type, ...]] = {
    "optype": (pl.String, pl.Categorical, pl.Enum),
    "start_ts": (pl.Float32, pl.Float64, *_INTEGER),
    "duration": (pl.Float32, pl.Float64, *_INTEGER),
}
_MAX_SECONDS = 1e6  # an op or a step of more than 11 days is not a training step
_SECONDS = "seconds in [0, 1e6]"
_MAX_SIDECAR_BYTES = 64 << 20
# Parallel degrees of the meta yaml; each sizes the groups built, so each is checked the same way
# (`dsp_size` is StragglerAnalysis's name for the context-parallel degree).
_META_SIZES = ("dp_size", "pp_size", "tp_size", "cp_size", "dsp_size")

_LANES = {"compute": 0, "pp-comm": 1, "dp-comm": 3, "misc": 4}

_P2P = {  # optype -> (direction, stage offset of the peer)
    "forward-send": ("send", 1),
    "forward-recv": ("recv", -1),
    "backward-send": ("send", -1),
    "backward-recv": ("recv", 1),
}

_SYNC_OPS = frozenset({"optimizer-clip-main-grad"})
_COMPUTE_OPS = frozenset({"optimizer", "gc"})


def _collective(optype: str) -> tuple[str, str] | None:
    """(kind, group family) of a collective optype, or None."""
    if optype == "embedding-grads-all-reduce":
        return "all_reduce", "embd"
    if optype == "layernorm-grads-all-reduce":
        return "all_reduce", "tp"
    for suffix, kind in (
        ("all-reduce", "all_reduce"),
        ("all-gather", "all_gather"),
        ("reduce-scatter", "reduce_scatter"),
        ("all-to-all", "all_to_all"),
        ("broadcast", "broadcast"),
    ):
        if optype.endswith(suffix):
            return kind, "dp"
    return None


def _category_lane(optype: str) -> tuple[str, str]:
    if optype in _P2P:
        return "comm", "pp-comm"
    if _collective(optype) is not None or optype in _SYNC_OPS:
        return "comm", "dp-comm"
    if optype.endswith("-compute") or optype in _COMPUTE_OPS:
        return "compute", "compute"
    return "other", "misc"


# --- files -----------------------------------------------------------------------------------


def _locate(path: Path) -> tuple[Path, Path | None, Path | None]:
    """The parquet, meta yaml and result json of an op timeline given as a file or a folder."""
    if path.is_dir():
        traces = sorted(path.glob("trace-*.parquet")) or sorted(path.glob("*.parquet"))
        if len(traces) != 1:
            found = [p.name for p in traces]
            msg = f"{path}: expected one `trace-<trial>.parquet`, found {found}"
            raise TraceFormatError(msg)
        parquet = traces[0]
    else:
        parquet = path
    folder = parquet.parent
    trial = parquet.stem[len("trace-") :] if parquet.stem.startswith("trace-") else None

    def beside(prefix: str, suffixes: tuple[str, ...]) -> Path | None:
        if trial is not None:
            for suf in suffixes:
                p = folder / f"{prefix}-{trial}{suf}"
                if p.is_file():
                    return p
        cands = sorted(p for suf in suffixes for p in folder.glob(f"{prefix}*{suf}"))
        return cands[0] if len(cands) == 1 else None

    return parquet, beside("meta", (".yaml", ".yml")), beside("result", (".json",))


def _read_meta(meta: Path | None) -> dict[str, Any]:
    if meta is None:
        return {}
    check_regular_file(meta)
    if meta.stat().st_size > _MAX_SIDECAR_BYTES:
        msg = f"{meta}: op-timeline meta is larger than {_MAX_SIDECAR_BYTES} bytes"
        raise TraceFormatError(msg)
    try:
        data = yaml.safe_load(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as exc:
        msg = f"{meta}: cannot read op-timeline meta: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc
    if not isinstance(data, dict):
        msg = f"{meta}: op-timeline meta is not a mapping"
        raise TraceFormatError(msg)
    for key in _META_SIZES:
        if data.get(key) is not None:
            data[key] = check_count(meta, data[key], f"`{key}`")
    if data.get("world_size") is not None:
        data["world_size"] = check_world_size(meta, data["world_size"], "`world_size`")
    return data


def _read_step_base(result: Path | None) -> dict[int, float]:
    if result is None:
        return {}
    check_regular_file(result)
    if result.stat().st_size > _MAX_SIDECAR_BYTES:
        msg = f"{result}: op-timeline result is larger than {_MAX_SIDECAR_BYTES} bytes"
        raise TraceFormatError(msg)
    try:
        data = json.loads(result.read_text(encoding="utf-8"))
        base = data.get("step_t_base") or {}
        out = {int(k): float(v) for k, v in base.items()}
    except (OSError, ValueError, AttributeError, TypeError, RecursionError) as exc:
        msg = f"{result}: cannot read `step_t_base`: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc
    for k, v in out.items():
        if not (math.isfinite(v) and 0 <= v <= _MAX_SECONDS):
            msg = f"{result}: `step_t_base` of step {k} is {v}, expected seconds in [0, 1e6]"
            raise TraceFormatError(msg)
    return out


def _read_parquet(parquet: Path) -> pl.DataFrame:
    check_regular_file(parquet)
    try:
        schema = pl.read_parquet_schema(parquet)
    except Exception as exc:  # polars/pyarrow raise several unrelated types on bad files
        msg = f"{parquet}: not a readable parquet file: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc
    need = ", ".join(REQUIRED_COLUMNS)
    for col in REQUIRED_COLUMNS:
        if col not in schema:
            msg = f"{parquet}: missing required column `{col}` (an op timeline needs {need})"
            raise MissingFieldError(msg)
    cols = [*REQUIRED_COLUMNS, *(c for c in _ARG_COLUMNS if c in schema)]
    for col in cols:
        kinds = _COLUMN_KINDS.get(col, _INTEGER)
        if not any(isinstance(schema[col], k) for k in kinds):
            want = "a string" if col == "optype" else "numbers" if col in _TIMES else "integers"
            msg = f"{parquet}: column `{col}` is {schema[col]}, expected {want}"
            raise TraceFormatError(msg)
    try:
        df = pl.read_parquet(parquet, columns=cols)
    except Exception as exc:  # corrupt pages surface only on read
        msg = f"{parquet}: cannot read parquet data: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc
    nulls = df.select(pl.col(REQUIRED_COLUMNS).null_count()).row(0, named=True)
    bad = [c for c, k in nulls.items() if k]
    if bad:
        msg = f"{parquet}: null values in required columns {bad}"
        raise TraceFormatError(msg)
    # Values are checked in the file's own types, before the casts: a rank of 2**40 is then "row
    # N: `rank` is 1099511627776", not a failed i64 -> i32 conversion that names no row.
    _check_values(parquet, df)
    try:
        return df.with_columns(
            pl.col("dp_rank", "stage", "rank").cast(pl.Int32),
            pl.col("step").cast(pl.Int64),
            pl.col("optype").cast(pl.Utf8),
            pl.col("start_ts", "duration").cast(pl.Float64),
            *(pl.col(c).cast(pl.Int64) for c in _ARG_COLUMNS if c in schema),
        )
    except pl.exceptions.PolarsError as exc:
        msg = f"{parquet}: bad column types: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc


def _check_values(parquet: Path, df: pl.DataFrame) -> None:
    """Refuse out-of-range values, naming the first bad row and its value.

    Runs on the columns as the file types them, so a value no cast could hold is still reported
    with its row rather than as a failed conversion of the whole column.
    """
    rules = [
        ("rank", (pl.col("rank") >= 0) & (pl.col("rank") < MAX_RANKS), f"in [0, {MAX_RANKS})"),
        ("dp_rank", pl.col("dp_rank").is_between(0, MAX_RANKS - 1), f"in [0, {MAX_RANKS})"),
        ("stage", pl.col("stage").is_between(0, MAX_RANKS - 1), f"in [0, {MAX_RANKS})"),
        ("step", pl.col("step").is_between(0, (1 << 31) - 1), "in [0, 2^31)"),
        *(
            (
                c,
                pl.col(c).is_finite() & pl.col(c).is_between(0, _MAX_SECONDS),
                "seconds in [0, 1e6]",
            )
            for c in _TIMES
        ),
        # Optional ids kept in `args`: an unsigned value past int64 would fail the cast.
        *(
            (c, pl.col(c) <= INT64_MAX, "an integer below 2^63")
            for c in _ARG_COLUMNS
            if c in df.columns
        ),
    ]
    checked = df.with_row_index("_row").select(
        "_row", *(c for c, _, _ in rules), *(ok.alias(f"_ok_{c}") for c, ok, _ in rules)
    )
    for col, _, want in rules:
        rows = checked.filter(~pl.col(f"_ok_{col}"))
        if rows.height:
            row, value = rows["_row"][0], rows[col][0]
            msg = f"{parquet}: row {row}: `{col}` is {value}, expected {want}"
            raise TraceFormatError(msg)


def _check_duplicates(parquet: Path, df: pl.DataFrame) -> None:
    """Refuse an op given twice: it would double the collectives and p2p calls."""
    key = ["rank", "step", "optype", "seq_id"] if "seq_id" in df.columns else df.columns
    dup = df.with_row_index("_row").filter(pl.struct(key).is_duplicated())
    if dup.height:
        first = dup.row(0, named=True)
        shown = ", ".join(f"{k}={first[k]}" for k in key)
        msg = f"{parquet}: row {first['_row']} is duplicated ({shown})"
        raise TraceFormatError(msg)


def sniff_op_timeline(path: Path) -> bool:
    """Whether ``path`` looks like an op timeline: a parquet with the required columns, or a folder
    with ``trace-*.parquet`` and ``meta-*.yaml``.
    """
    path = Path(path)
    if path.is_dir():
        return any(path.glob("trace-*.parquet")) and any(path.glob("meta*.y*ml"))
    if path.suffix != ".parquet" or not path.is_file():
        return False
    try:
        schema = pl.read_parquet_schema(path)
    except Exception:  # anything unreadable is simply not ours
        return False
    return all(c in schema for c in REQUIRED_COLUMNS)


# --- reader ----------------------------------------------------------------------------------


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


def _layout(df: pl.DataFrame, meta: dict[str, Any], parquet: Path) -> dict[str, Any]:
    """Parallel sizes and the (dp_rank, stage) -> rank map, checked to be one-to-one."""
    cells = df.select("dp_rank", "stage", "rank").unique()
    per_cell = cells.group_by("dp_rank", "stage").agg(pl.col("rank").n_unique().alias("n"))
    per_rank = cells.group_by("rank").agg(pl.len().alias("n"))
    if per_cell["n"].max() != 1 or per_rank["n"].max() != 1:  # type: ignore[operator]
        msg = f"{parquet}: (dp_rank, stage) and rank are not one-to-one"
        raise TraceFormatError(msg)
    dp = int(meta.get("dp_size") or (int(cells["dp_rank"].max()) + 1))  # type: ignore[arg-type]
    pp = int(meta.get("pp_size") or (int(cells["stage"].max()) + 1))  # type: ignore[arg-type]
    tp = int(meta.get("tp_size") or 1)
    # Context parallelism: `cp_size`, or `dsp_size` as StragglerAnalysis's meta names it.
    cp = int(meta.get("cp_size") or meta.get("dsp_size") or 1)
    world = meta.get("world_size")
    if dp * pp * tp * cp > MAX_RANKS or (world is not None and world != dp * pp * tp * cp):
        msg = (
            f"{parquet}: meta sizes contradict each other or the rank limit: dp_size {dp} *"
            f" pp_size {pp} * tp_size {tp} * cp_size {cp} = {dp * pp * tp * cp},"
            f" world_size {world}"
        )
        raise TraceFormatError(msg)
    bad = cells.filter((pl.col("dp_rank") >= dp) | (pl.col("stage") >= pp))
    if not bad.is_empty():
        row = bad.row(0, named=True)
        msg = f"{parquet}: rank {row['rank']} has dp_rank/stage outside dp_size={dp}, pp_size={pp}"
        raise TraceFormatError(msg)
    observed = {(d, s): r for d, s, r in cells.iter_rows()}
    renumber = (
        tp * cp > 1 and len(observed) > 1 and all(r == s * dp + d for (d, s), r in observed.items())
    )
    full = {
        (d, s): observed.get((d, s), (s * dp + d) * tp * cp) for d in range(dp) for s in range(pp)
    }
    return {"dp": dp, "pp": pp, "tp": tp, "cp": cp, "cells": full, "renumber": renumber}


def _groups(
    cell_rank: dict[tuple[int, int], int], dp: int, pp: int, tp: int, cp: int = 1
) -> dict[str, dict[str, Any]]:
    def g(desc: str, members: list[int]) -> dict[str, Any]:
        uniq = list(dict.fromkeys(members))
        return {"description": desc, "backend": "nccl", "size": len(uniq), "ranks": uniq}

    out: dict[str, dict[str, Any]] = {}
    for s in range(pp):
        out[f"dp_stage{s}"] = g("dp", [cell_rank[(d, s)] for d in range(dp)])
    for d in range(dp):
        out[f"pp_dp{d}"] = g("pp", [cell_rank[(d, s)] for s in range(pp)])
    for d in range(dp):
        out[f"embd_dp{d}"] = g("embd", [cell_rank[(d, 0)], cell_rank[(d, pp - 1)]])
    for d in range(dp):
        for s in range(pp):
            base = cell_rank[(d, s)]
            out[f"tp_stage{s}_dp{d}"] = g("tp", [base + t for t in range(tp)])
            if cp > 1:
                out[f"cp_stage{s}_dp{d}"] = g("cp", [base + c * tp for c in range(cp)])
    return out


def _collectives(
    df: pl.DataFrame, groups: dict[str, dict[str, Any]]
) -> tuple[pl.DataFrame, set[str]]:
    found = {o: _collective(o) for o in df["optype"].unique().to_list()}
    kinds = {o: k for o, k in found.items() if k is not None}
    if not kinds:
        return pl.DataFrame({"rank": []}, schema={"rank": pl.Int32}), set()
    family = pl.col("optype").replace_strict({o: f for o, (_, f) in kinds.items()})
    name = (
        pl.when(family == "dp")
        .then(pl.format("dp_stage{}", "stage"))
        .when(family == "embd")
        .then(pl.format("embd_dp{}", "dp_rank"))
        .otherwise(pl.format("tp_stage{}_dp{}", "stage", "dp_rank"))
    )
    sizes = {n: g["size"] for n, g in groups.items()}
    out = (
        df.filter(pl.col("optype").is_in(list(kinds)))
        .with_columns(name.alias("group_name"))
        .sort("rank", "group_name", "ts", "event_id")
        .with_columns(
            pl.int_range(pl.len(), dtype=pl.Int64).over("rank", "group_name").alias("seq")
        )
        .select(
            "rank",
            "event_id",
            "group_name",
            "seq",
            pl.col("optype")
            .replace_strict({o: k for o, (k, _) in kinds.items()}, return_dtype=pl.Utf8)
            .alias("kind"),
            pl.col("group_name").replace_strict(sizes, return_dtype=pl.Int32).alias("group_size"),
            pl.col("ts").alias("host_ts"),
            pl.col("dur").alias("host_dur"),
            pl.col("step").cast(pl.Int32).alias("iteration"),
        )
        .sort("rank", "event_id")
    )
    return out, set(out["group_name"].unique().to_list())


def _p2p(
    df: pl.DataFrame, cell_rank: dict[tuple[int, int], int], pp: int, parquet: Path
) -> pl.DataFrame:
    ops = df.filter(pl.col("optype").is_in(list(_P2P)))
    if ops.is_empty():
        return pl.DataFrame({"rank": []}, schema={"rank": pl.Int32})
    ops = ops.with_columns(
        pl.col("optype")
        .replace_strict({o: d for o, (d, _) in _P2P.items()}, return_dtype=pl.Utf8)
        .alias("direction"),
        (
            pl.col("stage")
            + pl.col("optype").replace_strict(
                {o: k for o, (_, k) in _P2P.items()}, return_dtype=pl.Int32
            )
        ).alias("_peer_stage"),
    )
    bad = ops.filter((pl.col("_peer_stage") < 0) | (pl.col("_peer_stage") >= pp))
    if not bad.is_empty():
        row = bad.row(0, named=True)
        msg = (
            f"{parquet}: `{row['optype']}` on rank {row['rank']} (stage {row['stage']}) has no"
            f" peer stage (pp_size={pp}) at step {row['step']}"
        )
        raise TraceFormatError(msg)
    peers = pl.DataFrame(
        {
            "dp_rank": [d for d, _ in cell_rank],
            "_peer_stage": [s for _, s in cell_rank],
            "peer": list(cell_rank.values()),
        },
        schema={"dp_rank": pl.Int32, "_peer_stage": pl.Int32, "peer": pl.Int32},
    )
    return (
        ops.join(peers, on=["dp_rank", "_peer_stage"], how="left")
        .sort("rank", "peer", "direction", "ts", "event_id")
        .with_columns(
            pl.int_range(pl.len(), dtype=pl.Int64).over("rank", "peer", "direction").alias("seq"),
            pl.format("pp_dp{}", "dp_rank").alias("group_name"),
        )
        .select(
            "rank",
            "event_id",
            "group_name",
            "seq",
            "direction",
            "peer",
            pl.col("ts").alias("host_ts"),
            pl.col("dur").alias("host_dur"),
            pl.col("step").cast(pl.Int32).alias("iteration"),
        )
        .sort("rank", "event_id")
    )

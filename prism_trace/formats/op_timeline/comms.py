"""The job an op timeline records: its parallel layout (the rank of each (dp_rank, stage) cell),
its process groups, and the collective and point-to-point calls among them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from prism_trace.errors import TraceFormatError
from prism_trace.formats.op_timeline.ops import _P2P, _collective
from prism_trace.limits import MAX_RANKS

__all__: list[str] = []


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
    """The job's groups by name: DP per stage, PP and embedding per dp_rank, TP (and CP) per
    cell, every member listed whether recorded or not."""

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
    """The collective calls, numbered per (rank, group) in time order, and the groups used."""
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
    """The sends and receives, each with its peer (the rank of the neighbouring stage at the same
    dp_rank), numbered per (rank, peer, direction) in time order."""
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

"""What ingest derives from the readers' frames before it stores them: a run's groups and their
sizes, the numbers of calls a trace did not number, the iteration of rows a reader could not
place, and one row per rank from its sources."""

from __future__ import annotations

import polars as pl

__all__ = ["assign_iteration", "fill_sizes"]

# Parallel coordinates a reader may put in a rank's args (directly, or as our generator's
# ``prism_layout`` {"tp_rank": ...}); slicing infers them otherwise.
_AXES = ("tp", "cp", "ep", "dp", "pp")
# Where a rank has several sources, timeline frames come from the best one.
_TIMELINE_PRIORITY: dict[str, int] = {"kineto": 0, "op_timeline": 1, "chakra": 2, "host_et": 3}


def _concat(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """The frames one under the other (the first itself when alone)."""
    return pl.concat(frames, how="vertical") if len(frames) > 1 else frames[0]


def _merge_groups(frames: list[pl.DataFrame], comm_names: set[str], world: int) -> pl.DataFrame:
    """One row per group name; member lists from whichever source knows them."""
    groups = _concat(frames).with_columns(has_ranks=pl.col("ranks").is_not_null())
    groups = (
        groups.sort(["name", "has_ranks"], descending=[False, True], nulls_last=True)
        .group_by("name", maintain_order=True)
        .agg(
            pl.col("description").drop_nulls().first(),
            pl.col("backend").drop_nulls().first(),
            pl.col("size").drop_nulls().first(),
            pl.col("ranks").drop_nulls().first(),
        )
    )
    missing = sorted(comm_names - set(groups["name"].to_list()))
    if missing:
        groups = pl.concat(
            [groups, pl.DataFrame({"name": missing}, schema={"name": pl.Utf8})], how="diagonal"
        )
    groups = groups.with_columns(
        size=pl.coalesce(pl.col("size"), pl.col("ranks").list.len().cast(pl.Int32))
    )
    default = list(range(world))
    # The default group "0" spans the world when no source lists its members.
    groups = groups.with_columns(
        ranks=pl.when(pl.col("ranks").is_null() & (pl.col("name") == "0"))
        .then(pl.lit(default, dtype=pl.List(pl.Int32)))
        .otherwise(pl.col("ranks")),
    ).with_columns(size=pl.coalesce(pl.col("size"), pl.col("ranks").list.len().cast(pl.Int32)))
    return (
        groups.sort([pl.col("name").cast(pl.Int64, strict=False), "name"], nulls_last=True)
        .with_row_index("group_id")
        .with_columns(pl.col("group_id").cast(pl.Int32))
    )


def fill_sizes(calls: pl.DataFrame, groups: pl.DataFrame) -> pl.DataFrame:
    """Sizes a reader could not finish without the group's size, from the run's groups.

    A Chakra file without process groups gives an all-gather's input (``comm_size``) but not
    its output, which is ``group size x`` that; the number of files tells the default group's
    size only here. Fills ``group_size``, an all-gather's ``out_bytes`` (a reduce-scatter's:
    ``in / size``) and ``msg_bytes = max(in, out)`` where they are NULL; known values stay.
    """
    need = ("kind", "group_name", "group_size", "in_bytes", "out_bytes", "msg_bytes")
    if calls.is_empty() or any(c not in calls.columns for c in need):
        return calls
    if calls["msg_bytes"].null_count() == 0 and calls["group_size"].null_count() == 0:
        return calls
    sizes = groups.select(pl.col("name").alias("group_name"), pl.col("size").alias("_gsize"))
    n = pl.col("group_size")
    return (
        calls.join(sizes, on="group_name", how="left", maintain_order="left")
        .with_columns(group_size=pl.coalesce(n, pl.col("_gsize")).cast(calls["group_size"].dtype))
        .with_columns(
            out_bytes=pl.coalesce(
                pl.col("out_bytes"),
                pl.when(pl.col("kind") == "all_gather")
                .then(pl.col("in_bytes") * n)
                .when(pl.col("kind") == "reduce_scatter")
                .then(pl.col("in_bytes") // n),
            ).cast(calls["out_bytes"].dtype)
        )
        .with_columns(
            msg_bytes=pl.coalesce(
                pl.col("msg_bytes"), pl.max_horizontal("in_bytes", "out_bytes")
            ).cast(calls["msg_bytes"].dtype)
        )
        .drop("_gsize")
    )


def _number(df: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Fill a null ``seq`` by host-time order within ``keys`` (all rows of a key, or none).

    ``seq_by_order`` says which rows were numbered here: across ranks they are one instance
    only if ``collectives.settle_order_matching`` finds the ranks' sequences agree.
    """
    if df.is_empty() or df["seq"].null_count() == 0:
        return df.with_columns(seq_by_order=pl.lit(value=False))
    by_order = pl.col("seq").null_count().over(keys) > 0
    return df.sort([*keys, "host_ts", "event_id"], nulls_last=True).with_columns(
        seq=pl.when(by_order)
        .then(pl.int_range(pl.len()).over(keys))
        .otherwise(pl.col("seq"))
        .cast(pl.Int64),
        seq_by_order=by_order,
    )


def assign_iteration(df: pl.DataFrame, ts_col: str, iterations: pl.DataFrame) -> pl.DataFrame:
    """Fill a null ``iteration`` from the step window containing ``ts_col`` on the same rank.

    ``iterations`` has ``rank, iteration, ts, dur``; rows outside every window stay null. Used for
    the rows a reader could not place (ingest) and for a replay's allocator rows.
    """
    if df.is_empty() or iterations.is_empty() or df["iteration"].null_count() == 0:
        return df
    steps = iterations.select(
        "rank",
        pl.col("iteration").alias("_it"),
        pl.col("ts").alias("_ts"),
        (pl.col("ts") + pl.col("dur")).alias("_end"),
    ).sort("_ts")
    known = df.filter(pl.col(ts_col).is_not_null()).with_row_index("_row")
    # Both sides are sorted on their time column as a whole, so within every rank too: polars
    # cannot check that itself when ``by`` is given (and warns), so it is told.
    joined = known.sort(ts_col).join_asof(
        steps,
        left_on=ts_col,
        right_on="_ts",
        by="rank",
        strategy="backward",
        check_sortedness=False,
    )
    joined = joined.with_columns(
        iteration=pl.coalesce(
            pl.col("iteration"), pl.when(pl.col(ts_col) < pl.col("_end")).then(pl.col("_it"))
        )
    ).sort("_row")
    return pl.concat(
        [joined.select(df.columns), df.filter(pl.col(ts_col).is_null())], how="vertical"
    )


def _rank_rows(frames: list[pl.DataFrame], et_counts: dict[int, tuple[int, int]]) -> pl.DataFrame:
    """One row per rank: the timeline source's facts first, the others fill its gaps."""
    rows = (
        pl.concat(frames, how="vertical")
        .sort(["rank", "_prio"])
        .drop("_prio")
        .group_by("rank", maintain_order=True)
        .agg(pl.all().drop_nulls().first())
    )
    rows = rows.with_columns(
        [
            pl.coalesce(
                pl.col("args").str.json_path_match(f"$.{axis}"),
                pl.col("args").str.json_path_match(f"$.prism_layout.{axis}_rank"),
            )
            .cast(pl.Int32, strict=False)
            .alias(axis)
            for axis in _AXES
        ]
    )
    et_df = pl.DataFrame(
        {
            "rank": list(et_counts),
            "et_ops": [v[0] for v in et_counts.values()],
            "et_ops_linked": [v[1] for v in et_counts.values()],
        },
        schema={"rank": pl.Int32, "et_ops": pl.Int64, "et_ops_linked": pl.Int64},
    )
    return rows.join(et_df, on="rank", how="left")

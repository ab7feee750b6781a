"""Ingest: discover → read → check → link → derive → write, all or nothing.

Everything that can fail on bad input (reading, rank clashes, run-name clashes) happens before the
first write, and the write itself is one DuckDB transaction, so a failed ingest leaves the store
exactly as it was.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import polars as pl
from tqdm import tqdm

from prism_trace.discover import TraceFile, discover, fingerprint
from prism_trace.errors import DuplicateRankError, DuplicateRunError, PrismError
from prism_trace.formats.base import FormatName, TraceTables
from prism_trace.store import Store

__all__ = ["IngestReport", "ingest", "read_trace"]

# Frames concatenated across files into the run's tables, and the table each one fills.
_TABLE_OF_FRAME = {
    "tracks": "track",
    "events": "event",
    "flows": "flow",
    "iterations": "iteration",
    "et_ops": "et_op",
}
# Parallel coordinates a reader may put in a rank's args (directly, or as our generator's
# ``prism_layout`` {"tp_rank": ...}); slicing infers them otherwise.
_AXES = ("tp", "cp", "ep", "dp", "pp")
# Where a rank has several sources, timeline frames come from the best one.
_TIMELINE_PRIORITY: dict[str, int] = {"kineto": 0, "op_timeline": 1, "chakra": 2, "host_et": 3}


def _reader(fmt: FormatName) -> Callable[..., TraceTables]:
    if fmt == "kineto":
        from prism_trace.formats.kineto import read_kineto

        return read_kineto
    if fmt == "host_et":
        from prism_trace.formats.host_et import read_host_et

        return read_host_et
    if fmt == "chakra":
        from prism_trace.formats.chakra import read_chakra

        return read_chakra
    from prism_trace.formats.op_timeline import read_op_timeline

    return read_op_timeline


def read_trace(trace: TraceFile, *, rank: int | None = None) -> TraceTables:
    """Read one file with the reader of its format, conformed to the contract."""
    return _reader(trace.format)(trace.path, rank=rank).conform()


@dataclass
class IngestReport:
    """What an ingest wrote: enough for the CLI to print and for tests to assert."""

    run: str
    run_id: int
    world_size: int
    ranks: list[int]
    files: list[tuple[str, str, list[int]]]
    skipped: list[str]
    rows: dict[str, int] = field(default_factory=dict)
    et_ops: dict[int, int] = field(default_factory=dict)
    et_ops_linked: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "run": self.run,
            "run_id": self.run_id,
            "world_size": self.world_size,
            "ranks": self.ranks,
            "files": [{"path": p, "format": f, "ranks": r} for p, f, r in self.files],
            "skipped": self.skipped,
            "rows": self.rows,
            "et_ops": self.et_ops,
            "et_ops_linked": self.et_ops_linked,
        }


def _check_ranks(tables: list[TraceTables]) -> None:
    """One file per (rank, format); a Kineto trace and a host ET of one rank are a pair."""
    seen: dict[tuple[int, str], Path] = {}
    for t in tables:
        for r in t.rank_ids:
            key = (r, t.format)
            if key in seen:
                msg = (
                    f"{t.path}: rank {r} appears twice in one run (also in {seen[key]});"
                    " ingest each job as its own --run"
                )
                raise DuplicateRankError(msg)
            seen[key] = t.path
        timeline = {f for (r, f) in seen if r in t.rank_ids and f != "host_et"}
        if len(timeline) > 1:
            msg = f"{t.path}: rank {t.rank_ids[0]} has timelines in formats {sorted(timeline)}"
            raise DuplicateRankError(msg)


def _link(tables: list[TraceTables]) -> dict[int, tuple[int, int]]:
    """Link each rank's host ET ops to its Kineto events in place; return (ops, linked) per rank."""
    kineto = {r: t for t in tables if t.format == "kineto" for r in t.rank_ids}
    counts: dict[int, tuple[int, int]] = {}
    for t in tables:
        if t.format != "host_et":
            continue
        for r in t.rank_ids:
            ops = t.et_ops.filter(pl.col("rank") == r)
            if r in kineto:
                from prism_trace.link import link_et_to_kineto

                events = kineto[r].events.filter(pl.col("rank") == r)
                ops, report = link_et_to_kineto(ops, events)
                counts[r] = (report.total, report.linked)
            else:
                counts[r] = (ops.height, 0)
            t.et_ops = pl.concat([t.et_ops.filter(pl.col("rank") != r), ops])
    return counts


def _timeline_sources(tables: list[TraceTables]) -> dict[int, TraceTables]:
    best: dict[int, TraceTables] = {}
    for t in tables:
        for r in t.rank_ids:
            cur = best.get(r)
            if cur is None or _TIMELINE_PRIORITY[t.format] < _TIMELINE_PRIORITY[cur.format]:
                best[r] = t
    return best


def _concat(frames: list[pl.DataFrame]) -> pl.DataFrame:
    return pl.concat(frames, how="vertical") if len(frames) > 1 else frames[0]


def _merge_groups(tables: list[TraceTables], comm_names: set[str], world: int) -> pl.DataFrame:
    """One row per group name; member lists from whichever source knows them."""
    groups = _concat([t.comm_groups for t in tables]).with_columns(
        has_ranks=pl.col("ranks").is_not_null()
    )
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


def _number(df: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Fill a null ``seq`` by host-time order within ``keys`` (all rows of a key, or none)."""
    if df.is_empty() or df["seq"].null_count() == 0:
        return df
    return df.sort([*keys, "host_ts", "event_id"], nulls_last=True).with_columns(
        seq=pl.when(pl.col("seq").null_count().over(keys) > 0)
        .then(pl.int_range(pl.len()).over(keys))
        .otherwise(pl.col("seq"))
        .cast(pl.Int64)
    )


def _assign_iteration(df: pl.DataFrame, ts_col: str, iterations: pl.DataFrame) -> pl.DataFrame:
    """Fill a null ``iteration`` from the step window containing ``ts_col`` on the same rank."""
    if df.is_empty() or iterations.is_empty() or df["iteration"].null_count() == 0:
        return df
    steps = iterations.select(
        "rank",
        pl.col("iteration").alias("_it"),
        pl.col("ts").alias("_ts"),
        (pl.col("ts") + pl.col("dur")).alias("_end"),
    ).sort("_ts")
    known = df.filter(pl.col(ts_col).is_not_null()).with_row_index("_row")
    joined = known.sort(ts_col).join_asof(
        steps, left_on=ts_col, right_on="_ts", by="rank", strategy="backward"
    )
    joined = joined.with_columns(
        iteration=pl.coalesce(
            pl.col("iteration"), pl.when(pl.col(ts_col) < pl.col("_end")).then(pl.col("_it"))
        )
    ).sort("_row")
    return pl.concat(
        [joined.select(df.columns), df.filter(pl.col(ts_col).is_null())], how="vertical"
    )


def ingest(
    store: Store,
    paths: list[Path],
    *,
    run: str,
    format: Literal["auto", "kineto", "host_et", "chakra", "op_timeline"] = "auto",
    rank: int | None = None,
    replace: bool = False,
    progress: bool = True,
) -> IngestReport:
    """Ingest the traces under ``paths`` as one recorded run.

    Args:
        store: an open, writable store.
        paths: files or folders holding the ranks of one job.
        run: the run name; must be new unless ``replace``.
        format: force a format instead of detecting it per file.
        rank: the rank of a single file whose rank cannot be told otherwise.
        replace: overwrite an existing run of that name (atomically).
        progress: show a progress bar (stderr).

    Returns:
        What was written.

    Raises:
        DuplicateRunError: the run exists and ``replace`` is false.
        DuplicateRankError: a rank appears twice, or a file was already ingested.
        TraceFormatError: a file is bad (its subclasses say how).
    """
    old_id = store.run_id(run)
    if old_id is not None and not replace:
        msg = f"{store.path}: run {run!r} already exists; pass --replace to overwrite it"
        raise DuplicateRunError(msg)
    files, skipped = discover(paths, format=format)
    if not files:
        msg = f"{', '.join(map(str, paths))}: no trace files found"
        raise PrismError(msg)
    if rank is not None and len(files) > 1:
        msg = f"{files[0].path}: --rank applies to a single file, but {len(files)} were given"
        raise PrismError(msg)

    prints = [(f, fingerprint(f.path)) for f in files]
    seen_fp: dict[str, Path] = {}
    for f, fp in prints:
        if fp in seen_fp:
            msg = f"{f.path}: same content as {seen_fp[fp]}; each file may be given once"
            raise DuplicateRankError(msg)
        seen_fp[fp] = f.path
    clash = store.con.execute(
        "SELECT s.path, r.name FROM source_file s JOIN run r USING (run_id)"
        " WHERE s.fingerprint IN (SELECT unnest(?)) AND s.run_id IS DISTINCT FROM ?",
        [list(seen_fp), old_id],
    ).fetchone()
    if clash is not None:
        msg = (
            f"{clash[0]}: already ingested as run {clash[1]!r}; re-ingesting is refused"
            f" (use --run {clash[1]} --replace to redo it)"
        )
        raise DuplicateRankError(msg)

    total = sum(f.path.stat().st_size for f in files)
    tables: list[TraceTables] = []
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="ingest") as bar:
        for f in files:
            tables.append(read_trace(f, rank=rank))
            bar.update(f.path.stat().st_size)
    _check_ranks(tables)
    et_counts = _link(tables)

    best = _timeline_sources(tables)
    ranks = sorted(best)
    sizes = [t.world_size for t in tables if t.world_size]
    world = max([*sizes, max(ranks) + 1])

    frames: dict[str, list[pl.DataFrame]] = defaultdict(list)
    for t in {id(t): t for t in best.values()}.values():
        mine = [r for r in t.rank_ids if best[r] is t]
        for name in ("tracks", "events", "memory", "flows", "iterations", "collectives", "p2p"):
            frames[name].append(getattr(t, name).filter(pl.col("rank").is_in(mine)))
    # Rank facts: the timeline source's first, then the others fill its gaps.
    for t in sorted(tables, key=lambda t: _TIMELINE_PRIORITY[t.format]):
        frames["et_ops"].append(t.et_ops)
        frames["ranks"].append(t.ranks)
    merged = {k: _concat(v) for k, v in frames.items()}
    rank_rows = (
        merged["ranks"]
        .sort("rank")
        .group_by("rank", maintain_order=True)
        .agg(pl.all().drop_nulls().first())
    )
    rank_rows = rank_rows.with_columns(
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

    comm_names = set(merged["collectives"]["group_name"].drop_nulls().to_list())
    comm_names |= set(merged["p2p"]["group_name"].drop_nulls().to_list())
    groups = _merge_groups(tables, comm_names, world)
    gid = groups.select(pl.col("name").alias("group_name"), "group_id")
    iterations = merged["iterations"]
    colls = _number(merged["collectives"], ["rank", "group_name"])
    colls = _assign_iteration(colls, "host_ts", iterations).join(gid, on="group_name", how="left")
    p2p = _number(merged["p2p"], ["rank", "group_name", "peer", "direction"])
    p2p = _assign_iteration(p2p, "host_ts", iterations).join(gid, on="group_name", how="left")
    memory = _assign_iteration(merged["memory"], "ts", iterations)

    formats = sorted({t.format for t in tables})
    source_format = formats[0] if len(formats) == 1 else "mixed"
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    with store.transaction() as con:
        if old_id is not None:
            _delete_run(con, old_id)
        row = con.execute("SELECT coalesce(max(run_id), 0) + 1 FROM run").fetchone()
        run_id = int(row[0]) if row else 1
        config = {"paths": [str(p) for p in paths], "format": format}
        con.execute(
            "INSERT INTO run (run_id, name, kind, world_size, source_format, created_at,"
            " config_json) VALUES (?, ?, 'recorded', ?, ?, ?, ?)",
            [run_id, run, world, source_format, now, json.dumps(config)],
        )
        et_df = pl.DataFrame(
            {
                "rank": list(et_counts),
                "et_ops": [v[0] for v in et_counts.values()],
                "et_ops_linked": [v[1] for v in et_counts.values()],
            },
            schema={"rank": pl.Int32, "et_ops": pl.Int64, "et_ops_linked": pl.Int64},
        )
        ranks_df = rank_rows.join(et_df, on="rank", how="left")
        _insert(con, "rank", run_id, ranks_df)
        src = pl.DataFrame(
            {
                "rank": [t.rank_ids[0] if len(t.rank_ids) == 1 else None for t in tables],
                "path": [str(t.path.resolve()) for t in tables],
                "format": [t.format for t in tables],
                "size_bytes": [t.path.stat().st_size for t in tables],
                "fingerprint": [fp for _, fp in prints],
                "ingested_at": [now] * len(tables),
            },
            schema_overrides={"rank": pl.Int32},
        )
        _insert(con, "source_file", run_id, src)
        _insert(con, "comm_group", run_id, groups)
        for frame, tbl in _TABLE_OF_FRAME.items():
            _insert(con, tbl, run_id, merged[frame])
        _insert(con, "collective", run_id, colls)
        _insert(con, "p2p", run_id, p2p)
        _insert(con, "memory", run_id, memory)
        counts = {tbl: _count(con, tbl, run_id) for tbl in _RUN_TABLES}
    return IngestReport(
        run=run,
        run_id=run_id,
        world_size=world,
        ranks=ranks,
        files=[(str(t.path), t.format, t.rank_ids) for t in tables],
        skipped=[str(p) for p in skipped],
        rows=counts,
        et_ops={r: v[0] for r, v in et_counts.items()},
        et_ops_linked={r: v[1] for r, v in et_counts.items()},
    )


_RUN_TABLES = (
    "rank",
    "source_file",
    "comm_group",
    "track",
    "event",
    "collective",
    "p2p",
    "memory",
    "flow",
    "iteration",
    "et_op",
)


def _count(con: object, table_name: str, run_id: int) -> int:
    row = con.execute(  # type: ignore[attr-defined]
        f"SELECT count(*) FROM {table_name} WHERE run_id = ?", [run_id]
    ).fetchone()
    return int(row[0])


def _delete_run(con: object, run_id: int) -> None:
    for tbl in _RUN_TABLES:
        con.execute(f"DELETE FROM {tbl} WHERE run_id = ?", [run_id])  # type: ignore[attr-defined]
    con.execute("DELETE FROM run WHERE run_id = ?", [run_id])  # type: ignore[attr-defined]


def _insert(con: object, table_name: str, run_id: int, df: pl.DataFrame) -> None:
    """Insert ``df`` into ``table_name`` under ``run_id``, matching columns by name."""
    from prism_trace import schema

    if df.is_empty():
        return
    cols = [c for c in schema.table(table_name).column_names if c != "run_id" and c in df.columns]
    data = df.select(cols).to_arrow()
    con.register("_ingest_frame", data)  # type: ignore[attr-defined]
    try:
        con.execute(  # type: ignore[attr-defined]
            f"INSERT INTO {table_name} (run_id, {', '.join(cols)})"
            f" SELECT {run_id}, {', '.join(cols)} FROM _ingest_frame"
        )
    finally:
        con.unregister("_ingest_frame")  # type: ignore[attr-defined]

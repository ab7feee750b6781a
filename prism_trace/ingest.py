"""Ingest: discover → read → check → link → derive → write, all or nothing.

Everything that can fail on bad input (reading, rank clashes, run-name clashes) happens before the
first write, and the write itself is one DuckDB transaction, so a failed ingest leaves the store
exactly as it was.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import polars as pl
from tqdm import tqdm

from prism_trace import schema
from prism_trace.discover import TraceFile, discover, fingerprint
from prism_trace.errors import DuplicateRankError, DuplicateRunError, PrismError
from prism_trace.formats.base import FRAME_SCHEMAS, FormatName, TraceTables
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


def _concat(frames: list[pl.DataFrame]) -> pl.DataFrame:
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


class _RankBook:
    """Which file gave each rank what, so clashes are caught as files stream in."""

    def __init__(self) -> None:
        self.timeline: dict[int, tuple[str, Path]] = {}
        self.host_et: dict[int, Path] = {}

    def add(self, t: TraceTables) -> None:
        for r in t.rank_ids:
            if t.format == "host_et":
                other = self.host_et.get(r)
                self.host_et[r] = t.path
            else:
                prev = self.timeline.get(r)
                other = None if prev is None else prev[1]
                self.timeline[r] = (t.format, t.path)
            if other is not None:
                msg = (
                    f"{t.path}: rank {r} appears twice in one run (also in {other});"
                    " ingest each job as its own --run"
                )
                raise DuplicateRankError(msg)


def _link_rank(con: object, rank: int, ops: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """Link one rank's host ET ops to its Kineto events already staged by this ingest."""
    from prism_trace.link import HOST_CATEGORIES, link_et_to_kineto

    cols = ", ".join(FRAME_SCHEMAS["events"])
    cats = ", ".join(f"'{c}'" for c in HOST_CATEGORIES)
    events = con.sql(  # type: ignore[attr-defined]
        f"SELECT {cols} FROM {_STAGE}.event WHERE rank = $1 AND category IN ({cats})",
        params=[rank],
    ).pl()
    linked, report = link_et_to_kineto(ops, events)
    return linked, report.linked


# The scratch database every file is staged into (committed file by file, so its pages can leave
# memory), and the in-memory one a Kineto reader works in (dropped after each file).
_STAGE = "_prism_stage"
_WORK = "_prism_work"
# Tables staged file by file and copied into the store at the end.
_STAGED = ("track", "event", "flow", "iteration", "memory", "et_op")
# A Kineto trace of at least this many JSON bytes is worked on in a database file, not in memory.
_WORK_ON_DISK_BYTES = 256 << 20


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

    Each file is read and its rows staged into a scratch DuckDB database in a temporary folder,
    committed file by file, so memory holds one file's work, not the job's (DuckDB may evict the
    staged pages); a Kineto file's events go there from SQL without a trip through Python. The
    store is written only at the end, by one transaction copying the staged tables, so any failure
    leaves it exactly as it was.

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
    # Timelines first, so a host ET can be linked to its rank's Kineto events already staged.
    files.sort(key=lambda f: f.format == "host_et")
    prints = _check_fingerprints(store, files, old_id)
    with tempfile.TemporaryDirectory(prefix="prism-ingest-") as tmp:
        store.con.execute(f"ATTACH '{_quote(Path(tmp) / 'stage.duckdb')}' AS {_STAGE}")
        try:
            return _ingest_staged(
                store,
                tmp=Path(tmp),
                files=files,
                skipped=skipped,
                prints=prints,
                paths=paths,
                run=run,
                format=format,
                rank=rank,
                old_id=old_id,
                progress=progress,
            )
        finally:
            store.con.execute(f"DETACH DATABASE IF EXISTS {_STAGE}")


def _ingest_staged(
    store: Store,
    *,
    tmp: Path,
    files: list[TraceFile],
    skipped: list[Path],
    prints: list[str],
    paths: list[Path],
    run: str,
    format: str,
    rank: int | None,
    old_id: int | None,
    progress: bool,
) -> IngestReport:
    """Stage every file into ``_STAGE``, then copy it all into the store in one transaction."""
    con = store.con
    for tbl in _STAGED:
        con.execute(_stage_ddl(f"{_STAGE}.{tbl}", tbl, group_name=False))
    con.execute(_stage_ddl(f"{_STAGE}.collective", "collective"))
    con.execute(_stage_ddl(f"{_STAGE}.p2p", "p2p"))

    book = _RankBook()
    rank_frames: list[pl.DataFrame] = []
    group_frames: list[pl.DataFrame] = []
    comm_names: set[str] = set()
    sizes: list[int] = []
    et_counts: dict[int, tuple[int, int]] = {}
    formats: set[str] = set()
    file_ranks: list[list[int]] = []
    sources: list[list[object]] = []
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    total = sum(f.path.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="ingest") as bar:
        for f, fp in zip(files, prints, strict=True):
            t = _read_staged(store, f, rank, tmp)
            book.add(t)
            file_ranks.append(t.rank_ids)
            formats.add(t.format)
            if t.world_size:
                sizes.append(t.world_size)
            rank_frames.append(t.ranks.with_columns(_prio=pl.lit(_TIMELINE_PRIORITY[t.format])))
            group_frames.append(t.comm_groups)
            mine = t.rank_ids
            if t.format == "host_et":
                # Timeline frames come from the rank's timeline source when it has one.
                mine = [r for r in t.rank_ids if r not in book.timeline]
                for r in t.rank_ids:
                    ops = t.et_ops.filter(pl.col("rank") == r)
                    n_linked = 0
                    if book.timeline.get(r, ("",))[0] == "kineto":
                        ops, n_linked = _link_rank(con, r, ops)
                    et_counts[r] = (ops.height, n_linked)
                    _stage(con, "et_op", ops)
            else:
                _stage(con, "et_op", t.et_ops)
            keep = pl.col("rank").is_in(mine)
            iterations = t.iterations.filter(keep)
            colls = _number(t.collectives.filter(keep), ["rank", "group_name"])
            p2p = _number(t.p2p.filter(keep), ["rank", "group_name", "peer", "direction"])
            comm_names |= set(colls["group_name"].drop_nulls()) | set(
                p2p["group_name"].drop_nulls()
            )
            _stage(con, "track", t.tracks.filter(keep))
            _stage(con, "event", t.events.filter(keep))
            _stage(con, "flow", t.flows.filter(keep))
            _stage(con, "iteration", iterations)
            _stage(con, "memory", _assign_iteration(t.memory.filter(keep), "ts", iterations))
            _stage(con, "collective", _assign_iteration(colls, "host_ts", iterations))
            _stage(con, "p2p", _assign_iteration(p2p, "host_ts", iterations))
            size = f.path.stat().st_size
            one = t.rank_ids[0] if len(t.rank_ids) == 1 else None
            sources.append([one, str(f.path.resolve()), t.format, size, fp, now])
            bar.update(size)
            del t

    ranks = sorted(set(book.timeline) | set(book.host_et))
    world = max([*sizes, max(ranks) + 1])
    groups = _merge_groups(group_frames, comm_names, world)
    rank_rows = _rank_rows(rank_frames, et_counts)
    with store.transaction() as con:
        if old_id is not None:
            _delete_run(con, old_id)
        row = con.execute("SELECT coalesce(max(run_id), 0) + 1 FROM run").fetchall()
        run_id = int(row[0][0])
        config = {"paths": [str(p) for p in paths], "format": format}
        source_format = formats.pop() if len(formats) == 1 else "mixed"
        con.execute(
            "INSERT INTO run (run_id, name, kind, created_at, config_json, world_size,"
            " source_format) VALUES (?, ?, 'recorded', ?, ?, ?, ?)",
            [run_id, run, now, json.dumps(config), world, source_format],
        )
        for tbl in _STAGED:
            cols = ", ".join(c for c in schema.table(tbl).column_names if c != "run_id")
            con.execute(
                f"INSERT INTO {tbl} (run_id, {cols}) SELECT {run_id}, {cols} FROM {_STAGE}.{tbl}"
            )
        _insert(con, "comm_group", run_id, groups)
        _insert(con, "rank", run_id, rank_rows)
        for tbl in ("collective", "p2p"):
            cols = [c for c in schema.table(tbl).column_names if c not in ("run_id", "group_id")]
            con.execute(
                f"INSERT INTO {tbl} (run_id, group_id, {', '.join(cols)})"
                f" SELECT {run_id}, g.group_id, {', '.join('s.' + c for c in cols)}"
                f" FROM {_STAGE}.{tbl} s LEFT JOIN comm_group g"
                f" ON g.run_id = {run_id} AND g.name = s.group_name"
            )
        con.executemany(
            "INSERT INTO source_file VALUES (?, ?, ?, ?, ?, ?, ?)", [[run_id, *s] for s in sources]
        )
        counts = {tbl: _count(con, tbl, run_id) for tbl in _RUN_TABLES}
    return IngestReport(
        run=run,
        run_id=run_id,
        world_size=world,
        ranks=ranks,
        files=[(str(f.path), f.format, r) for f, r in zip(files, file_ranks, strict=True)],
        skipped=[str(p) for p in skipped],
        rows=counts,
        et_ops={r: v[0] for r, v in et_counts.items()},
        et_ops_linked={r: v[1] for r, v in et_counts.items()},
    )


def _read_staged(store: Store, trace: TraceFile, rank: int | None, tmp: Path) -> TraceTables:
    """Read one file; a Kineto file's events go straight into the staged ``event`` table.

    The Kineto reader's work tables live in a database of their own, dropped after the file. For a
    large trace it is a file: there its tables are compressed and DuckDB can evict them, which
    bounds the peak (benchmarks/bench_ingest.py, big file); for a smaller one an in-memory
    database is faster (no disk write) and its tables are small anyway.
    """
    if trace.format != "kineto":
        return read_trace(trace, rank=rank)
    from prism_trace.formats.kineto import stage_kineto

    on_disk = _json_size_guess(trace.path) >= _WORK_ON_DISK_BYTES
    work = tmp / "work.duckdb"
    cur = store.con.cursor()
    try:
        cur.execute(f"ATTACH '{_quote(work) if on_disk else ':memory:'}' AS {_WORK}")
        cur.execute(f"USE {_WORK}")
        return stage_kineto(
            trace.path, con=cur, events_table=f"{_STAGE}.event", rank=rank, tmp_dir=tmp
        )
    finally:
        cur.execute(f"USE {_STAGE}")
        cur.execute(f"DETACH DATABASE IF EXISTS {_WORK}")
        cur.close()
        for p in (work, work.with_name(work.name + ".wal")):
            p.unlink(missing_ok=True)


def _json_size_guess(path: Path) -> int:
    """The JSON bytes of ``path``, guessed: gzipped Kineto JSON shrinks about 8 times."""
    with path.open("rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    return path.stat().st_size * (8 if gz else 1)


def _quote(path: Path) -> str:
    """``path`` for a single-quoted SQL string."""
    return str(path).replace("'", "''")


def _check_fingerprints(store: Store, files: list[TraceFile], old_id: int | None) -> list[str]:
    """Refuse a file given twice, or one already ingested into another run of this store."""
    prints = [fingerprint(f.path) for f in files]
    seen_fp: dict[str, Path] = {}
    for f, fp in zip(files, prints, strict=True):
        if fp in seen_fp:
            msg = f"{f.path}: same content as {seen_fp[fp]}; each file may be given once"
            raise DuplicateRankError(msg)
        seen_fp[fp] = f.path
    clash = store.con.execute(
        "SELECT s.path, r.name FROM source_file s JOIN run r USING (run_id)"
        " WHERE s.fingerprint IN (SELECT unnest(?)) AND s.run_id IS DISTINCT FROM ?",
        [list(seen_fp), old_id],
    ).fetchall()
    if clash:
        msg = (
            f"{clash[0][0]}: already ingested as run {clash[0][1]!r}; re-ingesting is refused"
            f" (use --run {clash[0][1]} --replace to redo it)"
        )
        raise DuplicateRankError(msg)
    return prints


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


def _stage_ddl(stage: str, table_name: str, *, group_name: bool = True) -> str:
    """A staging table shaped like ``table_name`` without ``run_id`` (minted at the end), keys
    or constraints; with ``group_name``, the group's name stands in for the minted group id."""
    cols = [
        "group_name VARCHAR" if group_name and c.name == "group_id" else f"{c.name} {c.type}"
        for c in schema.table(table_name).columns
        if c.name != "run_id"
    ]
    return f"CREATE TABLE {stage} ({', '.join(cols)})"


def _stage(con: object, table_name: str, df: pl.DataFrame) -> None:
    """Append ``df`` to the staged ``table_name``, matching columns by name."""
    if df.is_empty():
        return
    con.register("_stage_frame", df.to_arrow())  # type: ignore[attr-defined]
    try:
        con.execute(  # type: ignore[attr-defined]
            f"INSERT INTO {_STAGE}.{table_name} BY NAME SELECT * FROM _stage_frame"
        )
    finally:
        con.unregister("_stage_frame")  # type: ignore[attr-defined]


# Every per-run table: what a --replace deletes and what the report counts.
_RUN_TABLES = tuple(t.name for t in schema.TABLES if t.name not in ("meta", "run"))


def _count(con: object, table_name: str, run_id: int) -> int:
    row = con.execute(  # type: ignore[attr-defined]
        f"SELECT count(*) FROM {table_name} WHERE run_id = ?", [run_id]
    ).fetchall()[0]
    return int(row[0])


def _delete_run(con: object, run_id: int) -> None:
    for tbl in _RUN_TABLES:
        con.execute(f"DELETE FROM {tbl} WHERE run_id = ?", [run_id])  # type: ignore[attr-defined]
    con.execute("DELETE FROM run WHERE run_id = ?", [run_id])  # type: ignore[attr-defined]


def _insert(con: object, table_name: str, run_id: int, df: pl.DataFrame) -> None:
    """Insert ``df`` into ``table_name`` under ``run_id``, matching columns by name."""
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

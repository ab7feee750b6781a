"""The Kineto reader's communication tables: the trace's process groups, its collective and
point-to-point calls, and their groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import polars as pl

from prism_trace.formats.kineto.sql import (
    _LAUNCH_CATEGORIES,
    _call_bytes_sql,
    _dtype_size_sql,
    _dtype_sql,
    _op_kind_sql,
)
from prism_trace.formats.kineto.work import _Work
from prism_trace.limits import check_count, check_rank, check_text, wrong_type

__all__ = ["comm_raw_sql", "groups_by_id"]


def _json_list(value: Any) -> Any:
    """A metadata value that may be JSON text holding JSON (``add_metadata`` vs ``_json``)."""
    for _ in range(2):
        if isinstance(value, (str, bytes)):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError:
                return None
    return value


def _backend_of(config: Any, default: str | None) -> str | None:
    """``cuda:nccl`` -> ``nccl``; ``cpu:gloo,cuda:gloo`` -> ``gloo``; mixed -> the text as is."""
    if not isinstance(config, str) or not config:
        return default
    names = {part.split(":")[-1].strip() for part in config.split(",") if part.strip()}
    return names.pop() if len(names) == 1 else config


# What a trace's header says of its process groups is checked as its events are: a value the
# groups' frame cannot hold (a rank past Int32, a size given as text) is one line naming the
# member, not a crash building the frame; one of the wrong kind is not taken as something else.


def _group_name(path: Path, value: Any, where: str) -> str:
    """A group's name: torch writes a string, older traces an integer."""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return str(value)
    raise wrong_type(path, where, value, "a group name")


def _member_ranks(path: Path, value: Any, where: str) -> list[int] | None:
    """A group's members: a list of ranks, each in range; None where the trace gives none or a
    word instead of a list (some writers put ``"all"`` for the default group)."""
    value = _json_list(value)
    if not isinstance(value, list):
        return None
    return [check_rank(path, r, f"{where}[{i}]") for i, r in enumerate(value)]


def _group_size(path: Path, value: Any, where: str) -> int | None:
    return None if value is None else check_count(path, value, where)


def comm_raw_sql(ws: str, same_file: str) -> str:
    """The statement making ``comm_raw``: every collective and p2p call with its NCCL kernel.

    Args:
        ws: SQL for the world size (group size of a call that names no group).
        same_file: SQL added to the one join on ``correlation`` (which is unique within a file
            only): empty for one file, ``" AND k.f = r.f"`` for a batch (``kineto_batch``).
    """
    rpc_dtype = _dtype_sql("e.args->>'dtype'")
    old_dtype = _dtype_sql("a.args->'Input type'->>0")
    # What a backend's own span `a` (`gloo:all_reduce`) says of a call: its op and input size
    # only (the default group, the world's size), whether it annotates a call of the issuing
    # thread (older record_param_comms) or stands alone on a worker thread.
    mark_bytes = _call_bytes_sql(
        "list_aggregate(TRY_CAST(a.args->'Input Dims'->0 AS BIGINT[]), 'product')",
        _dtype_size_sql(old_dtype),
        "Input Dims",
        "a",
    )
    mark_op = _op_kind_sql("regexp_extract(a.name, '^[a-z]+:(.*)$', 1)")
    mark_columns = (
        f"'0' AS group_name, NULL::VARCHAR AS group_desc, NULL::VARCHAR AS group_ranks,"
        f" {ws}::INTEGER AS group_size, {mark_op} AS op, NULL::BIGINT AS seq,"
        f" {mark_bytes} AS in_bytes, NULL::BIGINT AS out_bytes, {old_dtype} AS dtype,"
        " NULL::INTEGER AS peer, NULL::INTEGER AS tag, NULL::INTEGER AS group_peer"
    )
    c10d_dtype = _dtype_sql("e.args->'Input type'->>(e.c10d_in)")
    k_dtype = _dtype_sql("ka.args->>'dtype'")
    launch = ", ".join(f"'{c}'" for c in _LAUNCH_CATEGORIES)
    file_of = "e.f" if same_file else "0"
    prism_in, prism_out = (
        _call_bytes_sql(
            rf"TRY_CAST(regexp_extract(e.name, '[:;]{k}=(\d+)', 1) AS HUGEINT)", "1", k, "e"
        )
        for k in ("in_bytes", "out_bytes")
    )
    return rf"""CREATE TABLE comm_raw AS
            WITH prism AS (
                SELECT e.event_id, e.track_id, e.ts, e.dur, 0 AS source,
                       regexp_extract(e.name, '[:;]pg=([^;]*)', 1) AS group_name,
                       nullif(regexp_extract(e.name, '[:;]desc=([^;]*)', 1), '') AS group_desc,
                       NULL::VARCHAR AS group_ranks, NULL::INTEGER AS group_size,
                       {_op_kind_sql("regexp_extract(e.name, '[:;]op=([^;]*)', 1)")} AS op,
                       TRY_CAST(regexp_extract(e.name, '[:;]seq=(-?\d+)', 1) AS BIGINT) AS seq,
                       {prism_in} AS in_bytes, {prism_out} AS out_bytes,
                       {_dtype_sql("regexp_extract(e.name, '[:;]dtype=([^;]*)', 1)")}
                           AS dtype,
                       TRY_CAST(regexp_extract(e.name, '[:;]peer=(-?\d+)', 1) AS INTEGER)
                           AS peer,
                       TRY_CAST(regexp_extract(e.name, '[:;]tag=(-?\d+)', 1) AS INTEGER) AS tag,
                       NULL::INTEGER AS group_peer
                FROM ev e WHERE NOT e.on_device AND starts_with(e.name, 'prism_comm:')),
            rpc_new AS (
                SELECT e.event_id, e.track_id, e.ts, e.dur, 1 AS source,
                       -- PyTorch 2.2-2.3 name the group by its id only
                       coalesce(e.args->>'Process Group Name',
                                'id:' || (e.args->>'Process Group ID'), '0') AS group_name,
                       e.args->>'Process Group Description' AS group_desc,
                       e.args->>'Process Group Ranks' AS group_ranks,
                       TRY_CAST(e.args->>'Group size' AS INTEGER) AS group_size,
                       {_op_kind_sql("e.args->>'Collective name'")} AS op,
                       TRY(TRY_CAST(e.args->>'Seq' AS BIGINT) - 1) AS seq,
                       {
        _call_bytes_sql(
            "TRY_CAST(e.args->>'In msg nelems' AS BIGINT)",
            _dtype_size_sql(rpc_dtype),
            "In msg nelems",
            "e",
        )
    } AS in_bytes,
                       {
        _call_bytes_sql(
            "TRY_CAST(e.args->>'Out msg nelems' AS BIGINT)",
            _dtype_size_sql(rpc_dtype),
            "Out msg nelems",
            "e",
        )
    } AS out_bytes,
                       {rpc_dtype} AS dtype, NULL::INTEGER AS peer, NULL::INTEGER AS tag,
                       coalesce(TRY_CAST(e.args->>'Dst Rank' AS INTEGER),
                                TRY_CAST(e.args->>'Src Rank' AS INTEGER)) AS group_peer
                FROM eva e
                WHERE e.name = 'record_param_comms' AND e.args->>'Collective name' IS NOT NULL),
            old_call AS (
                SELECT event_id, track_id, ts, dur FROM eva
                WHERE name = 'record_param_comms' AND args->>'Collective name' IS NULL),
            old_mark AS (
                SELECT event_id, ord, track_id, ts, dur, name, args FROM eva
                WHERE category = 'user_annotation'
                  AND regexp_matches(name, '^(nccl|gloo|mpi|ucc|xccl):')),
            rpc_old AS (
                -- the first backend annotation after the call on its track, if inside it
                SELECT e.event_id, e.track_id, e.ts, e.dur, 2 AS source,
                       {mark_columns}
                FROM old_call e ASOF JOIN old_mark a
                  ON a.track_id = e.track_id AND a.event_id > e.event_id
                WHERE a.ts + a.dur <= e.ts + e.dur),
            c10d AS (
                -- the c10d op itself (`c10d::_allgather_base_`), for a call whose
                -- record_param_comms is absent or says nothing (no args, no annotation)
                SELECT e.event_id, e.track_id, e.ts, e.dur, 3 AS source,
                       '0' AS group_name, NULL::VARCHAR AS group_desc,
                       NULL::VARCHAR AS group_ranks, {ws}::INTEGER AS group_size,
                       {_op_kind_sql("e.name")} AS op, NULL::BIGINT AS seq,
                       {
        _call_bytes_sql(
            "list_aggregate(TRY_CAST(e.args->'Input Dims'->(c10d_in) AS BIGINT[]), 'product')",
            _dtype_size_sql(c10d_dtype),
            "Input Dims",
            "e",
        )
    } AS in_bytes,
                       NULL::BIGINT AS out_bytes, {c10d_dtype} AS dtype,
                       NULL::INTEGER AS peer, NULL::INTEGER AS tag, NULL::INTEGER AS group_peer
                FROM (SELECT *,
                             -- the input tensor: (output, input, ...) for the *_base_ and
                             -- *_tensor forms, whose output differs across ranks
                             CASE WHEN regexp_matches(name, '(_base_?|_tensor)$')
                                  THEN 1 ELSE 0 END AS c10d_in
                      FROM eva) e
                WHERE e.category = 'cpu_op' AND starts_with(e.name, 'c10d::')),
            said AS (
                SELECT * FROM prism UNION ALL SELECT * FROM rpc_new
                UNION ALL SELECT * FROM rpc_old),
            c10d_alone AS (
                -- only where no better-described call starts inside the op
                SELECT d.* FROM c10d d ASOF LEFT JOIN said o
                  ON o.track_id = d.track_id AND o.ts >= d.ts
                WHERE o.ts IS NULL OR o.ts > d.ts + d.dur),
            described AS (
                -- the files (a batch reads several) whose calls something describes
                SELECT DISTINCT {file_of} AS f FROM ev e
                WHERE e.event_id IN (SELECT event_id FROM said UNION ALL
                                     SELECT event_id FROM c10d)),
            marks_alone AS (
                -- older PyTorch on CPU: a backend's span (`gloo:all_reduce`) on the worker
                -- thread that ran the call is all the trace says of it; taken only in a
                -- file where nothing else describes calls (elsewhere it repeats a call
                -- recorded on the issuing thread)
                SELECT a.event_id, a.track_id, a.ts, a.dur, 4 AS source,
                       {mark_columns}
                FROM (SELECT m.*, {file_of} AS f FROM old_mark m JOIN ev e USING (event_id)) a
                WHERE a.f NOT IN (SELECT f FROM described)),
            cand AS (
                SELECT * FROM said UNION ALL SELECT * FROM c10d_alone
                UNION ALL SELECT * FROM marks_alone),
            kept AS (
                -- drop a call enclosed by an earlier one in (ts, -dur, source, event_id)
                -- order on its track: a running max of the ends, not a range join
                SELECT * EXCLUDE (prev_end) FROM (
                    SELECT c.*, max(c.ts + c.dur) OVER (
                               PARTITION BY c.track_id
                               ORDER BY c.ts, c.dur DESC, c.source, c.event_id
                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_end
                    FROM cand c WHERE c.op IS NOT NULL)
                WHERE prev_end IS NULL OR prev_end < ts + dur),
            nccl AS (
                SELECT r.track_id, r.ts AS launch_ts, k.event_id, k.ts, k.dur
                FROM ev r JOIN ev k ON k.correlation = r.correlation{same_file}
                WHERE r.category IN ({launch}) AND k.category = 'kernel'
                  AND k.name ILIKE '%nccl%'),
            first_launch AS (
                -- the first NCCL launch on the call's track at or after its start
                SELECT c.event_id, n.event_id AS kernel_event_id, n.launch_ts
                FROM kept c ASOF JOIN nccl n
                  ON n.track_id = c.track_id AND n.launch_ts >= c.ts),
            linked AS (
                -- launched inside the call, else inside its enclosing op
                SELECT f.event_id, f.kernel_event_id
                FROM first_launch f JOIN kept c USING (event_id)
                LEFT JOIN ev ce ON ce.event_id = c.event_id
                LEFT JOIN ev p ON p.event_id = ce.parent_id
                WHERE f.launch_ts <= c.ts + c.dur
                   OR (p.category IN ('cpu_op', 'user_annotation')
                       AND f.launch_ts <= p.ts + p.dur))
            SELECT c.* REPLACE (
                       -- a host record that names no group (sources 2, 3): the NCCL
                       -- kernel's args may (newer Kineto copies them onto the kernel)
                       CASE WHEN c.source >= 2
                            THEN coalesce(ka.args->>'Process Group Name',
                                          'id:' || (ka.args->>'Process Group ID'),
                                          c.group_name)
                            ELSE c.group_name END AS group_name,
                       CASE WHEN c.source >= 2
                            THEN coalesce(ka.args->>'Process Group Description', c.group_desc)
                            ELSE c.group_desc END AS group_desc,
                       CASE WHEN c.source >= 2
                            THEN coalesce(ka.args->>'Process Group Ranks', c.group_ranks)
                            ELSE c.group_ranks END AS group_ranks,
                       CASE WHEN c.source >= 2
                            THEN coalesce(TRY_CAST(ka.args->>'Group size' AS INTEGER),
                                          c.group_size)
                            ELSE c.group_size END AS group_size,
                       CASE WHEN c.source >= 2
                            THEN coalesce(TRY_CAST(ka.args->>'Seq' AS BIGINT) - 1, c.seq)
                            ELSE c.seq END AS seq,
                       CASE WHEN c.source >= 2
                            THEN coalesce(c.in_bytes,
                                          TRY_CAST(ka.args->>'In msg nelems' AS BIGINT)
                                          * ({_dtype_size_sql(k_dtype)}))
                            ELSE c.in_bytes END AS in_bytes,
                       CASE WHEN c.source >= 2
                            THEN coalesce(c.out_bytes,
                                          TRY_CAST(ka.args->>'Out msg nelems' AS BIGINT)
                                          * ({_dtype_size_sql(k_dtype)}))
                            ELSE c.out_bytes END AS out_bytes,
                       CASE WHEN c.source >= 2 AND coalesce(c.dtype, '') = ''
                            THEN {k_dtype} ELSE c.dtype END AS dtype),
                   l.kernel_event_id, k.ts AS kernel_ts, k.dur AS kernel_dur,
                   i.iteration::INTEGER AS iteration
            FROM kept c
            LEFT JOIN linked l USING (event_id)
            LEFT JOIN ev k ON k.event_id = l.kernel_event_id
            LEFT JOIN eva ka ON ka.event_id = l.kernel_event_id
            LEFT JOIN ev_it i ON i.event_id = c.event_id"""


_BY_ID = "id:"
"""Prefix of a group name made from a call's ``Process Group ID`` (``comm_raw_sql``)."""


def groups_by_id(
    raw: pl.DataFrame, groups: dict[str, dict[str, Any]], world_size: int | None
) -> pl.DataFrame:
    """``raw`` with each group a call names by its id only given a name every rank shares.

    PyTorch 2.2-2.3 name a call's group by ``Process Group ID`` alone: the address of the
    process group object in that process, so the same group has another id on every rank and
    the calls of two ranks would never match (and a call with neither name nor id stored no
    group at all: ``NOT NULL constraint failed: collective.group_id``). The id's group is:

    - the declared group (``distributedInfo.pg_config``) with the members the call states
      (``Process Group Ranks``), else a group of those members;
    - without members, the declared group of the call's size when exactly one has it, else
      the default group ``"0"`` when the size is the world's;
    - else the id itself (a group of this rank only; its calls are matched in order).

    Returns ``raw`` itself when no call names a group by id.
    """
    by_id = pl.col("group_name").str.starts_with(_BY_ID)
    if raw.is_empty() or not raw.select(by_id.any()).item():
        return raw
    by_ranks = {tuple(g["ranks"]): n for n, g in groups.items() if g.get("ranks")}
    sizes: dict[int, list[str]] = {}
    for n, g in groups.items():
        size = g.get("size") if g.get("size") is not None else len(g.get("ranks") or [])
        if size:
            sizes.setdefault(int(size), []).append(n)

    def name_of(name: str, ranks_text: Any, size: Any) -> str:
        ranks = _json_list(ranks_text)
        if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
            return by_ranks.get(tuple(ranks), "ranks:" + ",".join(map(str, ranks)))
        if size is not None and len(sizes.get(int(size), [])) == 1:
            return sizes[int(size)][0]
        if size is not None and world_size is not None and int(size) == world_size:
            return "0"
        return name

    cache: dict[tuple[str, Any, Any], str] = {}
    names = []
    for name, ranks_text, size in raw.select("group_name", "group_ranks", "group_size").iter_rows():
        if name is None or not name.startswith(_BY_ID):
            names.append(name)
            continue
        key = (name, ranks_text, size)
        if key not in cache:
            cache[key] = name_of(name, ranks_text, size)
        names.append(cache[key])
    return raw.with_columns(pl.Series("group_name", names, dtype=pl.Utf8))


class _CommTables(_Work):
    """The communication stage of the Kineto reader (``reader._Reader`` inherits it):
    groups and calls read from the staged ``ev``/``raw`` tables of one file."""

    def _call_ranks(self, text: Any) -> list[int] | None:
        """The members a call's args list (``Process Group Ranks``), checked as the header's."""
        return _member_ranks(self.path, text, "a call's `Process Group Ranks`")

    def comm_groups_from_meta(self) -> dict[str, dict[str, Any]]:
        """Groups declared by the trace: ``distributedInfo.pg_config``, then ``prism_groups``."""
        path = self.path
        backend = check_text(path, self.info.get("backend"), "distributedInfo.backend")
        groups: dict[str, dict[str, Any]] = {}
        for i, g in enumerate(_json_list(self.meta.get("prism_groups")) or []):
            if isinstance(g, dict) and g.get("name") is not None:
                at = f"prism_groups[{i}]"
                name = _group_name(path, g["name"], f"{at}.name")
                ranks = _member_ranks(path, g.get("ranks"), f"{at}.ranks")
                size = _group_size(path, g.get("size"), f"{at}.size")
                groups[name] = {
                    "name": name,
                    "description": check_text(path, g.get("desc"), f"{at}.desc"),
                    "backend": _backend_of(g.get("backend"), backend),
                    "size": len(ranks) if ranks is not None else size,
                    "ranks": ranks,
                }
        pg_config = _json_list(self.info.get("pg_config"))
        if isinstance(pg_config, dict):  # older torch: {name: {...}}
            pg_config = [{"pg_name": k, **v} for k, v in pg_config.items() if isinstance(v, dict)]
        for i, g in enumerate(pg_config or []):
            if not isinstance(g, dict) or g.get("pg_name") is None:
                continue
            at = f"distributedInfo.pg_config[{i}]"
            name = _group_name(path, g["pg_name"], f"{at}.pg_name")
            ranks = _member_ranks(path, g.get("ranks"), f"{at}.ranks")
            size = _group_size(path, g.get("pg_size"), f"{at}.pg_size")
            desc = check_text(path, g.get("pg_desc"), f"{at}.pg_desc")
            groups[name] = {
                "name": name,
                "description": desc or groups.get(name, {}).get("description"),
                "backend": _backend_of(g.get("backend_config"), backend),
                "size": size if size is not None else (len(ranks) if ranks else None),
                "ranks": ranks if ranks is not None else groups.get(name, {}).get("ranks"),
            }
        return groups

    def comms(self, groups: dict[str, dict[str, Any]]) -> tuple[pl.DataFrame, pl.DataFrame]:
        """Collective and p2p calls, each linked to the NCCL kernel it launched (if any)."""
        ws = self.world_size if self.world_size is not None else "NULL"
        self.sql(comm_raw_sql(str(ws), ""))
        raw = self.frame("SELECT * FROM comm_raw ORDER BY ts, event_id")
        named = groups_by_id(raw, groups, self.world_size)
        if named is not raw:  # ``named_groups`` reads the table: it gets the names too
            self.con.register("_comm_named", named)
            try:
                self.sql("CREATE OR REPLACE TABLE comm_raw AS SELECT * FROM _comm_named")
            finally:
                self.con.unregister("_comm_named")
        return self.comm_frames(named, groups)

    def comm_frames(
        self, raw: pl.DataFrame, groups: dict[str, dict[str, Any]]
    ) -> tuple[pl.DataFrame, pl.DataFrame]:
        """The collective and p2p frames of the file's ``comm_raw`` rows (sorted by ts, id)."""
        ranks_of = {name: g["ranks"] for name, g in groups.items() if g.get("ranks") is not None}
        size_of = {name: g["size"] for name, g in groups.items() if g.get("size") is not None}
        group_ranks = pl.Series(
            "ranks",
            [
                ranks_of.get(n) if ranks_of.get(n) is not None else self._call_ranks(r)
                for n, r in zip(
                    raw["group_name"].to_list(), raw["group_ranks"].to_list(), strict=True
                )
            ],
            dtype=pl.List(pl.Int32),
        )
        raw = raw.with_columns(
            group_ranks,
            pl.coalesce(
                pl.col("group_size"),
                pl.col("group_name").replace_strict(size_of, default=None, return_dtype=pl.Int32),
            ).alias("group_size"),
        )
        return self._collectives(raw), self._p2p(raw)

    def _collectives(self, raw: pl.DataFrame) -> pl.DataFrame:
        coll = raw.filter(~pl.col("op").is_in(["send", "recv"]))
        size = pl.col("group_size").cast(pl.Int64)
        out_est = (
            pl.when(pl.col("out_bytes").is_not_null())
            .then(pl.col("out_bytes"))
            .when(pl.col("op") == "all_gather")
            .then(pl.col("in_bytes") * size)
            .when(pl.col("op") == "reduce_scatter")
            .then(pl.col("in_bytes") // size)
            .when(pl.col("op").is_in(["all_reduce", "all_to_all", "broadcast", "reduce"]))
            .then(pl.col("in_bytes"))
        )
        return coll.select(
            pl.lit(self.rank).alias("rank"),
            "event_id",
            "group_name",
            pl.when(pl.col("seq") >= 0).then(pl.col("seq")).alias("seq"),
            pl.col("op").alias("kind"),
            pl.col("dtype").replace("", None),
            "in_bytes",
            out_est.alias("out_bytes"),
            pl.max_horizontal("in_bytes", out_est).alias("msg_bytes"),
            "group_size",
            pl.col("ts").alias("host_ts"),
            pl.col("dur").alias("host_dur"),
            "kernel_event_id",
            "kernel_ts",
            "kernel_dur",
            "iteration",
        )

    def _p2p(self, raw: pl.DataFrame) -> pl.DataFrame:
        p2p = raw.filter(pl.col("op").is_in(["send", "recv"]))
        # Group-local peer (record_param_comms) -> global rank through the group's ranks.
        from_group = pl.col("ranks").list.get(pl.col("group_peer"), null_on_oob=True)
        peer = pl.coalesce(
            pl.when(pl.col("peer") >= 0).then(pl.col("peer")),
            pl.when(pl.col("group_peer").is_not_null() & pl.col("ranks").is_not_null()).then(
                from_group
            ),
            pl.col("group_peer"),
        )  # null when the peer is unknown
        return (
            p2p.with_columns(peer.cast(pl.Int32).alias("peer"))
            .select(
                pl.lit(self.rank).alias("rank"),
                "event_id",
                "group_name",
                pl.col("op").alias("direction"),
                "peer",
                pl.when(pl.col("op") == "send")
                .then(pl.col("in_bytes"))
                .otherwise(pl.coalesce(pl.col("out_bytes"), pl.col("in_bytes")))
                .alias("bytes"),
                "tag",
                pl.col("dtype").replace("", None),
                pl.col("ts").alias("host_ts"),
                pl.col("dur").alias("host_dur"),
                "kernel_event_id",
                "kernel_ts",
                "kernel_dur",
                "iteration",
            )
            .sort("host_ts", "event_id")
            .with_columns(
                (pl.int_range(pl.len()).over("peer", "direction")).cast(pl.Int64).alias("seq")
            )
        )

    def named_groups(self) -> list[tuple[Any, ...]]:
        """``(name, description, ranks text, size, source)`` of each group the calls name."""
        return self.rows(
            """SELECT group_name, any_value(group_desc), any_value(group_ranks),
                      max(group_size), min(source)
               FROM comm_raw WHERE group_name IS NOT NULL GROUP BY group_name ORDER BY group_name"""
        )

    def comm_groups(
        self, groups: dict[str, dict[str, Any]], coll: pl.DataFrame, p2p: pl.DataFrame
    ) -> pl.DataFrame:
        """Declared groups, plus those only named by calls (with their args' ranks)."""
        out = {name: dict(g) for name, g in groups.items()}
        named = self.named_groups()
        backend = self.info.get("backend")
        for name, desc, ranks_text, size, source in named:
            if name in out:
                g = out[name]
                g["description"] = g.get("description") or desc
                if g.get("ranks") is None:
                    g["ranks"] = self._call_ranks(ranks_text)
                continue
            ranks = self._call_ranks(ranks_text)
            if ranks is None and source == 2 and self.world_size is not None:
                ranks = list(range(self.world_size))  # old traces: the default group
            out[name] = {
                "name": name,
                "description": desc or ("default_pg" if source == 2 else None),
                "backend": backend,
                "size": len(ranks) if ranks else size,
                "ranks": ranks,
            }
        del coll, p2p
        rows = sorted(out.values(), key=lambda g: (len(g["name"]), g["name"]))
        return pl.DataFrame(
            {
                "name": [g["name"] for g in rows],
                "description": [g.get("description") for g in rows],
                "backend": [g.get("backend") for g in rows],
                "size": [g.get("size") for g in rows],
                "ranks": [g.get("ranks") for g in rows],
            },
            schema={
                "name": pl.Utf8,
                "description": pl.Utf8,
                "backend": pl.Utf8,
                "size": pl.Int32,
                "ranks": pl.List(pl.Int32),
            },
        )

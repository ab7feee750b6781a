"""The declared tables of the store: one source for the DDL, DuckDB comments and docs/schema.md.

Every table is keyed by ``run_id`` and, when it is per rank, by ``rank``. Recorded, sliced,
emulated and replayed runs all live in these same tables (``run.kind`` tells them apart), so every
query and view works on all of them. Times are integer nanoseconds (``ts``, ``dur``) on one
clock per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "GRAPH_TABLES",
    "RUN_KINDS",
    "SCHEMA_VERSION",
    "TABLES",
    "VIEWS",
    "Column",
    "Table",
    "View",
    "create_all",
    "render_markdown",
    "table",
]

SCHEMA_VERSION = 3
"""Bump on every breaking change, with an entry in docs/schema-changes.md."""

RUN_KINDS = ("recorded", "sliced", "emulated", "replayed")


@dataclass(frozen=True)
class Column:
    """One typed, documented column; ``join`` names the column it references, if any."""

    name: str
    type: str
    doc: str
    join: str | None = None
    nullable: bool = True


@dataclass(frozen=True)
class Table:
    """A declared table: its columns, primary key and a doc saying what one row is."""

    name: str
    doc: str
    columns: tuple[Column, ...]
    key: tuple[str, ...] = ()

    @property
    def column_names(self) -> list[str]:
        """Column names in declaration order (the order readers must produce)."""
        return [c.name for c in self.columns]

    def ddl(self) -> str:
        """``CREATE TABLE`` text for DuckDB."""
        cols = [f"    {c.name} {c.type}{'' if c.nullable else ' NOT NULL'}" for c in self.columns]
        if self.key:
            cols.append(f"    PRIMARY KEY ({', '.join(self.key)})")
        return f"CREATE TABLE IF NOT EXISTS {self.name} (\n" + ",\n".join(cols) + "\n)"


@dataclass(frozen=True)
class View:
    """A declared view over the tables, with its documented columns."""

    name: str
    doc: str
    sql: str
    columns: tuple[Column, ...] = field(default_factory=tuple)


def _c(name: str, type_: str, doc: str, join: str | None = None, *, null: bool = True) -> Column:
    return Column(name, type_, doc, join, null)


RUN_ID = _c("run_id", "INTEGER", "The run this row belongs to.", "run.run_id", null=False)
RANK = _c("rank", "INTEGER", "Global rank in the run's world.", "rank.rank", null=False)

TABLES: tuple[Table, ...] = (
    Table(
        "meta",
        "Store-wide facts: `schema_version`, the prism-trace version that created the file, and"
        " `last_run_id` (run ids are never reused).",
        (
            _c("key", "VARCHAR", "Name of the fact.", null=False),
            _c("value", "VARCHAR", "Its value."),
        ),
        ("key",),
    ),
    Table(
        "run",
        "One job: the recorded ranks of a real run, or a sliced, emulated or replayed derivative.",
        (
            _c("run_id", "INTEGER", "Minted id, stable within the store.", null=False),
            _c("name", "VARCHAR", "User-given name, unique in the store.", null=False),
            _c("kind", "VARCHAR", "recorded | sliced | emulated | replayed.", null=False),
            _c("parent_run_id", "INTEGER", "The run this one was derived from.", "run.run_id"),
            _c("world_size", "INTEGER", "Ranks in the job's world (not only those stored)."),
            _c("source_format", "VARCHAR", "kineto | host_et | chakra | op_timeline | mixed."),
            _c("created_at", "TIMESTAMP", "When the run was written."),
            _c("config_json", "JSON", "The resolved configuration that produced the run."),
        ),
        ("run_id",),
    ),
    Table(
        "rank",
        "One rank of a run, with where it came from and its parallel role.",
        (
            RUN_ID,
            _c("rank", "INTEGER", "Global rank.", null=False),
            _c("backend", "VARCHAR", "Communication backend (nccl, gloo, ...)."),
            _c("hostname", "VARCHAR", "Host name, when the trace says."),
            _c("pid", "BIGINT", "OS process id of the rank's main process."),
            _c("device", "VARCHAR", "Device model, e.g. `NVIDIA A100-PG509-200` or `cpu`."),
            _c("class_id", "INTEGER", "Equivalence class (sliced runs); NULL when recorded."),
            _c("represented_by", "INTEGER", "Recorded rank whose timing this rank replays."),
            _c("tp", "INTEGER", "Tensor-parallel coordinate."),
            _c("cp", "INTEGER", "Context-parallel coordinate."),
            _c("ep", "INTEGER", "Expert-parallel coordinate."),
            _c("dp", "INTEGER", "Data-parallel coordinate."),
            _c("pp", "INTEGER", "Pipeline stage."),
            _c("et_ops", "BIGINT", "Host ET ops ingested for this rank (NULL without host ET)."),
            _c("et_ops_linked", "BIGINT", "Host ET ops linked to a Kineto event."),
            _c("args", "JSON", "Other per-rank facts (trace header, device properties)."),
        ),
        ("run_id", "rank"),
    ),
    Table(
        "source_file",
        "A file ingested into a run; its fingerprint makes re-ingesting the same file detectable.",
        (
            RUN_ID,
            _c("rank", "INTEGER", "Rank the file described; NULL for multi-rank files."),
            _c("path", "VARCHAR", "Absolute path at ingest time.", null=False),
            _c("format", "VARCHAR", "Detected format.", null=False),
            _c("size_bytes", "BIGINT", "File size on disk."),
            _c(
                "fingerprint",
                "VARCHAR",
                "sha256 of the size, first and last 4 MiB: tells a re-ingested file cheaply.",
            ),
            _c("ingested_at", "TIMESTAMP", "When it was ingested."),
        ),
    ),
    Table(
        "comm_group",
        "A communicator (process group) of a run, with its member ranks.",
        (
            RUN_ID,
            _c("group_id", "INTEGER", "Minted id within the run.", null=False),
            _c("name", "VARCHAR", "Process-group name as the framework gives it (`0`, `1`, ...)."),
            _c("description", "VARCHAR", "Description, e.g. `default_pg`, `tp`, `dp`, `pp`."),
            _c("backend", "VARCHAR", "Backend of the group."),
            _c("size", "INTEGER", "Number of member ranks."),
            _c("ranks", "INTEGER[]", "Global ranks of the members, in group-rank order."),
            _c(
                "axis",
                "VARCHAR",
                "Parallel role: `tp`, `cp`, `ep`, `dp`, `pp`, several joined by `-` (`dp-cp`),"
                " `embd`, `world`; NULL until the layout is known. Slicing remaps by it.",
            ),
        ),
        ("run_id", "group_id"),
    ),
    Table(
        "track",
        "A lane of a rank's timeline: a host thread or a device stream.",
        (
            RUN_ID,
            RANK,
            _c("track_id", "INTEGER", "Minted id within the rank.", null=False),
            _c("kind", "VARCHAR", "thread | stream.", null=False),
            _c("pid", "VARCHAR", "Trace pid (process id, or device index for streams)."),
            _c("tid", "BIGINT", "OS thread id, or CUDA stream id."),
            _c("name", "VARCHAR", "Thread or stream name when the trace gives one."),
        ),
        ("run_id", "rank", "track_id"),
    ),
    Table(
        "event",
        "A timed slice on a track: host op, annotation, runtime call, kernel, memcpy or memset.",
        (
            RUN_ID,
            RANK,
            _c("event_id", "BIGINT", "Minted id within the rank.", null=False),
            _c("track_id", "INTEGER", "Lane the event ran on.", "track.track_id"),
            _c(
                "category",
                "VARCHAR",
                "cpu_op | user_annotation | python_function | cuda_runtime | cuda_driver |"
                " kernel | memcpy | memset | gpu_user_annotation | cuda_sync | compute | comm |"
                " instant | other.",
                null=False,
            ),
            _c("name", "VARCHAR", "Op, kernel or annotation name.", null=False),
            _c("ts", "BIGINT", "Start, ns on the run clock (NULL for untimed Chakra nodes)."),
            _c("dur", "BIGINT", "Duration, ns."),
            _c("correlation", "BIGINT", "CUDA correlation id joining a launch to its kernel."),
            _c("external_id", "BIGINT", "Kineto `External id` joining ops to their launches."),
            _c("rf_id", "BIGINT", "Kineto `Record function id` (host ET `rf_id`)."),
            _c("parent_id", "BIGINT", "Enclosing event on the same track.", "event.event_id"),
            _c("depth", "INTEGER", "Nesting depth on the track, 0 at the top."),
            _c("iteration", "INTEGER", "Training step of the event.", "iteration.iteration"),
            _c("args", "JSON", "Remaining trace args, verbatim."),
        ),
        ("run_id", "rank", "event_id"),
    ),
    Table(
        "collective",
        "One collective call on one rank; (run_id, group_id, seq) names the instance across ranks.",
        (
            RUN_ID,
            RANK,
            _c("event_id", "BIGINT", "Host op of the call.", "event.event_id"),
            _c("group_id", "INTEGER", "Communicator.", "comm_group.group_id", null=False),
            _c("seq", "BIGINT", "0-based number of the call within its group.", null=False),
            _c(
                "kind",
                "VARCHAR",
                "all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | reduce |"
                " gather | scatter | barrier.",
                null=False,
            ),
            _c("dtype", "VARCHAR", "Element type, lower case (`float`, `bfloat16`, ...)."),
            _c("in_bytes", "BIGINT", "Bytes of this rank's input buffer."),
            _c("out_bytes", "BIGINT", "Bytes of this rank's output buffer."),
            _c("msg_bytes", "BIGINT", "Size in nccl-tests convention: max(in_bytes, out_bytes)."),
            _c("group_size", "INTEGER", "Participants the call expects."),
            _c("host_ts", "BIGINT", "Start of the host op, ns."),
            _c("host_dur", "BIGINT", "Duration of the host op, ns."),
            _c("kernel_event_id", "BIGINT", "Device kernel that executed it.", "event.event_id"),
            _c("kernel_ts", "BIGINT", "Kernel start, ns (NULL on CPU backends)."),
            _c("kernel_dur", "BIGINT", "Kernel duration, ns."),
            _c("iteration", "INTEGER", "Training step.", "iteration.iteration"),
        ),
        ("run_id", "rank", "group_id", "seq"),
    ),
    Table(
        "p2p",
        "One point-to-point send or receive on one rank.",
        (
            RUN_ID,
            RANK,
            _c("event_id", "BIGINT", "Host op of the call.", "event.event_id"),
            _c("group_id", "INTEGER", "Communicator.", "comm_group.group_id"),
            _c("seq", "BIGINT", "0-based sequence number within (rank, peer, direction)."),
            _c("direction", "VARCHAR", "send | recv.", null=False),
            _c(
                "peer",
                "INTEGER",
                "Global rank of the other side (NULL when the trace does not say).",
            ),
            _c("bytes", "BIGINT", "Message size."),
            _c("tag", "INTEGER", "Message tag."),
            _c("dtype", "VARCHAR", "Element type."),
            _c("host_ts", "BIGINT", "Start of the host op, ns."),
            _c("host_dur", "BIGINT", "Duration of the host op, ns."),
            _c("kernel_event_id", "BIGINT", "Device kernel that executed it.", "event.event_id"),
            _c("kernel_ts", "BIGINT", "Kernel start, ns."),
            _c("kernel_dur", "BIGINT", "Kernel duration, ns."),
            _c("iteration", "INTEGER", "Training step.", "iteration.iteration"),
        ),
    ),
    Table(
        "memory",
        "An allocator event: bytes allocated (+) or freed (-) and the totals after it.",
        (
            RUN_ID,
            RANK,
            _c("ts", "BIGINT", "When, ns.", null=False),
            _c("device_type", "VARCHAR", "cpu | cuda | ..."),
            _c("device_id", "INTEGER", "Device index (-1 for host)."),
            _c("addr", "BIGINT", "Address of the block."),
            _c("bytes", "BIGINT", "Delta: positive on allocation, negative on free.", null=False),
            _c("total_allocated", "BIGINT", "Allocated bytes after the event."),
            _c("total_reserved", "BIGINT", "Reserved bytes after the event."),
            _c("iteration", "INTEGER", "Training step.", "iteration.iteration"),
        ),
    ),
    Table(
        "flow",
        "A dependency between two events of one rank: launch, fwd-bwd, data or control.",
        (
            RUN_ID,
            RANK,
            _c("kind", "VARCHAR", "launch | fwdbwd | data | ctrl | sync.", null=False),
            _c("src_event_id", "BIGINT", "Event that must happen first.", "event.event_id"),
            _c("dst_event_id", "BIGINT", "Event that depends on it.", "event.event_id"),
            _c("flow_id", "BIGINT", "Id of the flow in the trace (Kineto `id`)."),
        ),
    ),
    Table(
        "iteration",
        "One training step on one rank.",
        (
            RUN_ID,
            RANK,
            _c("iteration", "INTEGER", "Step number as the trace gives it.", null=False),
            _c("ts", "BIGINT", "Start, ns.", null=False),
            _c("dur", "BIGINT", "Duration, ns.", null=False),
            _c("name", "VARCHAR", "The marking annotation, e.g. `ProfilerStep#10`."),
        ),
        ("run_id", "rank", "iteration"),
    ),
    Table(
        "rank_step",
        "Per rank and training step of an emulated run: its communication waits, how late it"
        " arrived and its peak memory. Written for every rank of the world, class members and"
        " distinct replicas included, while per-op events are written for the class exemplars"
        " and `--keep-events` ranks only (replay/emulate/rank_step.py). An arrival is the start"
        " of the call's kernel when it has one, as in `comm_collective_wait`. One row per"
        " (run_id, rank, iteration).",
        (
            RUN_ID,
            RANK,
            _c("iteration", "INTEGER", "Training step.", "iteration.iteration", null=False),
            _c("comm_calls", "INTEGER", "Communication calls (collectives, sends, receives)."),
            _c("wait_ns", "BIGINT", "Summed over its calls: last arrival minus its arrival, ns."),
            _c(
                "late_ns",
                "BIGINT",
                "Summed over its calls: its arrival minus the first arrival (arrival skew), ns.",
            ),
            _c(
                "peak_allocated",
                "BIGINT",
                "Peak `total_allocated` in the step (its class exemplar's memory re-timed); NULL"
                " without memory events.",
            ),
        ),
        # One row per (run_id, rank, iteration), not declared: a key index would make inserting
        # 2 M rows (65,536 ranks x 32 steps) five times slower.
    ),
    Table(
        "et_op",
        "A node of a PyTorch host execution trace, with shapes and tensor ids for replay.",
        (
            RUN_ID,
            RANK,
            _c("node_id", "BIGINT", "ET node id.", null=False),
            _c("parent_node_id", "BIGINT", "ET parent node.", "et_op.node_id"),
            _c("name", "VARCHAR", "Op name.", null=False),
            _c("op_schema", "VARCHAR", "ATen schema string."),
            _c("tid", "BIGINT", "ET thread id."),
            _c("rf_id", "BIGINT", "Record-function id, joins `event.rf_id`."),
            _c("seq_id", "BIGINT", "Autograd sequence number."),
            _c("scope", "INTEGER", "RecordScope (0 function, 7 user scope, ...)."),
            _c("fw_parent", "BIGINT", "Forward parent of a backward op."),
            _c("inputs", "JSON", "Input values: tensor refs, scalars, lists."),
            _c("input_shapes", "JSON", "Input shapes."),
            _c("input_types", "JSON", "Input types."),
            _c("outputs", "JSON", "Output values."),
            _c("output_shapes", "JSON", "Output shapes."),
            _c("output_types", "JSON", "Output types."),
            _c("attrs", "JSON", "Other node attributes (schema >= 1.1)."),
            _c("event_id", "BIGINT", "Linked Kineto event, NULL if unlinked.", "event.event_id"),
        ),
        ("run_id", "rank", "node_id"),
    ),
)

GRAPH_TABLES: tuple[Table, ...] = (
    Table(
        "graph_node",
        "A node of a rank's execution graph: a top-level host op, a device op, or a communication."
        " A sliced run stores one graph per equivalence class, under the class's exemplar rank"
        " (`rank.class_id`).",
        (
            RUN_ID,
            _c("rank", "INTEGER", "Rank (or class exemplar rank in a sliced run).", null=False),
            _c("node_id", "BIGINT", "Minted id within the rank.", null=False),
            _c(
                "kind",
                "VARCHAR",
                "host | kernel | memcpy | memset | collective | send | recv.",
                null=False,
            ),
            _c("track_id", "INTEGER", "Thread or stream the node runs on.", "track.track_id"),
            _c("event_id", "BIGINT", "Source event (of `source_run_id`'s rank).", "event.event_id"),
            _c("name", "VARCHAR", "Op, kernel or collective name."),
            _c("ts", "BIGINT", "Recorded start, ns (NULL when the source has no times)."),
            _c("dur", "BIGINT", "Recorded duration, ns; for communication it includes waiting."),
            _c("iteration", "INTEGER", "Training step.", "iteration.iteration"),
            _c(
                "group_id",
                "INTEGER",
                "Communicator of a collective/send/recv.",
                "comm_group.group_id",
            ),
            _c("seq", "BIGINT", "Sequence number within the group (collective) or pair (p2p)."),
            _c("peer", "INTEGER", "Other side of a send/recv (global rank)."),
            _c("msg_bytes", "BIGINT", "Message size (rescaled in sliced runs)."),
            _c("comm_kind", "VARCHAR", "Collective kind (all_reduce, ...) of a collective node."),
        ),
        ("run_id", "rank", "node_id"),
    ),
    Table(
        "graph_edge",
        "A dependency inside one rank's graph: `dst` may start `delay` ns after `src`'s `anchor`"
        " (its start or its end); a `sync` edge instead holds back the *end* of `dst`.",
        (
            RUN_ID,
            _c("rank", "INTEGER", "Rank (or class exemplar rank).", null=False),
            _c("src", "BIGINT", "Node that comes first.", "graph_node.node_id", null=False),
            _c("dst", "BIGINT", "Node that depends on it.", "graph_node.node_id", null=False),
            _c(
                "kind",
                "VARCHAR",
                "program (host order, delay = recorded gap) | launch (host op → kernel) |"
                " stream (device order) | wait (cross-stream event wait) | sync (device → host"
                " synchronize) | comm (collective host op → its kernel) | data | ctrl (Chakra).",
                null=False,
            ),
            _c("anchor", "VARCHAR", "start | end: which instant of `src` the delay counts from."),
            _c("delay", "BIGINT", "ns after the anchor before `dst` may start (>= 0)."),
        ),
    ),
)

TABLES = TABLES + GRAPH_TABLES

VIEWS: tuple[View, ...] = (
    View(
        "collective_instance",
        "One collective instance across ranks (group + sequence): who arrived, when, and whether"
        " it matches.",
        """
        SELECT c.run_id, c.group_id, c.seq,
               any_value(g.name) AS group_name,
               min(c.kind) AS kind,
               count(DISTINCT c.kind) AS kinds,
               count(*) AS participants,
               any_value(g.size) AS group_size,
               list(c.rank ORDER BY c.rank) AS ranks,
               min(c.host_ts) AS first_arrival_ts,
               max(c.host_ts) AS last_arrival_ts,
               max(c.host_ts) - min(c.host_ts) AS arrival_spread,
               max(c.msg_bytes) AS msg_bytes,
               count(DISTINCT c.msg_bytes) AS sizes,
               (count(*) = any_value(g.size) AND count(DISTINCT c.kind) = 1
                AND count(DISTINCT c.msg_bytes) <= 1) AS matched
        FROM collective c JOIN comm_group g USING (run_id, group_id)
        GROUP BY c.run_id, c.group_id, c.seq
        """,
        (
            _c("group_name", "VARCHAR", "Process-group name."),
            _c("participants", "BIGINT", "Ranks that recorded the instance."),
            _c("matched", "BOOLEAN", "All members present with one kind and one size."),
        ),
    ),
    View(
        "comm_mismatch",
        "One row per collective instance that is not whole: members missing, extra ranks, or"
        " ranks whose kind or size differs from the others'. `mismatch` is false when the only"
        " missing members were never recorded in the run (a partial recording).",
        """        WITH inst AS (
            SELECT run_id, group_id, seq,
                   mode(kind) AS common_kind, mode(msg_bytes) AS common_bytes,
                   list(rank ORDER BY rank) AS present_ranks,
                   list_sort(list_distinct(list(kind))) AS kinds,
                   list_sort(list_distinct(list(msg_bytes))) AS sizes
            FROM collective GROUP BY run_id, group_id, seq),
        odd AS (
            SELECT c.run_id, c.group_id, c.seq, list(c.rank ORDER BY c.rank) AS odd_ranks
            FROM collective c JOIN inst i USING (run_id, group_id, seq)
            WHERE c.kind <> i.common_kind OR c.msg_bytes IS DISTINCT FROM i.common_bytes
            GROUP BY c.run_id, c.group_id, c.seq),
        recorded AS (SELECT run_id, list(rank) AS ranks FROM rank GROUP BY run_id),
        judged AS (
            SELECT i.run_id, i.group_id, g.name AS group_name, i.seq,
                   g.ranks AS expected_ranks, i.present_ranks,
                   list_filter(g.ranks, lambda x: NOT list_contains(i.present_ranks, x))
                       AS missing_ranks,
                   list_filter(i.present_ranks, lambda x: NOT list_contains(g.ranks, x))
                       AS extra_ranks,
                   coalesce(o.odd_ranks, []::INTEGER[]) AS odd_ranks,
                   i.kinds, i.sizes, r.ranks AS recorded_ranks,
                   len(i.present_ranks) < g.size AS short
            FROM inst i JOIN comm_group g USING (run_id, group_id)
            LEFT JOIN odd o USING (run_id, group_id, seq)
            LEFT JOIN recorded r USING (run_id))
        SELECT run_id, group_id, group_name, seq, expected_ranks, present_ranks, missing_ranks,
               list_filter(missing_ranks, lambda x: NOT list_contains(recorded_ranks, x))
                   AS unrecorded_ranks,
               extra_ranks, odd_ranks, kinds, sizes,
               (len(list_filter(missing_ranks, lambda x: list_contains(recorded_ranks, x))) > 0
                OR len(extra_ranks) > 0 OR len(odd_ranks) > 0
                OR (expected_ranks IS NULL AND coalesce(short, false))) AS mismatch
        FROM judged
        WHERE len(missing_ranks) > 0 OR len(extra_ranks) > 0 OR len(odd_ranks) > 0
           OR (expected_ranks IS NULL AND coalesce(short, false))
        """,
        (
            _c("group_name", "VARCHAR", "Process-group name."),
            _c("expected_ranks", "INTEGER[]", "The group's members (`comm_group.ranks`)."),
            _c("present_ranks", "INTEGER[]", "Ranks that recorded the instance."),
            _c("missing_ranks", "INTEGER[]", "Members that did not record it."),
            _c("unrecorded_ranks", "INTEGER[]", "Missing members absent from the run's ranks."),
            _c("extra_ranks", "INTEGER[]", "Ranks that recorded it but are not members."),
            _c("odd_ranks", "INTEGER[]", "Ranks whose kind or msg_bytes differs from the mode."),
            _c("kinds", "VARCHAR[]", "Distinct kinds recorded."),
            _c("sizes", "BIGINT[]", "Distinct msg_bytes recorded."),
            _c("mismatch", "BOOLEAN", "A recorded rank disagrees or is missing."),
        ),
    ),
    View(
        "p2p_pair",
        "A send matched with its receive: send(rank → peer, group, seq) ↔ recv(peer ← rank,"
        " group, seq); the side that was not recorded is NULL.",
        """        WITH s AS (SELECT * FROM p2p WHERE direction = 'send'),
             r AS (SELECT * FROM p2p WHERE direction = 'recv')
        SELECT coalesce(s.run_id, r.run_id) AS run_id,
               coalesce(s.group_id, r.group_id) AS group_id,
               g.name AS group_name,
               coalesce(s.seq, r.seq) AS seq,
               coalesce(s.rank, r.peer) AS src_rank,
               coalesce(s.peer, r.rank) AS dst_rank,
               s.bytes AS send_bytes, r.bytes AS recv_bytes,
               s.event_id AS send_event_id, r.event_id AS recv_event_id,
               s.host_ts AS send_ts, s.host_dur AS send_dur,
               r.host_ts AS recv_ts, r.host_dur AS recv_dur,
               s.kernel_ts AS send_kernel_ts, r.kernel_ts AS recv_kernel_ts,
               s.rank IS NOT NULL AND r.rank IS NOT NULL AS paired
        FROM s FULL OUTER JOIN r
          ON s.run_id = r.run_id AND s.group_id IS NOT DISTINCT FROM r.group_id
         AND s.rank = r.peer AND s.peer = r.rank AND s.seq = r.seq
        LEFT JOIN comm_group g
          ON g.run_id = coalesce(s.run_id, r.run_id)
         AND g.group_id = coalesce(s.group_id, r.group_id)
        """,
        (
            _c("src_rank", "INTEGER", "Sending rank."),
            _c("dst_rank", "INTEGER", "Receiving rank."),
            _c("send_event_id", "BIGINT", "Host op of the send (NULL when unpaired)."),
            _c("recv_event_id", "BIGINT", "Host op of the receive (NULL when unpaired)."),
            _c("send_ts", "BIGINT", "Start of the send's host op, ns."),
            _c("recv_ts", "BIGINT", "Start of the receive's host op, ns."),
            _c("paired", "BOOLEAN", "Both sides were found."),
        ),
    ),
    View(
        "host_op",
        "Host-side events (CPU ops and annotations).",
        "SELECT * FROM event WHERE category IN ('cpu_op', 'user_annotation', 'python_function')",
    ),
    View(
        "kernel",
        "Device-side events (kernels, memcpy, memset).",
        "SELECT * FROM event WHERE category IN ('kernel', 'memcpy', 'memset')",
    ),
)


def table(name: str) -> Table:
    """Look a declared table up by name."""
    for t in TABLES:
        if t.name == name:
            return t
    msg = f"no table named {name!r}"
    raise KeyError(msg)


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def create_all(con: object) -> None:
    """Create every table and view; ``COMMENT ON`` shows the docs in ``duckdb_columns()``."""
    for t in TABLES:
        con.execute(t.ddl())  # type: ignore[attr-defined]
        con.execute(f"COMMENT ON TABLE {t.name} IS {_sql_str(t.doc)}")  # type: ignore[attr-defined]
        for c in t.columns:
            con.execute(  # type: ignore[attr-defined]
                f"COMMENT ON COLUMN {t.name}.{c.name} IS {_sql_str(c.doc)}"
            )
    for v in VIEWS:
        con.execute(f"CREATE OR REPLACE VIEW {v.name} AS {v.sql}")  # type: ignore[attr-defined]
        con.execute(f"COMMENT ON VIEW {v.name} IS {_sql_str(v.doc)}")  # type: ignore[attr-defined]


def render_markdown() -> str:
    """Render docs/schema.md from the declarations (a test keeps the file in sync)."""
    out = [
        "# Store schema",
        "",
        "Generated from `prism_trace/store/schema.py`"
        " by `python -m prism_trace.store.schema > docs/schema.md`;",
        "do not edit by hand. Times are integer nanoseconds on one clock per run. Every per-rank",
        "table is keyed by `(run_id, rank, ...)`, and recorded, sliced, emulated and replayed runs",
        f"share the same tables (`run.kind`). Schema version: {SCHEMA_VERSION}.",
        "",
    ]
    for t in TABLES:
        out += [f"## `{t.name}`", "", t.doc, ""]
        if t.key:
            out += [f"Key: `({', '.join(t.key)})`", ""]
        out += ["| column | type | joins | description |", "|---|---|---|---|"]
        for c in t.columns:
            join = f"`{c.join}`" if c.join else ""
            null = "" if c.nullable else " NOT NULL"
            out.append(f"| `{c.name}` | {c.type}{null} | {join} | {c.doc} |")
        out.append("")
    out += ["# Views", ""]
    for v in VIEWS:
        out += [f"## `{v.name}`", "", v.doc, ""]
        if v.columns:
            out += ["| column | type | description |", "|---|---|---|"]
            out += [f"| `{c.name}` | {c.type} | {c.doc} |" for c in v.columns]
            out.append("")
        out += ["```sql", "\n".join(line.strip() for line in v.sql.strip().splitlines()), "```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render_markdown(), end="")

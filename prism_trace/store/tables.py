"""The declared tables of the store: every column typed and documented, with its key.

Every table is keyed by ``run_id`` and, when it is per rank, by ``rank``. Recorded, sliced,
emulated and replayed runs all live in these same tables (``run.kind`` tells them apart), so every
query and view works on all of them. Times are integer nanoseconds (``ts``, ``dur``) on one
clock per run.
"""

from __future__ import annotations

from prism_trace.store.declaration import Table, col

__all__ = ["GRAPH_TABLES", "RANK", "RUN_ID", "RUN_KINDS", "TABLES", "table"]

RUN_KINDS = ("recorded", "sliced", "emulated", "replayed")
"""The values of ``run.kind``."""

RUN_ID = col("run_id", "INTEGER", "The run this row belongs to.", "run.run_id", null=False)
RANK = col("rank", "INTEGER", "Global rank in the run's world.", "rank.rank", null=False)

TABLES: tuple[Table, ...] = (
    Table(
        "meta",
        "Store-wide facts: `schema_version`, the prism-trace version that created the file, and"
        " `last_run_id` (run ids are never reused).",
        (
            col("key", "VARCHAR", "Name of the fact.", null=False),
            col("value", "VARCHAR", "Its value."),
        ),
        ("key",),
    ),
    Table(
        "run",
        "One job: the recorded ranks of a real run, or a sliced, emulated or replayed derivative.",
        (
            col("run_id", "INTEGER", "Minted id, stable within the store.", null=False),
            col("name", "VARCHAR", "User-given name, unique in the store.", null=False),
            col("kind", "VARCHAR", "recorded | sliced | emulated | replayed.", null=False),
            col("parent_run_id", "INTEGER", "The run this one was derived from.", "run.run_id"),
            col("world_size", "INTEGER", "Ranks in the job's world (not only those stored)."),
            col("source_format", "VARCHAR", "kineto | host_et | chakra | op_timeline | mixed."),
            col("created_at", "TIMESTAMP", "When the run was written."),
            col("config_json", "JSON", "The resolved configuration that produced the run."),
        ),
        ("run_id",),
    ),
    Table(
        "rank",
        "One rank of a run, with where it came from and its parallel role.",
        (
            RUN_ID,
            col("rank", "INTEGER", "Global rank.", null=False),
            col("backend", "VARCHAR", "Communication backend (nccl, gloo, ...)."),
            col("hostname", "VARCHAR", "Host name, when the trace says."),
            col("pid", "BIGINT", "OS process id of the rank's main process."),
            col("device", "VARCHAR", "Device model, e.g. `NVIDIA A100-PG509-200` or `cpu`."),
            col("class_id", "INTEGER", "Equivalence class (sliced runs); NULL when recorded."),
            col("represented_by", "INTEGER", "Recorded rank whose timing this rank replays."),
            col("tp", "INTEGER", "Tensor-parallel coordinate."),
            col("cp", "INTEGER", "Context-parallel coordinate."),
            col("ep", "INTEGER", "Expert-parallel coordinate."),
            col("dp", "INTEGER", "Data-parallel coordinate."),
            col("pp", "INTEGER", "Pipeline stage."),
            col("et_ops", "BIGINT", "Host ET ops ingested for this rank (NULL without host ET)."),
            col("et_ops_linked", "BIGINT", "Host ET ops linked to a Kineto event."),
            col("args", "JSON", "Other per-rank facts (trace header, device properties)."),
        ),
        ("run_id", "rank"),
    ),
    Table(
        "source_file",
        "A file ingested into a run; its fingerprint makes re-ingesting the same file detectable.",
        (
            RUN_ID,
            col("rank", "INTEGER", "Rank the file described; NULL for multi-rank files."),
            col("path", "VARCHAR", "Absolute path at ingest time.", null=False),
            col("format", "VARCHAR", "Detected format.", null=False),
            col("size_bytes", "BIGINT", "File size on disk."),
            col(
                "fingerprint",
                "VARCHAR",
                "sha256 of the size, first and last 4 MiB: tells a re-ingested file cheaply.",
            ),
            col("ingested_at", "TIMESTAMP", "When it was ingested."),
        ),
    ),
    Table(
        "comm_group",
        "A communicator (process group) of a run, with its member ranks.",
        (
            RUN_ID,
            col("group_id", "INTEGER", "Minted id within the run.", null=False),
            col("name", "VARCHAR", "Process-group name as the framework gives it (`0`, `1`, ...)."),
            col("description", "VARCHAR", "Description, e.g. `default_pg`, `tp`, `dp`, `pp`."),
            col("backend", "VARCHAR", "Backend of the group."),
            col("size", "INTEGER", "Number of member ranks."),
            col("ranks", "INTEGER[]", "Global ranks of the members, in group-rank order."),
            col(
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
            col("track_id", "INTEGER", "Minted id within the rank.", null=False),
            col("kind", "VARCHAR", "thread | stream.", null=False),
            col("pid", "VARCHAR", "Trace pid (process id, or device index for streams)."),
            col(
                "tid",
                "BIGINT",
                "OS thread id, or the device stream id (args.stream where tid is text).",
            ),
            col("name", "VARCHAR", "Thread or stream name when the trace gives one."),
        ),
        ("run_id", "rank", "track_id"),
    ),
    Table(
        "event",
        "A timed slice on a track: host op, annotation, runtime call, kernel, memcpy or memset.",
        (
            RUN_ID,
            RANK,
            col("event_id", "BIGINT", "Minted id within the rank.", null=False),
            col("track_id", "INTEGER", "Lane the event ran on.", "track.track_id"),
            col(
                "category",
                "VARCHAR",
                "cpu_op | user_annotation | python_function | cuda_runtime | cuda_driver |"
                " kernel | memcpy | memset | gpu_user_annotation | cuda_sync | compute | comm |"
                " instant | other. Device ops and runtime calls of every backend (HIP, MTIA, XPU..."
                " as kernel/memcpy/memset and cuda_runtime/cuda_driver: formats.device).",
                null=False,
            ),
            col("name", "VARCHAR", "Op, kernel or annotation name.", null=False),
            col("ts", "BIGINT", "Start, ns on the run clock (NULL for untimed Chakra nodes)."),
            col("dur", "BIGINT", "Duration, ns."),
            col("correlation", "BIGINT", "CUDA correlation id joining a launch to its kernel."),
            col("external_id", "BIGINT", "Kineto `External id` joining ops to their launches."),
            col("rf_id", "BIGINT", "Kineto `Record function id` (host ET `rf_id`)."),
            col("parent_id", "BIGINT", "Enclosing event on the same track.", "event.event_id"),
            col("depth", "INTEGER", "Nesting depth on the track, 0 at the top."),
            col("iteration", "INTEGER", "Training step of the event.", "iteration.iteration"),
            col("args", "JSON", "Remaining trace args, verbatim."),
        ),
        ("run_id", "rank", "event_id"),
    ),
    Table(
        "collective",
        "One collective call on one rank; (run_id, group_id, seq) names the instance across ranks.",
        (
            RUN_ID,
            RANK,
            col("event_id", "BIGINT", "Host op of the call.", "event.event_id"),
            col("group_id", "INTEGER", "Communicator.", "comm_group.group_id", null=False),
            col("seq", "BIGINT", "0-based number of the call within its group.", null=False),
            col(
                "kind",
                "VARCHAR",
                "all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | reduce |"
                " gather | scatter | barrier.",
                null=False,
            ),
            col("dtype", "VARCHAR", "Element type, lower case (`float`, `bfloat16`, ...)."),
            col("in_bytes", "BIGINT", "Bytes of this rank's input buffer."),
            col("out_bytes", "BIGINT", "Bytes of this rank's output buffer."),
            col("msg_bytes", "BIGINT", "Size in nccl-tests convention: max(in_bytes, out_bytes)."),
            col("group_size", "INTEGER", "Participants the call expects."),
            col("host_ts", "BIGINT", "Start of the host op, ns."),
            col("host_dur", "BIGINT", "Duration of the host op, ns."),
            col("kernel_event_id", "BIGINT", "Device kernel that executed it.", "event.event_id"),
            col("kernel_ts", "BIGINT", "Kernel start, ns (NULL on CPU backends)."),
            col("kernel_dur", "BIGINT", "Kernel duration, ns."),
            col("iteration", "INTEGER", "Training step.", "iteration.iteration"),
        ),
        ("run_id", "rank", "group_id", "seq"),
    ),
    Table(
        "p2p",
        "One point-to-point send or receive on one rank.",
        (
            RUN_ID,
            RANK,
            col("event_id", "BIGINT", "Host op of the call.", "event.event_id"),
            col("group_id", "INTEGER", "Communicator.", "comm_group.group_id"),
            col("seq", "BIGINT", "0-based sequence number within (rank, peer, direction)."),
            col("direction", "VARCHAR", "send | recv.", null=False),
            col(
                "peer",
                "INTEGER",
                "Global rank of the other side (NULL when the trace does not say).",
            ),
            col("bytes", "BIGINT", "Message size."),
            col("tag", "INTEGER", "Message tag."),
            col("dtype", "VARCHAR", "Element type."),
            col("host_ts", "BIGINT", "Start of the host op, ns."),
            col("host_dur", "BIGINT", "Duration of the host op, ns."),
            col("kernel_event_id", "BIGINT", "Device kernel that executed it.", "event.event_id"),
            col("kernel_ts", "BIGINT", "Kernel start, ns."),
            col("kernel_dur", "BIGINT", "Kernel duration, ns."),
            col("iteration", "INTEGER", "Training step.", "iteration.iteration"),
        ),
    ),
    Table(
        "memory",
        "An allocator event: bytes allocated (+) or freed (-) and the totals after it.",
        (
            RUN_ID,
            RANK,
            col("ts", "BIGINT", "When, ns.", null=False),
            col("device_type", "VARCHAR", "cpu | cuda | ..."),
            col("device_id", "INTEGER", "Device index (-1 for host)."),
            col("addr", "BIGINT", "Address of the block."),
            col("bytes", "BIGINT", "Delta: positive on allocation, negative on free.", null=False),
            col("total_allocated", "BIGINT", "Allocated bytes after the event."),
            col("total_reserved", "BIGINT", "Reserved bytes after the event."),
            col("iteration", "INTEGER", "Training step.", "iteration.iteration"),
            col(
                "inferred",
                "BOOLEAN",
                "True: a free the trace did not record, inferred at ingest (a block allocated"
                " again at a live address, or never freed and of a size the rank loses unseen;"
                " formats/unseen_frees.py); `total_allocated` is lowered by it from there on."
                " False: recorded. NULL: the writer does not say (replayed runs).",
            ),
        ),
    ),
    Table(
        "flow",
        "A dependency between two events of one rank: launch, fwd-bwd, data or control.",
        (
            RUN_ID,
            RANK,
            col("kind", "VARCHAR", "launch | fwdbwd | data | ctrl | sync.", null=False),
            col("src_event_id", "BIGINT", "Event that must happen first.", "event.event_id"),
            col("dst_event_id", "BIGINT", "Event that depends on it.", "event.event_id"),
            col("flow_id", "BIGINT", "Id of the flow in the trace (Kineto `id`)."),
        ),
    ),
    Table(
        "iteration",
        "One training step on one rank.",
        (
            RUN_ID,
            RANK,
            col(
                "iteration",
                "INTEGER",
                "Step number as the trace gives it; -2: the whole trace of a recording without"
                " steps (an emulated run's one window per rank).",
                null=False,
            ),
            col("ts", "BIGINT", "Start, ns.", null=False),
            col("dur", "BIGINT", "Duration, ns.", null=False),
            col("name", "VARCHAR", "The marking annotation, e.g. `ProfilerStep#10`."),
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
            col("iteration", "INTEGER", "Training step.", "iteration.iteration", null=False),
            col("comm_calls", "INTEGER", "Communication calls (collectives, sends, receives)."),
            col("wait_ns", "BIGINT", "Summed over its calls: last arrival minus its arrival, ns."),
            col(
                "late_ns",
                "BIGINT",
                "Summed over its calls: its arrival minus the first arrival (arrival skew), ns.",
            ),
            col(
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
            col("node_id", "BIGINT", "ET node id.", null=False),
            col("parent_node_id", "BIGINT", "ET parent node.", "et_op.node_id"),
            col("name", "VARCHAR", "Op name.", null=False),
            col("op_schema", "VARCHAR", "ATen schema string."),
            col("tid", "BIGINT", "ET thread id."),
            col("rf_id", "BIGINT", "Record-function id, joins `event.rf_id`."),
            col("seq_id", "BIGINT", "Autograd sequence number."),
            col("scope", "INTEGER", "RecordScope (0 function, 7 user scope, ...)."),
            col("fw_parent", "BIGINT", "Forward parent of a backward op."),
            col("inputs", "JSON", "Input values: tensor refs, scalars, lists."),
            col("input_shapes", "JSON", "Input shapes."),
            col("input_types", "JSON", "Input types."),
            col("outputs", "JSON", "Output values."),
            col("output_shapes", "JSON", "Output shapes."),
            col("output_types", "JSON", "Output types."),
            col("attrs", "JSON", "Other node attributes (schema >= 1.1)."),
            col("event_id", "BIGINT", "Linked Kineto event, NULL if unlinked.", "event.event_id"),
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
            col("rank", "INTEGER", "Rank (or class exemplar rank in a sliced run).", null=False),
            col("node_id", "BIGINT", "Minted id within the rank.", null=False),
            col(
                "kind",
                "VARCHAR",
                "host | kernel | memcpy | memset | collective | send | recv.",
                null=False,
            ),
            col("track_id", "INTEGER", "Thread or stream the node runs on.", "track.track_id"),
            col(
                "event_id", "BIGINT", "Source event (of `source_run_id`'s rank).", "event.event_id"
            ),
            col("name", "VARCHAR", "Op, kernel or collective name."),
            col("ts", "BIGINT", "Recorded start, ns (NULL when the source has no times)."),
            col("dur", "BIGINT", "Recorded duration, ns; for communication it includes waiting."),
            col("iteration", "INTEGER", "Training step.", "iteration.iteration"),
            col(
                "group_id",
                "INTEGER",
                "Communicator of a collective/send/recv.",
                "comm_group.group_id",
            ),
            col("seq", "BIGINT", "Sequence number within the group (collective) or pair (p2p)."),
            col("peer", "INTEGER", "Other side of a send/recv (global rank)."),
            col("msg_bytes", "BIGINT", "Message size (rescaled in sliced runs)."),
            col("comm_kind", "VARCHAR", "Collective kind (all_reduce, ...) of a collective node."),
        ),
        ("run_id", "rank", "node_id"),
    ),
    Table(
        "graph_edge",
        "A dependency inside one rank's graph: `dst` may start `delay` ns after `src`'s `anchor`"
        " (its start or its end); a `sync` edge instead holds back the *end* of `dst`.",
        (
            RUN_ID,
            col("rank", "INTEGER", "Rank (or class exemplar rank).", null=False),
            col("src", "BIGINT", "Node that comes first.", "graph_node.node_id", null=False),
            col("dst", "BIGINT", "Node that depends on it.", "graph_node.node_id", null=False),
            col(
                "kind",
                "VARCHAR",
                "program (host order, delay = recorded gap) | launch (host op → kernel) |"
                " stream (device order) | wait (cross-stream event wait) | sync (device → host"
                " synchronize) | comm (collective host op → its kernel) | data | ctrl (Chakra).",
                null=False,
            ),
            col("anchor", "VARCHAR", "start | end: which instant of `src` the delay counts from."),
            col("delay", "BIGINT", "ns after the anchor before `dst` may start (>= 0)."),
        ),
    ),
)

TABLES = TABLES + GRAPH_TABLES


def table(name: str) -> Table:
    """Look a declared table up by name."""
    for t in TABLES:
        if t.name == name:
            return t
    msg = f"no table named {name!r}"
    raise KeyError(msg)

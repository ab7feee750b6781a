"""The emulator's I/O shell: a run's graph in the store → ``replay.emulator`` → an emulated run.

``emulate_run`` reads the execution graph of a recorded or sliced run, resolves its communication
instances (collectives by ``(group, seq)``, sends with their receives), takes each instance's
transfer time from the recording (``replay.timing``), runs the core once per *unit* (a recorded
rank, or a class exemplar of a sliced run) and writes a run of kind ``emulated`` in the same
schema: ``rank`` (every rank of the world, with ``class_id``), ``comm_group``, ``track``, ``event``,
``collective``/``p2p`` and ``memory`` (units only; memory re-timed by ``replay.memory``),
``iteration`` (every rank). See docs/emulator.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import polars as pl
from prism_trace.replay.emulator import (
    CommInstances,
    EmulatorGraph,
    Timeline,
    collective_instances,
    emulate,
    p2p_instances,
)
from prism_trace.replay.memory import (
    MEMORY_COLUMNS,
    memory_peaks,
    optimizer_shard_delta,
    retime_memory,
)
from prism_trace.replay.rank_step import rank_step_rows, rank_steps
from prism_trace.replay.timing import (
    TimingConfig,
    TransferQuery,
    recorded_completion,
    transfer_model,
)
from prism_trace.replay.topology import Topology
from prism_trace.replay.typical import typical_durations, typical_transfers
from prism_trace.replay.vector import (
    Replicas,
    ReplicaTimeline,
    class_groups,
    emulate_replicas,
    kineto_iterations,
    replica_durations,
    replica_grid,
    scale_replicas,
    shared_instances,
    vector_eligible,
)
from prism_trace.replay.whatif import (
    SlowDown,
    WhatIfConfig,
    WhatIfError,
    expand_replicas,
    resample_durations,
    slow_factors,
    spans_dp,
)

from prism_trace.errors import PrismError
from prism_trace.store_write import append, claim_run_name, drop_run, new_run

if TYPE_CHECKING:
    import duckdb

    from prism_trace.parallel import ParallelLayout
    from prism_trace.store import Store

__all__ = ["EmulationConfig", "EmulationReport", "MemoryConfig", "ReplayConfig", "emulate_run"]

_COMM = ("collective", "send", "recv")
_DEFAULT_CATEGORY = {
    "host": "cpu_op",
    "kernel": "kernel",
    "memcpy": "memcpy",
    "memset": "memset",
    "collective": "comm",
    "send": "comm",
    "recv": "comm",
}


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """The ``replay`` section of ``EmulationConfig``.

    Attributes:
        allow_partial: resolve a communication instance over the participants present instead of
            raising ``MissingParticipantError`` (for partial recordings; the result then ignores
            the absent ranks).
        completion: ``per_rank`` (each participant completes at last arrival + transfer + its
            recorded completion skew: exact replay of collectives whose ranks leave at different
            times, e.g. gloo) or ``common`` (all complete at last arrival + transfer).
    """

    allow_partial: bool = False
    completion: Literal["per_rank", "common"] = "per_rank"


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """The ``memory`` section of ``EmulationConfig`` (see ``replay.memory``).

    Attributes:
        optimizer_state_bytes: distributed-optimizer state each rank held at the recorded DP
            degree, for re-sizing its shard in a sliced run with another DP degree; None takes
            ``optimizer_state_bytes`` from the represented rank's ``rank.args`` (absent: 0, no
            change).
    """

    optimizer_state_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class EmulationConfig:
    """Everything that shapes an emulation; stored resolved in ``run.config_json``.

    Attributes:
        replay: how the graph is replayed (``ReplayConfig``).
        timing: the transfer-time model (``replay.timing.TimingConfig``).
        topology: the network (``replay.topology.Topology``), used by modelled transfers.
        memory: the memory replay (``MemoryConfig``).
        what_if: departures from the recording (``replay.whatif.WhatIfConfig``).
        seed: seed of the random models (the variance mode).
        keep_events: ranks whose own per-op events are written besides the class exemplars'
            (a class member otherwise shares its exemplar's events: ``rank.class_id``).
    """

    replay: ReplayConfig = field(default_factory=ReplayConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    topology: Topology = field(default_factory=Topology)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    what_if: WhatIfConfig = field(default_factory=WhatIfConfig)
    seed: int = 0
    keep_events: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EmulationConfig:
        """Build from a parsed TOML/JSON mapping with the same sections.

        Args:
            data: ``{"replay": {...}, "timing": {...}, "topology": {...}, "memory": {...},
                "what_if": {...}, "seed": 0}``.

        Returns:
            The config (unknown keys raise ``TypeError``).
        """
        return cls(
            replay=ReplayConfig(**data.get("replay", {})),
            timing=TimingConfig(**data.get("timing", {})),
            topology=Topology(**data.get("topology", {})),
            memory=MemoryConfig(**data.get("memory", {})),
            what_if=WhatIfConfig(**data.get("what_if", {})),
            seed=int(data.get("seed", 0)),
            keep_events=tuple(int(r) for r in data.get("keep_events", ())),
        )


@dataclass
class EmulationReport:
    """What ``emulate_run`` did."""

    run: str
    run_id: int
    input_run: str
    input_run_id: int
    input_kind: str
    world_size: int
    units: int
    nodes: int
    edges: int
    collective_instances: int
    p2p_instances: int
    rounds: int
    events_written: int
    iteration_rows: int
    represented_events: int
    rank_step_rows: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    iterations: list[dict[str, Any]] = field(default_factory=list)
    peak_memory: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def events_per_s(self) -> float:
        """Events of the full world (nodes x class members) per second of emulation."""
        t = self.seconds.get("emulate", 0.0)
        return self.represented_events / t if t > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "run": self.run,
            "run_id": self.run_id,
            "input_run": self.input_run,
            "input_run_id": self.input_run_id,
            "input_kind": self.input_kind,
            "world_size": self.world_size,
            "units": self.units,
            "nodes": self.nodes,
            "edges": self.edges,
            "collective_instances": self.collective_instances,
            "p2p_instances": self.p2p_instances,
            "rounds": self.rounds,
            "events_written": self.events_written,
            "iteration_rows": self.iteration_rows,
            "rank_step_rows": self.rank_step_rows,
            "represented_events": self.represented_events,
            "events_per_s": round(self.events_per_s, 1),
            "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
            "iterations": self.iterations,
            "peak_memory": {str(k): v for k, v in sorted(self.peak_memory.items())},
            "notes": self.notes,
        }

    def summary(self) -> str:
        """A few lines for the CLI."""
        lines = [
            f"emulated run {self.run!r} (id {self.run_id}) from {self.input_kind} run"
            f" {self.input_run!r}: {self.world_size} ranks as {self.units} units,"
            f" {self.nodes} nodes, {self.collective_instances} collectives,"
            f" {self.p2p_instances} send/recv pairs",
            f"  {self.seconds.get('total', 0.0):.2f} s (load {self.seconds.get('load', 0.0):.2f},"
            f" emulate {self.seconds.get('emulate', 0.0):.3f}, write"
            f" {self.seconds.get('write', 0.0):.2f}); {self.events_per_s:,.0f} events/s",
        ]
        for it in self.iterations[:10]:
            lines.append(
                f"  iteration {it['iteration']}: mean {it['mean_ns'] / 1e6:.3f} ms,"
                f" max {it['max_ns'] / 1e6:.3f} ms over {it['ranks']} ranks"
            )
        if len(self.iterations) > 10:
            lines.append(f"  ... {len(self.iterations) - 10} more iterations")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- loading -------------------------------------------------------------------------------------


@dataclass
class _Inputs:
    """A run's graph and everything the core needs, as frames and arrays."""

    run: str
    run_id: int
    kind: str
    source_run_id: int
    world_size: int
    source_format: str | None
    unit_rank: np.ndarray  # rank (exemplar) of each unit
    unit_source: np.ndarray  # recorded rank whose events/iterations each unit replays
    rank_unit: pl.DataFrame  # rank, unit (every rank of the world that maps to a unit)
    nodes: pl.DataFrame  # sorted by (rank, node_id); + unit, idx, category
    edges: pl.DataFrame  # + s, d (node indices)
    origin: int
    notes: list[str] = field(default_factory=list)
    # What-ifs (replay.whatif): ranks left out of the results, with why, and group sizes that
    # differ from the communicator's for the transfer model.
    left_out: dict[int, str] = field(default_factory=dict)
    size_override: dict[int, int] = field(default_factory=dict)
    parent_run_id: int | None = None  # the dp what-if: the run the user named, not the re-slice
    # no-stragglers: nodes that keep their recorded time (a slowdown group, replay.slowdown)
    keep_recorded: np.ndarray | None = None
    # replicas distinct on the class graph (replay.vector): the data-parallel replicas as
    # columns; None: one unit per class, or expanded units
    grid: Replicas | None = None
    # remove-gpu on the replica vector: the failed replica's column, its tp groups' sizes (class
    # graph group ids) and the factor on its compute and transfers (replay.vector.class_groups)
    failed_column: tuple[int, dict[int, int], float] | None = None


def _fetch(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> pl.DataFrame:
    return con.sql(sql, params=params).pl()


def _node_index(nodes: pl.DataFrame, unit_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted keys of ``(unit, node_id)`` for looking nodes up, and each node's unit."""
    unit = np.searchsorted(unit_rank, nodes["rank"].to_numpy()).astype(np.int64)
    keys = (unit << 32) | nodes["node_id"].to_numpy().astype(np.int64)
    return keys, unit


def _lookup(keys: np.ndarray, unit: np.ndarray, node_id: np.ndarray, what: str) -> np.ndarray:
    want = (unit.astype(np.int64) << 32) | node_id.astype(np.int64)
    pos = np.searchsorted(keys, want)
    pos = np.minimum(pos, max(keys.size - 1, 0))
    bad = keys[pos] != want if keys.size else np.ones(want.size, dtype=bool)
    if bad.any():
        i = int(np.argmax(bad))
        msg = f"graph_edge: {what} node {int(node_id[i])} does not exist (unit {int(unit[i])})"
        raise PrismError(msg)
    return pos


def _load(store: Store, run_id: int, *, name: str) -> _Inputs:
    con = store.con
    ((kind, parent, world, fmt),) = con.execute(
        "SELECT kind, parent_run_id, world_size, source_format FROM run WHERE run_id = ?", [run_id]
    ).fetchall()
    if kind not in ("recorded", "sliced"):
        msg = (
            f"{store.path}: run {name!r} is {kind}; only a recorded or sliced run has a graph"
            " to emulate"
        )
        raise PrismError(msg)
    source = int(parent) if kind == "sliced" else run_id
    nodes = _fetch(
        con,
        "SELECT n.rank, n.node_id, n.kind, n.track_id, n.event_id, n.name, n.ts, n.dur,"
        " n.iteration, n.group_id, n.seq, n.peer, n.msg_bytes, n.comm_kind,"
        " coalesce(r.represented_by, n.rank) AS source_rank, ev.category"
        " FROM graph_node n"
        " LEFT JOIN rank r ON r.run_id = n.run_id AND r.rank = n.rank"
        " LEFT JOIN event ev ON ev.run_id = $2 AND ev.rank = coalesce(r.represented_by, n.rank)"
        " AND ev.event_id = n.event_id"
        " WHERE n.run_id = $1 ORDER BY n.rank, n.node_id",
        [run_id, source],
    )
    if nodes.is_empty():
        msg = f"{store.path}: run {name!r} has no graph (run `prism graph` or slice it first)"
        raise PrismError(msg)
    edges = _fetch(
        con,
        "SELECT rank, src, dst, kind, anchor, delay FROM graph_edge WHERE run_id = $1",
        [run_id],
    )
    ranks = _fetch(
        con,
        "SELECT rank, coalesce(class_id, rank) AS cls FROM rank WHERE run_id = $1 ORDER BY rank",
        [run_id],
    )
    unit_rank = np.unique(nodes["rank"].to_numpy()).astype(np.int64)
    src_of = nodes.group_by("rank").agg(pl.col("source_rank").first()).sort("rank")
    unit_source = src_of["source_rank"].to_numpy().astype(np.int64)

    keys, unit = _node_index(nodes, unit_rank)
    nodes = nodes.with_columns(
        pl.Series("unit", unit),
        pl.Series("idx", np.arange(nodes.height, dtype=np.int64)),
        pl.col("category").fill_null(
            pl.col("kind").replace_strict(_DEFAULT_CATEGORY, default="other")
        ),
    )
    e_unit = np.searchsorted(unit_rank, edges["rank"].to_numpy()).astype(np.int64)
    s = _lookup(keys, e_unit, edges["src"].to_numpy(), "source")
    d = _lookup(keys, e_unit, edges["dst"].to_numpy(), "destination")
    edges = edges.with_columns(pl.Series("s", s), pl.Series("d", d))

    cls = ranks["cls"].to_numpy().astype(np.int64)
    pos = np.minimum(np.searchsorted(unit_rank, cls), unit_rank.size - 1)
    r_unit = np.where(unit_rank[pos] == cls, pos, -1)
    rank_unit = pl.DataFrame(
        {"rank": ranks["rank"].to_numpy().astype(np.int64), "unit": r_unit.astype(np.int64)}
    )
    notes: list[str] = []
    if kind == "recorded":
        rank_unit, notes = _with_symmetric_peers(store, name, rank_unit)
    ts = nodes["ts"]
    origin = int(ts.min()) if ts.null_count() < ts.len() else 0  # type: ignore[arg-type]
    return _Inputs(
        run=name,
        run_id=run_id,
        kind=str(kind),
        source_run_id=source,
        world_size=int(world) if world else int(ranks.height),
        source_format=fmt,
        unit_rank=unit_rank,
        unit_source=unit_source,
        rank_unit=rank_unit,
        nodes=nodes,
        edges=edges,
        origin=origin,
        notes=notes,
    )


def _with_symmetric_peers(
    store: Store, name: str, rank_unit: pl.DataFrame
) -> tuple[pl.DataFrame, list[str]]:
    """``rank_unit`` plus the unrecorded TP/CP peers of recorded ranks, each on its partner's
    unit (``prism_trace.symmetry``): a recording of one rank per TP/CP group is complete."""
    from prism_trace.parallel import infer_layout
    from prism_trace.symmetry import symmetric_partners

    try:
        layout = infer_layout(store, name)
    except PrismError:
        return rank_unit, []
    copies, partners = symmetric_partners(layout, rank_unit["rank"].to_numpy())
    if copies.size == 0:
        return rank_unit, []
    unit = _rank_lookup(rank_unit, partners)
    extra = pl.DataFrame({"rank": copies, "unit": unit}).filter(pl.col("unit") >= 0)
    note = (
        f"{extra.height} unrecorded ranks run as copies of their recorded TP/CP peer"
        f" (layout {layout.spec})"
    )
    return pl.concat([rank_unit, extra]).sort("rank"), [note]


def _sync_frame(nodes: pl.DataFrame, edges: pl.DataFrame) -> pl.DataFrame:
    """One row per communication node: the node where it synchronises and what it carries.

    A communication host node with a ``comm`` edge to a device kernel synchronises at that kernel
    (the host op only launches it); otherwise the host node itself is the sync node.
    """
    comm = nodes.filter(pl.col("kind").is_in(_COMM))
    kern = (
        edges.filter(pl.col("kind") == "comm")
        .group_by("s")
        .agg(pl.col("d").min().alias("kernel_idx"))
    )
    return comm.join(kern, left_on="idx", right_on="s", how="left").with_columns(
        pl.col("idx").alias("host_idx"),
        pl.coalesce("kernel_idx", "idx").alias("sync_idx"),
    )


def _rank_lookup(rank_unit: pl.DataFrame, ranks: np.ndarray) -> np.ndarray:
    """Unit of each rank (-1 when the rank is not in the run or has no unit)."""
    r = rank_unit["rank"].to_numpy()
    u = rank_unit["unit"].to_numpy()
    ranks = np.asarray(ranks, dtype=np.int64)
    if r.size == 0:
        return np.full(ranks.size, -1, dtype=np.int64)
    pos = np.minimum(np.searchsorted(r, ranks), r.size - 1)
    return np.where(r[pos] == ranks, u[pos], -1).astype(np.int64)


def _recorded_transfers(store: Store, inputs: _Inputs) -> pl.DataFrame:
    """Per sync node of the *source* run: its instance's recorded transfer and its skew.

    Returns ``source_rank, node_id, transfer, skew`` for every communication node of every
    recorded rank of the source run (the parent for a sliced run): the last arriver's duration,
    and how much later than the last arriver this node completed (``replay.timing``).
    """
    if inputs.kind == "recorded":
        nodes, edges = inputs.nodes, inputs.edges
    else:
        src = _load(store, inputs.source_run_id, name=f"parent of {inputs.run}")
        nodes, edges = src.nodes, src.edges
    sync = _sync_frame(nodes, edges)
    if sync.is_empty():
        return pl.DataFrame(
            schema={
                "source_rank": pl.Int64,
                "node_id": pl.Int64,
                "transfer": pl.Int64,
                "skew": pl.Int64,
                "rec_size": pl.Int64,
                "rec_lo": pl.Int64,
                "rec_hi": pl.Int64,
                "rec_bytes": pl.Int64,
            }
        )
    k_ts = nodes["ts"].fill_null(0).to_numpy()
    k_dur = nodes["dur"].fill_null(0).to_numpy()
    sidx = sync["sync_idx"].to_numpy()
    start, dur = k_ts[sidx], k_dur[sidx]
    rank = sync["rank"].to_numpy().astype(np.int64)
    group = sync["group_id"].fill_null(-1).to_numpy().astype(np.int64)
    seq = sync["seq"].fill_null(-1).to_numpy().astype(np.int64)
    peer = sync["peer"].fill_null(-1).to_numpy().astype(np.int64)
    is_coll = (sync["kind"] == "collective").to_numpy()
    is_send = (sync["kind"] == "send").to_numpy()
    inst = np.zeros(sync.height, dtype=np.int64)
    c = np.flatnonzero(is_coll & (group >= 0))
    ci, nc = collective_instances(
        c, rank[c], group[c], seq[c], expected={}, unit_rank=rank, allow_partial=True
    )
    inst[c] = ci
    p = np.flatnonzero(~is_coll)
    pi, npp = p2p_instances(
        p,
        rank[p],
        peer[p],
        is_send[p],
        group[p],
        seq[p],
        unit_rank=rank,
        peer_rank=peer[p],
        allow_partial=True,
    )
    inst[p] = pi + nc
    lone = np.flatnonzero(is_coll & (group < 0))  # no communicator: its own instance
    inst[lone] = nc + npp + np.arange(lone.size)
    n_inst = nc + npp + lone.size
    transfer, skew = recorded_completion(inst, start, dur, n_inst)
    # The recorded shape of each node's instance (group size, member range), for the transfer
    # model's ratio at a changed scale; a send/recv is a group of its two ranks.
    src_id = inputs.run_id if inputs.kind == "recorded" else inputs.source_run_id
    groups = _groups(store, src_id, sorted({int(g) for g in group[group >= 0]})).select(
        pl.col("group_id").cast(pl.Int64),
        pl.col("size").cast(pl.Int64).alias("g_size"),
        pl.col("ranks").list.min().cast(pl.Int64).alias("g_lo"),
        pl.col("ranks").list.max().cast(pl.Int64).alias("g_hi"),
    )
    peer_or_self = np.where(peer >= 0, peer, rank)
    shape = (
        pl.DataFrame({"group_id": group, "is_coll": is_coll})
        .join(groups, on="group_id", how="left", maintain_order="left")
        .select(
            pl.when(pl.col("is_coll")).then(pl.col("g_size").fill_null(2)).otherwise(2),
            pl.when(pl.col("is_coll"))
            .then(pl.col("g_lo"))
            .fill_null(pl.Series(np.minimum(rank, peer_or_self))),
            pl.when(pl.col("is_coll"))
            .then(pl.col("g_hi"))
            .fill_null(pl.Series(np.maximum(rank, peer_or_self))),
        )
    )
    rec_size, rec_lo, rec_hi = (shape.to_series(i).to_numpy() for i in range(3))
    return pl.DataFrame(
        {
            "source_rank": rank,
            "node_id": sync["node_id"].to_numpy().astype(np.int64),
            "transfer": transfer[inst],
            "skew": skew,
            "rec_size": rec_size,
            "rec_lo": rec_lo.astype(np.int64),
            "rec_hi": rec_hi.astype(np.int64),
            "rec_bytes": sync["msg_bytes"].fill_null(-1).to_numpy().astype(np.int64),
        }
    )


# -- emulating -----------------------------------------------------------------------------------


@dataclass
class _Result:
    inputs: _Inputs
    timeline: Timeline
    sync: pl.DataFrame  # sync frame + instance, unit
    n_collective: int
    n_p2p: int
    seconds: float
    memory: pl.DataFrame | None = None  # unit + replay.memory.MEMORY_COLUMNS less rank
    replicas: ReplicaTimeline | None = None  # every replica's times (inputs.grid set)
    shared: np.ndarray | None = None  # per instance: spans the replicas (inputs.grid set)


def _groups(store: Store, run_id: int, group_ids: list[int]) -> pl.DataFrame:
    return _fetch(
        store.con,
        "SELECT group_id, size, ranks, axis FROM comm_group"
        " WHERE run_id = $1 AND list_contains($2, group_id)",
        [run_id, group_ids],
    )


def _emulate(store: Store, inputs: _Inputs, config: EmulationConfig) -> _Result:
    nodes, edges = inputs.nodes, inputs.edges
    sync = _sync_frame(nodes, edges)
    rec = _recorded_transfers(store, inputs)
    sync = sync.with_columns(pl.col("source_rank").cast(pl.Int64)).join(
        rec, on=["source_rank", "node_id"], how="left"
    )
    lone_notes = sync.filter((pl.col("kind") == "collective") & pl.col("group_id").is_null()).height
    if lone_notes:
        inputs.notes.append(
            f"{lone_notes} collective nodes without a communicator run alone (recorded duration)"
        )
    sync = sync.filter(~((pl.col("kind") == "collective") & pl.col("group_id").is_null()))
    # A send/recv whose peer the trace does not say (a bare `c10d::send`) cannot be paired.
    lone_p2p = sync.filter(pl.col("kind").is_in(["send", "recv"]) & pl.col("peer").is_null())
    if lone_p2p.height:
        inputs.notes.append(
            f"{lone_p2p.height} send/recv nodes without a known peer run alone (recorded duration)"
        )
        sync = sync.filter(~(pl.col("kind").is_in(["send", "recv"]) & pl.col("peer").is_null()))
    untimed = sync.filter(pl.col("transfer").is_null() & pl.col("dur").is_null()).height
    if untimed:
        inputs.notes.append(
            f"{untimed} communication nodes have no recorded duration: transfer 0"
            " (a modelled transfer, timing.model = 'alpha_beta', fills them in)"
        )
    gids = sorted({int(g) for g in sync["group_id"].drop_nulls().to_list()})
    groups = _groups(store, inputs.run_id, gids)
    g_members = {
        int(g): np.asarray(m if m is not None else [], dtype=np.int64)
        for g, m in zip(groups["group_id"].to_list(), groups["ranks"].to_list(), strict=True)
    }
    g_size = dict(zip(groups["group_id"].to_list(), groups["size"].to_list(), strict=True))
    g_axis = dict(zip(groups["group_id"].to_list(), groups["axis"].to_list(), strict=True))
    unit_rank = inputs.unit_rank
    allow = config.replay.allow_partial
    if allow and inputs.kind == "recorded":
        from prism_trace.symmetry import missing_ranks

        present = inputs.rank_unit.filter(pl.col("unit") >= 0)["rank"].to_numpy()
        missing = missing_ranks(inputs.world_size, present, None)
        if missing is not None:
            inputs.notes.append(
                f"partial: {missing}; their collectives complete over the ranks present"
            )

    sidx = sync["sync_idx"].to_numpy().astype(np.int64)
    unit = sync["unit"].to_numpy().astype(np.int64)
    group = sync["group_id"].fill_null(-1).to_numpy().astype(np.int64)
    seq = sync["seq"].fill_null(-1).to_numpy().astype(np.int64)
    is_coll = (sync["kind"] == "collective").to_numpy()
    inst = np.zeros(sync.height, dtype=np.int64)

    c = np.flatnonzero(is_coll)
    expected = {}
    for g in np.unique(group[c]):
        members = g_members.get(int(g))
        if members is None or members.size == 0:
            expected[int(g)] = np.unique(unit[c][group[c] == g])  # no member list: who issues it
        else:
            expected[int(g)] = _rank_lookup(inputs.rank_unit, members)
    ci, nc = collective_instances(
        sidx[c],
        unit[c],
        group[c],
        seq[c],
        expected=expected,
        unit_rank=unit_rank,
        allow_partial=allow,
    )
    inst[c] = ci

    p = np.flatnonzero(~is_coll)
    peer = sync["peer"].fill_null(-1).to_numpy().astype(np.int64)[p]
    peer_unit = np.where(peer >= 0, _rank_lookup(inputs.rank_unit, peer), -1)
    if inputs.kind == "sliced":  # a group of the pair's axis, not the exemplar's own copy
        axes = sorted({str(a) for a in g_axis.values() if a is not None})
        code = {a: i for i, a in enumerate(axes)}
        gkey = np.array(
            [code.get(str(g_axis.get(int(g))), -2 - int(g)) for g in group[p]], dtype=np.int64
        )
    else:
        gkey = group[p]
    pi, npp = p2p_instances(
        sidx[p],
        unit[p],
        peer_unit,
        (sync["kind"] == "send").to_numpy()[p],
        gkey,
        seq[p],
        unit_rank=unit_rank,
        peer_rank=peer,
        allow_partial=allow,
    )
    inst[p] = pi + nc
    n_inst = nc + npp
    sync = sync.with_columns(pl.Series("instance", inst))

    # Per instance: recorded transfer (max over participants), kind, size, group size, span.
    per = (
        sync.with_columns(
            pl.col("transfer").fill_null(pl.col("dur")).fill_null(0),
            pl.col("rank").alias("r"),
        )
        .group_by("instance")
        .agg(
            pl.col("transfer").max(),
            pl.col("comm_kind").first(),
            pl.col("kind").first(),
            pl.col("msg_bytes").max(),
            pl.col("group_id").first(),
            pl.col("r").min().alias("lo"),
            pl.col("r").max().alias("hi"),
            pl.col("peer").min().alias("plo"),
            pl.col("peer").max().alias("phi"),
            pl.col("rec_size").max(),
            pl.col("rec_lo").min(),
            pl.col("rec_hi").max(),
            pl.col("rec_bytes").max(),
        )
        .sort("instance")
    )
    kinds = per["comm_kind"].fill_null(per["kind"]).to_numpy().astype(object)
    size_of = {**g_size, **inputs.size_override}
    gsize = np.array(
        [
            size_of.get(g, 2) if k == "collective" else 2
            for g, k in zip(per["group_id"].to_list(), per["kind"].to_list(), strict=True)
        ],
        dtype=np.int64,
    )
    lo = np.minimum(per["lo"].to_numpy(), per["plo"].fill_null(1 << 40).to_numpy())
    hi = np.maximum(per["hi"].to_numpy(), per["phi"].fill_null(-1).to_numpy())
    # A collective spans its communicator's member range.
    spanned = sorted((g, int(m.min()), int(m.max())) for g, m in g_members.items() if m.size)
    if spanned:
        g_ids, g_lo, g_hi = (np.array(c, dtype=np.int64) for c in zip(*spanned, strict=True))
        per_g = per["group_id"].fill_null(-1).to_numpy().astype(np.int64)
        pos = np.minimum(np.searchsorted(g_ids, per_g), g_ids.size - 1)
        hit = np.flatnonzero(
            (per["kind"] == "collective").to_numpy()
            & per["group_id"].is_not_null().to_numpy()
            & (g_ids[pos] == per_g)
        )
        lo[hit], hi[hit] = g_lo[pos[hit]], g_hi[pos[hit]]
    topology = config.topology
    if config.what_if.bandwidth_scale is not None:
        topology = dataclasses.replace(
            topology, bandwidth_scale=topology.bandwidth_scale * config.what_if.bandwidth_scale
        )
    if config.timing.calibrate:
        from prism_trace.replay.calibrate import calibrate_run

        cal = calibrate_run(store, inputs.source_run_id, base=topology)
        topology = cal.topology
        inputs.notes.extend(cal.notes)
    model = transfer_model(config.timing, topology)
    rec_size = per["rec_size"].fill_null(pl.Series(gsize)).to_numpy().astype(np.int64)
    rec_nodes, _ = topology.group_nodes(
        per["rec_lo"].fill_null(pl.Series(lo)).to_numpy(),
        per["rec_hi"].fill_null(pl.Series(hi)).to_numpy(),
        rec_size,
    )
    msg = per["msg_bytes"].fill_null(-1).to_numpy()

    def transfer_at(sizes: np.ndarray) -> np.ndarray:
        """Each instance's transfer with these group sizes."""
        n_nodes, _ = topology.group_nodes(lo, hi, sizes)
        return model.transfer(
            TransferQuery(
                kind=kinds,
                msg_bytes=msg,
                group_size=sizes,
                spans_nodes=n_nodes > 1,
                recorded_ns=per["transfer"].to_numpy().astype(np.int64),
                n_nodes=n_nodes,
                recorded_group_size=rec_size,
                recorded_msg_bytes=per["rec_bytes"].fill_null(pl.Series(msg)).to_numpy(),
                recorded_n_nodes=rec_nodes,
            )
        )

    transfer = transfer_at(gsize)

    release = nodes["ts"].fill_null(inputs.origin).to_numpy().astype(np.int64) - inputs.origin
    dur = np.maximum(
        nodes["emu_dur" if "emu_dur" in nodes.columns else "dur"]
        .fill_null(0)
        .to_numpy()
        .astype(np.int64),
        0,
    )
    delay = np.maximum(edges["delay"].fill_null(0).to_numpy().astype(np.int64), 0)
    skew = sync["skew"].fill_null(0).to_numpy().astype(np.int64)
    if config.replay.completion == "common":
        skew = np.zeros_like(skew)
    per_part = transfer[inst]
    failed = None
    if inputs.failed_column is not None:  # the failed replica's column: its own transfers
        col, sizes, f = inputs.failed_column
        g_of = per["group_id"].fill_null(-1).to_numpy()
        gs = np.where(
            np.isin(g_of, list(sizes)), [sizes.get(int(g), 0) for g in g_of], gsize
        ).astype(np.int64)
        fac = sync["factor"].fill_null(1.0).to_numpy() if "factor" in sync.columns else 1.0
        failed = col, np.rint(transfer_at(gs)[inst] * (fac * f)).astype(np.int64) + skew
    if "factor" in sync.columns:  # a slow-down of communication ops scales their transfer
        per_part = np.rint(per_part * sync["factor"].fill_null(1.0).to_numpy()).astype(np.int64)
    per_part = per_part + skew
    w = config.what_if
    if w.no_stragglers:  # every op its type's typical time (replay.typical)
        replace = np.ones(nodes.height, dtype=bool)
        if inputs.keep_recorded is not None:
            replace = ~inputs.keep_recorded
        held = np.zeros(nodes.height, dtype=bool)
        held[edges.filter(pl.col("kind") == "sync")["d"].to_numpy()] = True
        dur = typical_durations(nodes["name"], dur, replace, held)
        host = sync["idx"].to_numpy().astype(np.int64)
        # a communication's type: its name and message size (one kernel name serves all sizes)
        kind_key = sync.select(
            pl.concat_str(
                [pl.col("name"), pl.col("msg_bytes").cast(pl.Utf8).fill_null("")], separator="|"
            )
        ).to_series()
        per_part = typical_transfers(kind_key, per_part, replace[host])
    if w.no_launch_delay:  # no own delay: every op starts as soon as its dependencies allow
        delay = np.zeros_like(delay)
        release = np.zeros_like(release)
    elif w.no_stragglers:  # own time before computation stays; communication is posted at once
        to_comm = nodes["kind"].is_in(_COMM).to_numpy()[edges["d"].to_numpy()]
        delay = np.where(to_comm, 0, delay)
        release = np.zeros_like(release)
    graph = EmulatorGraph(
        unit=nodes["unit"].to_numpy(),
        dur=dur,
        release=release,
        src=edges["s"].to_numpy(),
        dst=edges["d"].to_numpy(),
        delay=delay,
        from_end=(edges["anchor"].fill_null("end") != "start").to_numpy(),
        holds_end=(edges["kind"] == "sync").to_numpy(),
    )
    comm = CommInstances(node=sidx, instance=inst, transfer=per_part)
    if n_inst == 0:
        comm = CommInstances.empty()

    def label(v: int) -> str:  # only for error messages: look the node up when asked
        r = nodes.row(int(v), named=True)
        return f"rank {r['rank']} node {r['node_id']} ({r['kind']} {r['name']!r})"

    t = time.perf_counter()
    if inputs.grid is not None:
        t_cols = None
        if failed is not None:
            t_cols = np.repeat(comm.transfer[:, None], inputs.grid.n_columns, axis=1)
            t_cols[:, failed[0]] = failed[1]
        vt, shared = _emulate_replicas(
            inputs, graph, comm, sync, g_axis, config, label, transfer=t_cols
        )
        seconds = time.perf_counter() - t
        timeline = Timeline(vt.start[:, 0], vt.end[:, 0], vt.arrival[:, 0], vt.rounds)
        return _Result(inputs, timeline, sync, nc, npp, seconds, replicas=vt, shared=shared)
    timeline = emulate(graph, comm, label=label)
    seconds = time.perf_counter() - t
    return _Result(inputs, timeline, sync, nc, npp, seconds)


def _emulate_replicas(
    inputs: _Inputs,
    graph: EmulatorGraph,
    comm: CommInstances,
    sync: pl.DataFrame,
    g_axis: dict[int, Any],
    config: EmulationConfig,
    label: Any,
    *,
    transfer: np.ndarray | None = None,
) -> tuple[ReplicaTimeline, np.ndarray]:
    """The class graph once, a column per data-parallel replica (``replay.vector``); also
    which instances span the replicas."""
    assert inputs.grid is not None
    w = config.what_if
    draw = w.variance and not w.no_stragglers  # no-stragglers replaces every op's time anyway
    dur = replica_durations(
        inputs.nodes,
        np.asarray(graph.dur, dtype=np.int64),
        replicas=inputs.grid.n_columns,
        variance=draw,
        seed=config.seed,
        mode=w.variance_mode,
    )
    scale = inputs.nodes["scale"].to_numpy() if "scale" in inputs.nodes.columns else np.ones(1)
    slow = w.slow
    if inputs.failed_column is not None:  # the failed replica computes f times longer
        col, _, f = inputs.failed_column
        ranks = tuple(int(r) for r in inputs.grid.column_grid()[:, col])
        slow = (*slow, SlowDown(factor=f, ranks=ranks))
    scale_replicas(dur, inputs.nodes, np.broadcast_to(scale, dur.shape[:1]), slow, inputs.grid)
    shared = shared_instances(
        comm.instance,
        sync["kind"],
        sync["group_id"].fill_null(-1).to_numpy().astype(np.int64),
        g_axis,
        comm.n_instances,
    )
    vt = emulate_replicas(graph, comm, dur=dur, shared=shared, label=label, transfer=transfer)
    return vt, shared


# -- results as frames ---------------------------------------------------------------------------


def _iteration_frame(res: _Result, rec_iter: pl.DataFrame) -> pl.DataFrame:
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
    nodes = inputs.nodes.select("unit", "iteration", "ts", "dur").with_columns(
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
        "name",
    ).sort("unit", "iteration")


_DEVICE_KINDS = ("kernel", "memcpy", "memset")


def _dp_sizes(store: Store, inputs: _Inputs) -> tuple[int, int]:
    """(recorded, emulated) data-parallel size: equal unless a sliced run changed it."""
    if inputs.kind != "sliced":
        return 1, 1
    rec = _run_layout(store, inputs.run_id, key="recorded_layout")
    tgt = _run_layout(store, inputs.run_id)
    if rec is None or tgt is None:
        return 1, 1
    return int(rec.dp), int(tgt.dp)


def _memory(store: Store, res: _Result, config: EmulationConfig) -> pl.DataFrame:
    """Every unit's memory events re-timed onto its emulated nodes (``replay.memory``)."""
    inputs, tl = res.inputs, res.timeline
    units = pl.DataFrame(
        {"unit": np.arange(inputs.unit_rank.size, dtype=np.int64), "rank": inputs.unit_source}
    )
    mem = _fetch(
        store.con,
        f"SELECT {', '.join(MEMORY_COLUMNS)} FROM memory"
        " WHERE run_id = $1 AND list_contains($2, rank)",
        [inputs.source_run_id, inputs.unit_source.tolist()],
    )
    # A rank recorded without [memory] events gets a timeline derived from its host ET.
    from prism_trace.replay.et_memory import et_memory

    derived = et_memory(
        store.con, inputs.source_run_id, sorted(set(inputs.unit_source.tolist()) - set(mem["rank"]))
    )
    if not derived.is_empty():
        mem = pl.concat([mem, derived.cast(mem.schema)])
    if mem.is_empty():
        return pl.DataFrame(
            schema={"unit": pl.Int64, **{c: t for c, t in mem.schema.items() if c != "rank"}}
        )
    mem = mem.join(units.cast({"rank": mem.schema["rank"]}), on="rank").drop("rank")
    n = inputs.nodes
    host = ~n["kind"].is_in(_DEVICE_KINDS) if inputs.source_format != "op_timeline" else None
    nodes = pl.DataFrame(
        {
            "unit": n["unit"],
            "rec_ts": n["ts"],
            "rec_end": n["ts"] + n["dur"].fill_null(0),
            "emu_ts": tl.start + inputs.origin,
            "emu_end": tl.end + inputs.origin,
            "host": host if host is not None else np.ones(n.height, dtype=bool),
        }
    ).filter(pl.col("rec_ts").is_not_null())
    dp_rec, dp_tgt = _dp_sizes(store, inputs)
    delta = None
    if dp_rec != dp_tgt:
        if config.memory.optimizer_state_bytes is not None:
            state = units.with_columns(
                pl.lit(int(config.memory.optimizer_state_bytes), pl.Int64).alias("state")
            )
        else:
            args = _fetch(
                store.con,
                "SELECT rank, TRY_CAST(json_extract(args, '$.optimizer_state_bytes') AS BIGINT)"
                " AS state FROM rank WHERE run_id = $1 AND list_contains($2, rank)",
                [inputs.source_run_id, inputs.unit_source.tolist()],
            )
            state = units.join(args.cast({"rank": pl.Int64}), on="rank", how="left")
        delta = state.select(
            "unit",
            pl.col("state")
            .fill_null(0)
            .map_elements(
                lambda b: optimizer_shard_delta(int(b), dp_rec, dp_tgt), return_dtype=pl.Int64
            )
            .alias("delta"),
        )
    return retime_memory(mem, nodes, delta=delta)


def _memory_rows(res: _Result, run_id: int) -> pl.DataFrame:
    """The re-timed memory of the units as ``memory`` rows of the emulated run."""
    mem = res.memory
    if mem is None or mem.is_empty():
        return pl.DataFrame()
    ranks = res.inputs.unit_rank
    return mem.with_columns(
        pl.lit(run_id, pl.Int32).alias("run_id"),
        pl.Series("rank", ranks[mem["unit"].to_numpy()].astype(np.int32)),
    ).drop("unit")


def rank_peaks(res: _Result) -> pl.DataFrame:
    """Emulated peak ``total_allocated`` of every rank of the world (``rank, peak``); members of
    a class share their exemplar's. Empty without memory events."""
    if res.memory is None or res.memory.is_empty():
        return pl.DataFrame(schema={"rank": pl.Int64, "peak": pl.Int64})
    per_unit = memory_peaks(res.memory, by="unit")
    return (
        res.inputs.rank_unit.filter(
            (pl.col("unit") >= 0) & ~pl.col("rank").is_in(list(res.inputs.left_out))
        )
        .join(per_unit, on="unit")
        .select("rank", "peak")
        .sort("rank")
    )


def _rank_step_rows(res: _Result, run_id: int) -> pl.DataFrame:
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


def _rank_iterations(res: _Result, per_unit: pl.DataFrame) -> pl.DataFrame:
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


def _all_iterations(res: _Result, rec_iter: pl.DataFrame) -> pl.DataFrame:
    """Every rank's iterations: its unit's, or its replica's column's (``replay.vector``)."""
    if res.replicas is not None:
        return _replica_iterations(res, rec_iter)
    return _rank_iterations(res, _iteration_frame(res, rec_iter))


def _replica_iterations(res: _Result, rec_iter: pl.DataFrame) -> pl.DataFrame:
    """Iterations of every rank when every replica is distinct (``replay.vector``).

    Op timelines: one window per step for the whole world (``_iteration_frame``), over every
    replica's ops: the earliest start and the latest end of each node across the replicas.
    Per-rank step annotations: ``vector.kineto_iterations``, replica by replica.
    """
    inputs, vt, reps_ = res.inputs, res.replicas, res.inputs.grid
    assert vt is not None
    assert reps_ is not None
    grid, column = reps_.grid, reps_.column
    if inputs.source_format == "op_timeline":
        tl = Timeline(vt.start.min(axis=1), vt.end.max(axis=1), vt.arrival[:, 0], vt.rounds)
        per_unit = _iteration_frame(dataclasses.replace(res, timeline=tl), rec_iter)
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


def _recorded_iterations(store: Store, inputs: _Inputs) -> pl.DataFrame:
    return _fetch(
        store.con,
        "SELECT rank, iteration, ts, dur, name FROM iteration"
        " WHERE run_id = $1 AND list_contains($2, rank)",
        [inputs.source_run_id, inputs.unit_source.tolist()],
    )


def _kept(res: _Result, keep: tuple[int, ...]) -> list[tuple[int, int, int]]:
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


def _event_frame(res: _Result, run_id: int, keep: tuple[int, ...] = ()) -> pl.DataFrame:
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
    res: _Result, run_id: int, start: np.ndarray, end: np.ndarray, rows: np.ndarray | None
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


def _comm_frames(res: _Result, run_id: int, g_size: dict[int, int]) -> tuple[Any, Any]:
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


# -- writing -------------------------------------------------------------------------------------


@dataclass
class _Writing:
    """An emulated run being written (see ``_writing``)."""

    con: duckdb.DuckDBPyConnection
    reader: Store  # the store on a second connection: for reads while the events go in
    res: _Result
    run_id: int
    g_size: dict[int, int]
    pending: list[Future[int]]  # inserts on the worker thread, in order (events first)
    worker: ThreadPoolExecutor
    n_events: int = 0
    n_rank_step: int = 0
    rank_step_s: float = 0.0  # working out and inserting the rank_step rows

    def memory(self) -> None:
        """Queue the memory rows (``res.memory``, once worked out) behind the events."""
        rows = _memory_rows(self.res, self.run_id)
        self.pending.append(self.worker.submit(append, self.con, "memory", rows))

    def finish(self, iters: pl.DataFrame) -> int:
        """Wait for the queued inserts, write the iterations and the communication rows.

        Returns:
            The number of iteration rows.
        """
        self.n_events = self.pending[0].result()
        for f in self.pending[1:]:
            f.result()
        n_iter = append(
            self.con, "iteration", iters.with_columns(run_id=pl.lit(self.run_id, pl.Int32))
        )
        coll, p2p = _comm_frames(self.res, self.run_id, self.g_size)
        append(self.con, "collective", coll)
        append(self.con, "p2p", p2p)
        t = time.perf_counter()
        self.n_rank_step = append(self.con, "rank_step", _rank_step_rows(self.res, self.run_id))
        self.rank_step_s = time.perf_counter() - t
        return n_iter


@contextlib.contextmanager
def _writing(
    store: Store,
    res: _Result,
    *,
    out_run: str,
    old_id: int | None,
    config: EmulationConfig,
) -> Iterator[_Writing]:
    """Write the emulated run in one transaction, the events while the caller works on.

    Opens the transaction, writes the run, its ranks, groups and tracks, and starts inserting the
    events (every node of every unit: the bulk of the write) on a worker thread. DuckDB inserts
    them on one core without the GIL, so the caller's work meanwhile (the memory and iterations,
    reading through ``reader``, a second connection) overlaps. The caller queues the memory rows
    (``_Writing.memory``) and ends with ``_Writing.finish``; the block commits on exit, or rolls
    everything back (after stopping the worker's insert) on an error.
    """
    inputs = res.inputs
    sizes = _fetch(
        store.con,
        "SELECT group_id, size FROM comm_group WHERE run_id = $1 AND list_contains($2, group_id)",
        [inputs.run_id, sorted({int(g) for g in res.sync["group_id"].drop_nulls().to_list()})],
    )
    g_size = dict(zip(sizes["group_id"].to_list(), sizes["size"].to_list(), strict=True))
    cursor = store.con.cursor()
    try:
        with ThreadPoolExecutor(max_workers=1) as worker, store.transaction() as con:
            run_id = _write_header(con, res, out_run=out_run, old_id=old_id, config=config)
            frame = _event_frame(res, run_id, config.keep_events)
            events = worker.submit(append, con, "event", frame)
            w = _Writing(
                con=con,
                reader=dataclasses.replace(store, con=cursor),
                res=res,
                run_id=run_id,
                g_size=g_size,
                pending=[events],
                worker=worker,
            )
            try:
                yield w
            except BaseException:
                con.interrupt()  # stop the worker's insert; the transaction rolls back
                wait(w.pending)
                raise
    finally:
        cursor.close()


def _write_header(
    con: duckdb.DuckDBPyConnection,
    res: _Result,
    *,
    out_run: str,
    old_id: int | None,
    config: EmulationConfig,
) -> int:
    """In the open transaction: the run row, ranks, groups and tracks; returns the run id."""
    inputs = res.inputs
    if old_id is not None:
        drop_run(con, old_id)
    run_id = new_run(
        con,
        name=out_run,
        kind="emulated",
        parent_run_id=inputs.parent_run_id or inputs.run_id,
        world_size=inputs.world_size,
        source_format=inputs.source_format,
        config={"input_run": inputs.run, "input_kind": inputs.kind, **config.as_dict()},
    )
    # class_id: the rank whose events a rank shares (what-ifs may have expanded replicas);
    # args.what_if: why a rank is left out of the results (a removed GPU and its slot).
    ru = inputs.rank_unit.filter(pl.col("unit") >= 0)
    kept = _kept(res, config.keep_events)
    own = inputs.unit_rank[ru["unit"].to_numpy()].astype(np.int32)
    r_all = ru["rank"].to_numpy().astype(np.int32)
    if kept:  # a rank with events of its own is its own class exemplar
        k = np.array([r for r, _, _ in kept], dtype=np.int32)
        own = np.where(np.isin(r_all, k), r_all, own)
    owner = pl.DataFrame({"rank": r_all, "owner": own}).join(
        pl.DataFrame(
            {"rank": list(inputs.left_out), "why": list(inputs.left_out.values())},
            schema={"rank": pl.Int32, "why": pl.Utf8},
        ),
        on="rank",
        how="left",
    )
    con.register("_emu_owner", owner.to_arrow())
    try:
        con.execute(
            "INSERT INTO rank (run_id, rank, backend, hostname, pid, device, class_id,"
            " represented_by, tp, cp, ep, dp, pp, et_ops, et_ops_linked, args)"
            " SELECT $1, r.rank, backend, hostname, pid, device,"
            " CASE WHEN r.class_id IS NULL THEN NULL ELSE coalesce(o.owner, r.class_id) END,"
            " coalesce(represented_by, r.rank), tp, cp, ep, dp, pp, et_ops, et_ops_linked,"
            " CASE WHEN o.why IS NULL THEN args ELSE json_merge_patch(coalesce(args, '{}'),"
            " json_object('what_if', o.why)) END"
            " FROM rank r LEFT JOIN _emu_owner o ON o.rank = r.rank WHERE r.run_id = $2",
            [run_id, inputs.run_id],
        )
    finally:
        con.unregister("_emu_owner")
    con.execute(
        "INSERT INTO comm_group (run_id, group_id, name, description, backend, size, ranks,"
        " axis) SELECT $1, group_id, name, description, backend, size, ranks, axis"
        " FROM comm_group WHERE run_id = $2",
        [run_id, inputs.run_id],
    )
    units = pl.DataFrame(
        {
            "rank": np.concatenate([inputs.unit_rank, [r for r, _, _ in kept]]).astype(np.int64),
            "source_rank": np.concatenate(
                [inputs.unit_source, [inputs.unit_source[u] for _, u, _ in kept]]
            ).astype(np.int64),
        }
    )
    con.register("_emu_units", units.to_arrow())
    try:
        con.execute(
            "INSERT INTO track (run_id, rank, track_id, kind, pid, tid, name)"
            " SELECT $1, u.rank, t.track_id, t.kind, t.pid, t.tid, t.name"
            " FROM track t JOIN _emu_units u ON t.rank = u.source_rank WHERE t.run_id = $2",
            [run_id, inputs.source_run_id],
        )
    finally:
        con.unregister("_emu_units")
    return run_id


# -- the entry point -----------------------------------------------------------------------------


def _prepare(store: Store, run: str) -> _Inputs:
    run_id = store.require_run(run)
    ((kind,),) = store.con.execute("SELECT kind FROM run WHERE run_id = ?", [run_id]).fetchall()
    if kind == "recorded":
        ((n,),) = store.con.execute(
            "SELECT count(*) FROM graph_node WHERE run_id = ?", [run_id]
        ).fetchall()
        if not n:
            if store.read_only:
                msg = f"{store.path}: run {run!r} has no graph; open the store writable to build it"
                raise PrismError(msg)
            from prism_trace.graph import build_graph

            build_graph(store, run)
    return _load(store, run_id, name=run)


def _run_layout(store: Store, run_id: int, *, key: str = "layout") -> ParallelLayout | None:
    """A layout a sliced run's ``config_json`` records: ``layout`` (the target) or
    ``recorded_layout`` (the recording's), with its order; None when absent."""
    from prism_trace.parallel import ParallelLayout

    rows = store.con.execute("SELECT config_json FROM run WHERE run_id = ?", [run_id]).fetchall()
    order_key = "order" if key == "layout" else key.replace("layout", "order")
    try:
        cfg = json.loads(rows[0][0] or "{}")
        return ParallelLayout.parse(cfg[key], cfg.get(order_key))
    except (KeyError, ValueError, TypeError, IndexError, PrismError):
        return None


def _reindex(
    inputs: _Inputs,
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    follow: np.ndarray,
    edge_rows: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """Recompute units, node indices and edge endpoints after the units changed (in place).

    ``edge_rows``: the edges' ends as rows of ``nodes`` when known (``Expansion.edge_rows``);
    used when ``nodes`` is sorted by ``(rank, node_id)`` already, else looked up.
    """
    rank = nodes["rank"].to_numpy().astype(np.int64)
    n_id = nodes["node_id"].to_numpy().astype(np.int64)
    step = np.diff(rank)
    if not ((step > 0) | ((step == 0) & (np.diff(n_id) > 0))).all():  # expand_replicas sorts
        nodes = nodes.sort("rank", "node_id")
        rank = nodes["rank"].to_numpy().astype(np.int64)
        edge_rows = None
    first = np.flatnonzero(np.diff(rank, prepend=rank[:1] - 1) != 0)
    unit_rank = rank[first]
    unit = np.repeat(np.arange(first.size, dtype=np.int64), np.diff(np.append(first, rank.size)))
    nodes = nodes.with_columns(
        pl.Series("unit", unit), pl.Series("idx", np.arange(nodes.height, dtype=np.int64))
    )
    if edge_rows is not None:
        s, d = edge_rows
    else:
        keys, _ = _node_index(nodes, unit_rank)
        e_unit = np.searchsorted(unit_rank, edges["rank"].to_numpy()).astype(np.int64)
        s = _lookup(keys, e_unit, edges["src"].to_numpy(), "source")
        d = _lookup(keys, e_unit, edges["dst"].to_numpy(), "destination")
    pos = np.minimum(np.searchsorted(unit_rank, follow), unit_rank.size - 1)
    r_unit = np.where(unit_rank[pos] == follow, pos, -1)
    inputs.nodes = nodes
    inputs.edges = edges.with_columns(pl.Series("s", s), pl.Series("d", d))
    inputs.unit_rank = unit_rank
    inputs.unit_source = nodes["source_rank"].to_numpy()[first].astype(np.int64)
    inputs.rank_unit = pl.DataFrame(
        {"rank": np.arange(follow.size, dtype=np.int64), "unit": r_unit.astype(np.int64)}
    )


def _coords(store: Store, run_id: int) -> pl.DataFrame:
    return _fetch(
        store.con,
        "SELECT rank, coalesce(class_id, rank) AS class_id, tp, dp FROM rank WHERE run_id = $1"
        " ORDER BY rank",
        [run_id],
    )


def _apply_what_if(store: Store, inputs: _Inputs, config: EmulationConfig) -> None:
    """Turn ``config.what_if`` into units, durations and group sizes (in place).

    Expands the data-parallel replicas that a rank-targeted what-if or the variance mode makes
    distinct (sliced runs only: a recorded run's units are its ranks already), then sets each
    node's ``emu_dur`` (drawn, then scaled) and ``factor`` (multiplies a communication node's
    transfer). See ``replay.whatif``.
    """
    w = config.what_if
    world = inputs.world_size
    targets = w.rank_targets()
    bad = sorted(r for r in targets if not 0 <= r < world)
    if bad:
        msg = f"what-if rank {bad[0]} is outside the world of {world} ranks of run {inputs.run!r}"
        raise WhatIfError(msg)
    coords = _coords(store, inputs.run_id)
    layout = None
    dp_of = dict(zip(coords["rank"].to_list(), coords["dp"].fill_null(0).to_list(), strict=True))
    if inputs.kind == "sliced" and (targets or w.variance):
        layout = _run_layout(store, inputs.run_id)
        if layout is None:
            msg = f"run {inputs.run!r}: sliced run without a layout in its config"
            raise WhatIfError(msg)
        if vector_eligible(w):
            distinct = None if w.variance else {int(dp_of[r]) for r in targets}
            inputs.grid = replica_grid(layout, inputs.unit_rank, distinct)
    if inputs.grid is not None:
        assert layout is not None
        n_dp, n_col = inputs.grid.grid.shape[1], inputs.grid.n_columns
        inputs.notes.append(
            f"{n_dp} data-parallel replicas simulated as {n_col} distinct columns of a vector"
            f" over the {inputs.unit_rank.size} class graphs (replay.vector); events are the"
            " class exemplars' (replica 0), iterations every rank's"
        )
    elif inputs.kind == "sliced" and (targets or w.variance):
        assert layout is not None
        replicas = set(range(layout.dp)) if w.variance else {int(dp_of[r]) for r in targets}
        groups = _fetch(
            store.con,
            "SELECT group_id, axis, ranks FROM comm_group WHERE run_id = $1",
            [inputs.run_id],
        )
        exp = expand_replicas(
            inputs.nodes.drop("unit", "idx"),
            inputs.edges.drop("s", "d"),
            ranks=coords.select("rank", "class_id"),
            groups=groups,
            layout=layout,
            replicas=replicas,
        )
        _reindex(inputs, exp.nodes, exp.edges, exp.rank_unit_rank, exp.edge_rows)
        inputs.notes += exp.notes

    nodes = inputs.nodes
    unit_rank = inputs.unit_rank
    extra = np.ones(nodes.height)
    if w.remove_gpu is not None:
        extra = _remove_gpu(store, inputs, coords, w.remove_gpu)
        if inputs.grid is not None:  # the failed replica is a column: replay.vector
            n_tp = int(coords["tp"].max()) + 1
            f = n_tp / (n_tp - 1)
            extra = _failed_column(store, inputs, int(dp_of[w.remove_gpu]), f, extra)
    dur = nodes["dur"].fill_null(0).to_numpy().astype(np.int64)
    if w.variance and inputs.grid is not None:
        inputs.notes.append(
            f"variance ({w.variance_mode} mode, seed {config.seed}): every replica but 0 (the"
            " recording) draws its durations from its class's recorded iterations"
        )
    elif w.variance:
        draw = np.ones(unit_rank.size, dtype=bool)
        if inputs.kind == "sliced":
            # The representative replica (dp 0, the class exemplars) keeps its recorded timing:
            # it *is* the recording; every other replica is a virtual peer and draws.
            draw = np.array([dp_of.get(int(r), 0) != 0 for r in unit_rank], dtype=bool)
        dur = resample_durations(nodes, draw, seed=config.seed, mode=w.variance_mode)
        inputs.notes.append(
            f"variance ({w.variance_mode} mode, seed {config.seed}): {int(draw.sum())} of"
            f" {draw.size} units draw their durations from their representative's iterations"
        )
    # with the replica vector, a slow rank is a column of replay.vector's durations instead
    slow = w.slow if inputs.grid is None else tuple(s for s in w.slow if not s.ranks)
    factor = slow_factors(nodes, slow, extra=extra)
    is_comm = nodes["kind"].is_in(_COMM).to_numpy()
    if inputs.grid is not None:  # scaled per replica column (replay.vector.scale_replicas)
        inputs.nodes = nodes.with_columns(
            pl.Series("emu_dur", dur),
            pl.Series("factor", np.where(is_comm, factor, 1.0)),
            pl.Series("scale", np.where(is_comm, 1.0, factor)),
        )
        return
    emu = np.where(is_comm, dur, np.rint(dur * factor)).astype(np.int64)
    inputs.nodes = nodes.with_columns(
        pl.Series("emu_dur", emu), pl.Series("factor", np.where(is_comm, factor, 1.0))
    )


def _failed_column(
    store: Store, inputs: _Inputs, replica: int, f: float, extra: np.ndarray
) -> np.ndarray:
    """remove-gpu on the replica vector: the failed replica's column gets the compute and
    transfer factor and its smaller tp groups (``inputs.failed_column``), instead of the per-node
    factor and the group sizes ``_remove_gpu`` set for every column; returns factors of 1."""
    assert inputs.grid is not None
    groups = _fetch(
        store.con, "SELECT group_id, ranks FROM comm_group WHERE run_id = $1", [inputs.run_id]
    )
    sizes = class_groups(inputs.grid, replica, groups, inputs.size_override)
    inputs.size_override = {}
    inputs.failed_column = (int(inputs.grid.column[replica]), sizes, f)
    return np.ones_like(extra)


def _remove_gpu(store: Store, inputs: _Inputs, coords: pl.DataFrame, rank: int) -> np.ndarray:
    """The failed-GPU what-if: per-node compute factor; fills ``left_out``/``size_override``."""
    c = coords.filter(pl.col("rank") == rank)
    if c.is_empty() or c["tp"][0] is None or c["dp"][0] is None:
        msg = (
            f"run {inputs.run!r}: rank {rank} has no tp/dp coordinates (run `prism graph` so the"
            " layout is inferred)"
        )
        raise WhatIfError(msg)
    tp_of, dp_of = int(c["tp"][0]), int(c["dp"][0])
    n_tp = int(coords["tp"].max()) + 1
    if n_tp < 2:
        msg = (
            f"run {inputs.run!r}: removing rank {rank} leaves tp = 0 in its replica; with tp = 1"
            " a failed GPU removes the whole replica: use the what-if dp=N-1 instead"
        )
        raise WhatIfError(msg)
    replica = coords.filter(pl.col("dp") == dp_of)
    slot = replica.filter(pl.col("tp") == tp_of)["rank"].to_list()
    inputs.left_out = {int(r): ("removed" if r == rank else "idle") for r in slot}
    scale = n_tp / (n_tp - 1)
    in_replica = np.isin(inputs.nodes["rank"].to_numpy(), replica["rank"].to_numpy())
    groups = _fetch(
        store.con,
        "SELECT group_id, size, ranks, axis FROM comm_group WHERE run_id = $1",
        [inputs.run_id],
    )
    for gid, size, members, axis in groups.iter_rows():
        tp_group = axis is not None and "tp" in str(axis).split("-") and not spans_dp(axis)
        if tp_group and members and any(int(m) in inputs.left_out for m in members):
            inputs.size_override[int(gid)] = int(size) - 1
    inputs.notes.append(
        f"remove-gpu {rank}: replica dp={dp_of} runs at tp={n_tp - 1}; its compute x{scale:.4f},"
        f" {len(inputs.size_override)} tp groups at {n_tp - 1} members; ranks"
        f" {sorted(inputs.left_out)} (tp slot {tp_of}) leave the results"
    )
    return np.where(in_replica, scale, 1.0)


def _iteration_summary(iters: pl.DataFrame) -> list[dict[str, Any]]:
    if iters.is_empty():
        return []
    s = (
        iters.group_by("iteration")
        .agg(
            pl.col("dur").mean().alias("mean_ns"),
            pl.col("dur").max().alias("max_ns"),
            pl.len().alias("ranks"),
        )
        .sort("iteration")
    )
    return [
        {
            "iteration": int(r["iteration"]),
            "mean_ns": float(r["mean_ns"]),
            "max_ns": int(r["max_ns"]),
            "ranks": int(r["ranks"]),
        }
        for r in s.iter_rows(named=True)
    ]


def emulate_in_memory(
    store: Store, *, run: str, config: EmulationConfig | None = None
) -> tuple[_Result, pl.DataFrame]:
    """Emulate ``run`` without writing: the result and every rank's iterations.

    Args:
        store: an open store (writable if a recorded run has no graph yet).
        run: a recorded or sliced run.
        config: the emulation config (default ``EmulationConfig()``).

    Returns:
        The internal result and the ``iteration`` rows (``rank, iteration, ts, dur, name``).
    """
    config = config or EmulationConfig()
    with _dp_what_if(store, run, config) as target:
        inputs = _prepare_what_if(store, target, config, input_run=run)
        res = _emulate(store, inputs, config)
        res.memory = _memory(store, res, config)
        return res, _all_iterations(res, _recorded_iterations(store, inputs))


def _prepare_what_if(store: Store, run: str, config: EmulationConfig, *, input_run: str) -> _Inputs:
    """``_prepare`` plus the what-ifs; ``run`` may be the temporary re-slice of ``input_run``."""
    inputs = _prepare(store, run)
    if run != input_run:  # the dp what-if: report against the run the user named
        inputs.parent_run_id = store.require_run(input_run)
        inputs.run = input_run
    if config.what_if.active:
        _apply_what_if(store, inputs, config)
    return inputs


@contextlib.contextmanager
def _dp_what_if(store: Store, run: str, config: EmulationConfig) -> Iterator[str]:
    """The run to emulate: ``run`` itself, or, for the ``dp`` what-if, a temporary re-slice.

    A recorded run is sliced to its inferred layout with the new dp; a sliced run is re-sliced
    from its parent with the same representatives. The temporary run is deleted afterwards.
    """
    dp = config.what_if.dp
    if dp is None:
        yield run
        return
    from dataclasses import replace

    from prism_trace.parallel import infer_layout

    run_id = store.require_run(run)
    line = store.run_ancestry(run_id)
    kind = line[0].kind
    from_ranks: list[int] | None = None
    if kind == "sliced":
        layout = _run_layout(store, run_id)
        source = line[1].name
        from_ranks = sorted(
            int(r)
            for (r,) in store.con.execute(
                "SELECT DISTINCT represented_by FROM rank WHERE run_id = ?", [run_id]
            ).fetchall()
        )
    elif kind == "recorded":
        layout, source = infer_layout(store, run), run
    else:
        msg = f"{store.path}: run {run!r} is {kind}; the dp what-if needs a recorded or sliced run"
        raise WhatIfError(msg)
    if layout is None:
        msg = f"{store.path}: run {run!r} has no layout to change dp in"
        raise WhatIfError(msg)
    with temporary_slice(
        store,
        run=source,
        layout=replace(layout, dp=dp),
        from_ranks=from_ranks,
        name=f"_what_if_dp{dp}_{run}",
    ) as tmp:
        yield tmp


@contextlib.contextmanager
def temporary_slice(
    store: Store,
    *,
    run: str,
    layout: ParallelLayout,
    from_ranks: list[int] | None,
    name: str,
) -> Iterator[str]:
    """Slice ``run`` to ``layout`` as run ``name`` for the duration of the block, then delete it
    (also on error): the dp what-if and the validation's slice check leave nothing behind."""
    from prism_trace.slicing import slice_run

    try:
        slice_run(
            store,
            run=run,
            layout=layout,
            world=layout.world_size,
            from_ranks=from_ranks,
            out_run=name,
            replace=True,
        )
        yield name
    finally:
        tmp_id = store.run_id(name)
        if tmp_id is not None:
            with store.transaction() as con:
                drop_run(con, tmp_id)


def emulate_run(
    store: Store,
    *,
    run: str,
    out_run: str,
    replace: bool = False,
    config: EmulationConfig | None = None,
) -> EmulationReport:
    """Emulate a recorded or sliced run and store the result as a run of kind ``emulated``.

    Every unit (recorded rank, or class exemplar of a sliced run) executes its graph in
    dependency order with recorded durations; collectives complete when every participant has
    arrived plus the instance's transfer time, sends/receives when both sides have. See
    docs/emulator.md.

    Args:
        store: an open, writable store.
        run: the recorded or sliced run (a recorded run without a graph gets one first).
        out_run: name of the new run.
        replace: overwrite an existing emulated run of that name.
        config: the emulation config (default ``EmulationConfig()``), stored in
            ``run.config_json``.

    Returns:
        What was emulated and written.

    Raises:
        MissingParticipantError: a collective or send/recv that some participant never issues.
        DeadlockError: the graph cannot make progress (communication out of order).
        DuplicateRunError: ``out_run`` exists and ``replace`` is false.
        PrismError: no such run, a run without a graph, or ``out_run`` names a non-emulated run.
    """
    t0 = time.perf_counter()
    config = config or EmulationConfig()
    if out_run == run:
        msg = f"{store.path}: --out-run {out_run!r} is the input run itself; choose a new name"
        raise PrismError(msg)
    old_id = claim_run_name(store, out_run, replace=replace, over=("emulated",))
    with _dp_what_if(store, run, config) as target:
        inputs = _prepare_what_if(store, target, config, input_run=run)
        t_load = time.perf_counter() - t0
        res = _emulate(store, inputs, config)
        t1 = time.perf_counter()
        # The events are written while the memory and iterations are worked out (`_writing`).
        with _writing(store, res, out_run=out_run, old_id=old_id, config=config) as w:
            res.memory = _memory(w.reader, res, config)
            w.memory()
            iters = _all_iterations(res, _recorded_iterations(w.reader, inputs))
            n_iter = w.finish(iters)
        run_id, n_events = w.run_id, w.n_events
        t_write = time.perf_counter() - t1
    members = inputs.rank_unit.filter(pl.col("unit") >= 0).group_by("unit").len()
    per_unit_nodes = inputs.nodes.group_by("unit").len().rename({"len": "nodes"})
    represented = int(
        per_unit_nodes.join(members, on="unit", how="left")
        .select((pl.col("nodes") * pl.col("len").fill_null(1)).sum())
        .item()
    )
    total = time.perf_counter() - t0
    return EmulationReport(
        run=out_run,
        run_id=run_id,
        input_run=run,
        input_run_id=inputs.parent_run_id or inputs.run_id,
        input_kind=inputs.kind,
        world_size=inputs.world_size,
        units=int(inputs.unit_rank.size),
        nodes=inputs.nodes.height,
        edges=inputs.edges.height,
        collective_instances=res.n_collective,
        p2p_instances=res.n_p2p,
        rounds=res.timeline.rounds,
        events_written=n_events,
        iteration_rows=n_iter,
        rank_step_rows=w.n_rank_step,
        represented_events=represented,
        seconds={
            "load": t_load,
            "emulate": res.seconds,
            "prepare_and_emulate": t1 - t0 - t_load,
            "write": t_write,  # with the memory and iterations, worked out while events go in
            "rank_step": w.rank_step_s,  # of which the rank_step rows
            "total": total,
        },
        iterations=_iteration_summary(iters),
        peak_memory={
            int(inputs.unit_rank[u]): int(p)
            for u, p in memory_peaks(res.memory, by="unit").iter_rows()
        }
        if res.memory is not None
        else {},
        notes=list(inputs.notes),
    )

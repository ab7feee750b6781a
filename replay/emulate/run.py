"""Emulation, the run stage: the discrete-event core over the prepared graph (or the replica
vector), with the timing model and the what-ifs applied."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
from prism_trace.replay.des.core import (
    CommInstances,
    EmulatorGraph,
    Timeline,
    collective_instances,
    emulate,
    p2p_instances,
)
from prism_trace.replay.des.replicas import replica_durations, scale_replicas, shared_instances
from prism_trace.replay.des.vector import ReplicaTimeline, emulate_replicas
from prism_trace.replay.emulate.config import _COMM, EmulationConfig
from prism_trace.replay.emulate.load import (
    _groups,
    _rank_lookup,
    _recorded_transfers,
    _sync_frame,
)
from prism_trace.replay.emulate.values import EmulationResult, PreparedRun
from prism_trace.replay.model.timing import TransferQuery, transfer_model
from prism_trace.replay.whatif.config import SlowDown, WhatIfError
from prism_trace.replay.whatif.typical import typical_durations, typical_transfers

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["run_emulation"]


def run_emulation(store: Store, inputs: PreparedRun, config: EmulationConfig) -> EmulationResult:
    """The run stage: resolve the communication instances, time their transfers and run the core.

    Args:
        store: the store the run came from (groups, recorded transfers, calibration).
        inputs: the prepare stage's value; not changed (the result carries an amended copy).
        config: the emulation config (``completion``, ``timing``, ``topology``, the what-ifs
            applied here: ``bandwidth``, ``no-stragglers``, ``no-launch-delay``).

    Raises:
        MissingParticipantError: a collective or send/recv that some participant never issues.
        DeadlockError: the graph cannot make progress.
        WhatIfError: the bandwidth scaled twice.
    """
    nodes, edges = inputs.nodes, inputs.edges
    notes: list[str] = []
    sync = _sync_frame(nodes, edges)
    rec = _recorded_transfers(store, inputs)
    sync = sync.with_columns(pl.col("source_rank").cast(pl.Int64)).join(
        rec, on=["source_rank", "node_id"], how="left"
    )
    lone_notes = sync.filter((pl.col("kind") == "collective") & pl.col("group_id").is_null()).height
    if lone_notes:
        notes.append(
            f"{lone_notes} collective nodes without a communicator run alone (recorded duration)"
        )
    sync = sync.filter(~((pl.col("kind") == "collective") & pl.col("group_id").is_null()))
    # A send/recv whose peer the trace does not say (a bare `c10d::send`) cannot be paired.
    lone_p2p = sync.filter(pl.col("kind").is_in(["send", "recv"]) & pl.col("peer").is_null())
    if lone_p2p.height:
        notes.append(
            f"{lone_p2p.height} send/recv nodes without a known peer run alone (recorded duration)"
        )
        sync = sync.filter(~(pl.col("kind").is_in(["send", "recv"]) & pl.col("peer").is_null()))
    untimed = sync.filter(pl.col("transfer").is_null() & pl.col("dur").is_null()).height
    if untimed:
        notes.append(
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
    allow = config.completion.allow_partial
    if allow and inputs.kind == "recorded":
        from prism_trace.layout.symmetry import missing_ranks

        present = inputs.rank_unit.filter(pl.col("unit") >= 0)["rank"].to_numpy()
        missing = missing_ranks(inputs.world_size, present, None)
        if missing is not None:
            notes.append(f"partial: {missing}; their collectives complete over the ranks present")

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
        if topology.bandwidth_scale != 1.0:  # two knobs for one thing: say which one wins
            msg = (
                f"the bandwidth is scaled twice: topology.bandwidth_scale = "
                f"{topology.bandwidth_scale} and --what-if bandwidth="
                f"{config.what_if.bandwidth_scale}; give one of them"
            )
            raise WhatIfError(msg)
        topology = dataclasses.replace(topology, bandwidth_scale=config.what_if.bandwidth_scale)
    if config.timing.calibrate:
        from prism_trace.replay.model.calibrate import calibrate_run

        cal = calibrate_run(store, inputs.source_run_id, base=topology)
        topology = cal.topology
        notes.extend(cal.notes)
    model = transfer_model(config.timing, topology)
    if config.network.enabled:  # a model fitted on nccl-tests prices every collective
        from prism_trace.replay.network.transfer import NetworkTransfer

        model = NetworkTransfer(config.network, topology, config.timing.model)
        notes.append(
            f"network: collectives priced by the fitted network model"
            f" ({', '.join(config.network.fitted_from) or 'given inline'})"
        )
        if config.network.ranks_per_node != topology.per_node:
            notes.append(
                f"network: fitted on {config.network.ranks_per_node} ranks per node, but groups"
                f" are placed {topology.per_node} per node ([topology] ranks_per_node)"
            )
    rec_size = per["rec_size"].fill_null(pl.Series(gsize)).to_numpy().astype(np.int64)
    rec_nodes, _ = topology.group_nodes(
        per["rec_lo"].fill_null(pl.Series(lo)).to_numpy(),
        per["rec_hi"].fill_null(pl.Series(hi)).to_numpy(),
        rec_size,
    )
    msg_bytes = per["msg_bytes"].fill_null(-1).to_numpy()

    def transfer_at(sizes: np.ndarray) -> np.ndarray:
        """Each instance's transfer with these group sizes."""
        n_nodes, _ = topology.group_nodes(lo, hi, sizes)
        return model.transfer(
            TransferQuery(
                kind=kinds,
                msg_bytes=msg_bytes,
                group_size=sizes,
                spans_nodes=n_nodes > 1,
                recorded_ns=per["transfer"].to_numpy().astype(np.int64),
                n_nodes=n_nodes,
                recorded_group_size=rec_size,
                recorded_msg_bytes=per["rec_bytes"].fill_null(pl.Series(msg_bytes)).to_numpy(),
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
    if config.completion.rule == "common":
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
    # No what-if moves a release (a root's recorded start, where its rank's first step window
    # starts): every what-if then moves weights only, and in this max-plus model every end moves
    # the way the weights did, so the end of every step and each rank's total follow
    # (docs/emulator.md, "Monotone what-ifs").
    if w.no_launch_delay:  # no own delay: every op starts as soon as its dependencies allow
        delay = np.zeros_like(delay)
    elif w.no_stragglers:  # own time before computation stays; communication is posted at once
        to_comm = nodes["kind"].is_in(_COMM).to_numpy()[edges["d"].to_numpy()]
        delay = np.where(to_comm, 0, delay)
        # The releases stay: a rank enters the recording when it did (its step window starts
        # there, replay.emulate.frames.unit_iterations). Moving every root to the origin made
        # each late rank's first step start earlier while its end stayed held by the
        # collectives: DLRM's mean step came out 13 % *longer* without stragglers.
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
    done = dataclasses.replace(inputs, notes=(*inputs.notes, *notes))
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
        return EmulationResult(done, timeline, sync, nc, npp, seconds, replicas=vt, shared=shared)
    timeline = emulate(graph, comm, label=label)
    seconds = time.perf_counter() - t
    return EmulationResult(done, timeline, sync, nc, npp, seconds)


def _emulate_replicas(
    inputs: PreparedRun,
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
    held = np.zeros(graph.n_nodes, dtype=bool)
    held[np.asarray(graph.dst)[np.asarray(graph.holds_end, dtype=bool)]] = True
    dur = replica_durations(
        inputs.nodes,
        np.asarray(graph.dur, dtype=np.int64),
        replicas=inputs.grid.n_columns,
        variance=draw,
        seed=config.seed,
        mode=w.variance_mode,
        fit=inputs.variance_fit,
        held=held,
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

"""Emulation, the load stage: a recorded or sliced run's graph, ranks, groups and recorded transfers
from the store, as arrays the core takes."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
from prism_trace.replay.des.core import collective_instances, p2p_instances
from prism_trace.replay.emulate.config import _COMM, _DEFAULT_CATEGORY
from prism_trace.replay.emulate.values import LoadedRun
from prism_trace.replay.model.timing import recorded_completion

from prism_trace.errors import PrismError, RunStateError
from prism_trace.slicing.report import one_member_note

if TYPE_CHECKING:
    import duckdb

    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.store.connection import Store

__all__ = ["load_run"]


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


def load_run(store: Store, run: str) -> LoadedRun:
    """The load stage: ``run``'s graph from the store, as the core takes it.

    A recorded run without a graph gets one first (``prism_trace.graph.build``), inside the
    caller's transaction when there is one, so that a command refused later writes nothing.

    Raises:
        RunNotFoundError: no such run.
        RunStateError: a run of another kind, or a read-only store and no graph.
    """
    run_id = store.require_run(run)
    ((kind,),) = store.con.execute("SELECT kind FROM run WHERE run_id = ?", [run_id]).fetchall()
    if kind == "recorded":
        ((n,),) = store.con.execute(
            "SELECT count(*) FROM graph_node WHERE run_id = ?", [run_id]
        ).fetchall()
        if not n:
            if store.read_only:
                msg = f"{store.path}: run {run!r} has no graph; open the store writable to build it"
                raise RunStateError(msg)
            from prism_trace.graph.build import build_graph

            build_graph(store, run)
    return _load(store, run_id, name=run)


def _run_layout(store: Store, run_id: int, *, key: str = "layout") -> ParallelLayout | None:
    """A layout a sliced run's ``config_json`` records: ``layout`` (the target) or
    ``recorded_layout`` (the recording's), with its order; None when absent."""
    from prism_trace.layout.mesh import ParallelLayout

    cfg = _run_config(store, run_id)
    order_key = "order" if key == "layout" else key.replace("layout", "order")
    try:
        return ParallelLayout.parse(cfg[key], cfg.get(order_key))
    except (KeyError, ValueError, TypeError, PrismError):
        return None


def _run_config(store: Store, run_id: int) -> dict[str, Any]:
    """A run's ``config_json`` as a dict (empty when absent or not an object)."""
    rows = store.con.execute("SELECT config_json FROM run WHERE run_id = ?", [run_id]).fetchall()
    try:
        cfg = json.loads(rows[0][0] or "{}")
    except (ValueError, TypeError, IndexError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _dp_sizes(store: Store, run_id: int, kind: str) -> tuple[int, int]:
    """(recorded, emulated) data-parallel size: equal unless a sliced run changed it."""
    if kind != "sliced":
        return 1, 1
    rec = _run_layout(store, run_id, key="recorded_layout")
    tgt = _run_layout(store, run_id)
    if rec is None or tgt is None:
        return 1, 1
    return int(rec.dp), int(tgt.dp)


def _load(store: Store, run_id: int, *, name: str) -> LoadedRun:
    con = store.con
    ((kind, parent, world, fmt),) = con.execute(
        "SELECT kind, parent_run_id, world_size, source_format FROM run WHERE run_id = ?", [run_id]
    ).fetchall()
    if kind not in ("recorded", "sliced"):
        msg = (
            f"{store.path}: run {name!r} is {kind}; only a recorded or sliced run has a graph"
            " to emulate"
        )
        raise RunStateError(msg)
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
        raise RunStateError(msg)
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
    elif _run_config(store, run_id).get("dp_from_one_member"):
        notes.append(one_member_note(_dp_sizes(store, run_id, "sliced")[1]))
    ts = nodes["ts"]
    origin = int(ts.min()) if ts.null_count() < ts.len() else 0  # type: ignore[arg-type]
    recorded_graph = None
    if kind == "sliced":
        # Read here, on the command's own connection: the write stage works the memory out
        # through a second one, which cannot see a graph built earlier in the same transaction.
        recorded_graph = _fetch(
            con,
            "SELECT rank, kind, track_id, event_id, ts, ts + coalesce(dur, 0) AS rec_end"
            " FROM graph_node"
            " WHERE run_id = $1 AND list_contains($2, rank)",
            [source, unit_source.tolist()],
        )
    return LoadedRun(
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
        dp_sizes=_dp_sizes(store, run_id, str(kind)),
        notes=tuple(notes),
        recorded_graph=recorded_graph,
    )


def _with_symmetric_peers(
    store: Store, name: str, rank_unit: pl.DataFrame
) -> tuple[pl.DataFrame, list[str]]:
    """``rank_unit`` plus the unrecorded TP/CP peers of recorded ranks, each on its partner's
    unit (``prism_trace.layout.symmetry``): a recording of one rank per TP/CP group is complete."""
    from prism_trace.layout.choice import infer_layout
    from prism_trace.layout.symmetry import symmetric_partners

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


def _recorded_transfers(store: Store, inputs: LoadedRun) -> pl.DataFrame:
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
    out = pl.DataFrame(
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
    return out if inputs.kind == "recorded" else _copied_nodes(out, nodes, inputs.nodes)


def _copied_nodes(rec: pl.DataFrame, parent: pl.DataFrame, sliced: pl.DataFrame) -> pl.DataFrame:
    """``rec`` (keyed by the parent's node ids) plus a row for every sliced node that copies a
    parent node under another id (a microbatch repeated by ``prism_trace.slicing.rebatch``): the
    same recorded event (``event_id``), so the same recorded transfer."""
    own = sliced.select(pl.col("source_rank").cast(pl.Int64), "node_id", "event_id")
    known = parent.select(pl.col("rank").cast(pl.Int64).alias("source_rank"), "node_id", "event_id")
    copies = own.join(known, on=["source_rank", "node_id"], how="anti").drop_nulls("event_id")
    if copies.is_empty():
        return rec
    by_event = (
        known.drop_nulls("event_id")
        .unique(["source_rank", "event_id"], keep="none")
        .join(rec, on=["source_rank", "node_id"])
        .drop("node_id")
    )
    extra = copies.join(by_event, on=["source_rank", "event_id"]).drop("event_id")
    return pl.concat([rec, extra.select(rec.columns)])


def _groups(store: Store, run_id: int, group_ids: list[int]) -> pl.DataFrame:
    return _fetch(
        store.con,
        "SELECT group_id, size, ranks, axis FROM comm_group"
        " WHERE run_id = $1 AND list_contains($2, group_id)",
        [run_id, group_ids],
    )

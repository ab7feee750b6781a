"""The execution graph as a critical-path walk reads it: times, binding predecessors, instances.

``load_path_graph`` reads a run's graph (``graph_node``/``graph_edge``, docs/schema.md) with the
times to analyse: a recorded or sliced run's own, or an emulated/replayed run's events on its
parent's graph. For each node it works out, vectorised (polars), what ``critical_path``'s walk
follows one pointer at a time: the binding predecessor of its start (the in-edge with the latest
constraint), the same within its own iteration, its latest ``sync`` in-edge, and the
communication instance it synchronises at, with each instance's last arrival and last arriver.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from prism_trace.errors import RunStateError
from prism_trace.store.connection import Store

__all__ = ["COMM_KINDS", "WHOLE_TRACE", "PathGraph", "load_path_graph"]

COMM_KINDS = ("collective", "send", "recv")
"""Graph node kinds of communication."""

WHOLE_TRACE = -2
"""The iteration of every node when no rank has steps: the whole trace is one window."""


@dataclass
class PathGraph:
    """A run's graph with the times to analyse, as arrays indexed by node position."""

    nodes: pl.DataFrame  # rank, node_id, kind, name, category, iteration, ts, dur
    start: np.ndarray
    end: np.ndarray
    iteration: np.ndarray  # -1 when NULL
    pred: np.ndarray  # binding predecessor of the start (-1: none)
    pred_c: np.ndarray  # its constraint: anchor time + delay
    pred_kind: list[str | None]
    pred_from_end: np.ndarray
    # The binding predecessor among the in-edges from the node's own iteration (-1: none): the
    # walk's way on when the overall one is earlier-step work (a stream still busy with it).
    pred_in: np.ndarray
    pred_in_c: np.ndarray
    pred_in_kind: list[str | None]
    pred_in_from_end: np.ndarray
    sync_pred: np.ndarray  # latest sync in-edge source (-1: none)
    sync_c: np.ndarray
    inst: np.ndarray  # communication instance of a sync node (-1: none)
    inst_arrival: np.ndarray  # per instance: last arrival
    inst_last: np.ndarray  # per instance: node of the last arriver


def _fetch(store: Store, sql: str, params: list[object]) -> pl.DataFrame:
    return store.con.sql(sql, params=params).pl()


def _graph_run(store: Store, run: str) -> tuple[int, int, bool]:
    """``(run_id, graph_run_id, own_times)``: whose graph to walk and whether its times are the
    graph's own (recorded/sliced) or the run's events (emulated/replayed).

    Raises:
        RunNotFoundError: no such run.
        RunStateError: neither it nor its parent has a graph.
    """
    run_id = store.require_run(run)
    rows = store.con.execute(
        "SELECT r.kind, r.parent_run_id,"
        " EXISTS (SELECT 1 FROM graph_node n WHERE n.run_id = r.run_id),"
        " EXISTS (SELECT 1 FROM graph_node n WHERE n.run_id = r.parent_run_id)"
        " FROM run r WHERE r.run_id = ?",
        [run_id],
    ).fetchall()
    kind, parent, own, parent_has = rows[0]
    if own:
        return run_id, run_id, True
    if parent is not None and parent_has and kind in ("emulated", "replayed"):
        return run_id, int(parent), False
    msg = (
        f"{store.path}: run {run!r} ({kind}) has no execution graph"
        + (" and neither has its parent" if parent is not None else "")
        + f"; build it with `prism graph {store.path} --run {run}`"
    )
    raise RunStateError(msg)


def _kind(store: Store, run_id: int) -> str:
    rows = store.con.execute("SELECT kind FROM run WHERE run_id = ?", [run_id]).fetchall()
    return str(rows[0][0])


def load_path_graph(store: Store, run: str) -> PathGraph:
    """The graph ``critical_path`` walks for ``run``, with every node's binding choices.

    A run without a step on any rank gets ``WHOLE_TRACE`` as every node's iteration.

    Raises:
        RunNotFoundError: no such run.
        RunStateError: no graph for it (nor its parent), or no timed node.
    """
    run_id, graph_id, own = _graph_run(store, run)
    if own:
        nodes = _fetch(
            store,
            "SELECT n.rank, n.node_id, n.kind, n.name,"
            " coalesce(e.category, n.kind) AS category, n.iteration, n.ts, n.dur,"
            " n.group_id, n.seq, n.peer, n.track_id"
            " FROM graph_node n"
            " LEFT JOIN rank r ON r.run_id = n.run_id AND r.rank = n.rank"
            " LEFT JOIN run u ON u.run_id = n.run_id"
            " LEFT JOIN event e ON e.run_id = (CASE WHEN u.kind = 'sliced'"
            "   THEN u.parent_run_id ELSE n.run_id END)"
            " AND e.rank = coalesce(r.represented_by, n.rank) AND e.event_id = n.event_id"
            " WHERE n.run_id = $1 AND n.ts IS NOT NULL ORDER BY n.rank, n.node_id",
            [graph_id],
        )
    elif _kind(store, run_id) == "replayed":
        # A replayed run's events are host ET nodes (``event_id = et_op.node_id``); the graph
        # node of one is the graph node of the recorded event its ET op is linked to.
        nodes = _fetch(
            store,
            "SELECT n.rank, n.node_id, n.kind, n.name, e.category, e.iteration, e.ts, e.dur,"
            " n.group_id, n.seq, n.peer, n.track_id"
            " FROM graph_node n"
            " JOIN et_op o ON o.run_id = $1 AND o.rank = n.rank AND o.event_id = n.event_id"
            " JOIN event e ON e.run_id = $2 AND e.rank = n.rank AND e.event_id = o.node_id"
            " WHERE n.run_id = $1 AND e.ts IS NOT NULL ORDER BY n.rank, n.node_id",
            [graph_id, run_id],
        )
    else:
        nodes = _fetch(
            store,
            "SELECT n.rank, n.node_id, n.kind, n.name, e.category, e.iteration, e.ts, e.dur,"
            " n.group_id, n.seq, n.peer, n.track_id"
            " FROM graph_node n"
            " JOIN event e ON e.run_id = $2 AND e.rank = n.rank AND e.event_id = n.node_id"
            " WHERE n.run_id = $1 AND e.ts IS NOT NULL ORDER BY n.rank, n.node_id",
            [graph_id, run_id],
        )
    if nodes.is_empty():
        msg = f"{store.path}: run {run!r} has no timed graph nodes"
        raise RunStateError(msg)
    nodes = nodes.with_columns(
        pl.col("dur").fill_null(0).clip(lower_bound=0),
        pl.int_range(pl.len(), dtype=pl.Int64).alias("idx"),
    )
    key = nodes.select("rank", "node_id", "idx")
    edges = (
        _fetch(
            store,
            "SELECT rank, src, dst, kind, anchor, delay FROM graph_edge WHERE run_id = $1",
            [graph_id],
        )
        .join(key.rename({"node_id": "src", "idx": "s"}), on=["rank", "src"], how="inner")
        .join(key.rename({"node_id": "dst", "idx": "d"}), on=["rank", "dst"], how="inner")
    )
    start = nodes["ts"].to_numpy().astype(np.int64)
    end = start + nodes["dur"].to_numpy().astype(np.int64)
    n = nodes.height

    s = edges["s"].to_numpy()
    from_end = (edges["anchor"].fill_null("end") != "start").to_numpy()
    anchor_t = np.where(from_end, end[s], start[s])
    delay = np.maximum(edges["delay"].fill_null(0).to_numpy().astype(np.int64), 0)
    edges = edges.with_columns(
        pl.Series("c", anchor_t + delay),
        pl.Series("src_end", end[s]),
        pl.Series("from_end", from_end),
    )
    pred = np.full(n, -1, dtype=np.int64)
    pred_c = np.zeros(n, dtype=np.int64)
    pred_from_end = np.ones(n, dtype=bool)
    pred_kind: list[str | None] = [None] * n
    # Binding predecessor: the latest constraint; among equals the source that ended last.
    best = (
        edges.filter(pl.col("kind") != "sync")
        .sort(["d", "c", "src_end", "s"])
        .group_by("d", maintain_order=True)
        .last()
    )
    d = best["d"].to_numpy()
    pred[d] = best["s"].to_numpy()
    pred_c[d] = best["c"].to_numpy()
    pred_from_end[d] = best["from_end"].to_numpy()
    for i, k in zip(d.tolist(), best["kind"].to_list(), strict=True):
        pred_kind[i] = k
    _inferred_waits(nodes, edges, start, end, pred, pred_c, pred_from_end, pred_kind)
    iteration = nodes["iteration"].fill_null(-1).to_numpy().astype(np.int64)
    if not (iteration >= 0).any():
        # No step on any rank (no ProfilerStep): HTA's rule for a trace without the annotation
        # is the whole trace as one window (``critical_path_analysis(annotation="")``).
        iteration = np.full(n, WHOLE_TRACE, dtype=np.int64)
    pred_in, pred_in_c, pred_in_from_end, pred_in_kind = _same_step_preds(edges, iteration, n)
    sync_pred = np.full(n, -1, dtype=np.int64)
    sync_c = np.zeros(n, dtype=np.int64)
    sync = (
        edges.filter(pl.col("kind") == "sync")
        .sort(["d", "c", "s"])
        .group_by("d", maintain_order=True)
        .last()
    )
    sync_pred[sync["d"].to_numpy()] = sync["s"].to_numpy()
    sync_c[sync["d"].to_numpy()] = sync["c"].to_numpy()

    inst, arrival, last = _instances(store, graph_id, nodes, edges, start)
    return PathGraph(
        nodes=nodes.select("rank", "node_id", "kind", "name", "category", "iteration", "ts", "dur"),
        start=start,
        end=end,
        iteration=iteration,
        pred=pred,
        pred_c=pred_c,
        pred_kind=pred_kind,
        pred_from_end=pred_from_end,
        pred_in=pred_in,
        pred_in_c=pred_in_c,
        pred_in_kind=pred_in_kind,
        pred_in_from_end=pred_in_from_end,
        sync_pred=sync_pred,
        sync_c=sync_c,
        inst=inst,
        inst_arrival=arrival,
        inst_last=last,
    )


def _same_step_preds(
    edges: pl.DataFrame, iteration: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str | None]]:
    """Per node, the binding predecessor among its in-edges from its own iteration.

    A step whose first device op waits on the stream for the previous step's kernels (the GPU
    still behind the host) has its overall binding predecessor in the earlier step; the time
    the step itself spent up to that op is on the host that launched it (data loading, a
    blocking copy), which is where HTA's critical path, built from the step's own events only,
    runs. Returns ``(pred, constraint, from_end, kind)``; ``-1`` where there is none.
    """
    pred = np.full(n, -1, dtype=np.int64)
    c = np.zeros(n, dtype=np.int64)
    from_end = np.ones(n, dtype=bool)
    kind: list[str | None] = [None] * n
    if edges.is_empty():
        return pred, c, from_end, kind
    s_it = iteration[edges["s"].to_numpy()]
    d_it = iteration[edges["d"].to_numpy()]
    best = (
        edges.filter(pl.Series((s_it == d_it) & (d_it != -1)) & (pl.col("kind") != "sync"))
        .sort(["d", "c", "src_end", "s"])
        .group_by("d", maintain_order=True)
        .last()
    )
    d = best["d"].to_numpy()
    pred[d] = best["s"].to_numpy()
    c[d] = best["c"].to_numpy()
    from_end[d] = best["from_end"].to_numpy()
    for i, k in zip(d.tolist(), best["kind"].to_list(), strict=True):
        kind[i] = k
    return pred, c, from_end, kind


def _inferred_waits(
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    start: np.ndarray,
    end: np.ndarray,
    pred: np.ndarray,
    pred_c: np.ndarray,
    pred_from_end: np.ndarray,
    pred_kind: list[str | None],
) -> None:
    """Bind launched device ops that started later than any of their edges allow to the device op
    of the rank that ended last before them (in place; reason ``inferred-wait``).

    Traces without CUDA event flows (older Kineto, e.g. DLRM) have no ``wait`` edges, so a copy
    that waits for an NCCL kernel on another stream shows only slack after its launch and stream
    constraints. The op that ended last before it on any stream of the rank is the likeliest
    cause; it is taken only when it ended later than every known constraint.
    """
    launched = edges.filter(pl.col("kind").is_in(["launch", "comm"]))["d"].unique().to_numpy()
    if launched.size == 0:
        return
    dev = nodes.filter(pl.col("kind").is_in(["kernel", "memcpy", "memset"])).select(
        "rank", "idx", pl.col("ts").alias("s"), (pl.col("ts") + pl.col("dur")).alias("e")
    )
    dev = dev.with_columns(pl.Series("c", pred_c[dev["idx"].to_numpy()]))
    want = dev.filter(pl.col("idx").is_in(launched)).filter(pl.col("s") > pl.col("c")).sort("s")
    if want.is_empty():
        return
    ends = dev.select("rank", pl.col("idx").alias("w"), pl.col("e").alias("t")).sort("t")
    hit = want.join_asof(
        ends, left_on="s", right_on="t", by="rank", strategy="backward", check_sortedness=False
    ).filter(
        pl.col("w").is_not_null() & (pl.col("t") > pl.col("c")) & (pl.col("w") != pl.col("idx"))
    )
    i = hit["idx"].to_numpy()
    pred[i] = hit["w"].to_numpy()
    pred_c[i] = hit["t"].to_numpy()
    pred_from_end[i] = True
    for j in i.tolist():
        pred_kind[j] = "inferred-wait"


def _instances(
    store: Store, graph_id: int, nodes: pl.DataFrame, edges: pl.DataFrame, start: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Communication instances over the sync nodes: ``(instance of each node, arrival, last)``.

    As the emulator (docs/emulator.md): a communication node with a ``comm`` edge to a device
    kernel synchronises at that kernel, otherwise at itself. Collectives meet on
    ``(group_id, seq)``; a send meets its receive on ``(group, sender, receiver, seq)``, peers
    mapped to their class exemplar, and in a sliced graph the group replaced by its axis.
    """
    n = nodes.height
    inst = np.full(n, -1, dtype=np.int64)
    kernel = edges.filter(pl.col("kind") == "comm").group_by("s").agg(pl.col("d").min().alias("k"))
    comm = (
        nodes.filter(pl.col("kind").is_in(COMM_KINDS) & pl.col("group_id").is_not_null())
        .join(kernel, left_on="idx", right_on="s", how="left")
        .with_columns(pl.coalesce("k", "idx").alias("sync"))
    )
    if comm.is_empty():
        return inst, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    units = _fetch(
        store,
        "WITH r AS (SELECT rank, coalesce(class_id, rank) AS cls FROM rank WHERE run_id = $1),"
        " ex AS (SELECT DISTINCT rank FROM graph_node WHERE run_id = $1)"
        " SELECT r.rank AS peer, x.rank AS peer_unit FROM r"
        " JOIN (SELECT r.cls, min(r.rank) AS rank FROM r JOIN ex USING (rank) GROUP BY r.cls) x"
        " USING (cls)",
        [graph_id],
    )
    groups = _fetch(
        store,
        "SELECT g.group_id, CASE WHEN u.kind = 'sliced' THEN"
        " -1 - dense_rank() OVER (ORDER BY coalesce(g.axis, g.group_id::VARCHAR))"
        " ELSE g.group_id END AS gkey"
        " FROM comm_group g JOIN run u USING (run_id) WHERE g.run_id = $1",
        [graph_id],
    )
    comm = (
        comm.join(units.with_columns(pl.col("peer").cast(pl.Int32)), on="peer", how="left")
        .join(groups.with_columns(pl.col("group_id").cast(pl.Int32)), on="group_id", how="left")
        .with_columns(
            pl.col("gkey").fill_null(pl.col("group_id").cast(pl.Int64)),
            pl.when(pl.col("kind") == "recv")
            .then(pl.col("peer_unit"))
            .otherwise(pl.col("rank"))
            .alias("sender"),
            pl.when(pl.col("kind") == "recv")
            .then(pl.col("rank"))
            .otherwise(pl.col("peer_unit"))
            .alias("receiver"),
        )
    )
    is_coll = pl.col("kind") == "collective"
    keys = ["_k0", "_k1", "_k2", "_k3", "_k4"]
    comm = comm.with_columns(
        pl.when(is_coll).then(0).otherwise(1).cast(pl.Int64).alias("_k0"),
        pl.when(is_coll)
        .then(pl.col("group_id"))
        .otherwise(pl.col("gkey"))
        .cast(pl.Int64)
        .alias("_k1"),
        pl.when(is_coll).then(-1).otherwise(pl.col("sender")).cast(pl.Int64).alias("_k2"),
        pl.when(is_coll).then(-1).otherwise(pl.col("receiver")).cast(pl.Int64).alias("_k3"),
        pl.col("seq").cast(pl.Int64).alias("_k4"),
    )
    ids = comm.select(keys).unique().sort(keys).with_row_index("inst")
    comm = comm.join(ids, on=keys, how="left", nulls_equal=True)
    sync = comm["sync"].to_numpy()
    k = comm["inst"].to_numpy()
    inst[sync] = k
    n_inst = int(k.max()) + 1
    s = start[sync]
    rank = comm["rank"].to_numpy().astype(np.int64)
    # Last arriver: latest start, ties to the lowest rank.
    order = np.lexsort((rank, -s, k))
    first = np.ones(order.size, dtype=bool)
    first[1:] = k[order][1:] != k[order][:-1]
    arrival = np.zeros(n_inst, dtype=np.int64)
    last = np.full(n_inst, -1, dtype=np.int64)
    arrival[k[order][first]] = s[order][first]
    last[k[order][first]] = sync[order][first]
    return inst, arrival, last

"""Critical path of an iteration across ranks, through the execution graph and communication.

HTA's critical path covers one rank; a distributed step is held back by whichever rank arrives
last at each collective or send/receive, so the path here crosses ranks there. It reads the
execution graph (``graph_node``/``graph_edge``: docs/schema.md) with the times of the run being
analysed: a recorded (or sliced) run's own graph with its recorded times, or, for an emulated
run, the graph of the run it was emulated from (``run.parent_run_id``) with the emulated times of
its events (``event_id`` = ``graph_node.node_id``). Class members of a sliced run share their
exemplar's graph, so the path names exemplar ranks.

The walk (docs/analysis.md, "Critical path"): start at the node of the iteration that ends last
and go back in time, at each node taking the constraint that determined it.

- A communication node whose instance (collective ``(group_id, seq)``, or a send with its
  receive) had its last arrival after the node's own start completed because of that arrival: the
  path keeps the node from the arrival to its end and jumps to the last arriver's sync node, on
  another rank (``comm-last-arriver``).
- A node held back by a ``sync`` edge (a host op blocked in a device synchronisation) ended
  because of the device op: the path jumps to it.
- Otherwise the node ran from its start; its start was set by the in-edge whose constraint (the
  source's start or end, per ``anchor``, plus ``delay``) is the latest: the *binding
  predecessor*. Its kind is the reason (``program``, ``launch``, ``stream``, ``wait``, ``comm``,
  ``data``, ``ctrl``). The walk stops at a node without a binding predecessor in the iteration.

Only the binding choices are vectorised (polars); the walk follows one pointer per path node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import polars as pl

from prism_trace.errors import RunStateError
from prism_trace.store.connection import Store

__all__ = [
    "CARRIED_OVER",
    "PATH_COLUMNS",
    "PRECEDING_OP",
    "SYNC_SLACK_NS",
    "critical_path",
    "critical_path_shares",
    "critical_path_summary",
]

SYNC_SLACK_NS = 20_000
"""How much later than ``device end + delay`` a host op blocked in a synchronisation may end.

The ``sync`` edge's delay is the host's time after the call returned; the call returns a few µs
after the device op ends (3-12 µs on DLRM's V100s), so a recorded blocked op ends that much after
the constraint. Emulated times are exact (0). A host op that called the sync after the device op
had ended ends much later than the constraint and is not bound by it.
"""

_COMM_KINDS = ("collective", "send", "recv")

WHOLE_TRACE = -2
"""Internal iteration of every node when no rank has steps: the whole trace is one window."""

PRECEDING_OP = "preceding-op"
"""Reason of a node bound by no recorded dependency: the path goes on through the op of its rank
that ended last before it (the first op of another thread, such as autograd's backward thread)."""

CARRIED_OVER = "carried-over"
"""Reason of a node whose binding constraint was an earlier step's work (a stream still busy):
the path goes on through its predecessor in its own step, the gap is the wait."""

PATH_COLUMNS: dict[str, pl.DataType] = {
    "iteration": pl.Int32(),
    "step": pl.Int32(),
    "rank": pl.Int32(),
    "node_id": pl.Int64(),
    "name": pl.Utf8(),
    "kind": pl.Utf8(),
    "category": pl.Utf8(),
    "ts": pl.Int64(),
    "dur": pl.Int64(),
    "path_ts": pl.Int64(),
    "path_ns": pl.Int64(),
    "gap_ns": pl.Int64(),
    "reason": pl.Utf8(),
}
"""Columns of a path: one row per node on it, in time order (``step`` numbers them)."""


@dataclass
class _Graph:
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


def _load(store: Store, run: str) -> _Graph:
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
    return _Graph(
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
        nodes.filter(pl.col("kind").is_in(_COMM_KINDS) & pl.col("group_id").is_not_null())
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


class _EndedBefore:
    """The node of a window that ended last before another's start, on the same rank."""

    def __init__(self, g: _Graph, members: np.ndarray) -> None:
        self._g = g
        rank = g.nodes["rank"].to_numpy()[members].astype(np.int64)
        order = np.lexsort((g.end[members], rank))
        self._idx = members[order]
        self._rank = rank[order]
        self._end = g.end[self._idx]

    def latest(self, node: int) -> int:
        """The member on ``node``'s rank whose end is latest at or before its start; -1: none."""
        g = self._g
        r = int(g.nodes["rank"][node])
        lo = int(np.searchsorted(self._rank, r, side="left"))
        hi = int(np.searchsorted(self._rank, r, side="right"))
        j = lo + int(np.searchsorted(self._end[lo:hi], g.start[node], side="right")) - 1
        while j >= lo and self._idx[j] == node:
            j -= 1
        return int(self._idx[j]) if j >= lo else -1


def _walk(g: _Graph, it: int) -> list[tuple[int, int, int, str]]:
    """The path of iteration ``it``, latest first: ``(node, path_ts, path_end, reason)``."""
    members = np.flatnonzero(g.iteration == it)
    if members.size == 0:
        return []
    # The node that ends last; ties to the one that started last.
    cur = int(members[np.lexsort((g.start[members], g.end[members]))[-1]])
    before = _EndedBefore(g, members)
    path_end = int(g.end[cur])
    by_end = True
    rows: list[tuple[int, int, int, str]] = []
    # A node may appear twice: its end (a host op blocked in a sync on a device op it launched)
    # and its start (the launch); never twice the same way.
    seen: set[tuple[int, bool]] = set()
    while (cur, by_end) not in seen:
        seen.add((cur, by_end))
        s = int(g.start[cur])
        k = int(g.inst[cur])
        if by_end and k >= 0 and g.inst_arrival[k] > s and g.inst_last[k] != cur:
            a = int(g.inst_arrival[k])
            rows.append((cur, a, path_end, "comm-last-arriver"))
            cur, path_end, by_end = int(g.inst_last[k]), a, False
            continue
        sp = int(g.sync_pred[cur])
        if by_end and sp >= 0 and g.end[sp] > s and g.end[cur] - g.sync_c[cur] <= SYNC_SLACK_NS:
            rows.append((cur, int(g.end[sp]), path_end, "sync"))
            cur, path_end, by_end = sp, int(g.end[sp]), True
            continue
        u = int(g.pred[cur])
        if u >= 0 and g.iteration[u] == it:
            reason, c, by_end = (
                str(g.pred_kind[cur]),
                int(g.pred_c[cur]),
                bool(g.pred_from_end[cur]),
            )
        elif g.pred_in[cur] >= 0:
            # Bound by an earlier step's work (the stream still busy with it): the step's own
            # time up to here went through its in-step predecessor (the host that launched it).
            u = int(g.pred_in[cur])
            reason, c = CARRIED_OVER, int(g.pred_in_c[cur])
            by_end = bool(g.pred_in_from_end[cur])
        else:
            u = before.latest(cur)
            if u < 0:
                rows.append((cur, s, max(path_end, s), "start"))
                break
            # No recorded dependency binds it (the first op of another thread, e.g. autograd's
            # backward thread): the rank's op that ended last before it is the likeliest cause,
            # so the path stays on the rank's own time back to the step start.
            reason, c, by_end = PRECEDING_OP, int(g.end[u]), True
        rows.append((cur, s, max(path_end, s), reason))
        path_end = int(g.end[u]) if by_end else min(c, int(g.end[u]))
        cur = u
    return rows


def _path_frame(g: _Graph, it: int, rows: list[tuple[int, int, int, str]]) -> pl.DataFrame:
    if not rows:
        return pl.DataFrame(schema=PATH_COLUMNS)
    rows = rows[::-1]
    idx = np.array([r[0] for r in rows], dtype=np.int64)
    p_ts = np.array([r[1] for r in rows], dtype=np.int64)
    p_end = np.array([r[2] for r in rows], dtype=np.int64)
    gap = np.zeros(len(rows), dtype=np.int64)
    gap[1:] = p_ts[1:] - p_end[:-1]
    base = g.nodes[idx.tolist()]
    return base.select(
        pl.lit(it, pl.Int32).alias("iteration"),
        pl.int_range(pl.len(), dtype=pl.Int32).alias("step"),
        "rank",
        "node_id",
        "name",
        "kind",
        "category",
        "ts",
        "dur",
        pl.Series("path_ts", p_ts),
        pl.Series("path_ns", p_end - p_ts),
        pl.Series("gap_ns", gap),
        pl.Series("reason", [r[3] for r in rows], dtype=pl.Utf8),
    ).cast(PATH_COLUMNS)  # type: ignore[arg-type]


def _paths(g: _Graph, iteration: int | None) -> pl.DataFrame:
    """The paths of the graph's windows (``WHOLE_TRACE`` kept as is), in iteration order."""
    its = sorted({int(i) for i in np.unique(g.iteration) if i >= 0 or i == WHOLE_TRACE})
    if iteration is not None:
        its = [i for i in its if i == iteration]
    frames = [_path_frame(g, it, _walk(g, it)) for it in its]
    if not frames:
        return pl.DataFrame(schema=PATH_COLUMNS)
    return pl.concat(frames, how="vertical")


def _whole_trace_as_null(df: pl.DataFrame) -> pl.DataFrame:
    """The whole-trace window's iteration as NULL, as the ``iteration`` of a stepless rank."""
    it = pl.col("iteration")
    return df.with_columns(pl.when(it == WHOLE_TRACE).then(None).otherwise(it).alias("iteration"))


def critical_path(store: Store, run: str, *, iteration: int | None = None) -> pl.DataFrame:
    """The critical path of each iteration across ranks, one row per node on it in time order.

    A run without steps on any rank (a trace without ProfilerStep) has one window, the whole
    trace, as HTA's critical path takes it without an annotation; its ``iteration`` is NULL.

    Args:
        store: an open store (read-only is fine).
        run: a recorded or sliced run with a graph, or an emulated/replayed run whose parent has
            one.
        iteration: only this iteration (default: every iteration).

    Returns:
        ``PATH_COLUMNS``: per node, its rank, name, graph kind and event category, its start and
        duration, the part of it on the path (``path_ts``, ``path_ns``), the time between the
        previous node's part and this one's (``gap_ns``: launch delay, CPU gap, slack), and
        ``reason``: how the previous row bound this node (an edge kind, ``sync``,
        ``comm-last-arriver`` where the path changes rank, ``carried-over`` where the node
        waited for an earlier step's work and the path goes on through its own step's
        predecessor, ``start`` for the first). For every iteration, ``sum(path_ns) +
        sum(gap_ns)`` equals the last end minus the first ``path_ts``.

    Raises:
        RunNotFoundError: no such run.
        RunStateError: no execution graph for it.
    """
    return _whole_trace_as_null(_paths(_load(store, run), iteration))


def _span(g: _Graph) -> pl.DataFrame:
    return (
        pl.DataFrame({"iteration": g.iteration, "ts": g.start, "end": g.end})
        .filter((pl.col("iteration") >= 0) | (pl.col("iteration") == WHOLE_TRACE))
        .group_by("iteration")
        .agg((pl.col("end").max() - pl.col("ts").min()).alias("span_ns"))
        .with_columns(pl.col("iteration").cast(pl.Int32))
    )


def critical_path_summary(store: Store, run: str, *, iteration: int | None = None) -> pl.DataFrame:
    """Per iteration: the path's length against the iteration, and where its time goes.

    Returns:
        ``iteration, nodes, ranks, rank_switches, path_ns`` (last end minus first ``path_ts``),
        ``span_ns`` (first start to last end of all the iteration's graph nodes, all ranks),
        ``path_pct`` (of the span), ``busy_ns`` (sum of ``path_ns``), split into ``host_ns``
        (host ops: CPU operators, runtime calls), ``compute_ns`` (device ops and timeline
        compute ops that are not communication) and ``comm_ns`` (communication nodes),
        ``gap_ns``, and the rank and op with the most path time (``top_rank``, ``top_op``).
        ``iteration`` is NULL for the whole-trace window of a run without steps.

    Raises:
        RunNotFoundError: no such run.
        RunStateError: no execution graph for it.
    """
    g = _load(store, run)
    path = _paths(g, iteration)
    comm = pl.col("kind").is_in(_COMM_KINDS)
    host = pl.col("kind") == "host"
    summary = (
        path.sort("iteration", "step")
        .group_by("iteration", maintain_order=True)
        .agg(
            pl.len().alias("nodes"),
            pl.col("rank").n_unique().alias("ranks"),
            (pl.col("rank") != pl.col("rank").shift(1)).sum().alias("rank_switches"),
            (pl.col("path_ts").last() + pl.col("path_ns").last() - pl.col("path_ts").first()).alias(
                "path_ns"
            ),
            pl.col("path_ns").sum().alias("busy_ns"),
            pl.col("path_ns").filter(host).sum().alias("host_ns"),
            pl.col("path_ns").filter(~comm & ~host).sum().alias("compute_ns"),
            pl.col("path_ns").filter(comm).sum().alias("comm_ns"),
            pl.col("gap_ns").sum().alias("gap_ns"),
        )
    )
    top = {
        c: path.group_by("iteration", c)
        .agg(pl.col("path_ns").sum())
        .sort(["iteration", "path_ns", c], descending=[False, True, False])
        .group_by("iteration", maintain_order=True)
        .first()
        .select("iteration", pl.col(c).alias(f"top_{'rank' if c == 'rank' else 'op'}"))
        for c in ("rank", "name")
    }
    out = (
        summary.join(_span(g), on="iteration", how="left")
        .join(top["rank"], on="iteration", how="left")
        .join(top["name"], on="iteration", how="left")
        .with_columns((100.0 * pl.col("path_ns") / pl.col("span_ns")).alias("path_pct"))
        .select(
            "iteration",
            "nodes",
            "ranks",
            "rank_switches",
            "path_ns",
            "span_ns",
            "path_pct",
            "busy_ns",
            "host_ns",
            "compute_ns",
            "comm_ns",
            "gap_ns",
            "top_rank",
            "top_op",
        )
        .sort("iteration")
    )
    return _whole_trace_as_null(out)


def critical_path_shares(
    store: Store,
    run: str,
    *,
    by: Literal["rank", "kind", "name"] = "rank",
    iteration: int | None = None,
) -> pl.DataFrame:
    """Time on the critical path by rank, node kind or op name, over the chosen iterations.

    Returns:
        ``<by>, nodes, path_ns, share_pct`` (of all path time), largest first.

    Raises:
        RunNotFoundError: no such run.
        RunStateError: no execution graph for it.
    """
    path = critical_path(store, run, iteration=iteration)
    total = path["path_ns"].sum() or 1
    return (
        path.group_by(by)
        .agg(pl.len().alias("nodes"), pl.col("path_ns").sum())
        .with_columns((100.0 * pl.col("path_ns") / total).alias("share_pct"))
        .sort(["path_ns", by], descending=[True, False])
    )

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

from typing import Literal

import numpy as np
import polars as pl
from prism_trace.analysis.path_graph import COMM_KINDS, WHOLE_TRACE, PathGraph, load_path_graph

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


class _EndedBefore:
    """The node of a window that ended last before another's start, on the same rank."""

    def __init__(self, g: PathGraph, members: np.ndarray) -> None:
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


def _walk(g: PathGraph, it: int) -> list[tuple[int, int, int, str]]:
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


def _path_frame(g: PathGraph, it: int, rows: list[tuple[int, int, int, str]]) -> pl.DataFrame:
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


def _paths(g: PathGraph, iteration: int | None) -> pl.DataFrame:
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
    return _whole_trace_as_null(_paths(load_path_graph(store, run), iteration))


def _span(g: PathGraph) -> pl.DataFrame:
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
    g = load_path_graph(store, run)
    path = _paths(g, iteration)
    comm = pl.col("kind").is_in(COMM_KINDS)
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

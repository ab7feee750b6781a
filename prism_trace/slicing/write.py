"""Writing a sliced run's rows: its ranks, its target communicators, and each class's graph
copied from its representative under its exemplar.

Each writer runs inside ``slice_run``'s transaction, after the whole slice has been planned
(``plan``), so a slice that cannot be mapped writes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from prism_trace.layout.mesh import AXES, ParallelAxis, ParallelLayout
from prism_trace.slicing.plan import SliceClass, TargetGroups
from prism_trace.store.write import append

if TYPE_CHECKING:
    import duckdb

__all__ = ["count_rows", "write_graph", "write_groups", "write_ranks"]


def write_ranks(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    rec_id: int,
    layout: ParallelLayout,
    classes: list[SliceClass],
) -> None:
    """One ``rank`` row per target rank: its coordinates, its class (the exemplar), the recorded
    rank it replays, and that rank's backend and device."""
    ranks = np.arange(layout.world_size, dtype=np.int64)
    coords = layout.coords(ranks)
    cls_index = layout.group_index((ParallelAxis.DP,), ranks)
    exemplar = np.array([c.exemplar for c in classes], dtype=np.int64)[cls_index]
    rep = np.array([c.representative for c in classes], dtype=np.int64)[cls_index]
    facts = con.sql(
        "SELECT rank AS represented_by, backend, device FROM rank WHERE run_id = $1",
        params=[rec_id],
    ).pl()
    frame = pl.DataFrame(
        {
            "run_id": np.full(ranks.size, run_id, dtype=np.int32),
            "rank": ranks.astype(np.int32),
            "class_id": exemplar.astype(np.int32),
            "represented_by": rep.astype(np.int32),
            **{a.value: coords[a].astype(np.int32) for a in AXES},
        }
    )
    frame = frame.join(facts.cast({"represented_by": pl.Int32}), on="represented_by", how="left")
    append(con, "rank", frame)


def write_groups(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    tgt: TargetGroups,
    rec_axes: dict[int, str],
    rec_groups: dict[int, tuple[Any, ...]],
) -> int:
    """The target communicators, one block of ids per axis value, each named ``axis:i`` and
    described and backed like the first recorded group of its axis; returns how many."""
    frames = []
    for axis, base in tgt.base.items():
        members = tgt.members[axis]
        first = min(g for g, a in rec_axes.items() if a == axis)
        _, desc, backend, _ = rec_groups[first]
        n, size = members.shape
        frames.append(
            pl.DataFrame(
                {
                    "group_id": np.arange(base, base + n, dtype=np.int32),
                    "name": [f"{axis}:{i}" for i in range(n)],
                    "ranks": pl.Series(members.astype(np.int32)).cast(pl.List(pl.Int32)),
                }
            ).with_columns(
                run_id=pl.lit(run_id, pl.Int32),
                description=pl.lit(desc, pl.Utf8),
                backend=pl.lit(backend, pl.Utf8),
                size=pl.lit(size, pl.Int32),
                axis=pl.lit(axis, pl.Utf8),
            )
        )
    if not frames:
        return 0
    df = pl.concat(frames)
    append(con, "comm_group", df)
    return df.height


def write_graph(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    rec_id: int,
    classes: list[SliceClass],
    group_rows: dict[tuple[int, int], int],
    peer_rows: dict[tuple[int, int], int],
    rewritten: tuple[pl.DataFrame, pl.DataFrame] | None = None,
) -> tuple[int, int]:
    """Copy each class's representative graph under its exemplar; ``group_rows`` and
    ``peer_rows`` map ``(exemplar, recorded group or peer)`` to the target's.

    ``rewritten``: the representatives' graphs as nodes and edges frames (``batch``: another
    number of microbatches), copied instead of the recorded ones.
    """
    cls = pl.DataFrame(
        {
            "rep": [c.representative for c in classes],
            "exemplar": [c.exemplar for c in classes],
        },
        schema={"rep": pl.Int32, "exemplar": pl.Int32},
    )
    gmap = pl.DataFrame(
        {
            "ex": [k[0] for k in group_rows],
            "old": [k[1] for k in group_rows],
            "new": list(group_rows.values()),
        },
        schema={"ex": pl.Int32, "old": pl.Int32, "new": pl.Int32},
    )
    pmap = pl.DataFrame(
        {
            "ex": [k[0] for k in peer_rows],
            "old": [k[1] for k in peer_rows],
            "new": list(peer_rows.values()),
        },
        schema={"ex": pl.Int32, "old": pl.Int32, "new": pl.Int32},
    )
    con.register("_slice_class", cls.to_arrow())
    con.register("_slice_group", gmap.to_arrow())
    con.register("_slice_peer", pmap.to_arrow())
    names = ["_slice_class", "_slice_group", "_slice_peer"]
    src_nodes = "(SELECT * FROM graph_node WHERE run_id = $2)"
    src_edges = "(SELECT * FROM graph_edge WHERE run_id = $2)"
    if rewritten is not None:
        con.register("_slice_nodes", rewritten[0].to_arrow())
        con.register("_slice_edges", rewritten[1].to_arrow())
        names += ["_slice_nodes", "_slice_edges"]
        src_nodes = "(SELECT * FROM _slice_nodes WHERE $2 IS NOT NULL)"
        src_edges = "(SELECT * FROM _slice_edges WHERE $2 IS NOT NULL)"
    try:
        before_n = count_rows(con, "graph_node", run_id)
        con.execute(
            "INSERT INTO graph_node (run_id, rank, node_id, kind, track_id, event_id, name, ts,"
            " dur, iteration, group_id, seq, peer, msg_bytes, comm_kind)"
            " SELECT $1, c.exemplar, n.node_id, n.kind, n.track_id, n.event_id, n.name, n.ts,"
            " n.dur, n.iteration, g.new, n.seq, p.new, n.msg_bytes, n.comm_kind"
            f" FROM {src_nodes} n JOIN _slice_class c ON n.rank = c.rep"
            " LEFT JOIN _slice_group g ON g.ex = c.exemplar AND g.old = n.group_id"
            " LEFT JOIN _slice_peer p ON p.ex = c.exemplar AND p.old = n.peer",
            [run_id, rec_id],
        )
        con.execute(
            "INSERT INTO graph_edge (run_id, rank, src, dst, kind, anchor, delay)"
            " SELECT $1, c.exemplar, e.src, e.dst, e.kind, e.anchor, e.delay"
            f" FROM {src_edges} e JOIN _slice_class c ON e.rank = c.rep",
            [run_id, rec_id],
        )
    finally:
        for name in names:
            con.unregister(name)
    return count_rows(con, "graph_node", run_id) - before_n, count_rows(con, "graph_edge", run_id)


def count_rows(con: duckdb.DuckDBPyConnection, table_name: str, run_id: int) -> int:
    """The number of ``table_name`` rows of run ``run_id``."""
    ((n,),) = con.execute(
        f"SELECT count(*) FROM {table_name} WHERE run_id = ?", [run_id]
    ).fetchall()
    return int(n)

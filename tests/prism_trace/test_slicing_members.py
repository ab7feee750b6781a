"""Per-member ops of list collectives follow the group's target size (``slicing.members``), on
hand-made graphs: the caller's allocations before the call, the backend's copies during it."""

from __future__ import annotations

import polars as pl

from prism_trace.graph.base import EDGE_SCHEMA, NODE_SCHEMA
from prism_trace.slicing.members import find_member_runs, scale_member_ops

AG = "all_gather"


def _graph(
    tracks: dict[int, list[tuple[str, int, int]]], call: tuple[int, int, int, str] | None = None
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Nodes (name, ts, dur) per track, chained by program edges with the recorded gaps; the op
    named ``call`` is the collective (group 5) of kind ``call[3]``."""
    rows, edges, nid = [], [], 0
    for track, ops in tracks.items():
        prev = None
        for name, ts, dur in ops:
            is_call = name == "CALL"
            rows.append(
                {
                    "rank": 0,
                    "node_id": nid,
                    "kind": "collective" if is_call else "host",
                    "track_id": track,
                    "event_id": 1000 + nid,
                    "name": name,
                    "ts": ts,
                    "dur": dur,
                    "iteration": 1,
                    "group_id": 5 if is_call else None,
                    "seq": 0 if is_call else None,
                    "peer": None,
                    "msg_bytes": 64 if is_call else None,
                    "comm_kind": (call[3] if call else AG) if is_call else None,
                }
            )
            if prev is not None:
                gap = ts - (prev[1] + prev[2])
                edges.append(
                    {"rank": 0, "src": prev[0], "dst": nid, "kind": "program", "anchor": "end",
                     "delay": gap}
                )  # fmt: skip
            prev = (nid, ts, dur)
            nid += 1
    return (
        pl.DataFrame(rows, schema=NODE_SCHEMA),
        pl.DataFrame(edges, schema=EDGE_SCHEMA),
    )


def _chain(nodes: pl.DataFrame, edges: pl.DataFrame, track: int) -> list[str]:
    """The names of ``track``'s nodes walked along its program edges from the first."""
    ids = set(nodes.filter(pl.col("track_id") == track)["node_id"].to_list())
    prog = edges.filter((pl.col("kind") == "program") & pl.col("src").is_in(list(ids)))
    nxt = dict(zip(prog["src"].to_list(), prog["dst"].to_list(), strict=True))
    assert len(nxt) == len(ids) - 1  # one chain, no edge lost or doubled
    start = (ids - set(nxt.values())).pop()
    names = dict(zip(nodes["node_id"].to_list(), nodes["name"].to_list(), strict=True))
    out = [names[start]]
    while start in nxt:
        start = nxt[start]
        out.append(names[start])
    return out


MAIN = [("zeros", 0, 10), ("empty_like", 20, 2), ("empty_like", 25, 2), ("CALL", 30, 50),
        ("next", 90, 5)]  # fmt: skip
WORKER = [("view", 35, 1), ("empty", 37, 1), ("select", 40, 1), ("copy_", 42, 3),
          ("select", 46, 1), ("copy_", 48, 3), ("later", 200, 4)]  # fmt: skip


def test_a_group_of_2_grown_to_4_repeats_each_members_ops() -> None:
    nodes, edges = _graph({0: MAIN, 1: WORKER})
    runs = find_member_runs(nodes, edges, {5: (2, 4)})
    assert sorted((len(r.nodes), r.block) for r in runs) == [(2, 1), (4, 2)]
    n, e = scale_member_ops(nodes, edges, runs)
    assert _chain(n, e, 0) == ["zeros", *["empty_like"] * 4, "CALL", "next"]
    assert _chain(n, e, 1) == ["view", "empty", *["select", "copy_"] * 4, "later"]
    assert n["node_id"].is_unique().all()
    assert set(e["src"]) | set(e["dst"]) <= set(n["node_id"])
    # Copies replay recorded ops; the gaps between blocks are the recorded ones.
    assert set(n["event_id"]) == set(nodes["event_id"])
    gaps = e.join(n.select(pl.col("node_id").alias("dst"), "name"), on="dst")
    assert sorted(gaps.filter(pl.col("name") == "select")["delay"].to_list()) == [1, 1, 1, 2]


def test_a_group_of_4_shrunk_to_2_drops_members_but_keeps_the_last() -> None:
    main = [("zeros", 0, 10), *[("empty_like", 20 + 3 * i, 2) for i in range(4)],
            ("CALL", 40, 50), ("next", 95, 5)]  # fmt: skip
    nodes, edges = _graph({0: main})
    runs = find_member_runs(nodes, edges, {5: (4, 2)})
    n, e = scale_member_ops(nodes, edges, runs)
    assert _chain(n, e, 0) == ["zeros", "empty_like", "empty_like", "CALL", "next"]
    kept = n.filter(pl.col("name") == "empty_like")["ts"].to_list()
    assert kept == [20, 29]  # the first and the last recorded member


def test_runs_that_are_not_the_calls_alone_are_left_as_recorded() -> None:
    # Three empty_like before a call of 2 members: which two are its own is not known.
    main = [("empty_like", 15, 2), *MAIN[1:]]
    nodes, edges = _graph({0: main})
    assert find_member_runs(nodes, edges, {5: (2, 4)}) == []
    # A flat collective (no repeated ops around it), or one whose size does not change.
    nodes, edges = _graph({0: [("zeros", 0, 10), ("CALL", 30, 50), ("next", 90, 5)]})
    assert find_member_runs(nodes, edges, {5: (2, 4)}) == []
    nodes, edges = _graph({0: MAIN, 1: WORKER})
    assert find_member_runs(nodes, edges, {}) == []
    # An all_reduce has no per-member form.
    nodes, edges = _graph({0: MAIN}, call=(0, 0, 0, "all_reduce"))
    assert find_member_runs(nodes, edges, {5: (2, 4)}) == []


def test_ops_tied_by_other_edges_are_not_repeated() -> None:
    """A per-member op that launches a kernel (or feeds data) would need its edges repeated
    too: such a run is left as recorded."""
    nodes, edges = _graph({0: MAIN, 1: WORKER})
    tie = pl.DataFrame(
        [{"rank": 0, "src": 1, "dst": 11, "kind": "launch", "anchor": "start", "delay": 0}],
        schema=EDGE_SCHEMA,
    )
    runs = find_member_runs(nodes, pl.concat([edges, tie]), {5: (2, 4)})
    assert [r.block for r in runs] == [2]  # the worker's run only

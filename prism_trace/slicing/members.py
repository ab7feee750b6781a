"""Per-member ops: the ops a list collective runs once for each member of its group, repeated or
dropped with the group's size.

A collective that takes or returns one tensor per member (``all_gather`` into a list,
``reduce_scatter`` from a list, ``all_to_all``, ``gather``, ``scatter``) comes with ops run once per
member: the caller allocates each output (``empty_like`` in a list comprehension), and the backend
copies each member's part out of its flat buffer (gloo's worker runs ``select`` + ``copy_`` per
member; NCCL's list ``all_gather`` copies each output). When the slice changes the group's size
from ``g`` to ``G``, these ops must number ``G`` per call, or the predicted step does the recorded
rank's per-member work and its structure differs from the job at the target scale.

Which ops are per member is read from the recorded graph, never from op names: on one track, a
*block* of ops (one or more nodes) repeated exactly ``g`` times in a row, where ``g`` is the
recorded size of the collective's group, and where

- on the collective's own track, the run ends right before the collective (the caller's
  allocations of its outputs), or
- on another track, the run starts while the collective runs (the backend's per-member work).

A run that repeats more than ``g`` times is not taken (it is not the collective's alone), nor is
one with an edge other than its track's program order (a launched kernel or a data dependency
would have to follow it). The run becomes ``G`` blocks: the recorded blocks but the last, copies of
them in turn (``G > g``) or fewer of them (``G < g``), then the last, so the joints to the ops
around it stay as recorded. A copy keeps its recorded ``event_id``, ``ts`` and ``dur`` (it replays
the same recorded op) and gets a new node id after the rank's largest; program-order edges are
redrawn along the new run with the recorded gaps.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

from prism_trace.graph.base import EDGE_SCHEMA, NODE_SCHEMA
from prism_trace.slicing.batch import read_graphs

if TYPE_CHECKING:
    import duckdb

__all__ = [
    "LIST_COLLECTIVES",
    "MemberRun",
    "find_member_runs",
    "rewrite_member_ops",
    "scale_member_ops",
]

LIST_COLLECTIVES = frozenset({"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"})
"""Collective kinds whose list form has one tensor per member."""

_MAX_BLOCK = 8
"""The longest block of per-member ops looked for (gloo's ``select`` + ``copy_`` is 2)."""


@dataclass(frozen=True)
class MemberRun:
    """One run of per-member blocks on one track.

    Attributes:
        nodes: the run's node ids in program order (``block * g`` of them).
        block: the number of nodes of one block.
        members: the recorded group size ``g`` (the run's number of blocks).
        target: the target group size ``G``.
        collective: the node id of the collective the run belongs to.
    """

    nodes: tuple[int, ...]
    block: int
    members: int
    target: int
    collective: int


def _repeats(names: list[str], start: int, block: int) -> int:
    """How many times ``names[start:start + block]`` repeats from ``start`` on."""
    first = names[start : start + block]
    if len(first) < block:
        return 0
    n = 1
    while names[start + n * block : start + (n + 1) * block] == first:
        n += 1
    return n


def _run_before(names: list[str], end: int, g: int) -> tuple[int, int] | None:
    """(start, block) of a run of exactly ``g`` equal blocks ending at ``end`` (exclusive)."""
    for block in range(1, _MAX_BLOCK + 1):
        start = end - g * block
        if start < 0:
            break
        if _repeats(names, start, block) != g:
            continue
        before = start - block  # one more block before the run: it is not the collective's alone
        if before >= 0 and names[before:start] == names[start : start + block]:
            continue
        return start, block
    return None


def _run_inside(names: list[str], g: int) -> tuple[int, int] | None:
    """(start, block) of the first run of exactly ``g`` equal blocks in ``names``."""
    for block in range(1, _MAX_BLOCK + 1):
        for start in range(len(names) - g * block + 1):
            if start >= block and names[start - block : start] == names[start : start + block]:
                continue  # the middle of a longer run
            if _repeats(names, start, block) == g:
                return start, block
    return None


def find_member_runs(
    nodes: pl.DataFrame, edges: pl.DataFrame, sizes: dict[int, tuple[int, int]]
) -> list[MemberRun]:
    """The per-member runs of one rank's graph.

    Args:
        nodes: the rank's nodes (``NODE_SCHEMA``).
        edges: the rank's edges (``EDGE_SCHEMA``).
        sizes: group id → (recorded size, target size), for the groups whose size changes.

    Returns:
        The runs found, at most one per track and collective, no node in two runs.
    """
    calls = nodes.filter(
        (pl.col("kind") == "collective")
        & pl.col("comm_kind").is_in(list(LIST_COLLECTIVES))
        & pl.col("group_id").is_in(list(sizes))
    )
    if calls.is_empty():
        return []
    ordered = nodes.sort("ts", "node_id", nulls_last=True)
    tracks: dict[int, tuple[list[int], list[int], list[str]]] = {}
    for key, part in ordered.group_by("track_id", maintain_order=True):
        tracks[int(key[0] if key[0] is not None else -1)] = (
            part["node_id"].to_list(),
            [t if t is not None else -1 for t in part["ts"].to_list()],
            part["name"].to_list(),
        )
    not_program = edges.filter(pl.col("kind") != "program")
    tied = set(not_program["src"].to_list()) | set(not_program["dst"].to_list())
    runs: list[MemberRun] = []
    taken: set[int] = set()
    for call in calls.iter_rows(named=True):
        g, target = sizes[call["group_id"]]
        if g < 2 or call["ts"] is None:
            continue  # one member: no repetition tells its ops apart
        own = call["track_id"] if call["track_id"] is not None else -1
        for track, (ids, ts, names) in tracks.items():
            if track == own:
                end = ids.index(call["node_id"])
                found = _run_before(names, end, g)
                offset = 0
            else:
                lo = bisect.bisect_left(ts, call["ts"])
                hi = bisect.bisect_right(ts, call["ts"] + (call["dur"] or 0))
                found = _run_inside(names[lo:hi], g)
                offset = lo
            if found is None:
                continue
            start, block = found
            run = tuple(ids[offset + start : offset + start + g * block])
            if taken.intersection(run) or tied.intersection(run):
                continue
            taken.update(run)
            runs.append(MemberRun(run, block, g, target, call["node_id"]))
    return runs


def _block_order(g: int, target: int) -> list[int]:
    """Recorded blocks of the new run, in order: all but the last, cycled or cut, then the last."""
    inner = [b % (g - 1) for b in range(target - 1)] if g > 1 else [0] * (target - 1)
    return [*inner, g - 1]


def scale_member_ops(
    nodes: pl.DataFrame, edges: pl.DataFrame, runs: list[MemberRun]
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """One rank's graph with each run rewritten to its target number of blocks.

    Returns:
        The rank's nodes and edges, in ``NODE_SCHEMA`` and ``EDGE_SCHEMA``.
    """
    if not runs:
        return nodes, edges
    next_id = int(nodes["node_id"].max()) + 1  # type: ignore[arg-type]
    by_id = {r["node_id"]: r for r in nodes.iter_rows(named=True)}
    program = edges.filter(pl.col("kind") == "program")
    out_edge = {r["src"]: r for r in program.iter_rows(named=True)}
    in_edge = {r["dst"]: r for r in program.iter_rows(named=True)}
    dropped: set[int] = set()
    new_nodes: list[dict[str, object]] = []
    redrawn: set[int] = set()  # nodes whose program edges (in and out) are drawn anew
    new_edges: list[dict[str, object]] = []
    for run in runs:
        blocks = [run.nodes[b * run.block : (b + 1) * run.block] for b in range(run.members)]
        used: set[int] = set()
        chain: list[tuple[int, int]] = []  # (node id in the new run, recorded node it replays)
        for b in _block_order(run.members, run.target):
            for rec in blocks[b]:
                if b in used:
                    new_nodes.append({**by_id[rec], "node_id": next_id})
                    chain.append((next_id, rec))
                    next_id += 1
                else:
                    chain.append((rec, rec))
            used.add(b)
        dropped.update(n for b in range(run.members) if b not in used for n in blocks[b])
        redrawn.update(run.nodes)
        first, last = run.nodes[0], run.nodes[-1]
        if first in in_edge:  # the joint before the run, as recorded
            new_edges.append({**in_edge[first], "dst": chain[0][0]})
        block_of = {blocks[b][0]: b for b in range(run.members)}
        for (src, _), (dst, rec_dst) in itertools.pairwise(chain):
            # The gap into a block's op as recorded; into a block's first op, the recorded gap
            # between blocks (the first block's is the second's).
            start = block_of.get(rec_dst)
            gap = in_edge.get(blocks[1][0] if start == 0 else rec_dst)
            if gap is not None:
                new_edges.append({**gap, "src": src, "dst": dst})
        if last in out_edge:  # the joint after the run, as recorded
            new_edges.append({**out_edge[last], "src": chain[-1][0]})
    kept_nodes = nodes.filter(~pl.col("node_id").is_in(list(dropped)))
    if new_nodes:
        kept_nodes = pl.concat([kept_nodes, pl.DataFrame(new_nodes, schema=nodes.schema)])
    kept_edges = edges.filter(
        ~(
            (pl.col("kind") == "program")
            & (pl.col("src").is_in(list(redrawn)) | pl.col("dst").is_in(list(redrawn)))
        )
    )
    if new_edges:
        kept_edges = pl.concat([kept_edges, pl.DataFrame(new_edges, schema=edges.schema)])
    return (
        kept_nodes.cast({c: t for c, t in NODE_SCHEMA.items()}).sort("node_id"),
        kept_edges.cast({c: t for c, t in EDGE_SCHEMA.items()}),
    )


def rewrite_member_ops(
    con: duckdb.DuckDBPyConnection,
    rec_id: int,
    reps: list[int],
    sizes: dict[int, tuple[int, int]],
    rewritten: tuple[pl.DataFrame, pl.DataFrame] | None,
) -> tuple[tuple[pl.DataFrame, pl.DataFrame] | None, int]:
    """The representatives' graphs with their per-member ops at the target group sizes.

    Args:
        con: the store's connection.
        rec_id: the recorded run.
        reps: the representatives (recorded ranks).
        sizes: recorded group id → (recorded size, target size), groups whose size changes.
        rewritten: the graphs as rewritten so far (another number of microbatches), or None
            for the recorded ones.

    Returns:
        The graphs (None when nothing changed and nothing was rewritten before), and the number
        of runs rewritten.
    """
    if not sizes:
        return rewritten, 0
    if rewritten is None:
        ((calls,),) = con.execute(
            "SELECT count(*) FROM graph_node WHERE run_id = $1 AND list_contains($2, rank)"
            " AND kind = 'collective' AND list_contains($3, comm_kind)"
            " AND list_contains($4, group_id)",
            [rec_id, reps, sorted(LIST_COLLECTIVES), list(sizes)],
        ).fetchall()
        if not calls:
            return None, 0  # no list collective changes size: the graphs are copied as stored
        nodes, edges = read_graphs(con, rec_id, reps)
    else:
        nodes, edges = rewritten
    out_nodes, out_edges, n_runs = [], [], 0
    for rep in reps:
        n = nodes.filter(pl.col("rank") == rep)
        e = edges.filter(pl.col("rank") == rep)
        runs = find_member_runs(n, e, sizes)
        n_runs += len(runs)
        n, e = scale_member_ops(n, e, runs)
        out_nodes.append(n)
        out_edges.append(e)
    if not n_runs and rewritten is None:
        return None, 0
    return (pl.concat(out_nodes), pl.concat(out_edges)), n_runs

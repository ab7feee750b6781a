"""The template of a Chakra file: the run loaded from the store, the communication sizes planned,
and each graph rank's nodes in dependency order with holes where members differ."""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from prism_trace.export.chakra.rules import (
    ASTRA_COMM_TYPE,
    CHAKRA_COMM_TYPE,
    CHAKRA_NODE_TYPE,
    CTRL_EDGE_KINDS,
    INPUT_SIZED,
    MIN_COMM_BYTES,
    PRISM_DEP_KINDS_ATTR,
    PRISM_DEPS_ATTR,
    PRISM_KIND_ATTR,
    SYNC_EDGE_KINDS,
    ChakraExportError,
)
from prism_trace.export.chakra.wire import attr, micros, record_bytes
from prism_trace.formats.chakra import chakra_pb2 as pb
from prism_trace.formats.chakra.tables import PRISM_MSG_ATTR
from prism_trace.graph.chakra import PRISM_EDGE_CODES

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["CommPlan", "ExportRun", "GraphTemplate", "comm_plan", "encode_template", "load_run"]


# -- the store side -----------------------------------------------------------------------------


@dataclass
class _Group:
    group_id: int
    name: str
    description: str | None
    backend: str | None
    size: int | None
    ranks: list[int] | None
    axis: str | None


@dataclass
class ExportRun:
    """What the writer needs of a run besides its graphs (nothing per node)."""

    run_id: int
    name: str
    kind: str
    world_size: int
    ranks: list[int]
    graph_rank: dict[int, int]
    """Rank → the rank whose graph rows it uses (itself, or its class exemplar)."""
    coords: dict[int, dict[str, int]]
    represented_by: dict[int, int]
    groups: dict[int, _Group]
    member_groups: dict[int, list[int]]
    """Rank → ids of the groups listing it as a member."""
    axis_group: dict[str, np.ndarray]
    """Axis value → array over ranks of the id of that axis's group holding the rank (-1: none)."""
    class_dp: dict[tuple[int, int], int]
    """(class exemplar, dp coordinate) → rank (sliced runs)."""
    class_size: dict[int, int]


def load_run(store: Store, run: str) -> ExportRun:
    """What the writer needs of a recorded or sliced run besides its graphs, in a few queries.

    Raises:
        ChakraExportError: the run is emulated or replayed (no graph to export).
        RunNotFoundError: no such run.
    """
    con = store.con
    rows = con.execute("SELECT run_id, kind, world_size FROM run WHERE name = ?", [run]).fetchall()
    if not rows:
        store.require_run(run)  # raises with the store's message
    run_id, kind, world = int(rows[0][0]), str(rows[0][1]), rows[0][2]
    if kind not in ("recorded", "sliced"):
        msg = (
            f"{store.path}: run {run!r} is {kind}; only recorded and sliced runs have a graph"
            " to export"
        )
        raise ChakraExportError(msg)
    rank_rows = con.execute(
        "SELECT rank, class_id, represented_by, tp, cp, ep, dp, pp FROM rank"
        " WHERE run_id = ? ORDER BY rank",
        [run_id],
    ).fetchall()
    if not rank_rows:
        msg = f"{store.path}: run {run!r} has no ranks"
        raise ChakraExportError(msg)
    ranks = [int(r[0]) for r in rank_rows]
    world_size = int(world) if world else max(ranks) + 1
    graph_rank: dict[int, int] = {}
    coords: dict[int, dict[str, int]] = {}
    represented_by: dict[int, int] = {}
    for r, cls, rep, *cs in rank_rows:
        if kind == "sliced":
            if cls is None:
                msg = f"{store.path}: sliced run {run!r}: rank {r} has no class_id"
                raise ChakraExportError(msg)
            graph_rank[int(r)] = int(cls)
        else:
            graph_rank[int(r)] = int(r)
        if rep is not None:
            represented_by[int(r)] = int(rep)
        coords[int(r)] = {
            a: int(v)
            for a, v in zip(("tp", "cp", "ep", "dp", "pp"), cs, strict=True)
            if v is not None
        }
    groups = {
        int(g): _Group(
            int(g), str(name), desc, backend, size, list(rs) if rs is not None else None, axis
        )
        for g, name, desc, backend, size, rs, axis in con.execute(
            "SELECT group_id, name, description, backend, size, ranks, axis FROM comm_group"
            " WHERE run_id = ? ORDER BY group_id",
            [run_id],
        ).fetchall()
    }
    member_groups: dict[int, list[int]] = defaultdict(list)
    axis_group: dict[str, np.ndarray] = {}
    for g in groups.values():
        for m in g.ranks or ():
            member_groups[int(m)].append(g.group_id)
        if g.axis is not None and g.ranks:
            arr = axis_group.get(g.axis)
            if arr is None:
                arr = axis_group[g.axis] = np.full(world_size, -1, dtype=np.int64)
            members = np.asarray(g.ranks, dtype=np.int64)
            arr[members[(members >= 0) & (members < world_size)]] = g.group_id
    class_dp: dict[tuple[int, int], int] = {}
    class_size: dict[int, int] = Counter()
    if kind == "sliced":
        for r in ranks:
            cls = graph_rank[r]
            class_size[cls] += 1
            dp = coords[r].get("dp")
            if dp is not None:
                class_dp[(cls, dp)] = r
    return ExportRun(
        run_id=run_id,
        name=run,
        kind=kind,
        world_size=world_size,
        ranks=ranks,
        graph_rank=graph_rank,
        coords=coords,
        represented_by=represented_by,
        groups=groups,
        member_groups=dict(member_groups),
        axis_group=axis_group,
        class_dp=class_dp,
        class_size=dict(class_size),
    )


_NODE_SQL = (
    "SELECT node_id, kind, track_id, name, ts, dur, group_id, seq, peer, msg_bytes, comm_kind"
    " FROM graph_node WHERE run_id = $1 AND rank = $2 ORDER BY node_id"
)
_EDGE_SQL = (
    "SELECT src, dst, kind, anchor, delay FROM graph_edge WHERE run_id = $1 AND rank = $2"
    " ORDER BY dst, src, kind"
)


# -- templates ----------------------------------------------------------------------------------


@dataclass
class _Hole:
    """A node whose bytes differ per member rank: its fixed bytes and what to append."""

    static: bytes
    kind: str
    """``coll`` (pg_name) or ``send``/``recv`` (comm_src, comm_dst and pg_name)."""
    group_id: int | None
    peer: int | None


@dataclass
class GraphTemplate:
    """One graph encoded once: fixed records joined into runs, with holes between them."""

    graph_rank: int
    runs: list[bytes]
    """``len(holes) + 1`` fixed byte runs; the file body is runs[0] hole[0] runs[1] ..."""
    holes: list[_Hole]
    pg_init_id: int
    nodes: int
    node_types: Counter[str]
    deps: Counter[str]
    sized_by_rule: int
    single_member: int
    substituted: Counter[str]
    order_deps: int
    group_ids: set[int]
    """Groups the graph's nodes use (the graph rank's ids)."""


@dataclass
class CommPlan:
    """What the size rule and the issue order need across ranks (one small query per run).

    ``coll``: (group, seq) → (last recorded start among the members, shortest member duration);
    ``p2p``: (sender class, receiver class, seq) → shortest duration of the send and its receive.
    Classes are ranks in a recorded run and class exemplars in a sliced one.
    """

    coll: dict[tuple[int, int], tuple[int | None, int | None]]
    p2p: dict[tuple[int, int, int], int | None]
    bandwidth: float
    """Bytes per ns of the size rule (GB/s)."""


def comm_plan(store: Store, rd: ExportRun, bandwidth_gbps: float) -> CommPlan:
    """The cross-rank facts of the run's communication the size rule and issue order need."""
    con = store.con
    coll = {
        (int(g), int(q)): (ts, dur)
        for g, q, ts, dur in con.execute(
            "SELECT group_id, seq, max(ts), min(dur) FROM graph_node WHERE run_id = ?"
            " AND kind = 'collective' AND group_id IS NOT NULL AND seq IS NOT NULL"
            " GROUP BY ALL",
            [rd.run_id],
        ).fetchall()
    }
    p2p = {
        (int(src), int(dst), int(q)): dur
        for src, dst, q, dur in con.execute(
            "WITH n AS (SELECT n.kind, n.rank, n.seq, n.dur,"
            " coalesce(r.class_id, n.peer) AS peer_cls FROM graph_node n LEFT JOIN rank r"
            " ON r.run_id = n.run_id AND r.rank = n.peer WHERE n.run_id = ?"
            " AND n.kind IN ('send', 'recv') AND n.peer IS NOT NULL AND n.seq IS NOT NULL)"
            " SELECT CASE WHEN kind = 'send' THEN rank ELSE peer_cls END,"
            " CASE WHEN kind = 'send' THEN peer_cls ELSE rank END, seq, min(dur)"
            " FROM n GROUP BY ALL",
            [rd.run_id],
        ).fetchall()
    }
    return CommPlan(coll, p2p, bandwidth_gbps)


def _ring_factor(kind: str, n: int) -> float:
    """Bytes each member sends per byte of ``comm_size`` in ASTRA-sim's ring of ``n``.

    nccl-tests' bus factors, except the all-gather: ASTRA-sim takes its ``comm_size`` as each
    rank's input and moves ``(n-1) x comm_size`` (docs/network.md).
    """
    if kind in ("send", "recv") or n < 2:
        return 1.0
    if kind in ("all_reduce", "reduce"):
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "gather", "scatter"):
        return float(n - 1)
    return (n - 1) / n


def _rule_size(dur: int | None, kind: str, n: int, bandwidth: float) -> int:
    """The size rule: the bytes a ring moves in ``dur`` ns at ``bandwidth`` GB/s (≥ the floor)."""
    if kind == "barrier" or not dur or dur <= 0:
        return MIN_COMM_BYTES
    return max(MIN_COMM_BYTES, round(bandwidth * dur / _ring_factor(kind, n)))


def _node_label(run: str, rank: int, row: dict[str, Any]) -> str:
    return (
        f"run {run!r} rank {rank}: {row['kind']} node {row['node_id']} ({row['name']!r},"
        f" comm_kind {row['comm_kind']!r})"
    )


def _topo_order(
    ids: list[int], deps: dict[int, list[int]], prio: dict[int, int] | None = None
) -> list[int]:
    """Node ids in a topological order of ``deps``: the ready node of smallest (prio, id) first.

    A cycle cannot be ordered: its nodes follow by (prio, id).
    """
    prio = prio or {}
    known = set(ids)
    indeg = dict.fromkeys(ids, 0)
    children: dict[int, list[int]] = defaultdict(list)
    for dst, srcs in deps.items():
        for s in srcs:
            if s in known and s != dst and dst in indeg:
                indeg[dst] += 1
                children[s].append(dst)
    heap = [(prio.get(i, 0), i) for i, k in indeg.items() if k == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, i = heapq.heappop(heap)
        order.append(i)
        for c in children.get(i, ()):
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(heap, (prio.get(c, 0), c))
    if len(order) < len(ids):
        seen = set(order)
        order.extend(sorted((i for i in ids if i not in seen), key=lambda i: (prio.get(i, 0), i)))
    return order


def encode_template(store: Store, rd: ExportRun, graph_rank: int, plan: CommPlan) -> GraphTemplate:
    """Encode the graph of ``graph_rank`` once: fixed bytes, with holes where members differ
    (their groups, peers and process-group init node)."""
    con = store.con
    cols: tuple[str, ...] = ("node_id", "kind", "track_id", "name", "ts", "dur", "group_id")
    cols += ("seq", "peer", "msg_bytes", "comm_kind")
    nodes = [
        dict(zip(cols, row, strict=True))
        for row in con.sql(_NODE_SQL, params=[rd.run_id, graph_rank]).fetchall()
    ]
    data: dict[int, list[int]] = defaultdict(list)
    ctrl: dict[int, list[int]] = defaultdict(list)
    sync: dict[int, list[int]] = defaultdict(list)
    deps: Counter[str] = Counter()
    # Every edge as recorded (kind, anchor, delay) for prism's reader: Chakra's dependencies
    # say only "after the end", and an emulation of the read-back run needs the rest.
    exact: dict[int, tuple[list[int], list[str]]] = defaultdict(lambda: ([], []))
    for src, dst, kind, anchor, delay in con.sql(
        _EDGE_SQL, params=[rd.run_id, graph_rank]
    ).fetchall():
        ints, kinds = exact[dst]
        code = (
            2 * PRISM_EDGE_CODES.index(kind) + (anchor == "start")
            if kind in PRISM_EDGE_CODES
            else -1
        )
        ints.extend((int(src), int(delay or 0), code))
        kinds.append(f"{kind}@{anchor or 'end'}")
        if kind in SYNC_EDGE_KINDS:
            bucket, name = sync, "sync_deps"
        elif kind in CTRL_EDGE_KINDS:
            bucket, name = ctrl, "ctrl_deps"
        else:
            bucket, name = data, "data_deps"
        if src not in bucket[dst]:
            bucket[dst].append(int(src))
            deps[name] += 1
    by_id = {n["node_id"]: n for n in nodes}

    def group_size(gid: int | None) -> int:
        if gid is None or gid not in rd.groups:
            return rd.world_size
        g = rd.groups[gid]
        return int(g.size) if g.size is not None else len(g.ranks or ()) or rd.world_size

    # What ASTRA-sim runs as communication (one at a time per rank, matched by issue order),
    # and when each was issued: the last member's recorded start for a collective (no member
    # can finish it earlier), the node's own start otherwise.
    prio: dict[int, int] = {}
    slot: set[int] = set()
    for n in nodes:
        nid, kind = n["node_id"], n["kind"]
        t = int(n["ts"]) if n["ts"] is not None else 0
        if kind == "collective" and group_size(n["group_id"]) > 1:
            slot.add(nid)
            key = plan.coll.get((n["group_id"], n["seq"])) if n["group_id"] is not None else None
            if key is not None and key[0] is not None:
                t = max(t, int(key[0]))
        elif kind == "send":
            slot.add(nid)
        prio[nid] = t
    both = {k: data.get(k, []) + ctrl.get(k, []) for k in set(data) | set(ctrl)}
    order = _topo_order(list(by_id), both, prio)
    # Chain the communication in that order: ASTRA-sim then issues it as recorded on every
    # rank, whatever else is ready first. The added deps are listed in ``order_deps``.
    added: dict[int, int] = {}
    prev: int | None = None
    for nid in order:
        if nid in slot:
            if prev is not None and prev not in data.get(nid, ()):
                added[nid] = prev
            prev = nid
    pg_init_id = (max(by_id) + 1) if by_id else 0
    start_id = pg_init_id + 1

    runs: list[bytes] = []
    holes: list[_Hole] = []
    current: list[bytes] = []
    types: Counter[str] = Counter()
    sized = single = 0
    subst: Counter[str] = Counter()
    used_groups: set[int] = set()
    for nid in order:
        row = by_id[nid]
        kind = row["kind"]
        ntype = CHAKRA_NODE_TYPE.get(kind)
        if ntype is None:
            msg = f"{store.path}: {_node_label(rd.name, graph_rank, row)}: no Chakra node type"
            raise ChakraExportError(msg)
        gid = row["group_id"]
        n_members = group_size(gid)
        if kind == "collective" and n_members <= 1:
            ntype = pb.COMP_NODE
            single += 1
        dd = list(data.get(nid, []))
        if nid in added:
            dd.append(added[nid])
        gated = not dd and not ctrl.get(nid)
        if gated:  # a root: after the start node, so that METADATA is issued first
            dd.append(start_id)
        node = pb.Node(
            id=nid,
            name=row["name"] or "",
            type=ntype,
            data_deps=dd,
            ctrl_deps=ctrl.get(nid, []),
            duration_micros=micros(row["dur"]),
        )
        if row["ts"] is not None and row["ts"] > 0:
            node.start_time_micros = (int(row["ts"]) + 500) // 1000
        node.attr.append(attr("is_cpu_op", bool_val=kind == "host"))
        if row["track_id"] is not None:
            node.attr.append(attr("tid", int64_val=int(row["track_id"])))
        if kind in ("memcpy", "memset") or ntype != CHAKRA_NODE_TYPE[kind]:
            node.attr.append(attr(PRISM_KIND_ATTR, string_val=kind))
        if nid in added or gated:
            extra = added.get(nid, start_id)
            node.attr.append(attr("order_deps", int64_list=pb.Int64List(values=[extra])))
        if nid in sync:
            node.attr.append(attr("sync_deps", int64_list=pb.Int64List(values=sync[nid])))
        if nid in exact:
            ints, kinds = exact[nid]
            node.attr.append(attr(PRISM_DEPS_ATTR, int64_list=pb.Int64List(values=ints)))
            if -1 in ints[2::3]:
                node.attr.append(
                    attr(PRISM_DEP_KINDS_ATTR, string_list=pb.StringList(values=kinds))
                )
        types[pb.NodeType.Name(ntype)] += 1
        hole: _Hole | None = None
        if kind in ("collective", "send", "recv"):
            size = row["msg_bytes"]
            if size is None or size <= 0:
                if kind == "collective":
                    k = plan.coll.get((gid, row["seq"])) if gid is not None else None
                    took: int | None = k[1] if k is not None and k[1] is not None else row["dur"]
                else:
                    peer = row["peer"]
                    pcls = rd.graph_rank.get(int(peer), int(peer)) if peer is not None else -1
                    key = (graph_rank, pcls) if kind == "send" else (pcls, graph_rank)
                    took = plan.p2p.get((*key, int(row["seq"] or 0)), row["dur"])
                ck = row["comm_kind"] if kind == "collective" else kind
                size = _rule_size(took, ck or "", n_members, plan.bandwidth)
                sized += 1
                node.attr.append(attr("comm_size_rule", bool_val=True))
            elif kind == "collective" and row["comm_kind"] in INPUT_SIZED and n_members > 1:
                # An ALL_GATHER's comm_size is each member's input (docs/export.md).
                msg_bytes = int(size)
                size = -(-msg_bytes // n_members)
                if size * n_members != msg_bytes:
                    node.attr.append(attr(PRISM_MSG_ATTR, int64_val=msg_bytes))
            node.attr.append(attr("comm_size", int64_val=int(size)))
            if gid is not None:
                gid = int(gid)
                if gid not in rd.groups:
                    msg = (
                        f"{store.path}: {_node_label(rd.name, graph_rank, row)}: group {gid}"
                        " is not in comm_group"
                    )
                    raise ChakraExportError(msg)
                used_groups.add(gid)
            if kind == "collective":
                ck = row["comm_kind"] or ""
                ct = CHAKRA_COMM_TYPE.get(ck)
                if ct is None:
                    msg = (
                        f"{store.path}: {_node_label(rd.name, graph_rank, row)}: collective kind"
                        f" {row['comm_kind']!r} has no Chakra comm_type"
                        f" (known: {', '.join(CHAKRA_COMM_TYPE)})"
                    )
                    raise ChakraExportError(msg)
                if gid is None:
                    msg = (
                        f"{store.path}: {_node_label(rd.name, graph_rank, row)}: a collective"
                        " without a communicator has no pg_name"
                    )
                    raise ChakraExportError(msg)
                if ck in ASTRA_COMM_TYPE and ntype == pb.COMM_COLL_NODE:
                    ct = ASTRA_COMM_TYPE[ck][0]
                    subst[ck] += 1
                    node.attr.append(attr("prism_comm_kind", string_val=ck))
                node.attr.append(attr("comm_type", int64_val=ct))
                hole = _Hole(b"", "coll", gid, None)
            else:
                if row["peer"] is None:
                    msg = (
                        f"{store.path}: {_node_label(rd.name, graph_rank, row)}: a {kind}"
                        " without a peer has no comm_src/comm_dst (the trace names no peer:"
                        " `prism graph` lists the unmatched calls; record with a PyTorch whose"
                        " traces carry the peer, e.g. record_param_comms)"
                    )
                    raise ChakraExportError(msg)
                node.attr.append(attr("comm_tag", int32_val=int(row["seq"] or 0)))
                hole = _Hole(b"", kind, gid, int(row["peer"]))
        payload = node.SerializeToString()
        if hole is None:
            current.append(record_bytes(payload))
        else:
            hole.static = payload
            runs.append(b"".join(current))
            current = []
            holes.append(hole)
    runs.append(b"".join(current))
    deps["data_deps"] += len(added)
    return GraphTemplate(
        graph_rank=graph_rank,
        runs=runs,
        holes=holes,
        pg_init_id=pg_init_id,
        nodes=len(order),
        node_types=types,
        deps=deps,
        sized_by_rule=sized,
        single_member=single,
        substituted=subst,
        order_deps=len(added),
        group_ids=used_groups,
    )

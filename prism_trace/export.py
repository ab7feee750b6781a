"""Writers from the store to other tools' formats: Chakra ET (one protobuf file per rank).

Chakra ET (``export_chakra``): every rank of a recorded or sliced run becomes
``<prefix>.<rank>.et``, a stream of length-delimited protobuf records (the framing of
``chakra.src.third_party.utils.protolib.encodeMessage``): one ``GlobalMetadata``, one
``## process_group:init ##`` metadata node listing the rank's own communicators, then the
``Node`` messages of its execution graph in a topological order; and ``comm_groups.json``, the
communicators as ASTRA-sim's ``--comm-group-configuration`` (``pg_name`` is a decimal key of it).
The files are written for ASTRA-sim to run to completion: every communication node has a size
(the recorded one, else the size rule), copies and one-member collectives are compute, kinds it
does not simulate are substituted (with a warning), each rank issues its communication in the
recorded order (``order_deps``), and ``sync`` edges are an attribute, never a dependency. Every
edge is also kept exactly (``prism_deps``) for prism's own reader. The mapping is in
docs/export.md.

A sliced run stores one graph per class under its exemplar rank; the exporter encodes that
graph once as a template and writes each member rank's file by patching only what differs
(``pg_name`` of the member's own group of the same axis, ``comm_src``/``comm_dst`` of p2p nodes
shifted by the member's dp offset), so no more than one class's graph is in memory at once.
"""

from __future__ import annotations

import heapq
import json
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from prism_trace.errors import PrismError
from prism_trace.formats import chakra_pb2 as pb
from prism_trace.formats.chakra import NODE_COUNT_ATTR

if TYPE_CHECKING:
    from prism_trace.store import Store

__all__ = [
    "CHAKRA_COMM_TYPE",
    "CHAKRA_NODE_TYPE",
    "CHAKRA_SCHEMA",
    "CTRL_EDGE_KINDS",
    "PG_INIT_NAME",
    "SIZE_BANDWIDTH_GBPS",
    "SYNC_EDGE_KINDS",
    "ChakraExportError",
    "ExportReport",
    "export_chakra",
    "sanitize_prefix",
]

CHAKRA_VERSION = "0.0.4"
"""``GlobalMetadata.version`` of the files written (the Chakra schema they follow)."""

CHAKRA_SCHEMA = "prism-trace-1-chakra.0.0.4"
"""The ``schema`` attribute of ``GlobalMetadata``: who wrote the file, and for which Chakra."""

PG_INIT_NAME = "## process_group:init ##"
"""Name of the metadata node listing the rank's communicators (the PyTorch converter's)."""

CHAKRA_NODE_TYPE: dict[str, int] = {
    "host": pb.COMP_NODE,
    "kernel": pb.COMP_NODE,
    "memcpy": pb.COMP_NODE,
    "memset": pb.COMP_NODE,
    "collective": pb.COMM_COLL_NODE,
    "send": pb.COMM_SEND_NODE,
    "recv": pb.COMM_RECV_NODE,
}
"""``graph_node.kind`` → Chakra ``NodeType``. Copies are COMP_NODEs: ASTRA-sim runs a
MEM_LOAD/MEM_STORE node as a remote-memory transfer, which a recorded device copy is not (and
the graph has no copy size). A collective on a group of one member is a COMP_NODE too."""

PRISM_DEPS_ATTR = "prism_deps"
"""Node attribute (int64 list): ``src, delay, code`` of each incoming ``graph_edge``, so that
prism's reader restores every edge exactly; ``code = 2 * PRISM_EDGE_CODES.index(kind) + (anchor
== "start")``, or -1 when the kind is not in the table (then ``prism_dep_kinds`` says)."""

PRISM_DEP_KINDS_ATTR = "prism_dep_kinds"
"""Node attribute (string list), only where a kind has no code: ``kind@anchor`` of each
incoming edge, in the order of ``prism_deps``."""

PRISM_EDGE_CODES = ("program", "launch", "stream", "wait", "sync", "comm", "data", "ctrl")
"""Edge kinds with a code in ``prism_deps`` (fixed: files written today must read back later)."""

PRISM_KIND_ATTR = "prism_kind"
"""Node attribute (string) naming the ``graph_node.kind`` where the Chakra type loses it."""

ASTRA_COMM_TYPE: dict[str, tuple[int, str]] = {
    "reduce": (pb.ALL_REDUCE, "ALL_REDUCE"),
    "gather": (pb.ALL_GATHER, "ALL_GATHER"),
    "scatter": (pb.ALL_GATHER, "ALL_GATHER"),
    "barrier": (pb.ALL_REDUCE, "ALL_REDUCE"),
}
"""Collective kinds ASTRA-sim (c459ab6) does not simulate (the rank hangs), → the simulated
kind of the same ring traffic written instead. The recorded kind stays in ``prism_comm_kind``."""

SIZE_BANDWIDTH_GBPS = 50.0
"""Default bus bandwidth (GB/s) of the size rule for communication without a recorded size."""

MIN_COMM_BYTES = 4096
"""Smallest ``comm_size`` written: ASTRA-sim splits a collective into chunks per step and
member, and a 0-byte chunk never completes."""

CHAKRA_COMM_TYPE: dict[str, int] = {
    "all_reduce": pb.ALL_REDUCE,
    "all_gather": pb.ALL_GATHER,
    "reduce_scatter": pb.REDUCE_SCATTER,
    "all_to_all": pb.ALL_TO_ALL,
    "broadcast": pb.BROADCAST,
    "reduce": pb.REDUCE,
    "gather": pb.GATHER,
    "scatter": pb.SCATTER,
    "barrier": pb.BARRIER,
}
"""``graph_node.comm_kind`` of a collective → Chakra ``CollectiveCommType`` (``comm_type``)."""

CTRL_EDGE_KINDS = ("ctrl",)
"""Edge kinds written as ``ctrl_deps``; ``sync`` goes to ``sync_deps`` and every other kind
becomes a ``data_dep``."""

SYNC_EDGE_KINDS = ("sync",)
"""Edge kinds written as the ``sync_deps`` attribute (an int64 list): "the end of this node
waits for that one" has no Chakra form, and as a dependency it closes cycles."""

_VARINT_CACHE = 1 << 14


class ChakraExportError(PrismError, ValueError):
    """A run cannot be written as Chakra ET: a node, group or peer has no Chakra form."""


@dataclass
class ExportReport:
    """What ``export_chakra`` wrote: enough for the CLI to print and for tests to assert."""

    run: str
    run_id: int
    kind: str
    out_dir: Path
    prefix: str
    world_size: int
    files: int = 0
    templates: int = 0
    """Graphs encoded (one per recorded rank, or one per class of a sliced run)."""
    nodes: int = 0
    """Graph nodes written over all files (the metadata nodes not counted)."""
    deps: dict[str, int] = field(default_factory=dict)
    """Dependencies written over all files: ``data_deps`` and ``ctrl_deps``."""
    node_types: dict[str, int] = field(default_factory=dict)
    """Nodes written by Chakra ``NodeType`` name."""
    bytes: int = 0
    built_graph: bool = False
    sized_by_rule: int = 0
    """Communication nodes without a recorded size, whose ``comm_size`` the size rule gave."""
    size_bandwidth_gbps: float = SIZE_BANDWIDTH_GBPS
    """Bus bandwidth of the size rule."""
    single_member: int = 0
    """Collectives on a one-member group, written as COMP_NODEs."""
    substituted: dict[str, int] = field(default_factory=dict)
    """Collectives ASTRA-sim does not simulate, by recorded kind, written as another kind."""
    order_deps: int = 0
    """``data_deps`` added so that every rank issues its communication in the recorded order."""
    comm_groups: int = 0
    """Groups written to ``comm_groups.json``."""
    elapsed_s: float = 0.0

    def warnings(self) -> list[str]:
        """What ASTRA-sim will not see as recorded (one line each)."""
        out = []
        for kind, n in sorted(self.substituted.items()):
            astra = ASTRA_COMM_TYPE[kind][1]
            out.append(
                f"warning: {n} {kind} collectives written as {astra} (ASTRA-sim simulates no"
                f" {kind.upper()}); the recorded kind is in attribute prism_comm_kind"
            )
        return out

    def summary(self) -> str:
        """One paragraph: what was written where, and how fast."""
        types = ", ".join(f"{k} {v}" for k, v in sorted(self.node_types.items()))
        deps = ", ".join(f"{k} {v}" for k, v in sorted(self.deps.items()))
        lines = [
            f"run {self.run!r} ({self.kind}, world {self.world_size}): {self.files} Chakra ET"
            f" files {self.out_dir}/{self.prefix}.<rank>.et, {self.bytes / 1e6:.1f} MB,"
            f" {self.elapsed_s:.2f} s",
            f"{self.templates} graphs encoded, {self.nodes} nodes written ({types}); {deps}",
            f"{self.comm_groups} communicator groups in {self.out_dir}/comm_groups.json"
            f" (pg_name = its key; run: astra-sim --workload {self.out_dir}/{self.prefix}"
            f" --npus {self.world_size} --comm-groups {self.out_dir}/comm_groups.json)",
        ]
        if self.built_graph:
            lines.append("the run had no graph: build_graph wrote it first")
        if self.sized_by_rule:
            lines.append(
                f"{self.sized_by_rule} communication nodes have no recorded size: comm_size ="
                f" {self.size_bandwidth_gbps:g} GB/s x the shortest duration among the"
                " instance's members / the ring's traffic factor (docs/export.md)"
            )
        if self.single_member:
            lines.append(f"{self.single_member} collectives on one-member groups: COMP_NODEs")
        if self.order_deps:
            lines.append(
                f"{self.order_deps} data_deps added to issue communication in the recorded order"
            )
        lines.extend(self.warnings())
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (for ``--json``)."""
        return {
            "run": self.run,
            "run_id": self.run_id,
            "kind": self.kind,
            "out_dir": str(self.out_dir),
            "prefix": self.prefix,
            "world_size": self.world_size,
            "files": self.files,
            "templates": self.templates,
            "nodes": self.nodes,
            "deps": dict(self.deps),
            "node_types": dict(self.node_types),
            "bytes": self.bytes,
            "built_graph": self.built_graph,
            "sized_by_rule": self.sized_by_rule,
            "size_bandwidth_gbps": self.size_bandwidth_gbps,
            "single_member": self.single_member,
            "substituted": dict(self.substituted),
            "order_deps": self.order_deps,
            "comm_groups": self.comm_groups,
            "warnings": self.warnings(),
            "elapsed_s": round(self.elapsed_s, 3),
        }


# -- wire format helpers ------------------------------------------------------------------------


def _varint_uncached(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_VARINTS = [_varint_uncached(i) for i in range(_VARINT_CACHE)]


def _varint(n: int) -> bytes:
    return _VARINTS[n] if n < _VARINT_CACHE else _varint_uncached(n)


def _record(payload: bytes) -> bytes:
    """One length-delimited record, as ``protolib.encodeMessage`` frames it."""
    return _varint(len(payload)) + payload


def _attr(name: str, **value: Any) -> pb.AttributeProto:
    return pb.AttributeProto(name=name, **value)


def _attrs_bytes(*attrs: pb.AttributeProto) -> bytes:
    """Wire bytes of ``attrs`` as Node fields: appended to a Node's bytes they add its attrs."""
    return pb.Node(attr=list(attrs)).SerializeToString()


def _micros(ns: int | None) -> int:
    """ns → whole µs, rounded half up; a positive duration never becomes 0 (absent)."""
    if ns is None or ns <= 0:
        return 0
    return max(1, (int(ns) + 500) // 1000)


def sanitize_prefix(name: str) -> str:
    """A file-name prefix from a run name: other characters than ``[A-Za-z0-9_-]`` → ``_``."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or "run"


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
class _Run:
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


def _load_run(store: Store, run: str) -> _Run:
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
    return _Run(
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
class _Template:
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
class _CommPlan:
    """What the size rule and the issue order need across ranks (one small query per run).

    ``coll``: (group, seq) → (last recorded start among the members, shortest member duration);
    ``p2p``: (sender class, receiver class, seq) → shortest duration of the send and its receive.
    Classes are ranks in a recorded run and class exemplars in a sliced one.
    """

    coll: dict[tuple[int, int], tuple[int | None, int | None]]
    p2p: dict[tuple[int, int, int], int | None]
    bandwidth: float
    """Bytes per ns of the size rule (GB/s)."""


def _comm_plan(store: Store, rd: _Run, bandwidth_gbps: float) -> _CommPlan:
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
    return _CommPlan(coll, p2p, bandwidth_gbps)


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


def _template(store: Store, rd: _Run, graph_rank: int, plan: _CommPlan) -> _Template:
    con = store.con
    cols = ("node_id", "kind", "track_id", "name", "ts", "dur", "group_id", "seq", "peer")
    cols += ("msg_bytes", "comm_kind")
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
        node = pb.Node(
            id=nid,
            name=row["name"] or "",
            type=ntype,
            data_deps=dd,
            ctrl_deps=ctrl.get(nid, []),
            duration_micros=_micros(row["dur"]),
        )
        if row["ts"] is not None and row["ts"] > 0:
            node.start_time_micros = (int(row["ts"]) + 500) // 1000
        node.attr.append(_attr("is_cpu_op", bool_val=kind == "host"))
        if row["track_id"] is not None:
            node.attr.append(_attr("tid", int64_val=int(row["track_id"])))
        if kind in ("memcpy", "memset") or ntype != CHAKRA_NODE_TYPE[kind]:
            node.attr.append(_attr(PRISM_KIND_ATTR, string_val=kind))
        if nid in added:
            node.attr.append(_attr("order_deps", int64_list=pb.Int64List(values=[added[nid]])))
        if nid in sync:
            node.attr.append(_attr("sync_deps", int64_list=pb.Int64List(values=sync[nid])))
        if nid in exact:
            ints, kinds = exact[nid]
            node.attr.append(_attr(PRISM_DEPS_ATTR, int64_list=pb.Int64List(values=ints)))
            if -1 in ints[2::3]:
                node.attr.append(
                    _attr(PRISM_DEP_KINDS_ATTR, string_list=pb.StringList(values=kinds))
                )
        types[pb.NodeType.Name(ntype)] += 1
        hole: _Hole | None = None
        if kind in ("collective", "send", "recv"):
            size = row["msg_bytes"]
            if size is None or size <= 0:
                if kind == "collective":
                    k = plan.coll.get((gid, row["seq"])) if gid is not None else None
                    t = k[1] if k is not None and k[1] is not None else row["dur"]
                else:
                    peer = row["peer"]
                    pcls = rd.graph_rank.get(int(peer), int(peer)) if peer is not None else -1
                    key = (graph_rank, pcls) if kind == "send" else (pcls, graph_rank)
                    t = plan.p2p.get((*key, int(row["seq"] or 0)), row["dur"])
                ck = row["comm_kind"] if kind == "collective" else kind
                size = _rule_size(t, ck or "", n_members, plan.bandwidth)
                sized += 1
                node.attr.append(_attr("comm_size_rule", bool_val=True))
            node.attr.append(_attr("comm_size", int64_val=int(size)))
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
                    node.attr.append(_attr("prism_comm_kind", string_val=ck))
                node.attr.append(_attr("comm_type", int64_val=ct))
                hole = _Hole(b"", "coll", gid, None)
            else:
                if row["peer"] is None:
                    msg = (
                        f"{store.path}: {_node_label(rd.name, graph_rank, row)}: a {kind}"
                        " without a peer has no comm_src/comm_dst"
                    )
                    raise ChakraExportError(msg)
                node.attr.append(_attr("comm_tag", int32_val=int(row["seq"] or 0)))
                hole = _Hole(b"", kind, gid, int(row["peer"]))
        payload = node.SerializeToString()
        if hole is None:
            current.append(_record(payload))
        else:
            hole.static = payload
            runs.append(b"".join(current))
            current = []
            holes.append(hole)
    runs.append(b"".join(current))
    deps["data_deps"] += len(added)
    return _Template(
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


# -- per member ---------------------------------------------------------------------------------


class _Writer:
    """Writes member files from templates; caches what repeats across members."""

    def __init__(self, store: Store, rd: _Run, out_dir: Path, prefix: str) -> None:
        self.store = store
        self.rd = rd
        self.out_dir = out_dir
        self.prefix = prefix
        self._pg_attr: dict[int, bytes] = {}
        self._pg_json: dict[int, str] = {}
        self.astra_id = {gid: i + 1 for i, gid in enumerate(sorted(rd.groups))}
        """group_id → ASTRA-sim's decimal communicator id (≥ 1: its feeder needs one)."""

    def path(self, rank: int) -> Path:
        return self.out_dir / f"{self.prefix}.{rank}.et"

    # groups and peers of a member

    def group_of(self, tpl: _Template, gid: int, rank: int) -> int:
        """The member's own group for the template's group ``gid`` (same axis)."""
        if rank == tpl.graph_rank:
            return gid
        g = self.rd.groups[gid]
        arr = self.rd.axis_group.get(g.axis) if g.axis is not None else None
        new = int(arr[rank]) if arr is not None else -1
        if new < 0:
            msg = (
                f"{self.store.path}: run {self.rd.name!r} rank {rank}: no `{g.axis}` group holds"
                f" it (its class exemplar {tpl.graph_rank} uses group {g.name!r})"
            )
            raise ChakraExportError(msg)
        return new

    def peer_of(self, tpl: _Template, peer: int, rank: int) -> int:
        """The member's peer: the exemplar's peer shifted by the member's dp offset."""
        if rank == tpl.graph_rank:
            return peer
        rd = self.rd
        ex = tpl.graph_rank
        cls = rd.graph_rank.get(peer)
        dp_peer = rd.coords.get(peer, {}).get("dp")
        dp_r = rd.coords[rank].get("dp")
        dp_ex = rd.coords[ex].get("dp")
        new = None
        if cls is not None and dp_peer is not None and dp_r is not None and dp_ex is not None:
            n = rd.class_size.get(cls, 0)
            if n:
                new = rd.class_dp.get((cls, (dp_peer + dp_r - dp_ex) % n))
        if new is None:
            msg = (
                f"{self.store.path}: run {rd.name!r} rank {rank}: cannot shift peer {peer} of"
                f" exemplar {ex} by the dp offset (missing coordinates or class)"
            )
            raise ChakraExportError(msg)
        return new

    def pg_attr(self, gid: int) -> bytes:
        b = self._pg_attr.get(gid)
        if b is None:
            b = self._pg_attr[gid] = _attrs_bytes(
                _attr("pg_name", string_val=str(self.astra_id[gid]))
            )
        return b

    def group_json(self, gid: int) -> str:
        s = self._pg_json.get(gid)
        if s is None:
            g = self.rd.groups[gid]
            size = g.size if g.size is not None else len(g.ranks or [])
            world = size == self.rd.world_size and g.ranks is not None
            backend = g.backend or ""
            config = (
                "cpu:gloo,cuda:gloo"
                if backend == "gloo"
                else (f"cuda:{backend}" if backend else "")
            )
            s = self._pg_json[gid] = json.dumps(
                {
                    "pg_name": str(self.astra_id[gid]),
                    "pg_desc": g.name,
                    "description": g.description,
                    "backend_config": config,
                    # A world-sized group lists no ranks (the converter's convention).
                    "ranks": [] if world else list(g.ranks or []),
                    "group_size": size,
                    "pg_size": size,
                    "axis": g.axis,
                }
            )
        return s

    def members(self, gid: int) -> list[int] | None:
        """The group's ranks (a world-sized group without a list: every rank)."""
        g = self.rd.groups[gid]
        if g.ranks is not None:
            return sorted(int(r) for r in g.ranks)
        if g.size is not None and g.size == self.rd.world_size:
            return list(range(self.rd.world_size))
        return None

    def write_comm_groups(self) -> int:
        """``comm_groups.json``: ASTRA-sim's ``--comm-group-configuration`` (id → ranks).

        Written one group at a time (12 292 groups at 8192 ranks), never as one dict.
        """
        path = self.out_dir / "comm_groups.json"
        n = 0
        with path.open("w") as fh:
            fh.write("{")
            for gid in sorted(self.rd.groups):
                ranks = self.members(gid)
                if ranks is None:
                    continue
                fh.write(("," if n else "") + f'\n"{self.astra_id[gid]}": {json.dumps(ranks)}')
                n += 1
            fh.write("\n}\n")
        return n

    # records

    def metadata(self, tpl: _Template, rank: int, nodes: int) -> bytes:
        """The ``GlobalMetadata`` record; ``nodes`` (the Node records that follow) lets the reader
        tell a file cut at a record boundary from a shorter graph (``NODE_COUNT_ATTR``)."""
        rd = self.rd
        gm = pb.GlobalMetadata(version=CHAKRA_VERSION)
        gm.attr.extend(
            [
                _attr("schema", string_val=CHAKRA_SCHEMA),
                _attr("world_size", int64_val=rd.world_size),
                _attr("rank", int64_val=rank),
                _attr("run", string_val=rd.name),
                _attr("run_kind", string_val=rd.kind),
                _attr(NODE_COUNT_ATTR, int64_val=nodes),
            ]
        )
        if rd.kind == "sliced":
            gm.attr.append(_attr("class_id", int64_val=tpl.graph_rank))
            if rank in rd.represented_by:
                gm.attr.append(_attr("represented_by", int64_val=rd.represented_by[rank]))
        for a, v in rd.coords.get(rank, {}).items():
            gm.attr.append(_attr(a, int64_val=v))
        return _record(gm.SerializeToString())

    def pg_init(self, tpl: _Template, rank: int) -> bytes:
        gids = set(self.rd.member_groups.get(rank, ()))
        gids |= {self.group_of(tpl, g, rank) for g in tpl.group_ids}
        if not gids:
            return b""
        text = "[" + ", ".join(self.group_json(g) for g in sorted(gids)) + "]"
        node = pb.Node(
            id=tpl.pg_init_id,
            name=PG_INIT_NAME,
            type=pb.METADATA_NODE,
            inputs=pb.IOInfo(values=repr([text]), shapes="[[]]", types="['String']"),
        )
        node.attr.append(_attr("is_cpu_op", bool_val=True))
        return _record(node.SerializeToString())

    def write(self, tpl: _Template, rank: int) -> int:
        """Write ``rank``'s file from ``tpl``; return its size in bytes."""
        suffix: dict[tuple[str, int | None, int | None], bytes] = {}
        pg_init = self.pg_init(tpl, rank)
        nodes = tpl.nodes + (1 if pg_init else 0)
        parts = [self.metadata(tpl, rank, nodes), pg_init, tpl.runs[0]]
        for hole, run_bytes in zip(tpl.holes, tpl.runs[1:], strict=True):
            key = (hole.kind, hole.group_id, hole.peer)
            tail = suffix.get(key)
            if tail is None:
                pg = (
                    b""
                    if hole.group_id is None
                    else self.pg_attr(self.group_of(tpl, hole.group_id, rank))
                )
                if hole.kind == "coll":
                    tail = pg
                else:
                    assert hole.peer is not None  # set for every send/recv hole
                    peer = self.peer_of(tpl, hole.peer, rank)
                    src, dst = (rank, peer) if hole.kind == "send" else (peer, rank)
                    tail = pg + _attrs_bytes(
                        _attr("comm_src", int32_val=src), _attr("comm_dst", int32_val=dst)
                    )
                suffix[key] = tail
            parts.append(_varint(len(hole.static) + len(tail)))
            parts.append(hole.static)
            parts.append(tail)
            parts.append(run_bytes)
        data = b"".join(parts)
        self.path(rank).write_bytes(data)
        return len(data)


# -- entry point --------------------------------------------------------------------------------


def export_chakra(
    store: Store,
    *,
    run: str,
    out_dir: Path,
    prefix: str | None = None,
    progress: bool = False,
    size_bandwidth_gbps: float = SIZE_BANDWIDTH_GBPS,
) -> ExportReport:
    """Write every rank of ``run`` as a Chakra ET file ``<out_dir>/<prefix>.<rank>.et``.

    A recorded run exports each rank's own graph (built first when the run has none); a sliced
    run encodes each class's graph once and writes one file per member rank, patching its group
    names and p2p peers. See docs/export.md for the mapping.

    Args:
        store: an open store (writable when the recorded run's graph must be built).
        run: the run to export (recorded or sliced).
        out_dir: the folder to write into (created when missing).
        prefix: file-name prefix (default: the run name with other characters than
            ``[A-Za-z0-9_-]`` replaced by ``_``).
        progress: show a progress bar (stderr).
        size_bandwidth_gbps: bus bandwidth of the size rule for communication without a
            recorded size (docs/export.md).

    Returns:
        What was written.

    Raises:
        ChakraExportError: the run is neither recorded nor sliced, a node has no Chakra form
            (the message names it), a member's group or peer cannot be derived, the prefix is
            not a plain name, or ``out_dir`` holds files of this prefix for ranks the run lacks.
        PrismError: no such run.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    prefix = sanitize_prefix(run) if prefix is None else prefix
    if not prefix or "/" in prefix or "\\" in prefix or prefix in (".", ".."):
        msg = f"{out_dir}: `prefix` {prefix!r} is not a plain file-name prefix"
        raise ChakraExportError(msg)
    rd = _load_run(store, run)
    if out_dir.is_dir():
        ours = set(rd.ranks)
        pat = re.compile(re.escape(prefix) + r"\.(\d+)\.et$")
        stray = sorted(
            p.name
            for p in out_dir.iterdir()
            if (m := pat.match(p.name)) is not None and int(m.group(1)) not in ours
        )
        if stray:
            msg = (
                f"{out_dir}: holds {stray[0]!r} ({len(stray)} such files), a rank run {run!r}"
                " lacks; an ingest of the folder would mix them in: use an empty folder"
            )
            raise ChakraExportError(msg)
    built = False
    if rd.kind == "recorded":
        rows = store.con.execute(
            "SELECT count(*) FROM graph_node WHERE run_id = ?", [rd.run_id]
        ).fetchall()
        if not rows[0][0]:
            from prism_trace.graph import build_graph

            build_graph(store, run)
            built = True
    out_dir.mkdir(parents=True, exist_ok=True)

    members: dict[int, list[int]] = defaultdict(list)
    for r in rd.ranks:
        members[rd.graph_rank[r]].append(r)
    report = ExportReport(
        run=run,
        run_id=rd.run_id,
        kind=rd.kind,
        out_dir=out_dir,
        prefix=prefix,
        world_size=rd.world_size,
        built_graph=built,
    )
    if not size_bandwidth_gbps > 0:
        msg = f"{out_dir}: size bandwidth {size_bandwidth_gbps!r} GB/s is not positive"
        raise ChakraExportError(msg)
    report.size_bandwidth_gbps = size_bandwidth_gbps
    writer = _Writer(store, rd, out_dir, prefix)
    plan = _comm_plan(store, rd, size_bandwidth_gbps)
    types: Counter[str] = Counter()
    deps: Counter[str] = Counter()
    subst: Counter[str] = Counter()
    with tqdm(total=len(rd.ranks), unit="rank", disable=not progress, desc="export") as bar:
        for graph_rank in sorted(members):
            tpl = _template(store, rd, graph_rank, plan)
            report.templates += 1
            n = len(members[graph_rank])
            for r in members[graph_rank]:
                report.bytes += writer.write(tpl, r)
                bar.update(1)
            report.files += n
            report.nodes += tpl.nodes * n
            report.sized_by_rule += tpl.sized_by_rule * n
            report.single_member += tpl.single_member * n
            report.order_deps += tpl.order_deps * n
            for k, v in tpl.substituted.items():
                subst[k] += v * n
            for k, v in tpl.node_types.items():
                types[k] += v * n
            for k, v in tpl.deps.items():
                deps[k] += v * n
            del tpl
    report.comm_groups = writer.write_comm_groups()
    report.node_types = dict(types)
    report.deps = dict(deps)
    report.substituted = dict(subst)
    report.elapsed_s = time.perf_counter() - t0
    return report

"""The tables of one Chakra file, built from the nodes its reader collected (``Graph``).

Events, tracks and flows are column lists; collectives and p2p are numbered in a topological
order of the dependency graph (Chakra has no timestamps); process groups come from a
``process_group:init`` node or default to the world (see ``chakra``'s docstring for the mapping).
"""

from __future__ import annotations

import ast
import heapq
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from prism_trace.errors import TraceFormatError, TruncatedTraceError
from prism_trace.formats.base import FRAME_SCHEMAS, TraceTables
from prism_trace.formats.chakra import chakra_pb2 as pb
from prism_trace.formats.chakra.records import comm_bytes, node_label
from prism_trace.limits import (
    INT64_MAX,
    MAX_RANKS,
    check_count,
    check_int,
    check_rank,
    check_text,
    check_world_size,
    wrong_type,
)

__all__ = [
    "DEFAULT_GROUP",
    "NODE_COUNT_ATTR",
    "PRISM_MSG_ATTR",
    "PRISM_SCHEMA_PREFIX",
    "Graph",
    "build",
    "parse_pg_init",
]

_MAX_MICROS = 1 << 53
"""A Chakra time in µs below this fits a nanosecond BIGINT (2^53 µs is 285 years)."""

_CATEGORY: dict[int, str] = {
    pb.COMP_NODE: "compute",
    pb.COMM_SEND_NODE: "comm",
    pb.COMM_RECV_NODE: "comm",
    pb.COMM_COLL_NODE: "comm",
    pb.MEM_LOAD_NODE: "memcpy",
    pb.MEM_STORE_NODE: "memcpy",
}

PRISM_SCHEMA_PREFIX = "prism-trace"
"""``GlobalMetadata.schema`` of prism's own export, whose extra attributes are read back."""

PRISM_MSG_ATTR = "prism_msg_bytes"
"""Node attribute of prism's export: the exact ``msg_bytes`` of an ALL_GATHER whose size is not
a multiple of its group size (``comm_size`` is each member's input, rounded up)."""

NODE_COUNT_ATTR = "prism_nodes"
"""``GlobalMetadata`` attribute giving the number of ``Node`` records that follow it. prism's export
writes it, so that a file cut exactly at a record boundary (which is otherwise a valid, shorter
graph) is refused as truncated; it is checked in any file that carries it."""

_COLL_KIND: dict[int, str] = {
    pb.ALL_REDUCE: "all_reduce",
    pb.REDUCE: "reduce",
    pb.ALL_GATHER: "all_gather",
    pb.GATHER: "gather",
    pb.SCATTER: "scatter",
    pb.BROADCAST: "broadcast",
    pb.ALL_TO_ALL: "all_to_all",
    pb.REDUCE_SCATTER: "reduce_scatter",
    pb.REDUCE_SCATTER_BLOCK: "reduce_scatter",
    pb.BARRIER: "barrier",
}

DEFAULT_GROUP = "0"


# --- process groups ---------------------------------------------------------------------------


def parse_pg_init(node: pb.Node, attrs: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """The group dicts a ``process_group:init`` node holds (in an attribute or in its inputs)."""
    candidates: list[str] = [v for v in attrs.values() if isinstance(v, str)]
    candidates.append(node.inputs.values)
    for text in candidates:
        for parsed in _json_or_literal(text):
            if isinstance(parsed, list) and parsed and all(isinstance(g, dict) for g in parsed):
                return parsed
    msg = f"{path}: cannot parse the process groups of node {node.id} ({node.name!r})"
    raise TraceFormatError(msg)


def _json_or_literal(text: str) -> Iterator[Any]:
    """Decode ``text`` as JSON, or as a Python literal list whose string items are JSON."""
    if not text:
        return
    try:
        yield json.loads(text)
        return
    except ValueError:
        pass
    try:
        lit = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return
    items = lit if isinstance(lit, list) else [lit]
    for item in items:
        if isinstance(item, str):
            try:
                yield json.loads(item)
            except ValueError:
                continue


def _pg_members(path: Path, pg: dict[str, Any], name: str) -> list[int]:
    """The ``ranks`` of a process group: a list of ranks (empty or absent: not listed)."""
    ranks = pg.get("ranks")
    if ranks is None:
        return []
    if not isinstance(ranks, list):
        raise wrong_type(path, f"process group {name!r}: `ranks`", ranks, "a list of ranks")
    return [check_rank(path, x, f"a rank of process group {name!r}") for x in ranks]


def _pg_text(path: Path, pg: dict[str, Any], name: str, key: str) -> str | None:
    """A string field of process group ``name`` (``pg_desc``, ``backend_config``...), or None."""
    return check_text(path, pg.get(key), f"process group {name!r}: `{key}`")


def _backend(config: str | None) -> str | None:
    """``cuda:nccl`` → ``nccl``; ``cpu:gloo,cuda:gloo`` → ``gloo`` (the CUDA one when listed)."""
    if not config:
        return None
    pairs = [p.split(":", 1) for p in config.split(",") if p]
    for dev, name in (p for p in pairs if len(p) == 2):
        if dev == "cuda":
            return name
    return pairs[0][-1]


# --- topological order -----------------------------------------------------------------------


def find_cycle(ids: list[int], src: list[int], dst: list[int]) -> list[int] | None:
    """One cycle of the dependency edges ``src -> dst`` (self-loops left out), as the node ids
    around it in dependency order, or None when the graph is acyclic.

    Kahn's walk removes every node that does not wait, transitively, on a cycle; each node left
    waits on another node left, so walking back from any of them must come round again.
    """
    indeg: dict[int, int] = dict.fromkeys(ids, 0)
    children: dict[int, list[int]] = defaultdict(list)
    dep_of: dict[int, list[int]] = defaultdict(list)
    for a, b in zip(src, dst, strict=True):
        if a != b and a in indeg and b in indeg:
            indeg[b] += 1
            children[a].append(b)
            dep_of[b].append(a)
    ready = [nid for nid, k in indeg.items() if k == 0]
    left = len(indeg)
    while ready:
        nid = ready.pop()
        left -= 1
        for c in children.get(nid, ()):
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    if not left:
        return None
    on = {nid for nid, k in indeg.items() if k > 0}
    at = min(on)
    walk: dict[int, int] = {}
    while at not in walk:
        walk[at] = len(walk)
        at = next(d for d in dep_of[at] if d in on)
    loop = list(walk)[walk[at] :]
    return loop[::-1]


def _topo_order(ids: list[int], deps: list[list[int]]) -> dict[int, int]:
    """Position of each node in a topological order (smallest ready id first; cycles by id)."""
    known = set(ids)
    indeg: dict[int, int] = dict.fromkeys(ids, 0)
    children: dict[int, list[int]] = defaultdict(list)
    for nid, ds in zip(ids, deps, strict=True):
        for d in set(ds):
            if d != nid and d in known:
                indeg[nid] += 1
                children[d].append(nid)
    heap = [nid for nid, k in indeg.items() if k == 0]
    heapq.heapify(heap)
    order: dict[int, int] = {}
    while heap:
        nid = heapq.heappop(heap)
        order[nid] = len(order)
        for c in children.get(nid, ()):
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(heap, c)
    for nid in sorted(known - order.keys()):  # nodes on a cycle
        order[nid] = len(order)
    return order


@dataclass
class Graph:
    """What the decode loop collects from one file, column by column."""

    skipped: int = 0  # Node records read but not kept (the export's start node)
    ids: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    types: list[int] = field(default_factory=list)
    durs: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    track_keys: list[tuple[str, int]] = field(default_factory=list)
    deps: list[list[int]] = field(default_factory=list)  # data + ctrl deps of each node
    edge_src: list[int] = field(default_factory=list)
    edge_dst: list[int] = field(default_factory=list)
    edge_kind: list[str] = field(default_factory=list)  # data, ctrl or (prism's export) sync
    coll_nodes: list[tuple[int, dict[str, Any], bool | None]] = field(default_factory=list)
    p2p_nodes: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)
    host_coll: set[int] = field(default_factory=set)  # COMM_COLL_NODEs without comm_type
    groups_raw: list[dict[str, Any]] | None = None
    gm_attrs: dict[str, Any] = field(default_factory=dict)
    gm_version: str = ""


def build(path: Path, r: int, g: Graph) -> TraceTables:
    """The conformed frames of rank ``r`` from what the reader collected of ``path``."""
    ids, track_keys = g.ids, g.track_keys
    coll_nodes, p2p_nodes, host_coll = g.coll_nodes, g.p2p_nodes, g.host_coll
    groups_raw, gm_attrs = g.groups_raw, g.gm_attrs
    n = len(ids)
    _check_node_count(path, n + g.skipped, gm_attrs)
    if n == 0:
        msg = f"{path}: Chakra ET holds no nodes (only its metadata: empty or truncated file)"
        raise TruncatedTraceError(msg)
    top = max(ids)
    ahead = [(dst, src) for src, dst in zip(g.edge_src, g.edge_dst, strict=True) if src > top]
    if ahead:
        dst, src = ahead[0]
        msg = (
            f"{path}: node {dst} depends on node {src}, which is missing and after the last node"
            f" ({top}): truncated file"
        )
        raise TruncatedTraceError(msg)
    if len(set(ids)) != n:
        dup = next(i for i, c in _counts(ids).items() if c > 1)
        msg = f"{path}: node id {dup} appears more than once"
        raise TraceFormatError(msg)

    # tracks
    uniq_tracks = sorted(set(track_keys), key=lambda k: (k[0] != "thread", k[1]))
    track_id = {k: i for i, k in enumerate(uniq_tracks)}
    tracks = pl.DataFrame(
        {
            "rank": [r] * len(uniq_tracks),
            "track_id": list(range(len(uniq_tracks))),
            "kind": [k for k, _ in uniq_tracks],
            "pid": [None] * len(uniq_tracks),
            "tid": [t for _, t in uniq_tracks],
            "name": [f"{k} {t}" for k, t in uniq_tracks],
        },
        schema_overrides={"pid": pl.Utf8},
    )

    # events: µs that fit ns in a BIGINT (9.2e15 µs is 290 years)
    for field_name, values in (("duration_micros", g.durs), ("start_time_micros", g.starts)):
        k = max(range(n), key=values.__getitem__)
        if values[k] >= _MAX_MICROS:
            msg = f"{path}: node {ids[k]}: `{field_name}` = {values[k]} is out of range"
            raise TraceFormatError(msg)
    timed = any(g.starts)
    dur_ns = [d * 1000 if d else None for d in g.durs]
    ts_ns = (
        [
            s * 1000 if s or t != pb.METADATA_NODE else None
            for s, t in zip(g.starts, g.types, strict=True)
        ]
        if timed
        else [None] * n
    )
    events = pl.DataFrame(
        {
            "rank": [r] * n,
            "event_id": ids,
            "track_id": [track_id[k] for k in track_keys],
            "category": [_CATEGORY.get(t, "other") for t in g.types],
            "name": g.names,
            "ts": ts_ns,
            "dur": dur_ns,
            "args": g.args,
        },
        schema_overrides={"event_id": pl.Int64, "ts": pl.Int64, "dur": pl.Int64},
    )
    by_id = {nid: i for i, nid in enumerate(ids)}

    # flows
    id_col = pl.Series(ids, dtype=pl.Int64)
    edges = pl.DataFrame(
        {
            "src_event_id": pl.Series(g.edge_src, dtype=pl.UInt64),
            "dst_event_id": pl.Series(g.edge_dst, dtype=pl.UInt64),
            "kind": pl.Series(g.edge_kind, dtype=pl.Utf8),
        }
    ).with_columns(pl.col("src_event_id", "dst_event_id").cast(pl.Int64))
    flows = (
        edges.filter(pl.col("src_event_id") != pl.col("dst_event_id"))
        .join(pl.DataFrame({"src_event_id": id_col}), on="src_event_id", how="semi")
        .with_columns(pl.lit(r).alias("rank"))
    )
    dropped = edges.height - flows.height
    # data and ctrl deps wait for a node's end; prism's own ``sync`` edges tie two nodes' starts
    # (a collective's members), so a loop through one of them is no deadlock
    waits = flows.filter(pl.col("kind") != "sync")
    cycle = find_cycle(ids, waits["src_event_id"].to_list(), waits["dst_event_id"].to_list())

    all_deps = g.deps
    order = _topo_order(ids, all_deps) if (coll_nodes or p2p_nodes) else {}

    # comm groups and world size
    world = gm_attrs.get("world_size")
    world_size: int | None = (
        check_world_size(path, world, "metadata `world_size`") if world is not None else None
    )
    groups: dict[str, dict[str, Any]] = {}
    renamed: dict[str, str] = {}
    expanded = 0
    if groups_raw is not None:
        default = next(
            (pg for pg in groups_raw if pg.get("pg_desc") == "default_pg"),
            next((pg for pg in groups_raw if str(pg.get("pg_name")) == DEFAULT_GROUP), None),
        )
        if world_size is None and default is not None and default.get("group_size"):
            world_size = check_world_size(path, default["group_size"], "default group's size")
        own = str(gm_attrs.get("schema", "")).startswith(PRISM_SCHEMA_PREFIX)
        for pg in groups_raw:
            name = str(pg.get("pg_name"))
            if own and pg.get("pg_desc") is not None:
                # prism's export: pg_name is ASTRA-sim's decimal id, pg_desc the group's name.
                renamed[name] = name = str(pg["pg_desc"])
            size = pg.get("group_size")
            members = _pg_members(path, pg, name)
            if size is not None:
                size = check_count(path, size, f"size of process group {name!r}")
            if not members and size and world_size and int(size) == world_size:
                members = list(range(world_size))
            expanded += len(members)
            if expanded > 4 * MAX_RANKS:  # many world-sized groups: memory sized by the trace
                msg = f"{path}: process groups list more than {4 * MAX_RANKS} members in all"
                raise TraceFormatError(msg)
            groups[name] = {
                "name": name,
                "description": _pg_text(path, pg, name, "description" if own else "pg_desc"),
                "backend": _backend(_pg_text(path, pg, name, "backend_config")),
                "size": int(size) if size is not None else (len(members) or None),
                "ranks": members or None,
            }

    def group(name: str) -> dict[str, Any]:
        if name not in groups:
            is_default = name == DEFAULT_GROUP
            groups[name] = {
                "name": name,
                "description": "default_pg" if is_default else None,
                "backend": None,
                "size": world_size if is_default else None,
                "ranks": list(range(world_size)) if is_default and world_size else None,
            }
        return groups[name]

    # collectives
    coll_rows: list[dict[str, Any]] = []
    for nid, a, is_cpu in coll_nodes:
        ct = a["comm_type"]
        kind = _COLL_KIND.get(ct) if isinstance(ct, int) and not isinstance(ct, bool) else None
        if kind is None:
            msg = f"{path}: unknown comm_type {ct!r} at node {nid}"
            raise TraceFormatError(msg)
        i = by_id[nid]
        label = node_label(nid, g.names[i])
        gname = str(a.get("pg_name") or DEFAULT_GROUP)
        gname = renamed.get(gname, gname)
        kind = check_text(path, a.get("prism_comm_kind"), f"{label}: `prism_comm_kind`") or kind
        grp = group(gname)
        gsize = grp["size"]
        size = comm_bytes(path, a.get("comm_size"), f"{label}: `comm_size`")
        in_b, out_b, size = _in_out(kind, ct, size, gsize, _msg_bytes(path, a, label))
        host_id = nid
        kernel_id = None
        if is_cpu is False:
            kernel_id = nid
            host_id = next((d for d in all_deps[i] if d in host_coll), None)  # type: ignore[assignment]
        h = by_id.get(host_id) if host_id is not None else None
        coll_rows.append(
            {
                "event_id": host_id if host_id is not None else nid,
                "group_name": gname,
                "kind": kind,
                "in_bytes": in_b,
                "out_bytes": out_b,
                "msg_bytes": size,
                "group_size": gsize,
                "host_ts": ts_ns[h] if h is not None else None,
                "host_dur": dur_ns[h] if h is not None else None,
                "kernel_event_id": kernel_id,
                "kernel_ts": ts_ns[i] if kernel_id is not None else None,
                "kernel_dur": dur_ns[i] if kernel_id is not None else None,
                "_order": order[nid],
            }
        )
    coll_rows.sort(key=lambda row: row["_order"])
    seq_by_group: dict[str, int] = defaultdict(int)
    for row in coll_rows:
        row["seq"] = seq_by_group[row["group_name"]]
        seq_by_group[row["group_name"]] += 1
        del row["_order"]

    # p2p
    p2p_rows: list[dict[str, Any]] = []
    for nid, ntype, a in sorted(p2p_nodes, key=lambda x: order[x[0]]):
        is_send = ntype == pb.COMM_SEND_NODE
        field = "comm_dst" if is_send else "comm_src"
        peer = a.get(field)
        if peer is None:
            msg = f"{path}: {pb.NodeType.Name(ntype)} {nid} has no `{field}` attribute"
            raise TraceFormatError(msg)
        i = by_id[nid]
        label = node_label(nid, g.names[i])
        peer = check_rank(path, peer, f"{label}: `{field}`")
        pg_name = a.get("pg_name")
        p2p_rows.append(
            {
                "event_id": nid,
                "group_name": renamed.get(str(pg_name), str(pg_name))
                if pg_name is not None
                else None,
                "direction": "send" if is_send else "recv",
                "peer": peer,
                "bytes": comm_bytes(path, a.get("comm_size"), f"{label}: `comm_size`"),
                "tag": _tag(path, a.get("comm_tag"), label),
                "host_ts": ts_ns[i],
                "host_dur": dur_ns[i],
            }
        )
    seq_by_peer: dict[tuple[int, str], int] = defaultdict(int)
    for row in p2p_rows:
        key = (row["peer"], row["direction"])
        row["seq"] = seq_by_peer[key]
        seq_by_peer[key] += 1

    comm_groups = pl.DataFrame(list(groups.values()), schema=FRAME_SCHEMAS["comm_groups"])

    version = {"chakra_version": g.gm_version} if g.gm_version else {}
    rank_args = {**version, **gm_attrs, "nodes": n, "dropped_deps": dropped}
    pid = gm_attrs.get("pid")
    if pid is not None:
        pid = check_int(path, pid, "metadata `pid`", 0, INT64_MAX, "a process id")
    ranks = pl.DataFrame(
        {
            "rank": [r],
            "pid": [pid],
            "args": [json.dumps(rank_args, default=str)],
        },
        schema_overrides={"pid": pl.Int64},
    )

    tables = TraceTables(
        path=path,
        format="chakra",
        world_size=world_size,
        ranks=ranks,
        tracks=tracks,
        events=events,
        flows=flows,
        collectives=_frame(coll_rows, r),
        p2p=_frame(p2p_rows, r),
        comm_groups=comm_groups,
        cycle=None if cycle is None else _cycle_words(cycle, flows),
    )
    return tables.conform()


def _cycle_words(loop: list[int], flows: pl.DataFrame) -> str:
    """``nodes 4 -> 9 -> 4 wait on each other (ctrl deps)``: a cycle and its edges' kinds."""
    pairs = set(zip(loop, [*loop[1:], loop[0]], strict=True))
    kinds = sorted(
        {
            k
            for a, b, k in flows.select("src_event_id", "dst_event_id", "kind").iter_rows()
            if (a, b) in pairs
        }
    )
    shown = [*loop[:8], "..."] if len(loop) > 8 else loop
    path = " -> ".join(map(str, [*shown, loop[0]]))
    return f"nodes {path} wait on each other ({' and '.join(kinds)} deps): a dependency cycle"


def _check_node_count(path: Path, n: int, gm_attrs: dict[str, Any]) -> None:
    """Compare the Node records read with the count the metadata states (``NODE_COUNT_ATTR``)."""
    if NODE_COUNT_ATTR not in gm_attrs:
        return
    want = gm_attrs[NODE_COUNT_ATTR]
    if not isinstance(want, int) or isinstance(want, bool) or want < 0:
        msg = f"{path}: metadata `{NODE_COUNT_ATTR}` = {want!r} is not a node count"
        raise TraceFormatError(msg)
    if n < want:
        msg = (
            f"{path}: holds {n} nodes, its metadata `{NODE_COUNT_ATTR}` says {want}: truncated file"
        )
        raise TruncatedTraceError(msg)
    if n > want:
        msg = f"{path}: holds {n} nodes, more than the {want} its metadata `{NODE_COUNT_ATTR}` says"
        raise TraceFormatError(msg)


def _msg_bytes(path: Path, a: dict[str, Any], label: str) -> int | None:
    """prism's exact ``msg_bytes`` of a rounded all-gather (``PRISM_MSG_ATTR``), or None."""
    msg = a.get(PRISM_MSG_ATTR)
    if msg is None:
        return None
    return check_int(path, msg, f"{label}: `{PRISM_MSG_ATTR}`", 1, INT64_MAX, "a byte count")


_INT32 = 1 << 31


def _tag(path: Path, tag: Any, label: str) -> int | None:
    """A p2p ``comm_tag``: an integer of the INTEGER column, or None when absent."""
    if tag is None:
        return None
    return check_int(path, tag, f"{label}: `comm_tag`", -_INT32, _INT32 - 1, "an int32 tag")


def _frame(rows: list[dict[str, Any]], r: int) -> pl.DataFrame:
    if not rows:
        return pl.DataFrame({"rank": []}, schema={"rank": pl.Int32})
    return pl.DataFrame(rows, infer_schema_length=None).with_columns(pl.lit(r).alias("rank"))


def _in_out(
    kind: str, comm_type: int, size: int | None, gsize: int | None, msg: int | None = None
) -> tuple[int | None, int | None, int | None]:
    """Input, output and nccl-tests bytes of a call whose Chakra ``comm_size`` is ``size``.

    ``comm_size`` is the call's *input* (the PyTorch converter sums the input tensors, and
    ASTRA-sim's ring sends ``comm_size`` per step of an all-gather): an ALL_GATHER's output is
    ``group size x comm_size``, a REDUCE_SCATTER's is ``comm_size / group size``. ``msg_bytes``
    is ``max(in, out)``; NULL while the group size is unknown (ingest fills it in from the
    run's groups, ``ingest.fill_sizes``). ``msg`` is prism's exact ``msg_bytes`` where its
    export had to round (attribute ``prism_msg_bytes``).
    """
    if size is None:
        return None, None, None
    if comm_type == pb.ALL_GATHER:
        # gather/scatter exported as ALL_GATHER of their per-member piece (docs/export.md)
        full = size * gsize if gsize else None
        if msg is not None:
            full = msg
        if kind == "scatter":
            return full, size, full
        return size, full, full
    if kind == "reduce_scatter":
        return size, (size // gsize if gsize else None), size
    return size, size, size


def _counts(xs: list[int]) -> dict[int, int]:
    c: dict[int, int] = defaultdict(int)
    for x in xs:
        c[x] += 1
    return c

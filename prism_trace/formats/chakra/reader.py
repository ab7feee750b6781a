"""Chakra ET reader: one rank's length-delimited protobuf graph of nodes → the contract's frames.

A Chakra ET file (``<prefix>.<rank>.et``, optionally gzipped) is a stream of records, each a varint
length followed by a message: one ``GlobalMetadata``, then ``Node`` messages. The framing is decoded
here over a buffered stream (no whole-file read), and each message with ``Node.FromString``.
This module owns the decode loop (``read_chakra``); the framing is in ``chakra_records``, the
tables built from the collected nodes in ``chakra_graph``.

Mapping (one rank per file):

- every node → an ``events`` row: ``event_id`` = node id; ``category`` ``compute`` (COMP_NODE),
  ``comm`` (COMM_SEND/RECV/COLL_NODE), ``memcpy`` (MEM_LOAD/STORE_NODE), else ``other``; ``ts`` is
  NULL unless the file carries ``start_time_micros``; ``dur`` = ``duration_micros`` * 1000, NULL
  when 0 (proto3 cannot tell "absent" from 0); ``args`` = JSON of the node's attributes by name.
- tracks: one per ``(kind, tid)`` when nodes carry a ``tid`` attribute (``stream`` when
  ``is_cpu_op`` is false, as in the PyTorch converter's GPU nodes, else ``thread``); nodes without
  ``tid`` share one ``thread`` track with tid 0.
- ``flows``: ``data_deps`` → kind ``data``, ``ctrl_deps`` → kind ``ctrl`` (src = dependency,
  dst = node); self-loops and edges to nodes absent from the file are dropped (counted in
  ``ranks.args``).
- ``collectives``: COMM_COLL_NODEs that carry ``comm_type`` (the converter's GPU-side kernels and
  ASTRA-sim nodes; CPU-side ``c10d::*`` COMM_COLL_NODEs have none and stay plain events, but a GPU
  node whose dependency is such a host node gets it as ``event_id`` and the GPU node as
  ``kernel_event_id``). ``comm_size`` is the call's input, as the PyTorch converter writes it
  (the sum of the input tensors) and as ASTRA-sim simulates it: an all-gather's output is
  ``comm_size x group size``, a reduce-scatter's ``comm_size / group size``; ``msg_bytes`` is
  nccl-tests' ``max(in, out)``, filled in by ingest when the group size comes from the run.
  ``group_name`` = ``pg_name`` attribute, else ``"0"`` (PyTorch's default group).
  Chakra has no timestamps, so ``seq`` is numbered here per group in a topological order of the
  dependency graph (ties broken by node id).
- ``p2p``: COMM_SEND/RECV_NODEs; peer = ``comm_dst``/``comm_src``, tag = ``comm_tag``, bytes =
  ``comm_size``; ``seq`` per (peer, direction) in the same topological order. (``comm_type`` on p2p
  nodes is ignored: ASTRA-sim writes 5/6 there, which are not collective kinds.)
- ``comm_groups``: parsed from a ``## process_group:init ##`` node when present (a JSON list of
  ``pg_name``/``pg_desc``/``backend_config``/``ranks``/``group_size``; an empty ``ranks`` list of a
  world-sized group means all ranks); otherwise a default group ``"0"`` whose size and ranks are the
  world when known, else NULL for ingest to fill in from the number of files.
- ``world_size``: a ``world_size`` metadata attribute, else the default group's size, else NULL.
- Every value a table keeps is checked first, since an attribute may hold any protobuf type: node
  ids and ``tid`` fit a BIGINT, ``comm_dst``/``comm_src`` are ranks, ``comm_size`` is an integer
  byte count (not a string, not a bool), ``comm_tag`` an int32, process-group fields strings; a
  bad one is one line naming the file, the node and the field (``limits.check_int``).

Files of prism's own export (``GlobalMetadata`` ``schema`` ``prism-trace-…``) carry more: a
group's name is its ``pg_desc`` (``pg_name`` is ASTRA-sim's decimal id), ``prism_kind`` gives the
kind of copies and one-member collectives written as COMP_NODEs, ``prism_comm_kind`` the
recorded kind of a substituted collective, ``sync_deps`` become ``sync`` flows, and the
``order_deps`` added for ASTRA-sim's issue order are dropped, and so is the ``## prism:start ##``
node they may point to (docs/export.md).

The rank comes from the file name (``<prefix>.<rank>.et``, also ``name.0.et_schema1.0.1_HEAD.gz``),
else from the ``rank`` argument.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

from google.protobuf import unknown_fields

from prism_trace.errors import RankUnknownError, TraceFormatError
from prism_trace.formats.base import TraceTables
from prism_trace.formats.chakra import chakra_pb2 as pb
from prism_trace.formats.chakra.records import (
    GZIP_MAGIC,
    attrs,
    node_label,
    parse,
    records,
)
from prism_trace.formats.chakra.tables import (
    PRISM_SCHEMA_PREFIX,
    Graph,
    build,
    parse_pg_init,
)
from prism_trace.limits import (
    INT64_MAX,
    INT64_MIN,
    BoundedGzip,
    check_int,
    check_rank,
    check_regular_file,
    check_text,
    short_repr,
    wrong_type,
)

__all__ = [
    "PRISM_START_NAME",
    "rank_from_name",
    "read_chakra",
]

_RANK_RE = re.compile(r"^(?P<prefix>.+?)\.(?P<rank>\d+)\.et(?:$|[._-])")

_VALID_TYPES = frozenset(v for v in pb.NodeType.values() if v != pb.INVALID_NODE)
"""Node types of the schema; proto3 keeps any other number (a corrupt or foreign record)."""

PRISM_START_NAME = "## prism:start ##"
"""Name of the start node of prism's export (ASTRA-sim's issue order only): not read back."""

_OWN_TYPE: dict[tuple[int, str | None], int] = {
    (pb.COMP_NODE, "memcpy"): pb.MEM_LOAD_NODE,
    (pb.COMP_NODE, "memset"): pb.MEM_STORE_NODE,
    (pb.COMP_NODE, "collective"): pb.COMM_COLL_NODE,
}
"""(Chakra type, ``prism_kind``) of prism's export → the type the node had before it was
written for ASTRA-sim (docs/export.md)."""


def rank_from_name(path: Path) -> int | None:
    """The rank in a Chakra file name ``<prefix>.<rank>.et[suffix]``, or None when it has none."""
    m = _RANK_RE.match(path.name)
    return int(m.group("rank")) if m else None


# --- reader ----------------------------------------------------------------------------------


def read_chakra(path: Path, *, rank: int | None = None) -> TraceTables:
    """Read one rank's Chakra ET protobuf file (plain or gzipped) into the contract's frames.

    Args:
        path: the ``<prefix>.<rank>.et`` file.
        rank: the rank, used when the file name carries none.

    Returns:
        The conformed frames of the rank (events, tracks, flows, collectives, p2p, comm_groups,
        ranks) with ``world_size`` when the file says.

    Raises:
        RankUnknownError: neither the file name nor ``rank`` gives the rank.
        TruncatedTraceError: the file ends inside a record.
        TraceFormatError: the file is not a Chakra ET (corrupt record, unknown collective type).
    """
    path = Path(path)
    file_rank = rank_from_name(path)
    if file_rank is None:
        file_rank = rank
    if file_rank is None:
        msg = f"{path}: cannot tell the rank (expected `<prefix>.<rank>.et`); pass `rank`"
        raise RankUnknownError(msg)
    r = check_rank(path, file_rank, "the rank")

    check_regular_file(path)
    g = Graph()
    with ExitStack() as stack:
        try:
            raw = stack.enter_context(path.open("rb"))
        except OSError as exc:
            msg = f"{path}: cannot open: {exc}"
            raise TraceFormatError(msg) from exc
        fh: IO[bytes] = raw
        if raw.read(2) == GZIP_MAGIC:
            fh = stack.enter_context(BoundedGzip(path))  # type: ignore[arg-type]  # as above
        raw.seek(0)
        recs = records(fh, path)
        first = next(recs, None)
        if first is None:
            msg = f"{path}: empty file, not a Chakra ET"
            raise TraceFormatError(msg)
        gm = parse(pb.GlobalMetadata, first, path)
        if len(unknown_fields.UnknownFieldSet(gm)):
            msg = f"{path}: not a Chakra ET: the first record is not a GlobalMetadata message"
            raise TraceFormatError(msg)
        g.gm_attrs = attrs(gm)
        seen: set[int] = set()
        g.gm_version = gm.version
        own = str(g.gm_attrs.get("schema", "")).startswith(PRISM_SCHEMA_PREFIX)
        first_node = True
        for rec in recs:
            node = parse(pb.Node, rec, path)
            # Fields outside the schema: a foreign stream when the first node has them, else a
            # corrupt record (a flipped bit turns `id` into an unknown fixed64 field, say).
            if len(unknown_fields.UnknownFieldSet(node)):
                what = "not a Chakra ET: record" if first_node else "corrupt record"
                msg = f"{path}: {what} at byte offset {rec[0]} is not a Node (unknown fields)"
                raise TraceFormatError(msg)
            first_node = False
            if node.type not in _VALID_TYPES:
                msg = (
                    f"{path}: node {node.id} (record at byte offset {rec[0]}):"
                    f" `type` = {node.type} is not a valid Chakra node type"
                )
                raise TraceFormatError(msg)
            nid = node.id
            if own and node.name == PRISM_START_NAME and node.type == pb.COMP_NODE:
                g.skipped += 1
                continue  # the export's start node; its edges are order_deps
            if nid in seen:  # at once: a stream of empty records would run for minutes
                msg = f"{path}: node id {nid} appears more than once (record at byte {rec[0]})"
                raise TraceFormatError(msg)
            _check_id(path, node, rec[0])
            seen.add(nid)
            a = attrs(node)
            label = node_label(nid, node.name)
            ntype = node.type
            order_deps: list[int] = []
            sync_deps: list[int] = []
            if own:
                kind = check_text(path, a.get("prism_kind"), f"{label}: `prism_kind`")
                ntype = _OWN_TYPE.get((ntype, kind), ntype)
                order_deps = _id_list(path, a.get("order_deps"), f"{label}: `order_deps`")
                sync_deps = _id_list(path, a.get("sync_deps"), f"{label}: `sync_deps`")
            g.ids.append(nid)
            g.names.append(node.name)
            g.types.append(ntype)
            g.durs.append(node.duration_micros)
            # A metadata node has no time (a 0 would read as the epoch in a timed file).
            g.starts.append(0 if ntype == pb.METADATA_NODE else node.start_time_micros)
            g.args.append(json.dumps(a, separators=(",", ":"), default=str))
            g.track_keys.append(_track_key(path, a, label))
            dd = list(node.data_deps)
            cd = list(node.ctrl_deps)
            g.deps.append(dd + cd)
            if order_deps:  # added by prism's export for ASTRA-sim's issue order only
                dd = [d for d in dd if d not in order_deps]
            g.edge_src.extend(dd)
            g.edge_src.extend(cd)
            g.edge_src.extend(sync_deps)
            g.edge_dst.extend([nid] * (len(dd) + len(cd) + len(sync_deps)))
            g.edge_kind.extend(["data"] * len(dd))
            g.edge_kind.extend(["ctrl"] * len(cd))
            g.edge_kind.extend(["sync"] * len(sync_deps))
            if ntype == pb.COMM_COLL_NODE:
                if "comm_type" in a:
                    g.coll_nodes.append((nid, a, a.get("is_cpu_op")))
                else:
                    g.host_coll.add(nid)
            elif ntype in (pb.COMM_SEND_NODE, pb.COMM_RECV_NODE):
                g.p2p_nodes.append((nid, ntype, a))
            if g.groups_raw is None and "process_group:init" in node.name:
                g.groups_raw = parse_pg_init(node, a, path)

    return build(path, r, g)


def _check_id(path: Path, node: pb.Node, offset: int) -> None:
    """Refuse a node id above the BIGINT ``event_id`` column (proto's ``id`` is a uint64)."""
    if node.id > INT64_MAX:
        msg = (
            f"{path}: node {short_repr(node.name)} (record at byte offset {offset}):"
            f" `id` = {node.id} is above {INT64_MAX}, the largest node id stored"
        )
        raise TraceFormatError(msg)


def _track_key(path: Path, a: dict[str, Any], label: str) -> tuple[str, int]:
    """The ``(kind, tid)`` track of a node; an integer ``tid`` must fit the BIGINT column.

    A node without an integer ``tid`` goes to the shared ``thread`` track 0 (module docstring).
    """
    tid = a.get("tid")
    if not isinstance(tid, int) or isinstance(tid, bool):
        return ("thread", 0)
    check_int(path, tid, f"{label}: `tid`", INT64_MIN, INT64_MAX, "a thread id")
    return ("stream" if a.get("is_cpu_op") is False else "thread", tid)


def _id_list(path: Path, value: Any, where: str) -> list[int]:
    """Node ids of an attribute of prism's export (``order_deps``, ``sync_deps``); [] if absent."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise wrong_type(path, where, value, "a list of node ids")
    return [check_int(path, d, where, 0, INT64_MAX, "a list of node ids") for d in value]

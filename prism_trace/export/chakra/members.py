"""Writing member files from templates: each rank's metadata, process-group record and nodes, with
what repeats across members cached."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from prism_trace.export.chakra.rules import (
    CHAKRA_SCHEMA,
    CHAKRA_VERSION,
    START_NAME,
    ChakraExportError,
)
from prism_trace.export.chakra.template import ExportRun, GraphTemplate
from prism_trace.export.chakra.wire import attr, attrs_bytes, record_bytes, varint
from prism_trace.formats.chakra import chakra_pb2 as pb
from prism_trace.formats.chakra.tables import NODE_COUNT_ATTR
from prism_trace.formats.host_et.comms import PG_INIT_NAME

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["MemberWriter"]


class MemberWriter:
    """Writes member files from templates; caches what repeats across members."""

    def __init__(self, store: Store, rd: ExportRun, out_dir: Path, prefix: str) -> None:
        self.store = store
        self.rd = rd
        self.out_dir = out_dir
        self.prefix = prefix
        self._pg_attr: dict[int, bytes] = {}
        self._pg_json: dict[int, str] = {}
        self._start: dict[int, bytes] = {}
        self.astra_id = {gid: i + 1 for i, gid in enumerate(sorted(rd.groups))}
        """group_id → ASTRA-sim's decimal communicator id (≥ 1: its feeder needs one)."""

    def path(self, rank: int) -> Path:
        """The member file of ``rank``: ``<prefix>.<rank>.et``, the name Chakra's tools expect."""
        return self.out_dir / f"{self.prefix}.{rank}.et"

    # groups and peers of a member

    def group_of(self, tpl: GraphTemplate, gid: int, rank: int) -> int:
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

    def peer_of(self, tpl: GraphTemplate, peer: int, rank: int) -> int:
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
        """The ``pg_name`` attribute of group ``gid`` as wire bytes, encoded once per group."""
        b = self._pg_attr.get(gid)
        if b is None:
            b = self._pg_attr[gid] = attrs_bytes(
                attr("pg_name", string_val=str(self.astra_id[gid]))
            )
        return b

    def group_json(self, gid: int) -> str:
        """Group ``gid`` as the process-group JSON of the init node, encoded once per group."""
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

    def metadata(self, tpl: GraphTemplate, rank: int, nodes: int) -> bytes:
        """The ``GlobalMetadata`` record; ``nodes`` (the Node records that follow) lets the reader
        tell a file cut at a record boundary from a shorter graph (``NODE_COUNT_ATTR``)."""
        rd = self.rd
        gm = pb.GlobalMetadata(version=CHAKRA_VERSION)
        gm.attr.extend(
            [
                attr("schema", string_val=CHAKRA_SCHEMA),
                attr("world_size", int64_val=rd.world_size),
                attr("rank", int64_val=rank),
                attr("run", string_val=rd.name),
                attr("run_kind", string_val=rd.kind),
                attr(NODE_COUNT_ATTR, int64_val=nodes),
            ]
        )
        if rd.kind == "sliced":
            gm.attr.append(attr("class_id", int64_val=tpl.graph_rank))
            if rank in rd.represented_by:
                gm.attr.append(attr("represented_by", int64_val=rd.represented_by[rank]))
        for a, v in rd.coords.get(rank, {}).items():
            gm.attr.append(attr(a, int64_val=v))
        return record_bytes(gm.SerializeToString())

    def pg_init(self, tpl: GraphTemplate, rank: int) -> bytes:
        """The record of ``rank``'s process-group init node: every group it belongs to or uses
        (empty when none)."""
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
        node.attr.append(attr("is_cpu_op", bool_val=True))
        return record_bytes(node.SerializeToString())

    def start(self, tpl: GraphTemplate) -> bytes:
        """The start node: a GPU COMP_NODE of duration 0 with no dependency (`START_NAME`).

        The old ETFeeder skips it at once (runtime 0, no ops) and frees its children; the newer
        ``Workload`` runs it for 1 ns on the GPU slot, whose end issues the rank's first nodes.
        """
        b = self._start.get(tpl.pg_init_id)
        if b is None:
            node = pb.Node(id=tpl.pg_init_id + 1, name=START_NAME, type=pb.COMP_NODE)
            node.attr.append(attr("is_cpu_op", bool_val=False))
            b = self._start[tpl.pg_init_id] = record_bytes(node.SerializeToString())
        return b

    def write(self, tpl: GraphTemplate, rank: int) -> int:
        """Write ``rank``'s file from ``tpl``; return its size in bytes."""
        suffix: dict[tuple[str, int | None, int | None], bytes] = {}
        pg_init = self.pg_init(tpl, rank)
        nodes = tpl.nodes + (1 if pg_init else 0) + 1  # the graph's, pg init's, the start node
        parts = [self.metadata(tpl, rank, nodes), pg_init, self.start(tpl), tpl.runs[0]]
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
                    tail = pg + attrs_bytes(
                        attr("comm_src", int32_val=src), attr("comm_dst", int32_val=dst)
                    )
                suffix[key] = tail
            parts.append(varint(len(hole.static) + len(tail)))
            parts.append(hole.static)
            parts.append(tail)
            parts.append(run_bytes)
        data = b"".join(parts)
        self.path(rank).write_bytes(data)
        return len(data)

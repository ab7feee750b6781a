"""Communication of a host execution trace: process groups, collectives and p2p from comm nodes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from prism_trace.errors import TraceFormatError
from prism_trace.formats.base import FRAME_SCHEMAS
from prism_trace.limits import MAX_RANKS, check_count, check_rank, type_name

__all__ = [
    "PG_INIT_NAME",
    "collectives_frame",
    "comm_groups",
    "comm_rows",
    "default_backend",
    "default_group",
    "groups_frame",
    "normalize_comm_kind",
    "p2p_frame",
]

PG_INIT_NAME = "## process_group:init ##"
"""The node whose single string input lists the job's process groups (schema >= 1.0.2)."""


# Normalised (lower case, no underscores) comm names → collective kind or p2p direction.
_KIND_BY_PREFIX: tuple[tuple[str, str], ...] = (
    ("allreduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("reducescatter", "reduce_scatter"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("reduce", "reduce"),
    ("send", "send"),
    ("recv", "recv"),
)
# In record_param_comms the value before the collective name is this rank, except for these, where
# it is the root (broadcast, reduce, gather, scatter) or the peer (send, recv).
_RANK_FIELD_IS_SELF = frozenset(
    ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier")
)
# c10d ops whose first argument is the output and second the input.
_OUT_FIRST_PREFIXES = ("allgather", "reducescatter", "alltoall", "gather", "scatter")

_C_TYPE_TO_DTYPE = {
    "long int": "long",
    "int64_t": "long",
    "unsigned char": "byte",
    "signed char": "char",
    "short int": "short",
}
_TENSOR_TYPE = re.compile(r"Tensor\(([^)]+)\)")


def normalize_comm_kind(name: str) -> str | None:
    """Map a comm name (``allreduce``, ``_allgather_base``, ``c10d::alltoall_base_``, ``send``).

    Args:
        name: a ``record_param_comms`` collective name or a ``c10d::`` op name.

    Returns:
        A collective kind (``all_reduce`` ... ``barrier``), ``send``/``recv``, or None for non-comm
        names such as ``wait`` or ``coalesced``.
    """
    key = name.removeprefix("c10d::").replace("_", "").lower()
    for prefix, kind in _KIND_BY_PREFIX:
        if key.startswith(prefix):
            return kind
    return None


# --------------------------------------------------------------------------------------------------
# comm groups


def comm_groups(
    path: Path, nodes: list[dict[str, Any]], dist_info: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Groups by name from ``## process_group:init ##`` (or ``distributedInfo.pg_config``)."""
    configs: list[dict[str, Any]] = []
    for n in nodes:
        if n.get("name") != PG_INIT_NAME:
            continue
        ins = n.get("inputs")
        values = ins.get("values", []) if isinstance(ins, dict) else (ins or [])
        for v in values:
            if not isinstance(v, str):
                continue
            try:
                parsed = orjson.loads(v)
            except orjson.JSONDecodeError as exc:
                msg = f"{path}: `{PG_INIT_NAME}` input is not JSON at node {n.get('id')}: {exc}"
                raise TraceFormatError(msg) from exc
            if isinstance(parsed, list):
                configs += [c for c in parsed if isinstance(c, dict)]
    if not configs and isinstance(dist_info.get("pg_config"), list):
        configs = [c for c in dist_info["pg_config"] if isinstance(c, dict)]

    groups: dict[str, dict[str, Any]] = {}
    members = 0
    for c in configs:
        name = c.get("pg_name")
        if name is None:
            continue
        size = c.get("group_size", c.get("pg_size"))
        where = f"process group {str(name)[:40]!r}"
        if size is not None:
            size = check_count(path, size, f"the size of {where}")
        ranks = [check_rank(path, r, f"a rank of {where}") for r in _list(c.get("ranks"))]
        if not ranks and isinstance(size, int):
            ranks = list(range(size))  # empty `ranks` means the group spans the whole world
        members += len(ranks)
        if members > 4 * MAX_RANKS:  # many world-sized groups: memory sized by the trace
            msg = f"{path}: process groups list more than {4 * MAX_RANKS} members in all"
            raise TraceFormatError(msg)
        groups[str(name)] = {
            "name": str(name),
            "description": c.get("pg_desc"),
            "backend": _backend_of(c.get("backend_config")),
            "size": size if isinstance(size, int) else (len(ranks) or None),
            "ranks": ranks or None,
            "backend_id": c.get("backend_id"),
        }
    return groups


def _list(value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        msg = f"expected a list, got {type_name(value)}"
        raise TypeError(msg)
    return value


def _backend_of(config: Any) -> str | None:
    """``cuda:nccl`` → ``nccl``; ``cpu:gloo,cuda:nccl`` → ``nccl`` (the device backend wins)."""
    if not isinstance(config, str) or not config:
        return None
    pairs = [p.split(":", 1) for p in config.split(",") if p]
    by_device = {p[0].strip(): p[-1].strip() for p in pairs}
    return by_device.get("cuda") or next(iter(by_device.values()), None)


def default_backend(dist_info: dict[str, Any], groups: dict[str, dict[str, Any]]) -> str | None:
    if isinstance(dist_info.get("backend"), str):
        return str(dist_info["backend"])
    default = default_group(groups)
    return default["backend"] if default else None


def default_group(groups: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    for g in groups.values():
        if g["description"] == "default_pg":
            return g
    return groups.get("0")


def groups_frame(groups: dict[str, dict[str, Any]]) -> pl.DataFrame:
    cols = ("name", "description", "backend", "size", "ranks")
    return pl.DataFrame(
        {c: [g[c] for g in groups.values()] for c in cols},
        schema=FRAME_SCHEMAS["comm_groups"],
    )


# --------------------------------------------------------------------------------------------------
# collectives and p2p


def comm_rows(
    nodes: list[dict[str, Any]], groups: dict[str, dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]:
    """Rows for collectives and p2p, and the self ranks the comm nodes state."""
    rpc = [n for n in nodes if n.get("name") == "record_param_comms"]
    coll: list[dict[str, Any]] = []
    p2p: list[dict[str, Any]] = []
    self_ranks: list[int] = []
    by_backend_id = {g["backend_id"]: g["name"] for g in groups.values() if g["backend_id"]}
    only_group = next(iter(groups)) if len(groups) == 1 else None

    if rpc:
        calls = [_from_record_param_comms(n, by_backend_id) for n in rpc]
    else:
        calls = [_from_c10d_op(n) for n in nodes if str(n.get("name", "")).startswith("c10d::")]
    for call in calls:
        if call is None:
            continue
        kind = call["kind"]
        if call.get("self_rank") is not None:
            self_ranks.append(call["self_rank"])
        if kind is None:
            continue
        group = call.get("group_name") or only_group
        size = call.get("group_size")
        if size is None and group in groups:
            size = groups[group]["size"]
        in_b, out_b = call.get("in_bytes"), call.get("out_bytes")
        row = {
            "rf_id": call.get("rf_id"),
            "node_id": call.get("node_id"),
            "group_name": group or None,
            "dtype": call.get("dtype"),
        }
        if kind in ("send", "recv"):
            peer = call.get("peer")
            if peer is None:
                continue
            p2p.append({**row, "direction": kind, "peer": peer, "bytes": in_b or out_b})
        elif group is not None:  # a collective names its group; 1.0.1 only has a pg pointer
            msg = max((b for b in (in_b, out_b) if b is not None), default=None)
            coll.append(
                {
                    **row,
                    "kind": kind,
                    "in_bytes": in_b,
                    "out_bytes": out_b,
                    "msg_bytes": msg,
                    "group_size": size,
                }
            )
    return coll, p2p, self_ranks


def _attr_map(node: dict[str, Any]) -> dict[str, Any]:
    return {a["name"]: a.get("value") for a in node.get("attrs") or ()}


def _io(node: dict[str, Any], side: str) -> tuple[list[Any], list[Any]]:
    """(values, types) of a node's inputs or outputs in either layout."""
    block = node.get(side)
    if isinstance(block, dict):
        return list(block.get("values") or []), list(block.get("types") or [])
    return list(block or []), list(node.get(f"{side[:-1]}_types") or [])


def _is_tensor_ref(v: Any) -> bool:
    return (
        isinstance(v, list)
        and len(v) == 6
        and isinstance(v[5], str)
        and all(isinstance(x, int) and not isinstance(x, bool) for x in v[:5])
    )


def _tensor_bytes(values: list[Any]) -> tuple[int | None, int | None]:
    """Total bytes of the tensor refs ``[id, storage, offset, numel, itemsize, device]``."""
    total, itemsize, found = 0, None, False
    stack = list(values)
    while stack:
        v = stack.pop()
        if _is_tensor_ref(v):
            total += v[3] * v[4]
            itemsize = itemsize or v[4]
            found = True
        elif isinstance(v, list):
            stack.extend(v)
    return (total if found else None), itemsize


def _tensor_dtype(types: list[Any]) -> str | None:
    """The first tensor's element type as a lower-case ScalarType name (``long int`` → ``long``)."""
    for t in types:
        m = _TENSOR_TYPE.search(str(t))
        if m:
            c_name = m.group(1).removeprefix("c10::").lower()
            return _C_TYPE_TO_DTYPE.get(c_name, c_name)
    return None


def _from_record_param_comms(
    node: dict[str, Any], by_backend_id: dict[Any, str]
) -> dict[str, Any] | None:
    """Decode ``record_param_comms``.

    Its inputs are ``[tensors.., seq, pg, rank, name, in_split, out_split, (global_rank_start,
    global_rank_stride,) (world_size)]``; ``pg`` is a ``(name, desc)`` pair (>= 1.0.3) or a backend
    id (1.0.2) or pointer (1.0.1). Schema >= 1.1.0 repeats them as named attrs.
    """
    attrs = _attr_map(node)
    values, types = _io(node, "inputs")
    out_values, _ = _io(node, "outputs")
    idx = next((i for i, t in enumerate(types) if t == "String"), None)
    if idx is None:
        idx = next((i for i, v in enumerate(values) if isinstance(v, str)), None)
    coll_name = attrs.get("collective_name")
    if coll_name is None and idx is not None:
        coll_name = values[idx]
    if not isinstance(coll_name, str):
        return None
    kind = normalize_comm_kind(coll_name)
    rank_field = values[idx - 1] if idx is not None and idx >= 1 else None
    rank_field = rank_field if isinstance(rank_field, int) and rank_field >= 0 else None
    self_rank = rank_field if (kind in _RANK_FIELD_IS_SELF or coll_name == "wait") else None

    group_name = attrs.get("pg_name")
    if group_name is None and idx is not None and idx >= 2:
        pg = values[idx - 2]
        if isinstance(pg, list) and pg and isinstance(pg[0], str):
            group_name = pg[0]
        elif pg in by_backend_id:
            group_name = by_backend_id[pg]
    group_size = attrs.get("pg_size")
    tail = values[idx + 3 :] if idx is not None else []
    if group_size is None and tail and isinstance(tail[-1], int):
        group_size = tail[-1]
    in_split = values[idx + 1] if idx is not None and len(values) > idx + 1 else None
    if group_size is None and kind == "all_to_all" and isinstance(in_split, list) and in_split:
        group_size = len(in_split)  # all_to_allv lists one split per member

    in_b, itemsize = _tensor_bytes(values[: max(idx - 3, 0)] if idx is not None else values)
    out_b, out_itemsize = _tensor_bytes(out_values)
    itemsize = itemsize or out_itemsize
    if itemsize and isinstance(attrs.get("in_msg_nelems"), int):
        in_b = attrs["in_msg_nelems"] * itemsize
    if itemsize and isinstance(attrs.get("out_msg_nelems"), int):
        out_b = attrs["out_msg_nelems"] * itemsize
    dtype = attrs.get("dtype")
    dtype = dtype.lower() if isinstance(dtype, str) else _tensor_dtype(types)

    peer = None
    if kind in ("send", "recv") and rank_field is not None:
        start, stride = attrs.get("global_rank_start"), attrs.get("global_rank_stride")
        peer = start + rank_field * stride if isinstance(start, int) and stride else rank_field
    return {
        "kind": kind,
        "node_id": node.get("id"),
        "rf_id": attrs.get("rf_id", node.get("rf_id")),
        "group_name": str(group_name) if group_name is not None else None,
        "group_size": group_size if isinstance(group_size, int) and group_size > 0 else None,
        "in_bytes": in_b,
        "out_bytes": out_b,
        "dtype": dtype,
        "self_rank": self_rank,
        "peer": peer,
    }


def _from_c10d_op(node: dict[str, Any]) -> dict[str, Any] | None:
    """A ``c10d::`` op when the trace has no ``record_param_comms`` (gloo): kind and sizes only."""
    name = str(node["name"])
    kind = normalize_comm_kind(name)
    if kind is None:
        return None
    values, types = _io(node, "inputs")
    key = name.removeprefix("c10d::").replace("_", "").lower()
    if key.startswith(_OUT_FIRST_PREFIXES) and len(values) >= 2:
        out_b, _ = _tensor_bytes(values[:1])
        in_b, _ = _tensor_bytes(values[1:2])
    else:
        in_b, _ = _tensor_bytes(values[:1])
        out_b = in_b
    attrs = _attr_map(node)
    return {
        "kind": kind,
        "node_id": node.get("id"),
        "rf_id": attrs.get("rf_id", node.get("rf_id")),
        "group_name": None,
        "in_bytes": in_b,
        "out_bytes": out_b,
        "dtype": _tensor_dtype(types),
        "peer": None,
    }


def _ordered(rows: list[dict[str, Any]], key: str) -> pl.DataFrame:
    df = pl.DataFrame(rows, infer_schema_length=None)
    return df.sort(["rf_id", "node_id"], nulls_last=True).with_columns(
        pl.int_range(pl.len(), dtype=pl.Int64).over(key).alias("seq")
    )


def collectives_frame(rows: list[dict[str, Any]], rank: int) -> pl.DataFrame:
    if not rows:
        return pl.DataFrame(schema=FRAME_SCHEMAS["collectives"])
    df = _ordered(rows, "group_name")
    return df.drop("rf_id", "node_id").with_columns(pl.lit(rank, pl.Int32).alias("rank"))


def p2p_frame(rows: list[dict[str, Any]], rank: int) -> pl.DataFrame:
    if not rows:
        return pl.DataFrame(schema=FRAME_SCHEMAS["p2p"])
    df = pl.DataFrame(rows, infer_schema_length=None).sort(["rf_id", "node_id"], nulls_last=True)
    df = df.with_columns(
        pl.int_range(pl.len(), dtype=pl.Int64).over("peer", "direction").alias("seq")
    )
    return df.drop("rf_id", "node_id").with_columns(pl.lit(rank, pl.Int32).alias("rank"))

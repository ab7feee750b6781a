"""Communication of a host execution trace: process groups, collectives and p2p from comm nodes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from prism_trace.errors import TraceFormatError
from prism_trace.formats.base import FRAME_SCHEMAS
from prism_trace.formats.host_et.load import bad_value, node_where
from prism_trace.limits import MAX_COMM_BYTES, MAX_RANKS, check_count, check_rank, check_text

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
_TENSOR_WANT = (
    f"a tensor [id, storage, offset, numel, itemsize, device] of 0 to {MAX_COMM_BYTES} bytes"
)
_PG_WANT = "a (name, description) pair of strings or a backend id"


class _BadField(Exception):
    """A comm node's field holds a value the reader cannot use.

    The decoders see one node and not its file or place in it; ``comm_rows`` turns this into the
    one-line ``TraceFormatError`` naming the file, the node, the field and the value.
    """

    def __init__(self, field: str, value: Any, want: str) -> None:
        super().__init__(f"`{field}` is {value!r}, expected {want}")
        self.field, self.value, self.want = field, value, want


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    configs: list[tuple[str, dict[str, Any]]] = []  # (where it was read, config)
    for i, n in enumerate(nodes):
        if n.get("name") != PG_INIT_NAME:
            continue
        where = node_where(n.get("id"), i)
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
                configs += [(where, c) for c in parsed if isinstance(c, dict)]
    if not configs and isinstance(dist_info.get("pg_config"), list):
        configs = [("distributedInfo.pg_config", c) for c in dist_info["pg_config"]]
        configs = [(w, c) for w, c in configs if isinstance(c, dict)]

    groups: dict[str, dict[str, Any]] = {}
    members = 0
    for source, c in configs:
        name = c.get("pg_name")
        if name is None:
            continue
        where = f"{source}: process group {str(name)[:40]!r}"
        _check_group_fields(path, where, c)
        size = c.get("group_size", c.get("pg_size"))
        if size is not None:
            size = check_count(path, size, f"{where}: the size")
        ranks = [check_rank(path, r, f"{where}: a rank") for r in c.get("ranks") or []]
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


def _check_group_fields(path: Path, where: str, config: dict[str, Any]) -> None:
    """Refuse a process group whose fields have the wrong type, before any is used.

    ``pg_desc`` lands in the store (and ``default_pg`` picks the world group), ``backend_id`` is
    a dict key for the comm nodes' lookup (a list there is unhashable), ``ranks`` is iterated: a
    wrong type in any is a damaged trace, not something to store or skip quietly.

    Raises:
        TraceFormatError: naming ``where``, the field, its value and the type expected.
    """
    name = config.get("pg_name")
    if not isinstance(name, str) and not _is_int(name):
        raise bad_value(path, where, "pg_name", name, "a string")
    for key in ("pg_desc", "backend_config"):
        value = config.get(key)
        if value is not None and not isinstance(value, str):
            raise bad_value(path, where, key, value, "a string")
    backend_id = config.get("backend_id")
    if backend_id is not None and not (_is_int(backend_id) or isinstance(backend_id, str)):
        raise bad_value(path, where, "backend_id", backend_id, "an integer")
    ranks = config.get("ranks")
    if ranks is not None and not isinstance(ranks, list):
        raise bad_value(path, where, "ranks", ranks, "a list of ranks")


def _backend_of(config: Any) -> str | None:
    """``cuda:nccl`` → ``nccl``; ``cpu:gloo,cuda:nccl`` → ``nccl`` (the device backend wins)."""
    if not isinstance(config, str) or not config:
        return None
    pairs = [p.split(":", 1) for p in config.split(",") if p]
    by_device = {p[0].strip(): p[-1].strip() for p in pairs}
    return by_device.get("cuda") or next(iter(by_device.values()), None)


def default_backend(
    path: Path, dist_info: dict[str, Any], groups: dict[str, dict[str, Any]]
) -> str | None:
    """The rank's backend: ``distributedInfo.backend``, else its default group's.

    Raises:
        TraceFormatError: ``distributedInfo.backend`` is there but not text (the Kineto reader
            refuses the same).
    """
    backend = check_text(path, dist_info.get("backend"), "distributedInfo.backend")
    if backend is not None:
        return backend
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
    path: Path, nodes: list[dict[str, Any]], groups: dict[str, dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]:
    """Rows for collectives and p2p, and the self ranks the comm nodes state.

    Raises:
        TraceFormatError: a comm node's field has a value the tables cannot hold (a list process
            group, a tensor of more than 8 TiB, a group size past the rank limit, ...).
    """
    coll: list[dict[str, Any]] = []
    p2p: list[dict[str, Any]] = []
    self_ranks: list[int] = []
    by_backend_id = {g["backend_id"]: g["name"] for g in groups.values() if g["backend_id"]}
    only_group = next(iter(groups)) if len(groups) == 1 else None

    for call in _decode_calls(path, nodes, by_backend_id):
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


def _decode_calls(
    path: Path, nodes: list[dict[str, Any]], by_backend_id: dict[Any, str]
) -> list[dict[str, Any] | None]:
    """Each comm node decoded: ``record_param_comms``, else (a trace with none) ``c10d::`` ops.

    Raises:
        TraceFormatError: a decoder's ``_BadField``, with the file and the node's id and place.
    """
    rpc = [i for i, n in enumerate(nodes) if n.get("name") == "record_param_comms"]
    c10d = not rpc
    todo = rpc or [i for i, n in enumerate(nodes) if str(n.get("name", "")).startswith("c10d::")]
    calls: list[dict[str, Any] | None] = []
    for i in todo:
        n = nodes[i]
        try:
            calls.append(_from_c10d_op(n) if c10d else _from_record_param_comms(n, by_backend_id))
        except _BadField as exc:
            where = f"{node_where(n.get('id'), i)} {str(n.get('name'))[:60]}"
            raise bad_value(path, where, exc.field, exc.value, exc.want) from exc
    return calls


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


def _tensor_bytes(values: list[Any], side: str = "inputs") -> tuple[int | None, int | None]:
    """Total bytes of the tensor refs ``[id, storage, offset, numel, itemsize, device]``.

    Raises:
        _BadField: a negative numel or itemsize, or a total the BIGINT byte columns cannot hold.
    """
    total, itemsize, found = 0, None, False
    stack = list(values)
    while stack:
        v = stack.pop()
        if _is_tensor_ref(v):
            total += v[3] * v[4]
            if v[3] < 0 or v[4] < 0 or total > MAX_COMM_BYTES:
                raise _BadField(side, v, _TENSOR_WANT)
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
    _check_comm_attrs(attrs)
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
        group_name = _group_of_pg(values[idx - 2], idx - 2, by_backend_id)
    group_size = _group_size(attrs.get("pg_size"), "attrs.pg_size")
    tail = values[idx + 3 :] if idx is not None else []
    if group_size is None and tail and isinstance(tail[-1], int):
        group_size = _group_size(tail[-1], f"inputs[{len(values) - 1}] (the group size)")
    split_at = idx + 1 if idx is not None and len(values) > idx + 1 else None
    in_split = values[split_at] if split_at is not None else None
    if group_size is None and kind == "all_to_all" and isinstance(in_split, list) and in_split:
        group_size = _group_size(len(in_split), f"inputs[{split_at}] (the input splits)")

    in_b, itemsize = _tensor_bytes(values[: max(idx - 3, 0)] if idx is not None else values)
    out_b, out_itemsize = _tensor_bytes(out_values, "outputs")
    itemsize = itemsize or out_itemsize
    in_b = _msg_bytes(attrs, "in_msg_nelems", itemsize, in_b)
    out_b = _msg_bytes(attrs, "out_msg_nelems", itemsize, out_b)
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
        "group_size": group_size,
        "in_bytes": in_b,
        "out_bytes": out_b,
        "dtype": dtype,
        "self_rank": self_rank,
        "peer": peer,
    }


def _check_comm_attrs(attrs: dict[str, Any]) -> None:
    """Refuse comm attrs of the wrong type (schema >= 1.1.0 writes each with a fixed type).

    A string ``global_rank_stride`` would repeat a string (or a list: build one ``rank`` times
    long), a list ``pg_name`` would become a group named ``"['x']"``: refused, not guessed at.

    Raises:
        _BadField: the first attr whose value is of the wrong type.
    """
    for key in ("pg_name", "dtype", "collective_name"):
        value = attrs.get(key)
        if value is not None and not isinstance(value, str):
            field = f"attrs.{key}"
            raise _BadField(field, value, "a string")
    for key in ("global_rank_start", "global_rank_stride", "pg_size"):
        value = attrs.get(key)
        if value is not None and not _is_int(value):
            field = f"attrs.{key}"
            raise _BadField(field, value, "an integer")


def _group_of_pg(pg: Any, index: int, by_backend_id: dict[Any, str]) -> str | None:
    """The group a ``record_param_comms`` ``pg`` input names: ``(name, desc)`` or a backend id.

    Raises:
        _BadField: ``pg`` is a list or object other than a ``(name, desc)`` pair (it is no id).
    """
    if isinstance(pg, list) and pg and isinstance(pg[0], str):
        return pg[0]
    if isinstance(pg, (list, dict)):
        field = f"inputs[{index}] (the process group)"
        raise _BadField(field, pg, _PG_WANT)
    return by_backend_id.get(pg)


def _group_size(value: Any, field: str) -> int | None:
    """A stated group size: None when absent or not positive (unknown), else at most MAX_RANKS.

    Raises:
        _BadField: a size past the rank limit (the group_size column is 32-bit).
    """
    if not _is_int(value) or value <= 0:
        return None
    if value > MAX_RANKS:
        raise _BadField(field, value, f"a group size in [1, {MAX_RANKS}]")
    return int(value)


def _msg_bytes(
    attrs: dict[str, Any], key: str, itemsize: int | None, default: int | None
) -> int | None:
    """``attrs[key]`` (an element count) times ``itemsize``; ``default`` without either.

    Raises:
        _BadField: the count is not a non-negative integer, or the bytes pass ``MAX_COMM_BYTES``.
    """
    nelems = attrs.get(key)
    if nelems is None:
        return default
    size = itemsize or 1  # without a tensor the count is still checked, as if of bytes
    if not _is_int(nelems) or nelems < 0 or nelems * size > MAX_COMM_BYTES:
        want = f"an element count of at most {MAX_COMM_BYTES} bytes ({size}-byte elements)"
        field = f"attrs.{key}"
        raise _BadField(field, nelems, want)
    return int(nelems * itemsize) if itemsize else default


def _from_c10d_op(node: dict[str, Any]) -> dict[str, Any] | None:
    """A ``c10d::`` op when the trace has no ``record_param_comms`` (gloo): kind and sizes only."""
    name = str(node["name"])
    kind = normalize_comm_kind(name)
    if kind is None:
        return None
    values, types = _io(node, "inputs")
    key = name.removeprefix("c10d::").replace("_", "").lower()
    if key.startswith(_OUT_FIRST_PREFIXES) and len(values) >= 2:
        out_b, _ = _tensor_bytes(values[:1], "inputs[0] (the output)")
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

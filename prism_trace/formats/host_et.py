"""Reader of PyTorch host execution traces (``ExecutionTraceObserver`` JSON, schema 1.0.1-1.1.1).

Two node layouts exist. Up to 1.0.1 a node carries ``parent``, ``rf_id``, ``seq_id``, ... and flat
``inputs``/``input_shapes``/``input_types`` lists. From 1.0.2 (``-chakra.0.0.4``) a node carries
``ctrl_deps`` as its parent, ``inputs``/``outputs`` as objects of ``values``, ``shapes``, ``types``
(and, from 1.1.1, ``strides``), and everything else as an ``attrs`` list of ``{name, type, value}``.
Both become one ``et_ops`` row per node. Comm nodes (``record_param_comms``, or ``c10d::*`` ops when
a trace has none) also become ``collectives``/``p2p`` rows, and ``## process_group:init ##`` becomes
``comm_groups``. A host ET has no timing, so ``host_ts``/``host_dur`` stay null.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from prism_trace.errors import (
    MissingFieldError,
    RankUnknownError,
    TraceFormatError,
    TruncatedTraceError,
)
from prism_trace.formats.base import FRAME_SCHEMAS, TraceTables, read_all_bytes
from prism_trace.limits import MAX_RANKS, check_count, check_rank, check_world_size, type_name

__all__ = [
    "ET_ONLY_PREFIX",
    "PG_INIT_NAME",
    "is_et_only_name",
    "normalize_comm_kind",
    "rank_from_file_name",
    "read_host_et",
    "sniff_host_et",
]

PG_INIT_NAME = "## process_group:init ##"
"""The node whose single string input lists the job's process groups (schema >= 1.0.2)."""

ET_ONLY_PREFIX = "[pytorch|profiler|execution_"
"""Prefix of the ET's synthetic process and thread roots (no Kineto counterpart)."""

_PROMOTED_ATTRS = ("rf_id", "seq_id", "scope", "tid", "fw_parent", "op_schema")
_OLD_KNOWN_KEYS = frozenset(
    (
        "id",
        "name",
        "parent",
        *_PROMOTED_ATTRS,
        "inputs",
        "input_shapes",
        "input_types",
        "outputs",
        "output_shapes",
        "output_types",
    )
)
_NEW_KNOWN_KEYS = frozenset(("id", "name", "ctrl_deps", "inputs", "outputs", "attrs"))

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

_RANK_NAME_PATTERNS = (
    re.compile(r"rank[_\-.]?(\d+)", re.IGNORECASE),
    re.compile(r"worker[_\-.]?(\d+)", re.IGNORECASE),
    re.compile(r"_(\d+)$"),
    re.compile(r"^(?!.*\d+\.\d+\.\d+$).*\.(\d+)$"),  # `<name>.<n>`, but not a version `x.y.z`
)
_C_TYPE_TO_DTYPE = {
    "long int": "long",
    "int64_t": "long",
    "unsigned char": "byte",
    "signed char": "char",
    "short int": "short",
}
_TENSOR_TYPE = re.compile(r"Tensor\(([^)]+)\)")
_SNIFF_SCHEMA = re.compile(rb'"schema"\s*:\s*"\d+\.\d+\.\d+')


def sniff_host_et(head: bytes) -> bool:
    """Tell whether the first few KB of a (decompressed) file look like a host execution trace.

    Args:
        head: the start of the decompressed file.

    Returns:
        True for a PyTorch ``ExecutionTraceObserver`` JSON (a ``schema`` version and ``nodes``).
    """
    if b"traceEvents" in head:
        return False
    has_nodes = b'"nodes"' in head
    return has_nodes and (_SNIFF_SCHEMA.search(head) is not None or ET_ONLY_PREFIX.encode() in head)


def is_et_only_name(name: str) -> bool:
    """True for ET nodes without a Kineto counterpart: process/thread roots, process-group init."""
    return name.startswith(ET_ONLY_PREFIX) or name == PG_INIT_NAME


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


def read_host_et(path: Path, *, rank: int | None = None) -> TraceTables:
    """Read one host execution trace into conformed frames.

    Args:
        path: the ET JSON file, optionally gzipped.
        rank: the rank to use when neither the trace nor its file name tells it.

    Returns:
        ``TraceTables`` with ``ranks``, ``et_ops``, ``comm_groups``, ``collectives`` and ``p2p``.

    Raises:
        TruncatedTraceError: the gzip stream or the JSON ends early.
        TraceFormatError: the JSON is invalid or a node is malformed.
        MissingFieldError: the trace has no ``schema`` or no ``nodes``.
        RankUnknownError: the rank cannot be told and ``rank`` was not given.
    """
    path = Path(path)
    doc = _load(path)
    nodes: list[dict[str, Any]] = doc["nodes"]
    check_nodes(path, nodes)
    try:
        return _read(path, doc, nodes, rank)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        if isinstance(exc, TraceFormatError):
            raise
        # A shape the checks above do not cover: still one line naming the file.
        msg = f"{path}: malformed host execution trace ({type(exc).__name__}: {exc})"
        raise TraceFormatError(msg.splitlines()[0]) from exc
    except pl.exceptions.PolarsError as exc:
        msg = f"{path}: malformed host execution trace: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc


def _read(path: Path, doc: dict[str, Any], nodes: list[dict[str, Any]], rank: int | None) -> Any:
    ops = _op_frame(nodes)
    info = doc.get("distributedInfo")
    dist_info: dict[str, Any] = info if isinstance(info, dict) else {}
    groups = _comm_groups(path, nodes, dist_info)
    comm_rows, p2p_rows, comm_ranks = _comm_rows(nodes, groups)
    for r in comm_ranks:
        check_rank(path, r, "the rank a record_param_comms node states")
    for row in p2p_rows:
        check_rank(path, row["peer"], f"the peer of p2p node {row['node_id']}")
    world_size = _world_size(path, dist_info, groups, comm_rows)

    the_rank = _resolve_rank(path, dist_info, groups, comm_ranks, world_size, rank)
    backend = _default_backend(dist_info, groups)
    meta = {k: v for k, v in doc.items() if k != "nodes"}

    tables = TraceTables(path=path, format="host_et", world_size=world_size)
    tables.ranks = pl.DataFrame(
        {
            "rank": [the_rank],
            "backend": [backend],
            "pid": [doc.get("pid") if isinstance(doc.get("pid"), int) else None],
            "args": [orjson.dumps(meta).decode()],
        },
        schema={k: FRAME_SCHEMAS["ranks"][k] for k in ("rank", "backend", "pid", "args")},
    )
    tables.et_ops = ops.with_columns(pl.lit(the_rank, pl.Int32).alias("rank"))
    tables.comm_groups = _groups_frame(groups)
    tables.collectives = _collectives_frame(comm_rows, the_rank)
    tables.p2p = _p2p_frame(p2p_rows, the_rank)
    return tables.conform()


# --------------------------------------------------------------------------------------------------
# loading


# A host ET is parsed whole (its nodes refer to each other anywhere in the file); Python objects
# take several times the JSON's bytes, so larger files are refused with a clear message.
_MAX_JSON_BYTES = 512 << 20


def _load(path: Path) -> dict[str, Any]:
    limit = int(os.environ.get("PRISM_MAX_JSON_BYTES") or _MAX_JSON_BYTES)
    raw = read_all_bytes(path, max_bytes=limit).removeprefix(b"\xef\xbb\xbf")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        doc = _load_lenient(path, raw, exc)
    if not isinstance(doc, dict):
        msg = (
            f"{path}: not a host execution trace (top level is {type(doc).__name__}, not an object)"
        )
        raise TraceFormatError(msg)
    for key in ("schema", "nodes"):
        if key not in doc:
            msg = f"{path}: missing field `{key}` (not a PyTorch host execution trace?)"
            raise MissingFieldError(msg)
    if not isinstance(doc["nodes"], list):
        msg = f"{path}: field `nodes` is {type(doc['nodes']).__name__}, expected a list"
        raise TraceFormatError(msg)
    return doc


def _load_lenient(path: Path, raw: bytes, exc: orjson.JSONDecodeError) -> Any:
    """Retry with the stdlib parser (it accepts the NaN/Infinity some ETs write); else raise."""
    stripped = raw.rstrip()
    if exc.pos >= len(stripped) - 1:
        msg = f"{path}: truncated JSON (input ends at byte {len(raw)} inside a value)"
        raise TruncatedTraceError(msg) from exc
    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let surrogates pass
    except UnicodeDecodeError as err:
        msg = f"{path}: not valid UTF-8 at byte {err.start}: {err.reason}"
        raise TraceFormatError(msg) from err
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    msg = f"{path}: invalid JSON at byte {exc.pos}: {exc.msg}"
    raise TraceFormatError(msg) from exc


_INT64 = 1 << 63
# Fields that, when present and not null, must be of these types, per layout (``int`` excludes
# bool; a float is refused too, so a NaN ``rf_id`` cannot pass).
_OLD_TYPES: dict[str, tuple[type, ...]] = {
    "parent": (int,),
    "rf_id": (int,),
    "seq_id": (int,),
    "tid": (int,),
    "fw_parent": (int,),
    "scope": (int,),
    "op_schema": (str,),
    "inputs": (list,),
    "input_shapes": (list,),
    "input_types": (list,),
    "outputs": (list,),
    "output_shapes": (list,),
    "output_types": (list,),
}
_NEW_TYPES: dict[str, tuple[type, ...]] = {
    "ctrl_deps": (int,),
    "inputs": (dict,),
    "outputs": (dict,),
    "attrs": (list,),
}
_ATTR_TYPES: dict[str, tuple[type, ...]] = {
    "rf_id": (int,),
    "seq_id": (int,),
    "tid": (int,),
    "fw_parent": (int,),
    "scope": (int,),
    "op_schema": (str,),
}
_IO_KEYS = ("values", "shapes", "types", "strides")
# Keys the ExecutionTraceObserver writes on every node of a layout (each real ET checked carries
# them on all nodes: DLRM 1.0.1, ResNet 1.0.3/1.1.0, GPT-2 1.1.0, the sample 1.1.1). A node
# without one is not a node the observer wrote: typically two nodes run together by a cut.
_OLD_REQUIRED = (
    "parent",
    "inputs",
    "input_shapes",
    "input_types",
    "outputs",
    "output_shapes",
    "output_types",
)
_NEW_REQUIRED = ("ctrl_deps", "inputs", "outputs", "attrs")


def _bad(path: Path, nid: Any, index: int, field: str, value: Any, want: str) -> TraceFormatError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    where = f"node {nid}" if isinstance(nid, int) and not isinstance(nid, bool) else "node"
    what = "missing or null" if value is None else f"{type_name(value)} {shown}"
    msg = f"{path}: {where} (nodes[{index}]): `{field}` is {what}, expected {want}"
    return TraceFormatError(msg)


def _typed(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int):
        return int in types and -_INT64 <= value < _INT64
    if isinstance(value, float):
        return float in types and math.isfinite(value)
    return isinstance(value, types)


_WANT = {int: "an integer", str: "a string", list: "a list", dict: "an object"}


def check_nodes(path: Path, nodes: list[Any]) -> None:
    """Check every node against its layout's types before anything is built from it.

    Raises:
        TraceFormatError: the first node that is not an object, has a missing, null or bool
            ``id``/``name``, a duplicate ``id``, lacks a key of its layout (``MissingFieldError``)
            or has a field of the wrong type, naming the node id, the field and the bad value.
    """
    new_layout = any(
        isinstance(n, dict) and (isinstance(n.get("inputs"), dict) or "attrs" in n)
        for n in nodes[:8]
    )
    types = _NEW_TYPES if new_layout else _OLD_TYPES
    required = _NEW_REQUIRED if new_layout else _OLD_REQUIRED
    seen: set[int] = set()
    for i, n in enumerate(nodes):
        if not isinstance(n, dict):
            raise _bad(path, None, i, "node", n, "an object")
        nid = n.get("id")
        if not isinstance(nid, int) or not _typed(nid, (int,)):
            raise _bad(path, None, i, "id", nid, "an integer")
        if nid in seen:
            msg = f"{path}: node id {nid} appears more than once (nodes[{i}])"
            raise TraceFormatError(msg)
        seen.add(nid)
        if not isinstance(n.get("name"), str):
            raise _bad(path, nid, i, "name", n.get("name"), "a string")
        gone = next((k for k in required if k not in n), None)
        if gone is not None:
            layout = "1.0.2+" if new_layout else "1.0.1"
            msg = (
                f"{path}: node {nid} (nodes[{i}]): missing field `{gone}`, which every node of"
                f" a {layout} host execution trace carries"
            )
            raise MissingFieldError(msg)
        for key, want in types.items():
            v = n.get(key)
            if v is not None and not _typed(v, want):
                raise _bad(path, nid, i, key, v, _WANT[want[0]])
        if not new_layout:
            continue
        for side in ("inputs", "outputs"):
            block = n.get(side) or {}
            for key in _IO_KEYS:
                v = block.get(key)
                if v is not None and not isinstance(v, list):
                    raise _bad(path, nid, i, f"{side}.{key}", v, "a list")
        for a in n.get("attrs") or ():
            if not isinstance(a, dict) or not isinstance(a.get("name"), str):
                raise _bad(path, nid, i, "attrs", a, "an object with a string `name`")
            attr_want = _ATTR_TYPES.get(a["name"])
            v = a.get("value")
            if attr_want is not None and v is not None and not _typed(v, attr_want):
                raise _bad(path, nid, i, f"attrs.{a['name']}", v, _WANT[attr_want[0]])


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


# --------------------------------------------------------------------------------------------------
# et_ops


def _op_frame(nodes: list[dict[str, Any]]) -> pl.DataFrame:
    """Build the ``et_ops`` columns (all but rank) column-wise from the raw nodes."""
    new_layout = any(isinstance(n.get("inputs"), dict) or "attrs" in n for n in nodes[:8])
    ids = [n["id"] for n in nodes]
    names = [n["name"] for n in nodes]
    if new_layout:
        amaps = [{a["name"]: a.get("value") for a in n.get("attrs") or ()} for n in nodes]
        parents = [n.get("ctrl_deps") for n in nodes]
        ins = [n.get("inputs") or {} for n in nodes]
        outs = [n.get("outputs") or {} for n in nodes]
        promoted = {k: [a.get(k) for a in amaps] for k in _PROMOTED_ATTRS}
        cols = {
            "inputs": [_dumps(i.get("values", [])) for i in ins],
            "input_shapes": [_dumps(i.get("shapes", [])) for i in ins],
            "input_types": [_dumps(i.get("types", [])) for i in ins],
            "outputs": [_dumps(o.get("values", [])) for o in outs],
            "output_shapes": [_dumps(o.get("shapes", [])) for o in outs],
            "output_types": [_dumps(o.get("types", [])) for o in outs],
        }
        attrs = [
            _dumps(_rest_new(n, a, i, o))
            for n, a, i, o in zip(nodes, amaps, ins, outs, strict=True)
        ]
    else:
        parents = [n.get("parent") for n in nodes]
        promoted = {k: [n.get(k) for n in nodes] for k in _PROMOTED_ATTRS}
        cols = {
            k: [_dumps(n.get(k, [])) for n in nodes]
            for k in ("inputs", "input_shapes", "input_types", "outputs", "output_shapes")
        }
        cols["output_types"] = [_dumps(n.get("output_types", [])) for n in nodes]
        attrs = [_dumps({k: v for k, v in n.items() if k not in _OLD_KNOWN_KEYS}) for n in nodes]

    schema = FRAME_SCHEMAS["et_ops"]
    df = pl.DataFrame(
        {
            "node_id": pl.Series(ids, dtype=pl.Int64),
            "parent_node_id": pl.Series(parents, dtype=pl.Int64, strict=False),
            "name": pl.Series(names, dtype=pl.Utf8),
            "op_schema": pl.Series(promoted["op_schema"], dtype=pl.Utf8, strict=False),
            "tid": pl.Series(promoted["tid"], dtype=pl.Int64, strict=False),
            "rf_id": pl.Series(promoted["rf_id"], dtype=pl.Int64, strict=False),
            "seq_id": pl.Series(promoted["seq_id"], dtype=pl.Int64, strict=False),
            "scope": pl.Series(promoted["scope"], dtype=schema["scope"], strict=False),
            "fw_parent": pl.Series(promoted["fw_parent"], dtype=pl.Int64, strict=False),
            **{k: pl.Series(v, dtype=pl.Utf8) for k, v in cols.items()},
            "attrs": pl.Series(attrs, dtype=pl.Utf8),
        }
    )
    # A root points at itself (process node) or at a node the trace does not hold: no parent.
    return df.with_columns(
        pl.when(
            (pl.col("parent_node_id") != pl.col("node_id"))
            & pl.col("parent_node_id").is_in(df["node_id"].implode())
        )
        .then(pl.col("parent_node_id"))
        .otherwise(None)
        .alias("parent_node_id"),
        pl.col("op_schema").replace("", None),
    )


def _rest_new(
    node: dict[str, Any], amap: dict[str, Any], ins: dict[str, Any], outs: dict[str, Any]
) -> dict[str, Any]:
    rest = {k: v for k, v in amap.items() if k not in _PROMOTED_ATTRS}
    for k, v in node.items():
        if k not in _NEW_KNOWN_KEYS:
            rest[k] = v
    if "strides" in ins:
        rest["input_strides"] = ins["strides"]
    if "strides" in outs:
        rest["output_strides"] = outs["strides"]
    return rest


# --------------------------------------------------------------------------------------------------
# comm groups


def _comm_groups(
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


def _default_backend(dist_info: dict[str, Any], groups: dict[str, dict[str, Any]]) -> str | None:
    if isinstance(dist_info.get("backend"), str):
        return str(dist_info["backend"])
    default = _default_group(groups)
    return default["backend"] if default else None


def _default_group(groups: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    for g in groups.values():
        if g["description"] == "default_pg":
            return g
    return groups.get("0")


def _groups_frame(groups: dict[str, dict[str, Any]]) -> pl.DataFrame:
    cols = ("name", "description", "backend", "size", "ranks")
    return pl.DataFrame(
        {c: [g[c] for g in groups.values()] for c in cols},
        schema=FRAME_SCHEMAS["comm_groups"],
    )


# --------------------------------------------------------------------------------------------------
# collectives and p2p


def _comm_rows(
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


def _collectives_frame(rows: list[dict[str, Any]], rank: int) -> pl.DataFrame:
    if not rows:
        return pl.DataFrame(schema=FRAME_SCHEMAS["collectives"])
    df = _ordered(rows, "group_name")
    return df.drop("rf_id", "node_id").with_columns(pl.lit(rank, pl.Int32).alias("rank"))


def _p2p_frame(rows: list[dict[str, Any]], rank: int) -> pl.DataFrame:
    if not rows:
        return pl.DataFrame(schema=FRAME_SCHEMAS["p2p"])
    df = pl.DataFrame(rows, infer_schema_length=None).sort(["rf_id", "node_id"], nulls_last=True)
    df = df.with_columns(
        pl.int_range(pl.len(), dtype=pl.Int64).over("peer", "direction").alias("seq")
    )
    return df.drop("rf_id", "node_id").with_columns(pl.lit(rank, pl.Int32).alias("rank"))


# --------------------------------------------------------------------------------------------------
# rank and world


def _world_size(
    path: Path,
    dist_info: dict[str, Any],
    groups: dict[str, dict[str, Any]],
    coll: list[dict[str, Any]],
) -> int | None:
    if dist_info.get("world_size") is not None:
        return check_world_size(path, dist_info["world_size"], "distributedInfo.world_size")
    default = _default_group(groups)
    if default and default["size"]:
        return int(default["size"])
    sizes = [c["group_size"] for c in coll if c["group_name"] == "0" and c["group_size"]]
    return check_world_size(path, max(sizes), "the default group's size") if sizes else None


def _resolve_rank(
    path: Path,
    dist_info: dict[str, Any],
    groups: dict[str, dict[str, Any]],
    comm_ranks: list[int],
    world_size: int | None,
    rank: int | None,
) -> int:
    """Rank from the trace, else from the file name, else from the argument."""
    if dist_info.get("rank") is not None:
        return check_rank(path, dist_info["rank"], "distributedInfo.rank")
    if comm_ranks:
        return Counter(comm_ranks).most_common(1)[0][0]
    if world_size == 1 and groups:
        return 0
    from_name = rank_from_file_name(path)
    if from_name is not None:
        return check_rank(path, from_name, "the rank in the file name")
    if rank is not None:
        return check_rank(path, rank, "the rank given")
    msg = (
        f"{path}: cannot tell the rank (no distributedInfo, comm node or rank in the file name);"
        " pass --rank"
    )
    raise RankUnknownError(msg)


def rank_from_file_name(path: Path) -> int | None:
    """``dlrm_eg_3.json.gz`` → 3, ``x_rank1_y`` → 1, ``trace.2.json`` → 2; None if none shows."""
    stem = path.name
    for suffix in (".gz", ".json", ".et"):
        stem = stem.removesuffix(suffix)
    for pattern in _RANK_NAME_PATTERNS:
        m = pattern.search(stem)
        if m:
            return int(m.group(1))
    return None

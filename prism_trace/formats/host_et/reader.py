"""Reader of PyTorch host execution traces (``ExecutionTraceObserver`` JSON, schema 1.0.1-1.1.1).

Two node layouts exist. Up to 1.0.1 a node carries ``parent``, ``rf_id``, ``seq_id``, ... and flat
``inputs``/``input_shapes``/``input_types`` lists. From 1.0.2 (``-chakra.0.0.4``) a node carries
``ctrl_deps`` as its parent, ``inputs``/``outputs`` as objects of ``values``, ``shapes``, ``types``
(and, from 1.1.1, ``strides``), and everything else as an ``attrs`` list of ``{name, type, value}``.
Both become one ``et_ops`` row per node. Comm nodes (``record_param_comms``, or ``c10d::*`` ops when
a trace has none) also become ``collectives``/``p2p`` rows, and ``## process_group:init ##`` becomes
``comm_groups``. A host ET has no timing, so ``host_ts``/``host_dur`` stay null.

This module owns the reader, ``et_ops`` and the rank; loading and the node checks are in
``host_et_check``, the communication tables in ``host_et_comms``.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from prism_trace.errors import RankUnknownError, TraceFormatError
from prism_trace.formats.base import FRAME_SCHEMAS, TraceTables
from prism_trace.formats.host_et.comms import (
    PG_INIT_NAME,
    collectives_frame,
    comm_groups,
    comm_rows,
    default_backend,
    default_group,
    groups_frame,
    p2p_frame,
)
from prism_trace.formats.host_et.load import (
    OLD_IO_KEYS,
    PROMOTED_ATTRS,
    check_nodes,
    check_parents,
    load,
)
from prism_trace.limits import check_rank, check_world_size

__all__ = [
    "ET_ONLY_PREFIX",
    "is_et_only_name",
    "rank_from_file_name",
    "read_host_et",
    "sniff_host_et",
]

ET_ONLY_PREFIX = "[pytorch|profiler|execution_"
"""Prefix of the ET's synthetic process and thread roots (no Kineto counterpart)."""

_OLD_KNOWN_KEYS = frozenset(("id", "name", "parent", *PROMOTED_ATTRS, *OLD_IO_KEYS))
_NEW_KNOWN_KEYS = frozenset(("id", "name", "ctrl_deps", "inputs", "outputs", "attrs"))
_RANK_NAME_PATTERNS = (
    re.compile(r"rank[_\-.]?(\d+)", re.IGNORECASE),
    re.compile(r"worker[_\-.]?(\d+)", re.IGNORECASE),
    re.compile(r"_(\d+)$"),
    re.compile(r"^(?!.*\d+\.\d+\.\d+$).*\.(\d+)$"),  # `<name>.<n>`, but not a version `x.y.z`
)
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
    doc = load(path)
    nodes: list[dict[str, Any]] = doc["nodes"]
    check_nodes(path, nodes)
    check_parents(path, nodes)
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
    groups = comm_groups(path, nodes, dist_info)
    coll_rows, p2p_rows, comm_ranks = comm_rows(path, nodes, groups)
    for r in comm_ranks:
        check_rank(path, r, "the rank a record_param_comms node states")
    for row in p2p_rows:
        check_rank(path, row["peer"], f"the peer of p2p node {row['node_id']}")
    world_size = _world_size(path, dist_info, groups, coll_rows)

    the_rank = _resolve_rank(path, dist_info, groups, comm_ranks, world_size, rank)
    backend = default_backend(path, dist_info, groups)
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
    tables.comm_groups = groups_frame(groups)
    tables.collectives = collectives_frame(coll_rows, the_rank)
    tables.p2p = p2p_frame(p2p_rows, the_rank)
    return tables.conform()


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
        promoted = {k: [a.get(k) for a in amaps] for k in PROMOTED_ATTRS}
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
        promoted = {k: [n.get(k) for n in nodes] for k in PROMOTED_ATTRS}
        cols = {k: [_dumps(n.get(k, [])) for n in nodes] for k in OLD_IO_KEYS}
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
    rest = {k: v for k, v in amap.items() if k not in PROMOTED_ATTRS}
    for k, v in node.items():
        if k not in _NEW_KNOWN_KEYS:
            rest[k] = v
    if "strides" in ins:
        rest["input_strides"] = ins["strides"]
    if "strides" in outs:
        rest["output_strides"] = outs["strides"]
    return rest


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
    default = default_group(groups)
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
    """Rank from the trace, else from the file name, else from the argument, else 0 when the
    trace's one group is of one process (the argument first: ``--rank`` for a trace and its
    host ET, or the rank of the Kineto trace the ET pairs with, must give both one rank)."""
    if dist_info.get("rank") is not None:
        return check_rank(path, dist_info["rank"], "distributedInfo.rank")
    if comm_ranks:
        return Counter(comm_ranks).most_common(1)[0][0]
    from_name = rank_from_file_name(path)
    if from_name is not None:
        return check_rank(path, from_name, "the rank in the file name")
    if rank is not None:
        return check_rank(path, rank, "the rank given")
    if world_size == 1 and groups:
        return 0
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

"""Loading a host execution trace: the JSON parsed whole, each node checked against its layout."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from prism_trace.errors import MissingFieldError, TraceFormatError, TruncatedTraceError
from prism_trace.formats.base import ET_IO_COLUMNS, read_all_bytes
from prism_trace.formats.unique_keys import loads_unique
from prism_trace.limits import type_name

__all__ = [
    "OLD_IO_KEYS",
    "PROMOTED_ATTRS",
    "bad_value",
    "check_nodes",
    "check_parents",
    "load",
    "node_where",
]


# A host ET is parsed whole (its nodes refer to each other anywhere in the file); Python objects
# take several times the JSON's bytes, so larger files are refused with a clear message.
_MAX_JSON_BYTES = 512 << 20


def load(path: Path) -> dict[str, Any]:
    """The host ET's JSON, parsed whole, with its top-level keys checked.

    Parsed by the stdlib scanner with a hook that refuses a duplicate key in any object
    (``unique_keys``): orjson, which was used first, keeps the last of two values silently. The
    stdlib parser also takes the NaN/Infinity some ETs write.
    """
    limit = int(os.environ.get("PRISM_MAX_JSON_BYTES") or _MAX_JSON_BYTES)
    raw = read_all_bytes(path, max_bytes=limit).removeprefix(b"\xef\xbb\xbf")
    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let surrogates pass
    except UnicodeDecodeError as err:
        msg = f"{path}: not valid UTF-8 at byte {err.start}: {err.reason}"
        raise TraceFormatError(msg) from err
    del raw
    try:
        doc = loads_unique(text, path)
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text.rstrip()) - 1 or exc.msg.startswith("Unterminated string"):
            msg = f"{path}: truncated JSON (input ends at character {len(text)} inside a value)"
            raise TruncatedTraceError(msg) from exc
        msg = f"{path}: invalid JSON at character {exc.pos}: {exc.msg}"
        raise TraceFormatError(msg) from exc
    except RecursionError as exc:
        msg = f"{path}: invalid JSON: nested too deeply to parse"
        raise TraceFormatError(msg) from exc
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


_INT64 = 1 << 63
# Fields that, when present and not null, must be of these types, per layout (``int`` excludes
# bool; a float is refused too, so a NaN ``rf_id`` cannot pass).
_ATTR_TYPES: dict[str, tuple[type, ...]] = {
    "rf_id": (int,),
    "seq_id": (int,),
    "tid": (int,),
    "fw_parent": (int,),
    "scope": (int,),
    "op_schema": (str,),
}
"""The attributes the reader promotes to columns (``PROMOTED_ATTRS``), by their type."""
PROMOTED_ATTRS = tuple(_ATTR_TYPES)
OLD_IO_KEYS = ET_IO_COLUMNS
"""The flat input/output lists of a 1.0.1 node (they name the ``et_ops`` columns)."""
_OLD_TYPES: dict[str, tuple[type, ...]] = {
    "parent": (int,),
    **_ATTR_TYPES,
    **dict.fromkeys(OLD_IO_KEYS, (list,)),
}
_NEW_TYPES: dict[str, tuple[type, ...]] = {
    "ctrl_deps": (int,),
    # Not a key of this layout (rf_id is an attr here), but the comm decoding falls back to a
    # node-level one, which then orders the collectives: a string there would sort as text.
    "rf_id": (int,),
    "inputs": (dict,),
    "outputs": (dict,),
    "attrs": (list,),
}
_IO_KEYS = ("values", "shapes", "types", "strides")
# Keys the ExecutionTraceObserver writes on every node of a layout (each real ET checked carries
# them on all nodes: DLRM 1.0.1, ResNet 1.0.3/1.1.0, GPT-2 1.1.0, the sample 1.1.1). A node
# without one is not a node the observer wrote: typically two nodes run together by a cut.
_OLD_REQUIRED = ("parent", *OLD_IO_KEYS)
_NEW_REQUIRED = ("ctrl_deps", "inputs", "outputs", "attrs")


def node_where(nid: Any, index: int) -> str:
    """``node 7 (nodes[3])``: a node named by its id (when usable) and its place in the file."""
    where = f"node {nid}" if isinstance(nid, int) and not isinstance(nid, bool) else "node"
    return f"{where} (nodes[{index}])"


def bad_value(path: Path, where: str, field: str, value: Any, want: str) -> TraceFormatError:
    """The one-line refusal of ``field`` at ``where``: its type and (shortened) value, and ``want``.

    Shared by the node checks here and the comm decoding in ``host_et_comms``, so every bad
    value of a host ET reads the same way.
    """
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    what = "missing or null" if value is None else f"{type_name(value)} {shown}"
    return TraceFormatError(f"{path}: {where}: `{field}` is {what}, expected {want}")


def _bad(path: Path, nid: Any, index: int, field: str, value: Any, want: str) -> TraceFormatError:
    return bad_value(path, node_where(nid, index), field, value, want)


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


# The one node a real ET makes its own parent: the process root (``[pytorch|profiler|
# execution_trace|process]``, ``execution_graph`` in 1.0.1), id 1 in every ET checked.
_PROCESS_ROOT = re.compile(r"\[pytorch\|profiler\|execution_\w+\|process\]")


def check_parents(path: Path, nodes: list[dict[str, Any]]) -> None:
    """Refuse a node that is its own parent (but the process root) or a cycle of parents.

    A node's parent is ``parent`` (1.0.1) or ``ctrl_deps`` (1.0.2+); one the trace does not hold
    makes a root. Parents form a tree in every ET the observer writes; a cycle has no root, so
    nothing above its nodes could be nested or linked, and a self-parent other than the process
    root is a corrupt id. Run after ``check_nodes`` (ids unique integers, parents integers).

    Raises:
        TraceFormatError: naming the node (and, for a cycle, the nodes around it).
    """
    key = "ctrl_deps" if any("ctrl_deps" in n for n in nodes[:8]) else "parent"
    parent: dict[int, int] = {}
    for i, n in enumerate(nodes):
        nid, p = n["id"], n.get(key)
        if not isinstance(p, int) or isinstance(p, bool):
            continue
        if p == nid:
            if not _PROCESS_ROOT.fullmatch(n["name"]):
                msg = (
                    f"{path}: {node_where(nid, i)} is its own parent (`{key}` = {p}); only the"
                    " process root may be"
                )
                raise TraceFormatError(msg)
            continue
        parent[nid] = p
    done: set[int] = set()
    for start in parent:
        chain: dict[int, None] = {}  # ordered: the walk up from ``start``
        at: int | None = start
        while at is not None and at not in done:
            if at in chain:
                loop = list(chain)[list(chain).index(at) :]
                shown = " -> ".join(map(str, loop[:8])) + (" -> ..." if len(loop) > 8 else "")
                msg = (
                    f"{path}: the parents (`{key}`) of nodes {shown} -> {at} form a cycle;"
                    " a host ET's nodes form a tree"
                )
                raise TraceFormatError(msg)
            chain[at] = None
            at = parent.get(at)
        done.update(chain)

"""An independent judge of a mutated trace: is it a valid trace of its format, prism aside?

``fuzz_ingest.py`` asks it only when ``prism ingest`` accepted a mutated input whose data differs
from the unmutated seed's. A byte flip in a string, a chunk delete that removes whole JSON events,
a flipped float in a parquet page: the input is then a valid trace with other values, and taking
it is right. Anything else is a reader that let an invalid value through.

Nothing here uses prism's readers. Each check decodes the file with the format's own tools (the
``json`` module with strict UTF-8 and no NaN, ``pyarrow``, the Chakra protobuf schema of the
``mlc-chakra`` package when installed, else the copy bundled with prism, which
``tests/prism_trace/test_chakra_schema.py`` keeps equal to upstream) and holds it to the format's
schema as written down by its producers: the Chrome trace-event format for Kineto, PyTorch's
``ExecutionTraceObserver`` for host ETs, Chakra's ``et_def.proto``, the Megatron op timeline.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from pathlib import Path
from typing import Any

MAX_RANKS = 1 << 20
"""The rank bound the issue states (2^20): a world larger than this is refused, not read."""

_MAX_MICROS = 1 << 53  # a Chakra time in µs that fits a nanosecond BIGINT
PRISM_NODES = "prism_nodes"  # prism's export: the Node records after the metadata


class Invalid(Exception):
    """The input breaks its format; the message says where."""


def verdict(fmt: str, files: list[Path]) -> str | None:
    """None when every file is a valid trace of ``fmt``; else why one is not (one line)."""
    try:
        for f in files:
            if fmt == "op_timeline":
                _op_timeline(f)
            elif f.is_file():
                {"kineto": _kineto, "host_et": _host_et, "chakra": _chakra}[fmt](f)
    except Invalid as exc:
        return str(exc)
    return None


def chakra_states_count(path: Path) -> bool:
    """Whether a Chakra file's metadata states its node count (prism's export does)."""
    try:
        gm = _chakra_records(_payload(path))[0]
    except (Invalid, IndexError):
        return False
    pb = _chakra_pb()
    meta = pb.GlobalMetadata.FromString(gm)
    return any(a.name == PRISM_NODES for a in meta.attr)


# -- shared ---------------------------------------------------------------------------------------


def _payload(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise Invalid(f"{path.name}: bad gzip: {exc}") from exc
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(path: Path) -> Any:
    try:
        text = _payload(path).decode("utf-8-sig")  # RFC 8259 lets a parser ignore a BOM
        return json.loads(text, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Invalid(f"{path.name}: not strict UTF-8 JSON: {str(exc)[:80]}") from exc


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _need(ok: object, path: Path, where: str, what: str, value: Any) -> None:
    """Raise ``Invalid`` naming the file, the place and what was wanted, unless ``ok``."""
    if not ok:
        raise Invalid(f"{path.name}: {where}: {what}, got {str(value)[:60]!r}")


# -- Kineto: Chrome trace-event format ------------------------------------------------------------


def _kineto(path: Path) -> None:
    doc = _json(path)
    _need(isinstance(doc, dict), path, "top level", "an object", type(doc).__name__)
    events = doc.get("traceEvents")
    _need(isinstance(events, list), path, "traceEvents", "a list", type(events).__name__)
    info = doc.get("distributedInfo")
    if info is not None:
        _need(isinstance(info, dict), path, "distributedInfo", "an object", info)
        rank, world = info.get("rank"), info.get("world_size")
        if rank is not None:
            _need(_is_int(rank) and 0 <= rank < MAX_RANKS, path, "rank", "a rank", rank)
        if world is not None:
            _need(_is_int(world) and 1 <= world <= MAX_RANKS, path, "world_size", "a size", world)
            if rank is not None:
                _need(rank < world, path, "rank", f"below world_size {world}", rank)
    base = doc.get("baseTimeNanoseconds")
    if base is not None:
        _need(_is_int(base) and 0 <= base < 1 << 63, path, "baseTimeNanoseconds", "ns", base)
    for i, ev in enumerate(events):
        where = f"event {i}"
        _need(isinstance(ev, dict), path, where, "an object", ev)
        ph = ev.get("ph")
        _need(isinstance(ph, str) and len(ph) == 1, path, f"{where} ph", "a phase letter", ph)
        if "name" in ev:
            _need(isinstance(ev["name"], str), path, f"{where} name", "a string", ev["name"])
        if ev.get("cat") is not None:  # optional: null reads as absent
            _need(isinstance(ev["cat"], str), path, f"{where} cat", "a string", ev["cat"])
        for key in ("pid", "tid"):
            if key in ev:
                v = ev[key]
                _need(_is_int(v) or isinstance(v, str), path, f"{where} {key}", "an id", v)
        if "ts" in ev:
            _need(_is_num(ev["ts"]) and ev["ts"] >= 0, path, f"{where} ts", "a time", ev["ts"])
        if ev.get("args") is not None:  # optional: null reads as absent
            _need(isinstance(ev["args"], dict), path, f"{where} args", "an object", ev["args"])
        if ph == "X":
            for key in ("name", "ts", "dur", "pid", "tid"):
                _need(key in ev, path, where, f"a complete event has `{key}`", sorted(ev))
            dur = ev["dur"]
            _need(_is_num(dur) and dur >= 0, path, f"{where} dur", "a duration", dur)


# -- host ET: PyTorch ExecutionTraceObserver ------------------------------------------------------

_OLD_TYPES = {
    "parent": _is_int,
    "rf_id": _is_int,
    "tid": _is_int,
    "seq_id": _is_int,
    "fw_parent": _is_int,
    "scope": _is_int,
    "op_schema": lambda v: isinstance(v, str),
    "inputs": lambda v: isinstance(v, list),
    "input_shapes": lambda v: isinstance(v, list),
    "input_types": lambda v: isinstance(v, list),
    "outputs": lambda v: isinstance(v, list),
    "output_shapes": lambda v: isinstance(v, list),
    "output_types": lambda v: isinstance(v, list),
}
_NEW_TYPES = {
    "ctrl_deps": _is_int,
    "inputs": lambda v: isinstance(v, dict),
    "outputs": lambda v: isinstance(v, dict),
    "attrs": lambda v: isinstance(v, list),
}
# what PyTorch's ExecutionTraceObserver writes on every node of each layout
_OLD_KEYS = ("id", "name", "parent", "inputs", "input_shapes", "input_types", "outputs")
_OLD_KEYS += ("output_shapes", "output_types")
_NEW_KEYS = ("id", "name", "ctrl_deps", "inputs", "outputs", "attrs")
_NEW_ATTR_TYPES = {"rf_id": _is_int, "tid": _is_int, "seq_id": _is_int, "fw_parent": _is_int}


def _host_et(path: Path) -> None:
    doc = _json(path)
    _need(isinstance(doc, dict), path, "top level", "an object", type(doc).__name__)
    nodes = doc.get("nodes")
    _need(isinstance(nodes, list) and bool(nodes), path, "nodes", "a non-empty list", nodes)
    _need(isinstance(doc.get("schema"), str), path, "schema", "a version string", doc.get("schema"))
    new = any(isinstance(n, dict) and isinstance(n.get("inputs"), dict) for n in nodes[:8])
    seen: set[int] = set()
    for i, n in enumerate(nodes):
        _need(isinstance(n, dict), path, f"node {i}", "an object", n)
        nid = n.get("id")
        _need(_is_int(nid) and nid >= 0, path, f"node {i} id", "an id", nid)
        _need(nid not in seen, path, f"node {i} id", "unique", nid)
        seen.add(nid)
        _need(isinstance(n.get("name"), str), path, f"node {nid} name", "a string", n.get("name"))
        gone = [k for k in (_NEW_KEYS if new else _OLD_KEYS) if k not in n]
        _need(not gone, path, f"node {nid}", "every key of the observer's node", gone)
        for key, ok in (_NEW_TYPES if new else _OLD_TYPES).items():
            if key in n:
                _need(ok(n[key]), path, f"node {nid} {key}", "the schema's type", n[key])
        for a in n.get("attrs") or () if new else ():
            _need(isinstance(a, dict) and isinstance(a.get("name"), str), path, "attr", "named", a)
            check = _NEW_ATTR_TYPES.get(a["name"])
            if check is not None:
                _need(check(a.get("value")), path, f"node {nid} {a['name']}", "an int", a)
    if "rank" in doc:
        rank = doc["rank"]
        _need(_is_int(rank) and 0 <= rank < MAX_RANKS, path, "rank", "a rank", rank)


# -- Chakra ET: et_def.proto ----------------------------------------------------------------------


def _chakra_pb() -> Any:
    try:
        from chakra.schema.protobuf import et_def_pb2 as pb  # upstream's, when installed
    except ImportError:  # pragma: no cover - mlc-chakra is a dev dependency
        from prism_trace.formats.chakra import chakra_pb2 as pb
    return pb


def _chakra_records(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        size, shift = 0, 0
        while True:
            if pos >= len(data) or shift > 63:
                raise Invalid("record length cut or malformed")
            b = data[pos]
            pos += 1
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if pos + size > len(data):
            raise Invalid(f"record of {size} bytes at {pos} runs past the end")
        out.append(data[pos : pos + size])
        pos += size
    return out


def _chakra(path: Path) -> None:
    from google.protobuf import unknown_fields
    from google.protobuf.message import DecodeError

    pb = _chakra_pb()
    try:
        recs = _chakra_records(_payload(path))
    except Invalid as exc:
        raise Invalid(f"{path.name}: {exc}") from exc
    _need(len(recs) >= 2, path, "records", "metadata and at least one node", len(recs))
    types = set(pb.NodeType.values()) - {pb.INVALID_NODE}
    kinds = set(pb.CollectiveCommType.values())
    try:
        gm = pb.GlobalMetadata.FromString(recs[0])
        nodes = [pb.Node.FromString(r) for r in recs[1:]]
    except DecodeError as exc:
        raise Invalid(f"{path.name}: a record does not decode: {exc}") from exc
    _need(not len(unknown_fields.UnknownFieldSet(gm)), path, "metadata", "schema fields", gm)
    stated = {a.name: a for a in gm.attr}
    if PRISM_NODES in stated:
        want = stated[PRISM_NODES].int64_val
        _need(want == len(nodes), path, PRISM_NODES, f"{len(nodes)} nodes held", want)
    if "world_size" in stated:
        w = stated["world_size"].int64_val
        _need(1 <= w <= MAX_RANKS, path, "world_size", "a size", w)
    ids: set[int] = set()
    for n in nodes:
        where = f"node {n.id}"
        _need(not len(unknown_fields.UnknownFieldSet(n)), path, where, "schema fields", n)
        _need(n.type in types, path, f"{where} type", "a node type", n.type)
        _need(n.id not in ids, path, f"{where} id", "unique", n.id)
        ids.add(n.id)
        for t in (n.duration_micros, n.start_time_micros):
            _need(t < _MAX_MICROS, path, f"{where} time", "below 2^53 µs", t)
        for a in n.attr:
            if a.name == "comm_type" and n.type == pb.COMM_COLL_NODE:
                _need(a.int64_val in kinds, path, f"{where} comm_type", "a kind", a.int64_val)
    top = max(ids)
    for n in nodes:
        for d in [*n.data_deps, *n.ctrl_deps]:
            _need(d <= top, path, f"node {n.id} dependency", "a node of the file", d)


# -- op timeline: parquet + meta yaml -------------------------------------------------------------


def _op_timeline(folder: Path) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import yaml

    (trace,) = sorted(folder.glob("trace*.parquet"))
    metas = sorted(folder.glob("meta*.yaml"))
    try:
        table = pq.read_table(trace)
    except (pa.ArrowException, OSError) as exc:
        raise Invalid(f"{trace.name}: not parquet: {str(exc)[:80]}") from exc
    ints = ("rank", "step", "seq_id", "dp_rank", "stage")
    for col in (*ints, "optype", "start_ts", "duration"):
        _need(col in table.column_names, trace, col, "a column", table.column_names)
    for col in ints:
        _need(pa.types.is_integer(table[col].type), trace, col, "integers", table[col].type)
    for col in ("start_ts", "duration"):
        t = table[col].type
        _need(pa.types.is_floating(t) or pa.types.is_integer(t), trace, col, "numbers", t)
        values = table[col].to_pylist()
        bad = next((v for v in values if v is None or not math.isfinite(v) or v < 0), None)
        _need(bad is None, trace, col, "finite and >= 0", bad)
        _need(max(values) < 1e12, trace, col, "seconds of a run", max(values))
    ot = table["optype"].type
    ok = pa.types.is_string(ot) or pa.types.is_large_string(ot) or pa.types.is_dictionary(ot)
    _need(ok, trace, "optype", "strings", ot)
    keys = list(
        zip(*(table[c].to_pylist() for c in ("rank", "step", "optype", "seq_id")), strict=True)
    )
    _need(len(set(keys)) == len(keys), trace, "rows", "unique (rank, step, optype, seq_id)", "dup")
    lo = pc.min(table["rank"]).as_py()
    _need(lo is not None and lo >= 0, trace, "rank", ">= 0", lo)
    if not metas:
        return
    meta_path = metas[0]
    try:
        meta = yaml.safe_load(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
        raise Invalid(f"{meta_path.name}: not YAML: {str(exc)[:60]}") from exc
    _need(isinstance(meta, dict), meta_path, "top level", "a mapping", meta)
    sizes = {k: meta.get(k) for k in ("dp_size", "pp_size", "tp_size", "world_size")}
    for k, v in sizes.items():
        if v is not None:
            _need(_is_int(v) and 1 <= v <= MAX_RANKS, meta_path, k, "a size", v)
    dp, pp, tp, world = (sizes[k] for k in ("dp_size", "pp_size", "tp_size", "world_size"))
    if None not in (dp, pp, tp, world):
        _need(dp * pp * tp == world, meta_path, "sizes", "dp * pp * tp == world_size", sizes)
    if world is not None:
        hi = pc.max(table["rank"]).as_py()
        _need(hi < world, trace, "rank", f"below world_size {world}", hi)
    if dp is not None:
        hi = pc.max(table["dp_rank"]).as_py()
        _need(hi < dp, trace, "dp_rank", f"below dp_size {dp}", hi)
    if pp is not None:
        hi = pc.max(table["stage"]).as_py()
        _need(hi < pp, trace, "stage", f"below pp_size {pp}", hi)

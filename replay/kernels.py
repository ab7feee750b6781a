"""Rebuild the compute ops of one rank from its host execution trace, ready to execute.

The host ET (``et_op``) records every dispatched op with its ATen schema, its arguments and, for
each tensor, ``[tensor_id, storage_id, offset, numel, elem_bytes, device]`` plus shape, dtype
(``input_types``) and strides (``attrs.input_strides``, schema >= 1.1.1; contiguous before). This
module turns that into a *program*: a list of ``OpCall`` that a replay executes in recorded order.

Which ops (the rules of PARAM's ``et_replay``, made schema-based):

- A node with an ``op_schema`` is an op; a node without one (``ProfilerStep#``, annotations,
  ``autograd::engine::evaluate_function: ...``, ``AddmmBackward0``, ``Optimizer.step#...``,
  custom autograd Functions) is a container whose ops are looked at instead.
- Only the *outermost* ops are replayed: an op whose ancestor is also an op ran inside it
  (``aten::linear`` → ``aten::addmm``) and is executed again by replaying its ancestor. This picks
  ``aten::linear`` in forward, the ``aten::mm``/``aten::sum`` of ``AddmmBackward0`` in backward and
  ``aten::_fused_adam_`` under the optimizer, as PARAM's ``is_op``/``is_backward_aten`` do.
- A communication unit (an ET node linked to a communication node of the run's graph, e.g. the
  ``prism_comm:...`` annotation, or ``record_param_comms``) is replayed by ``replay.hybrid`` from
  the peers' schedule, never as kernels; the ops under it are skipped. ``c10d::``/
  ``record_param_comms`` ops that no communication node covers are counted as ``uncovered_comm``.
- Profiler machinery (``profiler::`` ops) is skipped and counted.

Tensors (``TensorPlan``): ids are recycled by the recording (an id is the address of a
``TensorImpl`` or of a storage), so a tensor is resolved *in program order*: an input whose key
``(tensor_id, storage_id, offset, numel, elem_bytes, device)`` is the output of an earlier replayed
op refers to that op's result; else, when an earlier result lives in the same storage, it is a view
of it rebuilt with ``as_strided`` (so aliasing and memory are preserved, e.g. autograd's saved
tensors); else it is an *external* tensor (parameters, optimizer state, inputs made outside the
replayed ops), allocated once with random data, externals of one storage sharing one buffer.
Every result is dropped after its last use, so memory rises and falls as in the recording.
Floating tensors get uniform [0, 1) data (no NaN from ``sqrt``/``log``), integer and bool tensors
zeros (valid indices and targets).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    import polars as pl
    import torch

__all__ = [
    "ArgSpec",
    "OpCall",
    "Program",
    "TensorMeta",
    "Unit",
    "UnsupportedOp",
    "build_program",
    "parse_schema",
    "select_units",
]

_TYPE_DTYPES = {
    "float": "float32",
    "double": "float64",
    "c10::Half": "float16",
    "c10::BFloat16": "bfloat16",
    "long int": "int64",
    "int64_t": "int64",
    "int": "int32",
    "short int": "int16",
    "signed char": "int8",
    "unsigned char": "uint8",
    "bool": "bool",
    "c10::complex<float>": "complex64",
    "c10::complex<double>": "complex128",
    "c10::complex<c10::Half>": "complex32",
    "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2",
    "unsigned short": "uint16",
    "unsigned int": "uint32",
}
# c10::ScalarType enum order (stable across releases).
_SCALAR_TYPES = {
    0: "uint8",
    1: "int8",
    2: "int16",
    3: "int32",
    4: "int64",
    5: "float16",
    6: "float32",
    7: "float64",
    8: "complex32",
    9: "complex64",
    10: "complex128",
    11: "bool",
    15: "bfloat16",
    23: "float8_e5m2",
    24: "float8_e4m3fn",
    27: "uint16",
    28: "uint32",
    29: "uint64",
}
_LAYOUTS = {0: "strided", 1: "sparse_coo", 2: "sparse_csr", 4: "sparse_csc"}
_MEMORY_FORMATS = {
    0: "contiguous_format",
    1: "preserve_format",
    2: "channels_last",
    3: "channels_last_3d",
}
_TENSOR_TYPE = re.compile(r"^Tensor\((.*)\)$")
_NONE = "<None>"
COMM_OP_PREFIXES = ("c10d::", "record_param_comms", "nccl:", "gloo:")
"""Op names that communicate: replayed from the peers' schedule, never as kernels."""
SKIPPED_NAMESPACES = ("profiler::",)
"""Schema ops that are profiler machinery, not work of the job."""


# -- schema parsing ----------------------------------------------------------------


@dataclass(frozen=True)
class ArgSpec:
    """One argument of an ATen schema.

    Attributes:
        name: argument name.
        type: type as written, without alias annotations (``Tensor``, ``Tensor?``, ``Tensor[]``,
            ``int[]``, ``ScalarType?``, ...).
        kwarg_only: declared after ``*``.
    """

    name: str
    type: str
    kwarg_only: bool

    @property
    def base(self) -> str:
        """The type without ``?``, ``[]`` and sizes: ``Tensor?[]`` → ``Tensor``."""
        return re.sub(r"\[\d*\]", "", self.type).replace("?", "")

    @property
    def is_list(self) -> bool:
        """A list type (``Tensor[]``, ``int[2]``, ...)."""
        return "[" in self.type


def _split_top(text: str) -> list[str]:
    out: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def parse_schema(schema: str) -> tuple[str, str, list[ArgSpec], list[str]]:
    """Parse an ATen schema string as the ET records it.

    Args:
        schema: e.g. ``aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor``.

    Returns:
        ``(qualified name, overload or "default", arguments, return types)``.

    Raises:
        ValueError: not a schema.
    """
    m = re.match(r"^\s*([\w:]+)(?:\.(\w+))?\((.*)\)\s*->\s*(.*)$", schema, re.S)
    if m is None:
        msg = f"not an op schema: {schema!r}"
        raise ValueError(msg)
    qname, overload, args_text, ret_text = m.groups()
    args: list[ArgSpec] = []
    kw = False
    for part in _split_top(args_text):
        if part == "*":
            kw = True
            continue
        decl = part.split("=", 1)[0].strip()
        type_text, _, name = decl.rpartition(" ")
        type_text = re.sub(r"\([^)]*\)", "", type_text)  # Tensor(a!) -> Tensor
        args.append(ArgSpec(name=name, type=type_text.strip(), kwarg_only=kw))
    ret_text = ret_text.strip()
    if ret_text.startswith("(") and ret_text.endswith(")"):
        ret_text = ret_text[1:-1]
    returns = [re.sub(r"\([^)]*\)", "", r).split(" ")[0] for r in _split_top(ret_text) if r]
    return qname, overload or "default", args, returns


# -- units: which ET nodes a replay executes ----------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One step of a rank's replay: a compute op or a communication call.

    Attributes:
        index: position in the rank's program.
        kind: ``compute`` or ``comm``.
        node_id: the ET node (``et_op.node_id``).
        name: its name.
        iteration: training step (the ``ProfilerStep#`` it ran under), None when unknown.
        event_id: the linked Kineto event, None when unlinked.
    """

    index: int
    kind: str
    node_id: int
    name: str
    iteration: int | None
    event_id: int | None


_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def select_units(
    ops: pl.DataFrame, comm_event_ids: Iterable[int]
) -> tuple[list[Unit], Counter[str]]:
    """The units a replay executes, in recorded order, and what it leaves out.

    Args:
        ops: ``et_op`` rows of one rank (``node_id``, ``parent_node_id``, ``name``, ``op_schema``,
            ``event_id``; optional ``iteration`` from the linked events).
        comm_event_ids: recorded events that are communication nodes of the run's graph.

    Returns:
        The units and the counts of skipped ops per reason: ``inside_op`` (an ancestor op runs
        it), ``inside_comm`` (part of a communication unit), ``profiler`` and ``uncovered_comm``
        (a communication op no graph node covers).
    """
    comm = set(comm_event_ids)
    rows = ops.sort("node_id").select(
        "node_id",
        "parent_node_id",
        "name",
        "op_schema",
        "event_id",
        *(["iteration"] if "iteration" in ops.columns else []),
    )
    state: dict[int, str] = {}
    iteration: dict[int, int | None] = {}
    units: list[Unit] = []
    skipped: Counter[str] = Counter()
    has_it = "iteration" in rows.columns
    for r in rows.iter_rows(named=True):
        nid, parent, name = r["node_id"], r["parent_node_id"], r["name"]
        pstate = state.get(parent, "container") if parent is not None else "container"
        step = _STEP.match(name)
        it = int(step.group(1)) if step else iteration.get(parent) if parent is not None else None
        if it is None and has_it and r["iteration"] is not None:
            it = int(r["iteration"])
        iteration[nid] = it
        if pstate in ("op", "comm"):
            state[nid] = pstate
            skipped["inside_op" if pstate == "op" else "inside_comm"] += int(
                r["op_schema"] is not None
            )
            continue
        ev = r["event_id"]
        if ev is not None and ev in comm:
            state[nid] = "comm"
            units.append(Unit(len(units), "comm", nid, name, it, ev))
        elif r["op_schema"] is not None:
            state[nid] = "op"
            if name.startswith(SKIPPED_NAMESPACES):
                skipped["profiler"] += 1
            elif name.startswith(COMM_OP_PREFIXES):
                skipped["uncovered_comm"] += 1
            else:
                units.append(Unit(len(units), "compute", nid, name, it, ev))
        else:
            state[nid] = "container"
    return units, skipped


# -- tensors ----------------------------------------------------------------


@dataclass(frozen=True)
class TensorMeta:
    """A tensor as the ET records it.

    Attributes:
        key: ``(tensor_id, storage_id, offset, numel, elem_bytes, device)``.
        shape: sizes.
        strides: strides in elements (contiguous when the ET has none).
        dtype: torch dtype name (``float32``, ...).
    """

    key: tuple[Any, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str

    @property
    def storage(self) -> tuple[int, str]:
        """``(storage_id, device)``: what views of one buffer share."""
        return (int(self.key[1]), str(self.key[5]))

    @property
    def offset(self) -> int:
        """Storage offset, elements."""
        return int(self.key[2])

    @property
    def elem_bytes(self) -> int:
        """Bytes per element."""
        return int(self.key[4])

    @property
    def device(self) -> str:
        """Recorded device, e.g. ``cpu`` or ``cuda:0``."""
        return str(self.key[5])

    @property
    def extent(self) -> int:
        """Storage elements the tensor reaches: offset + span of its strides."""
        if any(s == 0 for s in self.shape):
            return self.offset
        return (
            self.offset
            + 1
            + sum((s - 1) * abs(st) for s, st in zip(self.shape, self.strides, strict=False))
        )


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


def _is_ref(v: Any) -> bool:
    return (
        isinstance(v, list)
        and len(v) in (5, 6)
        and all(isinstance(x, int) for x in v[:5])
        and (len(v) == 5 or isinstance(v[5], str))
    )


def _elem_types(t: str) -> list[str]:
    if t.startswith("GenericList[") and t.endswith("]"):
        return _split_top(t[len("GenericList[") : -1])
    return [t]


def _dtype_of(type_text: str) -> str | None:
    m = _TENSOR_TYPE.match(type_text)
    return _TYPE_DTYPES.get(m.group(1)) if m else None


def _meta(ref: list[Any], shape: Any, strides: Any, type_text: str) -> TensorMeta:
    key = tuple(ref) if len(ref) == 6 else (*ref, "cpu")
    dtype = _dtype_of(type_text)
    if dtype is None:
        msg = f"tensor type {type_text!r} has no torch dtype here"
        raise _Unsupported(msg)
    shp = tuple(int(s) for s in shape) if isinstance(shape, list) else ()
    if (
        isinstance(strides, list)
        and len(strides) == len(shp)
        and all(isinstance(s, int) for s in strides)
    ):
        st = tuple(int(s) for s in strides)
    else:
        st = _contiguous(shp)
    return TensorMeta(key=key, shape=shp, strides=st, dtype=dtype)


class _Unsupported(Exception):
    """An op the replay cannot rebuild (the message says why)."""


# -- the program ----------------------------------------------------------------


@dataclass
class OpCall:
    """A compute unit rebuilt: the op, its arguments and where its results go.

    Argument references (``args``, ``kwargs``) are ``("c", value)`` for a constant,
    ``("s", slot)`` for an earlier result, ``("x", ext)`` for an external tensor,
    ``("a", alias)`` for a view rebuilt before the call, ``("l", [refs])`` for a list.

    Attributes:
        unit: the unit.
        op: the ``torch.ops`` overload packet entry (``OpOverload``).
        args: positional argument references.
        kwargs: keyword-only argument references.
        n_returns: values the schema returns.
        outputs: ``(return index, list index or None, slot, meta)`` for each tensor result.
        aliases: ``(alias, base reference, meta)``: views to build before the call.
        frees: slots whose last use is this unit.
    """

    unit: Unit
    op: Any
    args: list[tuple[str, Any]]
    kwargs: dict[str, tuple[str, Any]]
    n_returns: int
    outputs: list[tuple[int, int | None, int, TensorMeta]]
    aliases: list[tuple[int, tuple[str, Any], TensorMeta]] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class UnsupportedOp:
    """Ops of one name the replay cannot rebuild, with why and how often."""

    name: str
    reason: str
    count: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "reason": self.reason, "count": self.count}


@dataclass
class Program:
    """One rank's replay: units in order, the rebuilt ops, external tensors, unsupported ops.

    Attributes:
        units: compute and communication units in recorded order.
        calls: rebuilt op per compute unit index (absent: unsupported).
        unsupported: unit index -> reason, for compute units that could not be rebuilt.
        externals: tensors made outside the replayed ops, allocated once.
        ext_buffer: per external, its buffer (externals of one storage share one).
        buffers: ``(dtype, elements, device)`` of each external buffer.
        n_slots: results the program names.
        substituted_outputs: per unsupported unit, its results ``(slot, meta)`` (made empty with
            the recorded layout when substituted).
        skipped: ET ops left out on purpose, per reason (``select_units``).
        slot_meta: recorded layout of every result slot.
        slot_made: unit index at which each slot's tensor appears (its op, or for a nested
            output the unit whose inner op made it).
        frees_after: unit index -> slots freed after it: their last use, or later where the
            recording's allocator held them longer (``replay.lifetimes``).
        nested_outputs: unit index -> ``(slot, meta)`` of floating-point storages an op nested
            in the unit made and a later unit reads (saved for backward: ``native_layer_norm``'s
            mean and rstd inside ``layer_norm``); the replay allocates each, uninitialised, right
            after the unit, as a flat buffer that later units view.
    """

    units: list[Unit]
    calls: dict[int, OpCall]
    unsupported: dict[int, str]
    externals: list[TensorMeta]
    ext_buffer: list[int]
    buffers: list[tuple[str, int, str]]
    n_slots: int
    substituted_outputs: dict[int, list[tuple[int, TensorMeta]]]
    skipped: Counter[str]
    slot_meta: dict[int, TensorMeta] = field(default_factory=dict)
    slot_made: dict[int, int] = field(default_factory=dict)
    frees_after: dict[int, list[int]] = field(default_factory=dict)
    nested_outputs: dict[int, list[tuple[int, TensorMeta]]] = field(default_factory=dict)

    @property
    def compute_units(self) -> int:
        """Compute units (supported or not)."""
        return sum(1 for u in self.units if u.kind == "compute")

    def unsupported_ops(self) -> list[UnsupportedOp]:
        """Unsupported ops grouped by name and reason, most frequent first."""
        c: Counter[tuple[str, str]] = Counter(
            (self.units[i].name, r) for i, r in self.unsupported.items()
        )
        return [UnsupportedOp(n, r, k) for (n, r), k in c.most_common()]

    def support_summary(self) -> dict[str, Any]:
        """Counts of compute units by support, for reports."""
        n = self.compute_units
        bad = len(self.unsupported)
        return {
            "compute_units": n,
            "supported": n - bad,
            "unsupported": bad,
            "supported_fraction": (n - bad) / n if n else 1.0,
            "comm_units": sum(1 for u in self.units if u.kind == "comm"),
            "externals": len(self.externals),
            "skipped": dict(self.skipped),
            "unsupported_ops": [u.as_dict() for u in self.unsupported_ops()],
        }


def _resolve_op(schema: str) -> tuple[Any, list[ArgSpec], list[str]]:
    import torch

    qname, overload, args, returns = parse_schema(schema)
    ns, _, name = qname.partition("::")
    try:
        packet = getattr(getattr(torch.ops, ns), name)
        op = getattr(packet, overload)
    except (AttributeError, RuntimeError) as exc:
        msg = f"no op {qname}.{overload} in this torch"
        raise _Unsupported(msg) from exc
    return op, args, returns


_CONST_TYPES = frozenset(
    ("int", "SymInt", "float", "bool", "str", "Scalar", "number", "SymFloat", "SymBool")
)


class _Planner:
    """Resolves tensors in program order (see the module docstring)."""

    def __init__(self) -> None:
        self.live_key: dict[tuple[Any, ...], tuple[tuple[str, Any], TensorMeta]] = {}
        self.live_storage: dict[tuple[int, str], tuple[tuple[str, Any], TensorMeta]] = {}
        self.externals: list[TensorMeta] = []
        self.n_slots = 0
        self.n_alias = 0
        self.slot_meta: dict[int, TensorMeta] = {}
        self.slot_made: dict[int, int] = {}
        self.last_use: dict[int, int] = {}
        # storage -> unit whose nested op made it last (floating-point ones become allocations)
        self.nested: dict[tuple[int, str], int] = {}
        self.nested_log: list[tuple[int, int, TensorMeta]] = []  # (unit, slot, flat meta)
        self.nested_taken: list[tuple[tuple[int, str], int]] = []  # popped from nested

    def _use(self, ref: tuple[str, Any], at: int) -> None:
        if ref[0] == "s":
            self.last_use[ref[1]] = at

    def tensor(
        self, meta: TensorMeta, at: int, aliases: list[tuple[int, tuple[str, Any], TensorMeta]]
    ) -> tuple[str, Any]:
        hit = self.live_key.get(meta.key)
        if hit is not None and hit[1].shape == meta.shape and hit[1].strides == meta.strides:
            self._use(hit[0], at)
            return hit[0]
        base = hit or self.live_storage.get(meta.storage)
        same = base is not None and base[1].dtype == meta.dtype
        if same and base[0][0] == "s" and meta.extent > base[1].extent:  # type: ignore[index]
            # Reaches past the earlier result's storage: the recording recycled the storage id
            # (an address) for a new, larger allocation, so this is not a view of that result.
            same = False
        if base is not None and same:
            self._use(base[0], at)
            alias = self.n_alias
            self.n_alias += 1
            aliases.append((alias, base[0], meta))
            return ("a", alias)
        made_at = self.nested.get(meta.storage)
        if made_at is not None and meta.dtype in _FLOAT_DTYPES:
            # Made inside an earlier unit's op (saved for backward): allocated after that unit,
            # so its life, and the memory it holds, is the recording's.
            self.nested_taken.append((meta.storage, self.nested.pop(meta.storage)))
            n = max(meta.extent, 1)
            flat = TensorMeta(
                key=(-1 - self.n_slots, meta.storage[0], 0, n, meta.elem_bytes, meta.device),
                shape=(n,),
                strides=(1,),
                dtype=meta.dtype,
            )
            slot = self.result(flat, made_at)
            self.nested_log.append((made_at, slot, flat))
            self._use(("s", slot), at)
            alias = self.n_alias
            self.n_alias += 1
            aliases.append((alias, ("s", slot), meta))
            return ("a", alias)
        ref = ("x", len(self.externals))
        self.externals.append(meta)
        self.live_key[meta.key] = (ref, meta)
        self.live_storage.setdefault(meta.storage, (ref, meta))
        return ref

    def result(self, meta: TensorMeta, at: int) -> int:
        slot = self.n_slots
        self.n_slots += 1
        self.slot_meta[slot] = meta
        self.slot_made[slot] = at
        self.live_key[meta.key] = (("s", slot), meta)
        self.live_storage[meta.storage] = (("s", slot), meta)
        self.last_use[slot] = at
        return slot


_FLOAT_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16"})
"""Dtypes of nested-made storages the replay allocates uninitialised; others (indices) stay
external, with valid data."""


def _ref_storages(values: Any) -> Iterator[tuple[int, str]]:
    """``(storage_id, device)`` of every tensor reference in a recorded value list."""
    for v in values:
        if _is_ref(v):
            yield (int(v[1]), str(v[5]))
        elif isinstance(v, list):
            yield from _ref_storages(v)


def _nested_storages(units: list[Unit], ops: pl.DataFrame) -> dict[int, set[tuple[int, str]]]:
    """Per compute unit: storages that ops nested in it output, other than its own refs."""
    unit_of = {u.node_id: u.index for u in units if u.kind == "compute"}
    top: dict[int, int] = {}
    made: dict[int, set[tuple[int, str]]] = {}
    own: dict[int, set[tuple[int, str]]] = {}
    rows = ops.select("node_id", "parent_node_id", "inputs", "outputs").sort("node_id")
    for nid, parent, ins, outs in rows.iter_rows():
        k = unit_of.get(nid)
        if k is not None:
            top[nid] = k
            own[k] = set(_ref_storages(orjson.loads(ins or "[]"))) | set(
                _ref_storages(orjson.loads(outs or "[]"))
            )
            continue
        k = top.get(parent) if parent is not None else None
        if k is None:
            continue
        top[nid] = k
        if outs:
            made.setdefault(k, set()).update(_ref_storages(orjson.loads(outs)))
    return {k: v - own.get(k, set()) for k, v in made.items()}


_ENUMS = {"ScalarType": _SCALAR_TYPES, "Layout": _LAYOUTS, "MemoryFormat": _MEMORY_FORMATS}
"""Schema argument types recorded as an enum code, with their code → torch attribute tables."""


def _const(arg: ArgSpec, v: Any, device: Any) -> tuple[str, Any]:
    import torch

    base = arg.base
    if v == _NONE or v is None:
        return ("c", None)
    enum = _ENUMS.get(base)
    if enum is not None:  # ScalarType / Layout / MemoryFormat: recorded as their int code
        name = enum.get(int(v))
        if name is None or not hasattr(torch, name):
            msg = f"{base} {v} unknown"
            raise _Unsupported(msg)
        return ("c", getattr(torch, name))
    if base == "Device":
        return ("c", device(str(v)))
    if base == "Generator":
        return ("c", None)
    if base in _CONST_TYPES:
        if arg.is_list:
            if not isinstance(v, list):
                v = [v]
            return ("c", list(v))
        return ("c", v)
    msg = f"argument type {arg.type} not rebuilt"
    raise _Unsupported(msg)


def _plan_op(
    unit: Unit,
    row: dict[str, Any],
    planner: _Planner,
    device: Any,
) -> OpCall:
    op, specs, returns = _resolve_op(row["op_schema"])
    values = orjson.loads(row["inputs"] or "[]")
    shapes = orjson.loads(row["input_shapes"] or "[]")
    types = orjson.loads(row["input_types"] or "[]")
    attrs = orjson.loads(row["attrs"] or "{}")
    strides = attrs.get("input_strides") or [None] * len(values)
    if len(values) != len(specs):
        msg = f"{len(values)} recorded arguments for a schema of {len(specs)}"
        raise _Unsupported(msg)
    at = unit.index
    aliases: list[tuple[int, tuple[str, Any], TensorMeta]] = []
    args: list[tuple[str, Any]] = []
    kwargs: dict[str, tuple[str, Any]] = {}
    for i, spec in enumerate(specs):
        v = values[i]
        shp = shapes[i] if i < len(shapes) else None
        st = strides[i] if i < len(strides) else None
        ty = types[i] if i < len(types) else ""
        if spec.base == "Tensor":
            if spec.is_list:
                if not isinstance(v, list):
                    msg = f"argument {spec.name}: expected a tensor list"
                    raise _Unsupported(msg)
                etypes = _elem_types(ty)
                items: list[tuple[str, Any]] = []
                for k, item in enumerate(v):
                    et = etypes[k] if k < len(etypes) else etypes[-1]
                    if item == _NONE or item is None or "nullptr" in et:
                        items.append(("c", None))
                        continue
                    if not _is_ref(item):
                        msg = f"argument {spec.name}: element {k} is not a tensor"
                        raise _Unsupported(msg)
                    m = _meta(
                        item,
                        shp[k] if isinstance(shp, list) and k < len(shp) else None,
                        st[k] if isinstance(st, list) and k < len(st) else None,
                        etypes[k] if k < len(etypes) else etypes[-1],
                    )
                    items.append(planner.tensor(m, at, aliases))
                ref: tuple[str, Any] = ("l", items)
            elif v == _NONE or v is None or "nullptr" in str(ty):  # None / undefined tensor
                ref = ("c", None)
            elif _is_ref(v):
                ref = planner.tensor(_meta(v, shp, st, ty), at, aliases)
            else:
                msg = f"argument {spec.name}: recorded value is not a tensor"
                raise _Unsupported(msg)
        else:
            ref = _const(spec, v, device)
        if spec.kwarg_only:
            kwargs[spec.name] = ref
        else:
            args.append(ref)
    outputs: list[tuple[int, int | None, int, TensorMeta]] = []
    out_vals = orjson.loads(row["outputs"] or "[]")
    out_shapes = orjson.loads(row["output_shapes"] or "[]")
    out_types = orjson.loads(row["output_types"] or "[]")
    out_strides = attrs.get("output_strides") or [None] * len(out_vals)
    for j, v in enumerate(out_vals):
        if j >= len(returns):
            break
        shp = out_shapes[j] if j < len(out_shapes) else None
        st = out_strides[j] if j < len(out_strides) else None
        ty = out_types[j] if j < len(out_types) else ""
        if _is_ref(v):
            m = _meta(v, shp, st, ty)
            outputs.append((j, None, planner.result(m, at), m))
        elif isinstance(v, list) and v and all(_is_ref(x) or x == _NONE for x in v):
            etypes = _elem_types(ty)
            for k, item in enumerate(v):
                if item == _NONE:
                    continue
                m = _meta(
                    item,
                    shp[k] if isinstance(shp, list) and k < len(shp) else None,
                    st[k] if isinstance(st, list) and k < len(st) else None,
                    etypes[k] if k < len(etypes) else etypes[-1],
                )
                outputs.append((j, k, planner.result(m, at), m))
    return OpCall(
        unit=unit,
        op=op,
        args=args,
        kwargs=kwargs,
        n_returns=len(returns),
        outputs=outputs,
        aliases=aliases,
    )


def build_program(
    units: list[Unit],
    ops: pl.DataFrame,
    *,
    device: Any,
    unsupported: dict[int, str] | None = None,
    skipped: Counter[str] | None = None,
) -> Program:
    """Rebuild every compute unit of ``units`` from its ``et_op`` row.

    Args:
        units: from ``select_units``.
        ops: the rank's ``et_op`` rows (with ``inputs``, ``input_shapes``, ``input_types``,
            ``outputs``, ``output_shapes``, ``output_types``, ``attrs``, ``op_schema``).
        device: maps a recorded device string to the replay's ``torch.device``.
        unsupported: unit index -> reason already known (e.g. found failing by a check run);
            these are not rebuilt and their results become empty tensors of the recorded layout.
        skipped: the ``select_units`` counts, kept in the program for reports.

    Returns:
        The program.
    """
    known = dict(unsupported or {})
    rows = {
        r["node_id"]: r
        for r in ops.select(
            "node_id",
            "op_schema",
            "inputs",
            "input_shapes",
            "input_types",
            "outputs",
            "output_shapes",
            "output_types",
            "attrs",
        ).iter_rows(named=True)
    }
    planner = _Planner()
    calls: dict[int, OpCall] = {}
    subs: dict[int, list[tuple[int, TensorMeta]]] = {}
    nested = _nested_storages(units, ops)
    for u in units:
        if u.kind != "compute":
            continue
        row = rows[u.node_id]
        if u.index not in known:
            saved = (dict(planner.live_key), dict(planner.live_storage), len(planner.externals))
            n_log, n_taken = len(planner.nested_log), len(planner.nested_taken)
            try:
                calls[u.index] = _plan_op(u, row, planner, device)
            except (_Unsupported, ValueError) as exc:
                known[u.index] = str(exc).splitlines()[0]
                planner.live_key, planner.live_storage = saved[0], saved[1]
                del planner.externals[saved[2] :]
                del planner.nested_log[n_log:]
                for storage, made_at in planner.nested_taken[n_taken:]:
                    planner.nested[storage] = made_at
                del planner.nested_taken[n_taken:]
        if u.index in known:
            subs[u.index] = _substitute_outputs(u, row, planner)
        for storage in nested.get(u.index, ()):
            # A new storage from this unit's inner ops: the id (an address) may have named an
            # earlier, dead storage, whose entry must not be viewed from now on.
            planner.nested[storage] = u.index
            planner.live_storage.pop(storage, None)
    frees: dict[int, list[int]] = {}
    for slot, at in planner.last_use.items():
        frees.setdefault(at, []).append(slot)
    for i, call in calls.items():
        call.frees = sorted(frees.get(i, []))
    ext_buffer, buffers = _buffers(planner.externals)
    return Program(
        units=units,
        calls=calls,
        unsupported=known,
        externals=planner.externals,
        ext_buffer=ext_buffer,
        buffers=buffers,
        n_slots=planner.n_slots,
        substituted_outputs=subs,
        skipped=skipped or Counter(),
        slot_meta=planner.slot_meta,
        slot_made=planner.slot_made,
        frees_after=frees,
        nested_outputs=_by_unit(planner.nested_log),
    )


def _by_unit(log: list[tuple[int, int, TensorMeta]]) -> dict[int, list[tuple[int, TensorMeta]]]:
    out: dict[int, list[tuple[int, TensorMeta]]] = {}
    for k, slot, meta in log:
        out.setdefault(k, []).append((slot, meta))
    return out


def _substitute_outputs(
    unit: Unit, row: dict[str, Any], planner: _Planner
) -> list[tuple[int, TensorMeta]]:
    """Results of an op that is not rebuilt: slots of its recorded layout (inputs are unused)."""
    out: list[tuple[int, TensorMeta]] = []
    try:
        vals = orjson.loads(row["outputs"] or "[]")
        shapes = orjson.loads(row["output_shapes"] or "[]")
        types = orjson.loads(row["output_types"] or "[]")
        strides = orjson.loads(row["attrs"] or "{}").get("output_strides") or []
    except orjson.JSONDecodeError:
        return out
    for j, v in enumerate(vals):
        items: list[tuple[Any, int, int | None]] = [(v, j, None)] if _is_ref(v) else []
        if isinstance(v, list) and not _is_ref(v):
            items = [(x, j, k) for k, x in enumerate(v) if _is_ref(x)]
        for ref, jj, k in items:
            shp = shapes[jj] if jj < len(shapes) else None
            st = strides[jj] if jj < len(strides) else None
            ty = types[jj] if jj < len(types) else ""
            if k is not None:
                shp = shp[k] if isinstance(shp, list) and k < len(shp) else None
                st = st[k] if isinstance(st, list) and k < len(st) else None
                ty = _elem_types(ty)[min(k, len(_elem_types(ty)) - 1)]
            try:
                m = _meta(ref, shp, st, ty)
            except _Unsupported:
                continue
            out.append((planner.result(m, unit.index), m))
    return out


def _buffers(externals: list[TensorMeta]) -> tuple[list[int], list[tuple[str, int, str]]]:
    """One buffer per external storage, big enough for every external view of it."""
    index: dict[tuple[int, str, str], int] = {}
    sizes: list[int] = []
    kinds: list[tuple[str, str]] = []
    ext_buffer: list[int] = []
    for m in externals:
        k = (*m.storage, m.dtype)
        b = index.get(k)
        if b is None:
            b = index[k] = len(sizes)
            sizes.append(0)
            kinds.append((m.dtype, m.device))
        sizes[b] = max(sizes[b], m.extent)
        ext_buffer.append(b)
    return ext_buffer, [(d, n, dev) for (d, dev), n in zip(kinds, sizes, strict=True)]


def make_externals(program: Program, device: Any, *, seed: int = 0) -> list[torch.Tensor]:
    """Allocate the external tensors: one random buffer per storage, views into it.

    Args:
        program: the program.
        device: maps a recorded device string to a ``torch.device``.
        seed: seed of the random data.

    Returns:
        One tensor per ``program.externals`` entry.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    bufs = []
    for dtype_name, n, dev in program.buffers:
        dtype = getattr(torch, dtype_name)
        n = max(n, 1)
        if dtype.is_floating_point or dtype.is_complex:
            b = torch.rand(n, generator=gen, dtype=torch.float32).to(dtype)
        else:
            b = torch.zeros(n, dtype=dtype)
        bufs.append(b.to(device(dev)))
    return [
        torch.as_strided(bufs[b], m.shape, m.strides, m.offset)
        for m, b in zip(program.externals, program.ext_buffer, strict=True)
    ]


def external_buffers(program: Program, externals: list[Any]) -> list[Any]:
    """One tensor per external buffer (the whole storage), for saving and restoring them."""
    import torch

    out: dict[int, Any] = {}
    for t, b in zip(externals, program.ext_buffer, strict=True):
        if b not in out:
            _, n, _ = program.buffers[b]
            out[b] = torch.as_strided(t, (max(n, 1),), (1,), 0)
    return [out[b] for b in sorted(out)]


# -- code generation ----------------------------------------------------------------

_INLINE = (int, bool, str, type(None))


class _Consts:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def render(self, v: Any) -> str:
        if isinstance(v, _INLINE) or (isinstance(v, float) and v == v and abs(v) != float("inf")):
            return repr(v)
        if isinstance(v, (list, tuple)) and all(
            isinstance(x, _INLINE) or (isinstance(x, float) and x == x and abs(x) != float("inf"))
            for x in v
        ):
            return repr(list(v))
        name = f"C{len(self.values)}"
        self.values[name] = v
        return name


def _ref(ref: tuple[str, Any], consts: _Consts) -> str:
    kind, v = ref
    if kind == "c":
        return consts.render(v)
    if kind == "s":
        return f"t{v}"
    if kind == "x":
        return f"x{v}"
    if kind == "a":
        return f"a{v}"
    return "[" + ", ".join(_ref(r, consts) for r in v) + "]"


def render(
    program: Program, *, gaps: bool, device: Any, timed: bool = True
) -> tuple[str, dict[str, Any]]:
    """Python source of one replay pass over ``program`` and the globals it needs.

    The pass is straight-line code, one block per unit, so that the only work between two ops
    is a clock read, a few local stores and the frees: this keeps the replay's own overhead far
    below the ops' time (docs/replay.md). The views a unit needs (autograd's saved views, which
    the recording made inside C++ without a call of its own) are built *before* its gap wait,
    so that with ``gaps`` their µs come out of the recorded gap instead of adding to it.

    Hooks, passed as arguments: ``pc`` (clock), ``B(k)`` (an iteration starts at unit ``k``;
    ``B(len(units))`` ends the pass), ``S(k)`` (wait the
    recorded gap before unit ``k``; only with ``gaps``), ``W(k)`` (communication unit ``k``),
    ``SUB(k)`` (spend the recorded duration of a substituted op), ``AS`` (``torch.as_strided``)
    and ``ES`` (``torch.empty_strided``). ``T[2k]``/``T[2k+1]`` receive unit ``k``'s start/end.

    Args:
        program: the program.
        gaps: emit ``S(k)`` before each unit.
        device: maps recorded device strings to ``torch.device`` (for substituted results).
        timed: False renders the *bare* pass: the same ops, views, allocations and frees with
            no clock reads, no hooks, and neither communication nor substitutes; its wall time
            is what executing the ops costs without the replay, the baseline of the
            instrumentation overhead (``ReplayOptions.bare_passes``).

    Returns:
        ``(source, globals)``: exec the source with the globals to get ``_replay_pass``.
    """
    consts = _Consts()
    fns: dict[int, str] = {}
    glb: dict[str, Any] = {}
    lines = ["def _replay_pass(X, T, pc, B, S, W, SUB, AS, ES):"]
    if program.externals:
        names = ", ".join(f"x{i}" for i in range(len(program.externals)))
        lines.append(f"    ({names},) = X")
    prev_it: object = object()

    def stamp(i: int) -> list[str]:
        return [f"    T[{i}] = pc()"] if timed else []

    gaps = gaps and timed
    for u in program.units:
        k = u.index
        if u.iteration != prev_it and timed:
            lines.append(f"    B({k})")
        prev_it = u.iteration
        call = program.calls.get(k) if u.kind != "comm" else None
        if call is not None:  # views first, so that their cost falls inside the recorded gap
            lines += [
                f"    a{alias} = AS({_ref(base, consts)}, {list(m.shape)!r},"
                f" {list(m.strides)!r}, {m.offset})"
                for alias, base, m in call.aliases
            ]
        if gaps:
            lines.append(f"    S({k})")
        if u.kind == "comm":
            if timed:
                lines += [*stamp(2 * k), f"    W({k})", *stamp(2 * k + 1)]
            continue
        if call is None:
            if timed:
                lines += [*stamp(2 * k), f"    SUB({k})"]
            lines += [
                _alloc(slot, m, m.strides, consts, device)
                for slot, m in program.substituted_outputs.get(k, [])
            ]
            lines += stamp(2 * k + 1)
            lines += _nested_allocs(program, k, consts, device)
            lines += [f"    t{s} = None" for s in program.frees_after.get(k, [])]
            continue
        fid = id(call.op)
        if fid not in fns:
            fns[fid] = f"F{len(fns)}"
            glb[fns[fid]] = getattr(call.op, "_op", call.op)
        args = [_ref(r, consts) for r in call.args]
        args += [f"{name}={_ref(r, consts)}" for name, r in call.kwargs.items()]
        target = ""
        rest: list[str] = []
        if len(call.outputs) == 1 and call.outputs[0][1] is None and call.n_returns == 1:
            target = f"t{call.outputs[0][2]} = "
        elif call.outputs:
            target = f"r{k} = "
            for j, idx, slot, _ in call.outputs:
                sub = f"[{j}]" if call.n_returns > 1 else ""
                sub += f"[{idx}]" if idx is not None else ""
                rest.append(f"    t{slot} = r{k}{sub}")
            rest.append(f"    r{k} = None")
        lines += [
            *stamp(2 * k),
            f"    {target}{fns[fid]}({', '.join(args)})",
            *stamp(2 * k + 1),
            *rest,
        ]
        lines += _nested_allocs(program, k, consts, device)
        lines += [f"    t{s} = None" for s in call.frees]
        lines += [f"    a{a} = None" for a, _, _ in call.aliases]
    if timed:
        lines.append(f"    B({len(program.units)})")
    glb.update(consts.values)
    return "\n".join(lines) + "\n", glb


def _nested_allocs(program: Program, k: int, consts: _Consts, device: Any) -> list[str]:
    """Lines allocating the storages unit ``k``'s inner ops made for later units."""
    return [_alloc(slot, m, (1,), consts, device) for slot, m in program.nested_outputs.get(k, [])]


def _alloc(slot: int, m: TensorMeta, strides: Sequence[int], consts: _Consts, device: Any) -> str:
    """The line allocating slot ``slot`` uninitialised with ``m``'s shape, dtype and device."""
    dt = consts.render(_torch_dtype(m.dtype))
    dev = consts.render(device(m.device))
    return f"    t{slot} = ES({list(m.shape)!r}, {list(strides)!r}, {dt}, {dev})"


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def compile_pass(program: Program, *, gaps: bool, device: Any, timed: bool = True) -> Any:
    """``render`` and compile: the ``_replay_pass`` function of ``program``."""
    source, glb = render(program, gaps=gaps, device=device, timed=timed)
    code = compile(source, "<replay pass>", "exec")
    exec(code, glb)
    return glb["_replay_pass"]


def check_program(program: Program, externals: list[Any], device: Any) -> dict[int, str]:
    """Execute every rebuilt op once and return the ones that fail or disagree with the ET.

    An op fails when it raises, or when a result's shape differs from the recorded one (data-
    dependent shapes such as ``nonzero`` on random data). A failed op's results are replaced by
    empty tensors of the recorded layout, so that the ops after it are still checked.

    Args:
        program: the program.
        externals: from ``make_externals``.
        device: maps recorded device strings to ``torch.device``.

    Returns:
        Unit index -> reason, for the ops to treat as unsupported.
    """
    import torch

    slots: dict[int, Any] = {}
    aliases: dict[int, Any] = {}
    bad: dict[int, str] = {}

    def val(ref: tuple[str, Any]) -> Any:
        kind, v = ref
        if kind == "c":
            return v
        if kind == "s":
            return slots.get(v)
        if kind == "x":
            return externals[v]
        if kind == "a":
            return aliases[v]
        return [val(r) for r in v]

    def empty(m: TensorMeta) -> Any:
        return torch.empty_strided(
            m.shape, m.strides, dtype=getattr(torch, m.dtype), device=device(m.device)
        )

    with torch.no_grad():
        for u in program.units:
            call = program.calls.get(u.index)
            if call is None:
                for slot, m in program.substituted_outputs.get(u.index, []):
                    slots[slot] = empty(m)
                for slot, m in program.nested_outputs.get(u.index, []):
                    slots[slot] = empty(m)
                continue
            try:
                for a, base, m in call.aliases:
                    aliases[a] = torch.as_strided(val(base), m.shape, m.strides, m.offset)
                out = call.op(
                    *[val(r) for r in call.args], **{k: val(r) for k, r in call.kwargs.items()}
                )
                for j, idx, slot, m in call.outputs:
                    v = out[j] if call.n_returns > 1 else out
                    v = v[idx] if idx is not None else v
                    if not isinstance(v, torch.Tensor):
                        msg = f"result {j} is {type(v).__name__}, recorded a tensor"
                        raise _Unsupported(msg)
                    if tuple(v.shape) != m.shape:
                        msg = f"result shape {list(v.shape)} differs from recorded {list(m.shape)}"
                        raise _Unsupported(msg)
                    slots[slot] = v
            except Exception as exc:
                bad[u.index] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                for _, _, slot, m in call.outputs:
                    slots[slot] = empty(m)
            for slot, m in program.nested_outputs.get(u.index, []):
                slots[slot] = empty(m)
            for s in call.frees:
                slots.pop(s, None)
            aliases.clear()
    return bad

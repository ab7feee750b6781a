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

This module plans the program; ``kernels.schema`` parses schemas and tensor metadata,
``kernels.units`` picks the units, ``kernels.program`` holds the program's types and
``kernels.codegen`` turns a program into the generated pass function.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import orjson
from prism_trace.replay.kernels.program import OpCall, Program
from prism_trace.replay.kernels.schema import (
    _LAYOUTS,
    _MEMORY_FORMATS,
    _NONE,
    _SCALAR_TYPES,
    ArgSpec,
    TensorMeta,
    _elem_types,
    _meta,
    _Unsupported,
    is_tensor_ref,
    parse_schema,
)
from prism_trace.replay.kernels.units import Unit

from prism_trace.formats.base import ET_IO_COLUMNS

if TYPE_CHECKING:
    import polars as pl
    import torch

__all__ = ["build_program", "external_buffers", "make_externals"]


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
        # Views of an external that reach past every external view of its storage seen so far
        # (a storage whose id the recording gave to a larger allocation later, e.g. gloo's pinned
        # staging buffers on CUDA): the buffer is made big enough for them too.
        self.reach: list[TensorMeta] = []
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
            if base[0][0] == "x" and meta.extent > base[1].extent:
                self.reach.append(meta)
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
        if is_tensor_ref(v):
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
                    if not is_tensor_ref(item):
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
            elif is_tensor_ref(v):
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
        if is_tensor_ref(v) and "nullptr" in str(ty):  # undefined (no bias gradient): no tensor
            continue
        if is_tensor_ref(v):
            m = _meta(v, shp, st, ty)
            outputs.append((j, None, planner.result(m, at), m))
        elif isinstance(v, list) and v and all(is_tensor_ref(x) or x == _NONE for x in v):
            etypes = _elem_types(ty)
            for k, item in enumerate(v):
                if item == _NONE or "nullptr" in (etypes[k] if k < len(etypes) else etypes[-1]):
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
        for r in ops.select("node_id", "op_schema", *ET_IO_COLUMNS, "attrs").iter_rows(named=True)
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
            n_reach = len(planner.reach)
            n_log, n_taken = len(planner.nested_log), len(planner.nested_taken)
            try:
                calls[u.index] = _plan_op(u, row, planner, device)
            except (_Unsupported, ValueError) as exc:
                known[u.index] = str(exc).splitlines()[0]
                planner.live_key, planner.live_storage = saved[0], saved[1]
                del planner.externals[saved[2] :]
                del planner.reach[n_reach:]
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
    ext_buffer, buffers = _buffers(planner.externals, planner.reach)
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
        items: list[tuple[Any, int, int | None]] = [(v, j, None)] if is_tensor_ref(v) else []
        if isinstance(v, list) and not is_tensor_ref(v):
            items = [(x, j, k) for k, x in enumerate(v) if is_tensor_ref(x)]
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


def _buffers(
    externals: list[TensorMeta], reach: list[TensorMeta]
) -> tuple[list[int], list[tuple[str, int, str]]]:
    """One buffer per external storage, big enough for every external view of it and every
    view made from one (``reach``)."""
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
    for m in reach:
        b = index[(*m.storage, m.dtype)]
        sizes[b] = max(sizes[b], m.extent)
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

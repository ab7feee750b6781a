"""What a host-ET op says: its ATen schema parsed, its dtypes and its tensors' metadata."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMM_OP_PREFIXES",
    "SKIPPED_NAMESPACES",
    "ArgSpec",
    "TensorMeta",
    "contiguous_strides",
    "dtype_of_type",
    "is_tensor_ref",
    "parse_schema",
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


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a tensor of ``shape``: what a tensor the ET records
    without strides has (a size-0 dimension counts as 1, as torch's own strides do)."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


def is_tensor_ref(v: Any) -> bool:
    """Whether a recorded argument value is a tensor reference of the host ET:
    ``[tensor_id, storage_id, offset, numel, elem_bytes]`` plus, in newer ETs, the device.

    The readers of an op's arguments (the kernel rebuild, the ET memory timeline) tell tensors
    from other lists by this shape alone: the ET marks them no other way.
    """
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


def dtype_of_type(type_text: str) -> str | None:
    """The torch dtype name of an ET tensor type (``Tensor(float)`` → ``float32``), or None."""
    m = _TENSOR_TYPE.match(type_text)
    return _TYPE_DTYPES.get(m.group(1)) if m else None


def _meta(ref: list[Any], shape: Any, strides: Any, type_text: str) -> TensorMeta:
    key = tuple(ref) if len(ref) == 6 else (*ref, "cpu")
    dtype = dtype_of_type(type_text)
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
        st = contiguous_strides(shp)
    return TensorMeta(key=key, shape=shp, strides=st, dtype=dtype)


class _Unsupported(Exception):
    """An op the replay cannot rebuild (the message says why)."""

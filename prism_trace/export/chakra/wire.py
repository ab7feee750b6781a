"""The Chakra wire format, written by hand where it repeats: varint-delimited records and
attributes (the protobuf module builds the rest)."""

from __future__ import annotations

import re
from typing import Any

from prism_trace.export.chakra.rules import VARINT_CACHE
from prism_trace.formats.chakra import chakra_pb2 as pb

__all__ = ["attr", "attrs_bytes", "micros", "record_bytes", "sanitize_prefix", "varint"]


def _varint_uncached(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_VARINTS = [_varint_uncached(i) for i in range(VARINT_CACHE)]


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint (small values from a table: most lengths and ids are small)."""
    return _VARINTS[n] if n < VARINT_CACHE else _varint_uncached(n)


def record_bytes(payload: bytes) -> bytes:
    """One length-delimited record, as ``protolib.encodeMessage`` frames it."""
    return varint(len(payload)) + payload


def attr(name: str, **value: Any) -> pb.AttributeProto:
    """A Chakra node attribute: ``attr("comm_size", int64_val=n)``."""
    return pb.AttributeProto(name=name, **value)


def attrs_bytes(*attrs: pb.AttributeProto) -> bytes:
    """Wire bytes of ``attrs`` as Node fields: appended to a Node's bytes they add its attrs."""
    return pb.Node(attr=list(attrs)).SerializeToString()


def micros(ns: int | None) -> int:
    """ns → whole µs, rounded half up; a positive duration never becomes 0 (absent)."""
    if ns is None or ns <= 0:
        return 0
    return max(1, (int(ns) + 500) // 1000)


def sanitize_prefix(name: str) -> str:
    """A file-name prefix from a run name: other characters than ``[A-Za-z0-9_-]`` → ``_``."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or "run"

"""Chakra ET framing: the length-delimited protobuf records of a stream, and attributes as values.

A Chakra ET file is a varint length followed by a message, again and again: one ``GlobalMetadata``,
then ``Node`` messages. The framing is decoded over a buffered stream (no whole-file read).

An attribute may hold any of protobuf's types (a ``comm_size`` as a string, a ``tid`` as a uint64
above the BIGINT range), so a value the tables keep is checked first (``comm_bytes`` here,
``limits.check_int`` and ``limits.check_text``): a bad one is one line naming the file, the node
and the field.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError

from prism_trace.errors import TraceFormatError, TruncatedTraceError
from prism_trace.formats.chakra import chakra_pb2 as pb
from prism_trace.limits import MAX_COMM_BYTES, check_int, gzip_errors, short_repr

__all__ = [
    "GZIP_MAGIC",
    "attrs",
    "comm_bytes",
    "node_label",
    "parse",
    "records",
    "sniff_chakra",
]

_CHUNK = 1 << 22
GZIP_MAGIC = b"\x1f\x8b"
_MAX_VARINT_BYTES = 10
# A node is a few hundred bytes; the largest real one (a process-group init listing every group)
# a few MB. A record claiming more is corrupt, and buffering it would take that much memory.
_MAX_RECORD_BYTES = 64 << 20


def _varint(buf: bytes | bytearray, pos: int) -> tuple[int, int] | None:
    """``(value, index after it)`` of the varint at ``pos``; None when ``buf`` ends inside it.

    Raises:
        ValueError: more than ``_MAX_VARINT_BYTES`` bytes without an end (not a length).
    """
    value, shift, i, n = 0, 0, pos, len(buf)
    while i < n:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if i - pos >= _MAX_VARINT_BYTES:
            raise ValueError(pos)
    return None


def sniff_chakra(path: Path) -> bool:
    """Whether ``path`` (plain or gzipped) starts like a Chakra ET: a GlobalMetadata, then a Node.

    Reads at most the first two records; never raises for unreadable or foreign files.
    """
    try:
        with ExitStack() as stack:
            raw = stack.enter_context(Path(path).open("rb"))
            fh: IO[bytes] = raw
            if raw.read(2) == GZIP_MAGIC:
                # A GzipFile is a binary stream; typeshed types it BufferedIOBase, not IO[bytes].
                fh = stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb"))  # type: ignore[arg-type]
            raw.seek(0)
            head = fh.read(1 << 16)
    except (OSError, EOFError, zlib.error):
        return False
    msgs: list[bytes] = []
    pos = 0
    while len(msgs) < 2 and pos < len(head):
        try:
            length = _varint(head, pos)
        except ValueError:
            return False
        if length is None:
            return False
        size, i = length
        if i + size > len(head):
            break  # a long record: judge on what we have
        msgs.append(head[i : i + size])
        pos = i + size
    if not msgs:
        return False
    try:
        gm = pb.GlobalMetadata.FromString(msgs[0])
        if len(unknown_fields.UnknownFieldSet(gm)):
            return False
        if len(msgs) > 1:
            node = pb.Node.FromString(msgs[1])
            return not len(unknown_fields.UnknownFieldSet(node))
    except DecodeError:
        return False
    return True


def records(fh: IO[bytes], path: Path) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, payload)`` of each length-delimited record of a (decompressed) stream.

    Raises:
        TruncatedTraceError: the stream ends inside a record (or the gzip stream is cut).
        TraceFormatError: a length varint is malformed or the gzip data is corrupt.
    """
    buf = bytearray()
    pos = 0  # index of the next record in buf
    base = 0  # stream offset of buf[0]
    eof = False
    need = 1
    while True:
        if len(buf) - pos < need and not eof:
            del buf[:pos]
            base += pos
            pos = 0
            chunk = _read(fh, _CHUNK, path)  # never `need`: a bad length may be huge
            if chunk:
                buf += chunk
            else:
                eof = True
            continue
        if pos >= len(buf):
            return
        n = len(buf)
        try:
            length = _varint(buf, pos)
        except ValueError:
            msg = f"{path}: malformed record length at byte offset {base + pos}"
            raise TraceFormatError(msg) from None
        complete = length is not None
        size, i = length if length is not None else (0, n)
        if complete and size > _MAX_RECORD_BYTES:
            msg = (
                f"{path}: protobuf record at byte offset {base + pos} claims {size} bytes,"
                f" more than the {_MAX_RECORD_BYTES}-byte limit of a Chakra record"
                " (truncated or corrupt file)"
            )
            raise TruncatedTraceError(msg)
        if not complete or i + size > n:
            if eof:
                if base + pos == 0 and complete:
                    msg = (
                        f"{path}: not a Chakra ET: the first record claims {size} bytes but the"
                        f" stream has {n - i}"
                    )
                    raise TraceFormatError(msg)
                msg = f"{path}: truncated protobuf record at byte offset {base + pos}"
                raise TruncatedTraceError(msg)
            need = (i - pos) + size if complete else n - pos + 1
            continue
        need = 1
        yield base + pos, bytes(buf[i : i + size])
        pos = i + size


def _read(fh: IO[bytes], n: int, path: Path) -> bytes:
    with gzip_errors(path):
        return fh.read(n)


def _attr_value(a: pb.AttributeProto) -> Any:
    which = a.WhichOneof("value")
    if which is None:
        return None
    v = getattr(a, which)
    if which.endswith("_list"):
        vals = list(v.values)
        return [x.hex() for x in vals] if which == "bytes_list" else vals
    if which == "bytes_val":
        return v.hex()
    return v


def attrs(node: pb.Node | pb.GlobalMetadata) -> dict[str, Any]:
    """A node's (or the metadata's) attributes by name, bytes as hex."""
    return {a.name: _attr_value(a) for a in node.attr}


def parse(cls: Any, rec: tuple[int, bytes], path: Path) -> Any:
    """Decode one record as ``cls`` (``pb.GlobalMetadata`` or ``pb.Node``), naming its offset."""
    offset, payload = rec
    try:
        return cls.FromString(payload)
    except DecodeError as exc:
        msg = f"{path}: corrupt protobuf record at byte offset {offset}: {exc}"
        raise TraceFormatError(msg) from exc


# --- attribute values -------------------------------------------------------------------------


def node_label(nid: int, name: str) -> str:
    """How a message names a node: its id (to find it) and its name (to know what it is)."""
    return f"node {nid} ({short_repr(name)})"


def comm_bytes(path: Path, value: Any, where: str) -> int | None:
    """A ``comm_size`` as a byte count in ``[0, MAX_COMM_BYTES]``; None when absent.

    A string is refused rather than parsed: ``"12"`` times a group size would repeat it.
    """
    if value is None:
        return None
    return check_int(path, value, where, 0, MAX_COMM_BYTES, "a byte count")

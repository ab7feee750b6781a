"""Stream the ``traceEvents`` array of a (gzipped) Chrome-trace JSON into a file of its own.

A Kineto trace is one JSON object whose ``traceEvents`` array holds nearly all of its bytes. Parsing
it with ``json.load`` would build a Python object per event; instead ``split_trace_events`` copies
the array, decompressing in chunks, into a temporary file that DuckDB's ``read_json`` parses
natively, and parses only the small keys before the array (the header) and after it (the trailer) in
Python.

The end of the array is found without parsing it: in the last few MB of the stream, the array ends
at the earliest ``]`` after which ``'{"a":[]' + rest`` is a complete JSON object (a ``]`` inside an
event or a string leaves the rest unbalanced).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

import orjson

from prism_trace.errors import (
    MissingFieldError,
    TraceFormatError,
    TruncatedTraceError,
    UnknownFormatError,
)

__all__ = ["TraceEventsFile", "sniff_kineto", "split_trace_events"]

_CHUNK = 8 << 20
_HEAD_LIMIT = 64 << 20
_TAIL_KEEP = 4 << 20
_KEY_RE = re.compile(rb'"traceEvents"\s*:\s*\[')
# The array's closing bracket follows its last event (``}``); candidates are ``}]`` followed by
# ``,`` or ``}``, which inside an event only occurs in a list of objects.
_END_RE = re.compile(rb"}\s*(\])\s*[,}]")
_WS = b" \t\r\n"


@dataclass(frozen=True)
class TraceEventsFile:
    """The ``traceEvents`` array of a trace as a JSON file, with the rest of the top-level object.

    Attributes:
        events_path: a file holding exactly the JSON array ``[...]`` of ``traceEvents``.
        meta: every other top-level key of the trace (header and trailer), parsed.
        json_bytes: size of the whole uncompressed JSON document.
    """

    events_path: Path
    meta: dict[str, Any]
    json_bytes: int


def sniff_kineto(head: bytes) -> bool:
    """Tell whether the first bytes of a file look like a Kineto (torch.profiler) trace.

    A Kineto trace is a JSON object with a top-level ``traceEvents`` array, usually after
    ``schemaVersion``/``deviceProperties``; a PyTorch host execution trace has ``nodes`` and
    ``schema`` instead. ``head`` may be the raw (gzipped) start of the file.

    Args:
        head: the first bytes of the file (a few KB is enough; 64 KB is better).

    Returns:
        True if the bytes look like a Kineto trace.
    """
    if head[:2] == b"\x1f\x8b":
        try:
            head = zlib.decompressobj(wbits=31).decompress(head, 1 << 20)
        except zlib.error:
            return False
    text = head.lstrip(_WS + b"\xef\xbb\xbf")
    if not text.startswith(b"{"):
        return False
    if b'"nodes"' in text and b'"schema"' in text:
        return False
    if _KEY_RE.search(text):
        return True
    return b'"schemaVersion"' in text and (
        b'"deviceProperties"' in text or b'"distributedInfo"' in text
    )


def _open(path: Path) -> IO[bytes]:
    with path.open("rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # owns its file, so closing it closes both
    return path.open("rb")


def _chunks(path: Path) -> Iterator[bytes]:
    """Yield the uncompressed bytes of ``path`` in chunks, naming gzip damage as our errors."""
    with _open(path) as fh:
        while True:
            try:
                chunk = fh.read(_CHUNK)
            except EOFError as exc:
                msg = f"{path}: truncated gzip stream (file ends before the compressed data does)"
                raise TruncatedTraceError(msg) from exc
            except (OSError, zlib.error) as exc:
                msg = f"{path}: corrupt gzip data: {exc}"
                raise TraceFormatError(msg) from exc
            if not chunk:
                return
            yield chunk


def _parse_header(prefix: bytes) -> dict[str, Any] | None:
    """Parse the text before ``"traceEvents"`` as an object; None if it is not a clean prefix."""
    body = prefix.strip(_WS).removeprefix(b"\xef\xbb\xbf").strip(_WS)
    if not body.startswith(b"{"):
        return None
    body = body.rstrip(_WS)
    if body.endswith(b","):
        body = body[:-1]
    try:
        out = orjson.loads(body + b"}")
    except orjson.JSONDecodeError:
        return None
    return out if isinstance(out, dict) else None


def _find_end(tail: bytes, *, at_array_start: bool) -> tuple[int, dict[str, Any]] | None:
    """Locate the ``]`` closing the events array in ``tail``; return its offset and the trailer."""
    starts: list[int] = []
    if at_array_start:
        stripped = tail.lstrip(_WS)
        if stripped.startswith(b"]"):
            starts.append(len(tail) - len(stripped))
    starts += [m.start(1) for m in _END_RE.finditer(tail)]
    for p in starts:
        try:
            rest = orjson.loads(b'{"a":[]' + tail[p + 1 :])
        except orjson.JSONDecodeError:
            continue
        if isinstance(rest, dict):
            rest.pop("a", None)
            return p, rest
    return None


@contextlib.contextmanager
def split_trace_events(path: Path, *, tmp_dir: Path | None = None) -> Iterator[TraceEventsFile]:
    """Copy the ``traceEvents`` array of ``path`` into a temporary file, removed on exit.

    Args:
        path: a Chrome-trace JSON file, plain or gzipped, of any size.
        tmp_dir: where to put the temporary file (default: the system temp dir).

    Yields:
        The events file and the other top-level keys.

    Raises:
        TruncatedTraceError: the gzip stream or the JSON ends early.
        TraceFormatError: corrupt gzip data or JSON around the array.
        UnknownFormatError: the file is not a JSON object.
        MissingFieldError: the object has no top-level ``traceEvents`` array.
    """
    with tempfile.TemporaryDirectory(prefix="prism-kineto-", dir=tmp_dir) as tmp:
        out_path = Path(tmp) / "traceEvents.json"
        with out_path.open("wb") as out:
            meta, total = _copy_array(path, out)
        yield TraceEventsFile(events_path=out_path, meta=meta, json_bytes=total)


def _copy_array(path: Path, out: IO[bytes]) -> tuple[dict[str, Any], int]:
    """Write ``[`` + the array body to ``out``, truncate it after the ``]``; return meta, size."""
    total = 0
    head = bytearray()
    header: dict[str, Any] | None = None
    search_from = 0
    tail = bytearray()
    written = 0  # bytes of the array body (after "[") written so far
    for chunk in _chunks(path):
        total += len(chunk)
        if header is None:
            head += chunk
            if head.lstrip(_WS + b"\xef\xbb\xbf")[:1] not in (b"{", b""):
                msg = f"{path}: not a JSON object (a Kineto trace starts with `{{`)"
                raise UnknownFormatError(msg)
            while (m := _KEY_RE.search(head, search_from)) is not None:
                header = _parse_header(bytes(head[: m.start()]))
                if header is not None:
                    body = bytes(head[m.end() :])
                    out.write(b"[")
                    out.write(body)
                    written = len(body)
                    tail = bytearray(body[-_TAIL_KEEP:])
                    head = bytearray()
                    break
                search_from = m.start() + 1
            if header is None and len(head) > _HEAD_LIMIT:
                break
            continue
        out.write(chunk)
        written += len(chunk)
        tail += chunk
        if len(tail) > 2 * _TAIL_KEEP:
            del tail[: len(tail) - _TAIL_KEEP]
    if header is None:
        _raise_no_events(path, bytes(head))
    found = _find_end(bytes(tail), at_array_start=written <= len(tail))
    if found is None:
        msg = (
            f"{path}: JSON ends before the `traceEvents` array is closed"
            " (truncated or corrupt trace)"
        )
        raise TruncatedTraceError(msg)
    p, trailer = found
    end = 1 + written - len(tail) + p + 1  # the leading "[" + body up to and including "]"
    out.flush()
    os.truncate(out.fileno(), end)
    return {**header, **trailer}, total


def _raise_no_events(path: Path, head: bytes) -> NoReturn:
    try:
        doc = orjson.loads(head)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) or (doc is None and head.lstrip(_WS)[:1] == b"{"):
        msg = f"{path}: no top-level `traceEvents` array (not a Kineto/Chrome trace?)"
        raise MissingFieldError(msg)
    msg = f"{path}: not a JSON object with `traceEvents` (not a Kineto trace?)"
    raise UnknownFormatError(msg)

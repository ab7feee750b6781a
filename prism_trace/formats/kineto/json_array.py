"""Copy the ``traceEvents`` array of a (gzipped) Chrome-trace JSON into files of its own.

A Kineto trace is one JSON object whose ``traceEvents`` array holds nearly all of its bytes. Parsing
it with ``json.load`` would build a Python object per event; instead ``split_trace_events`` copies
the array into temporary files that DuckDB's ``read_json`` parses natively, and parses only the
small keys before the array (the header) and after it (the trailer) in Python. A plain file's array
is copied by the kernel; a gzipped one is decompressed in chunks. The array is cut into parts of
about ``_PART_BYTES`` (DuckDB parses one JSON array on one thread, several files in parallel).

The end of the array is found without parsing it: in the last few MB of the stream, the array ends
at the earliest ``]`` after which ``'{"a":[]' + rest`` is a complete JSON object (a ``]`` inside an
event or a string leaves the rest unbalanced).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import zlib
from collections.abc import Callable, Iterator
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
from prism_trace.formats.unique_keys import loads_unique
from prism_trace.limits import check_regular_file, gzip_errors, open_bounded

__all__ = ["TraceEventsFile", "json_size_guess", "sniff_kineto", "split_trace_events"]

_CHUNK = 8 << 20
# The array is cut into files of about this size, so that DuckDB parses them in parallel.
_PART_BYTES = 16 << 20
# How far past a cut offset to look for the end of an event line.
_CUT_SEARCH = 1 << 20
_HEAD_LIMIT = 64 << 20
_TAIL_KEEP = 4 << 20
_KEY_RE = re.compile(rb'"traceEvents"\s*:\s*\[')
# The array's closing bracket follows its last event (``}``); candidates are ``}]`` followed by
# ``,`` or ``}``, which inside an event only occurs in a list of objects.
_END_RE = re.compile(rb"}\s*(\])\s*[,}]")
_WS = b" \t\r\n"


@dataclass(frozen=True)
class TraceEventsFile:
    """The ``traceEvents`` array of a trace as JSON files, with the rest of the top-level object.

    Attributes:
        parts: the array cut into files of about ``_PART_BYTES`` each, in order, each a JSON array
            ``[...]`` of whole events if the cuts fell between events (each is made after a
            ``},`` that ends a line, which in Kineto's one-event-a-line layout is always between
            two events; any other cut leaves a part that is not valid JSON). DuckDB parses
            several files in parallel but one JSON array on one thread.
        meta: every other top-level key of the trace (header and trailer), parsed.
        json_bytes: size of the whole uncompressed JSON document.
    """

    parts: tuple[Path, ...]
    meta: dict[str, Any]
    json_bytes: int
    whole: Callable[[], Path]

    @property
    def events_path(self) -> Path:
        """A file holding exactly the JSON array ``[...]`` of ``traceEvents`` (made on demand)."""
        return self.whole()


def json_size_guess(path: Path) -> int:
    """The JSON bytes of ``path``, guessed without reading it: gzipped Kineto JSON shrinks
    about 8 times. Decides before a file is opened how it is read: in a batch or alone, in a
    work database in memory or on disk, here or by workers."""
    with path.open("rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    return path.stat().st_size * (8 if gz else 1)


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
    return open_bounded(path)  # a gzip bomb stops with a clear error, not a full disk


def _chunks(path: Path) -> Iterator[bytes]:
    """Yield the uncompressed bytes of ``path`` in chunks, naming gzip damage as our errors."""
    with _open(path) as fh:
        while True:
            with gzip_errors(path):
                chunk = fh.read(_CHUNK)
            if not chunk:
                return
            yield chunk


def _parse_header(path: Path, prefix: bytes) -> dict[str, Any] | None:
    """Parse the text before ``"traceEvents"`` as an object; None if it is not a clean prefix.

    Raises:
        TraceFormatError: the header states a key twice (``unique_keys``).
    """
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
    if not isinstance(out, dict):
        return None
    loads_unique(body + b"}", path, "before the `traceEvents` array")  # orjson kept the last of two
    return out


def _array_end(path: Path, tail: bytes, *, at_array_start: bool) -> tuple[int, dict[str, Any]]:
    """``_find_end``, or the one-line error of a trace cut off inside its events array."""
    found = _find_end(tail, at_array_start=at_array_start)
    if found is None:
        msg = (
            f"{path}: JSON ends before the `traceEvents` array is closed"
            " (truncated or corrupt trace)"
        )
        raise TruncatedTraceError(msg)
    p, _ = found
    rest = tail[p + 1 :].lstrip(_WS)
    if rest[:1] == b",":  # the trailer's keys, checked unique (orjson kept the last of two)
        loads_unique(b"{" + rest[1:], path, "after the `traceEvents` array")
    return found


def _merged_meta(path: Path, header: dict[str, Any], trailer: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys around the array, each stated once: a second ``traceEvents`` (which
    the array read first would hide), or a key both before and after the array, is refused."""
    again = sorted({"traceEvents", *header} & set(trailer))
    if again:
        msg = (
            f"{path}: duplicate key {again[0]!r} at the top level (before and after the"
            " `traceEvents` array); a key may appear once in an object"
        )
        raise TraceFormatError(msg)
    return {**header, **trailer}


def _find_end(tail: bytes, *, at_array_start: bool) -> tuple[int, dict[str, Any]] | None:
    """Locate the ``]`` closing the events array in ``tail``; return its offset and the trailer."""
    starts: list[int] = []
    stripped = tail.lstrip(_WS)
    # At the array's start (an empty array), or after more whitespace than the tail window
    # holds: the trailer check below tells whether this ``]`` closes the array.
    if stripped.startswith(b"]") and (at_array_start or len(stripped) < len(tail)):
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
def split_trace_events(
    path: Path, *, tmp_dir: Path | None = None, work_dir: tuple[Path, str] | None = None
) -> Iterator[TraceEventsFile]:
    """Copy the ``traceEvents`` array of ``path`` into temporary files, removed on exit.

    A plain (not gzipped) file is copied by the kernel (``copy_file_range``) between the array's
    two ends, found from its first and last few MB, so its bytes never pass through Python; a
    gzipped one is decompressed into one file in chunks, then cut the same way.

    Args:
        path: a Chrome-trace JSON file, plain or gzipped, of any size.
        tmp_dir: where to put the temporary files (default: the system temp dir), in a
            directory of their own.
        work_dir: instead, ``(directory, stem)``: a directory the caller owns and removes, in
            which the files are named after ``stem`` (unique in it) and deleted on exit; no
            directory is made. The batch reader splits its files so: one directory a batch,
            where a directory a file cost ~3 ms each to remove (32 files: 6% of the batch).

    Yields:
        The events files and the other top-level keys.

    Raises:
        TruncatedTraceError: the gzip stream or the JSON ends early.
        TraceFormatError: corrupt gzip data or JSON around the array.
        UnknownFormatError: the file is not a JSON object.
        MissingFieldError: the object has no top-level ``traceEvents`` array.
    """
    check_regular_file(path)  # a FIFO would block the first read
    if work_dir is None:
        with (
            tempfile.TemporaryDirectory(prefix="prism-kineto-", dir=tmp_dir) as tmp,
            _split(path, Path(tmp), "traceEvents") as tef,
        ):
            yield tef
        return
    made: list[Path] = []
    try:
        with _split(path, work_dir[0], work_dir[1], made) as tef:
            yield tef
    finally:
        for p in made:
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def _split(
    path: Path, tmp: Path, stem: str, written: list[Path] | None = None
) -> Iterator[TraceEventsFile]:
    """``split_trace_events`` into ``tmp``, its files named after ``stem`` (and listed in
    ``written`` as they are made)."""
    written = [] if written is None else written
    whole = tmp / f"{stem}.json"
    written.append(whole)
    located = _locate_plain_array(path)
    if located is None:  # gzipped (or a header past the first chunk): stream it to one file
        with whole.open("wb") as out:
            meta, total = _copy_array(path, out)
        src, start, end = whole, 1, whole.stat().st_size
    else:
        start, end, meta = located
        src, total = path, path.stat().st_size
    made: list[Path] = []

    def make_whole() -> Path:
        if src is not whole and not made:
            with src.open("rb") as fin, whole.open("wb") as out:
                out.write(b"[")
                out.flush()
                _copy_range(fin, out, start, end - start)
            made.append(whole)
        return whole

    cuts = _cut_points(src, start, end)
    parts = _write_parts(src, start, end, cuts, tmp, stem, written) if cuts else (make_whole(),)
    yield TraceEventsFile(parts=parts, meta=meta, json_bytes=total, whole=make_whole)


def _locate_plain_array(path: Path) -> tuple[int, int, dict[str, Any]] | None:
    """Where the array's body is in a plain file, from its head and tail, and the other keys.

    Returns:
        ``(start, end, meta)``: the body runs from ``start`` (after the ``[``) to ``end`` (just
        after the closing ``]``). None when the file is gzipped or its header is not within the
        first chunk; ``_copy_array`` then streams it.
    """
    size = path.stat().st_size
    with path.open("rb") as src:
        head = src.read(_CHUNK)
        if head[:2] == b"\x1f\x8b":
            return None
        if head.lstrip(_WS + b"\xef\xbb\xbf")[:1] not in (b"{", b""):
            msg = f"{path}: not a JSON object (a Kineto trace starts with `{{`)"
            raise UnknownFormatError(msg)
        header = None
        search_from = 0
        while (m := _KEY_RE.search(head, search_from)) is not None:
            header = _parse_header(path, head[: m.start()])
            if header is not None:
                break
            search_from = m.start() + 1
        if header is None or m is None:
            return None
        body = m.end()  # file offset of the first byte after "["
        # The same tail window ``_copy_array`` would keep: 4 to 8 MB before the end.
        tail_at = max(body, size - 2 * _TAIL_KEEP)
        src.seek(tail_at)
        tail = src.read()
    p, trailer = _array_end(path, tail, at_array_start=tail_at == body)
    return body, tail_at + p + 1, _merged_meta(path, header, trailer)


def _cut_points(src: Path, start: int, end: int) -> list[int]:
    """Offsets of the ``}`` of a ``},`` + newline about every ``_PART_BYTES`` of the body."""
    cuts: list[int] = []
    with src.open("rb") as fh:
        at = start + _PART_BYTES
        while at < end - _PART_BYTES // 4:  # no sliver of a last part
            fh.seek(at)
            window = fh.read(min(_CUT_SEARCH, end - at))
            i = window.find(b"},\n")
            if i >= 0 and at + i + 2 < end - 1:  # the comma is before the closing "]"
                cuts.append(at + i)
                at += i + 2 + _PART_BYTES
            else:
                at += _CUT_SEARCH
    return cuts


def _write_parts(
    src: Path, start: int, end: int, cuts: list[int], tmp: Path, stem: str, written: list[Path]
) -> tuple[Path, ...]:
    """Write the body of ``src`` between ``start`` and ``end``, cut after each of ``cuts``."""
    bounds = [start, *(c + 2 for c in cuts)]  # each part starts after a "},"
    stops = [*(c + 1 for c in cuts), end]  # and ends with its "}" (the last with the "]")
    parts = []
    with src.open("rb") as fin:
        for k, (a, b) in enumerate(zip(bounds, stops, strict=True)):
            part = tmp / f"{stem}.{k:05d}.json"
            written.append(part)
            with part.open("wb") as out:
                out.write(b"[")
                out.flush()
                _copy_range(fin, out, a, b - a)
                if b != end:
                    out.write(b"]")
            parts.append(part)
    return tuple(parts)


def _copy_range(src: IO[bytes], out: IO[bytes], offset: int, count: int) -> None:
    """Append ``count`` bytes of ``src`` from ``offset`` to ``out``, in the kernel if it can."""
    in_fd, out_fd = src.fileno(), out.fileno()
    try:
        while count > 0:
            n = os.copy_file_range(in_fd, out_fd, min(count, 1 << 30), offset)
            if n == 0:
                break
            offset += n
            count -= n
    except (AttributeError, OSError):  # no copy_file_range here, or not between these files
        src.seek(offset)
        while count > 0 and (chunk := src.read(min(count, _CHUNK))):
            out.write(chunk)
            count -= len(chunk)
    if count > 0:
        msg = f"{src.name}: file shrank while being read"
        raise TruncatedTraceError(msg)


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
                header = _parse_header(path, bytes(head[: m.start()]))
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
    p, trailer = _array_end(path, bytes(tail), at_array_start=written <= len(tail))
    end = 1 + written - len(tail) + p + 1  # the leading "[" + body up to and including "]"
    out.flush()
    os.truncate(out.fileno(), end)
    return _merged_meta(path, header, trailer), total


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

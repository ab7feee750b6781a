"""The bounds every reader holds a trace to, and the checks that enforce them.

A trace is untrusted input: a rank of 10**9 must not make ingest build a list of 10**9 ranks, a
gzip bomb must not be inflated until memory runs out, and a FIFO named like a trace must not
block forever. Everything sized by a value read from a file is checked here first.
"""

from __future__ import annotations

import gzip
import math
import os
import reprlib
import stat
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from prism_trace.errors import TraceFormatError, TruncatedTraceError

__all__ = [
    "GZIP_FLOOR_BYTES",
    "GZIP_MAX_RATIO",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_COMM_BYTES",
    "MAX_RANKS",
    "MAX_YAML_NODES",
    "BoundedGzip",
    "check_count",
    "check_int",
    "check_rank",
    "check_regular_file",
    "check_text",
    "check_world_size",
    "expansion_limit",
    "gzip_errors",
    "load_yaml",
    "open_bounded",
    "short_repr",
    "type_name",
    "wrong_type",
]

MAX_RANKS = 1 << 20
"""Ranks are in ``[0, MAX_RANKS)`` and a world holds at most ``MAX_RANKS`` ranks."""

INT64_MAX = (1 << 63) - 1
"""The largest value of a BIGINT column (ids, times in ns, byte counts)."""
INT64_MIN = -(1 << 63)

MAX_COMM_BYTES = INT64_MAX // MAX_RANKS
"""The most bytes one communication call moves (8 TiB): an all-gather's output, its input times
its group's size, must still fit a BIGINT for every group size up to ``MAX_RANKS`` (the sizes a
trace leaves out are filled by multiplying, ``ingest.fill_sizes``, and polars wraps on overflow)."""

GZIP_MAX_RATIO = 100
"""A gzip member may expand to this many times its compressed size (real traces: 8-30x)."""

GZIP_FLOOR_BYTES = 64 << 20
"""...or to this many bytes, whichever is larger, so a small file may compress very well."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return int(value) if value else default
    except ValueError:
        return default


def type_name(value: Any) -> str:
    """The JSON-ish type of ``value`` for messages (``bool`` is not an ``int``)."""
    if value is None:
        return "null"
    names = {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _short_reprs() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel = 3
    r.maxlist = r.maxtuple = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 6
    r.maxdict = 4
    r.maxstring = r.maxlong = r.maxother = 60
    return r


_SHORT = _short_reprs()
"""A repr that looks at most 3 levels deep and 6 items wide: a value in a message may be a
megabyte string or a YAML "billion laughs" of nested aliases, whose full repr is gigabytes."""


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, built from at most a few hundred items: a value in
    a message may be megabytes long, or nested aliases whose whole repr would be gigabytes."""
    try:
        text = _SHORT.repr(value)
    except (ValueError, RecursionError, MemoryError):  # an int of more than 4300 digits
        text = f"<{type_name(value)}>"
    return text if len(text) <= 60 else text[:57] + "..."


MAX_YAML_NODES = 1_000_000
"""The most nodes a YAML document may stand for once its aliases are expanded."""


def load_yaml(
    text: str,
    path: Path | str,
    *,
    loader: Any = None,
    passthrough: tuple[type[Exception], ...] = (),
) -> Any:
    """``yaml.safe_load(text)``, refused when its aliases expand past ``MAX_YAML_NODES`` nodes
    or refer to themselves; ``loader``: a ``yaml.SafeLoader`` subclass to construct with (one
    that refuses duplicate keys: ``formats.unique_keys``), default ``SafeLoader``;
    ``passthrough``: its exceptions, raised as they are for the caller to word.

    PyYAML shares an aliased node rather than copying it, so loading a "billion laughs" is
    small, but any later walk of the result (a repr, a JSON dump) expands it: the document's
    expanded size is counted on the composed nodes, each distinct node once.

    Raises:
        TraceFormatError: too many nodes, a recursive alias, or invalid YAML (one line).
    """
    import yaml

    def expanded(node: yaml.Node, seen: dict[int, int], open_: set[int]) -> int:
        key = id(node)
        if key in seen:
            return seen[key]
        if key in open_:
            msg = f"{path}: YAML alias refers to itself at line {node.start_mark.line + 1}"
            raise TraceFormatError(msg)
        open_.add(key)
        n = 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                n += expanded(k, seen, open_) + expanded(v, seen, open_)
        elif isinstance(node, yaml.SequenceNode):
            n += sum(expanded(v, seen, open_) for v in node.value)
        open_.discard(key)
        if n > MAX_YAML_NODES:
            msg = (
                f"{path}: YAML expands to more than {MAX_YAML_NODES} nodes through its aliases"
                f" (at line {node.start_mark.line + 1}); refused"
            )
            raise TraceFormatError(msg)
        seen[key] = n
        return n

    try:
        reader = (loader or yaml.SafeLoader)(text)
        try:
            node = reader.get_single_node()
            if node is None:
                return None
            expanded(node, {}, set())
            return reader.construct_document(node)
        finally:
            reader.dispose()
    except TraceFormatError:
        raise
    except (ValueError, RecursionError, yaml.YAMLError) as exc:
        if isinstance(exc, passthrough):
            raise
        msg = f"{path}: cannot read YAML: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc


def wrong_type(path: Path | str, where: str, value: Any, expected: str) -> TraceFormatError:
    """The one-line refusal of a value of the wrong type: what it is, and what was expected.

    Every reader's type checks say it the same way (``file: where is int 7, expected a string``).
    """
    return TraceFormatError(
        f"{path}: {where} is {type_name(value)} {short_repr(value)}, expected {expected}"
    )


def check_rank(path: Path | str, value: Any, where: str) -> int:
    """``value`` as a rank in ``[0, MAX_RANKS)``, or a one-line error naming ``where``.

    Raises:
        TraceFormatError: not an integer (bools, floats and strings are refused) or out of range.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise wrong_type(path, where, value, "an integer rank")
    if not 0 <= value < MAX_RANKS:
        msg = f"{path}: {where} = {value} is outside [0, {MAX_RANKS}) (the rank limit)"
        raise TraceFormatError(msg)
    return value


def check_world_size(path: Path | str, value: Any, where: str) -> int:
    """``value`` as a world size in ``[1, MAX_RANKS]``, or a one-line error naming ``where``."""
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        msg = f"{path}: {where} is {type_name(value)} {short_repr(value)}, expected an integer"
        raise TraceFormatError(msg)
    if not 1 <= value <= MAX_RANKS:
        msg = f"{path}: {where} = {value} is outside [1, {MAX_RANKS}] (the world-size limit)"
        raise TraceFormatError(msg)
    return value


def check_count(path: Path | str, value: Any, where: str, *, limit: int = MAX_RANKS) -> int:
    """A positive integer size (a parallel degree, a group size) of at most ``limit``."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
        msg = f"{path}: {where} = {short_repr(value)} is not an integer in [1, {limit}]"
        raise TraceFormatError(msg)
    return value


def check_int(path: Path | str, value: Any, where: str, lo: int, hi: int, expected: str) -> int:
    """``value`` as an integer in ``[lo, hi]``, or one line naming ``where`` and ``expected``.

    Raises:
        TraceFormatError: not an integer (bools, floats and strings are refused) or out of range.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise wrong_type(path, where, value, expected)
    if not lo <= value <= hi:
        msg = f"{path}: {where} = {value} is outside [{lo}, {hi}], expected {expected}"
        raise TraceFormatError(msg)
    return value


def check_text(path: Path | str, value: Any, where: str) -> str | None:
    """A descriptive string field (a backend, a group's description) or None when absent; any
    other type is one line naming ``where``, not a value turned into text."""
    if value is None or isinstance(value, str):
        return value
    raise wrong_type(path, where, value, "a string")


def check_regular_file(path: Path) -> None:
    """Refuse anything but a regular file (after symlinks): FIFOs block, devices never end.

    Raises:
        TraceFormatError: ``path`` is missing, or a FIFO, socket or device (also via a symlink).
    """
    try:
        st = path.stat()
    except OSError as exc:
        msg = f"{path}: cannot read: {exc.strerror or exc}"
        raise TraceFormatError(msg) from exc
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "a character device"
            if stat.S_ISCHR(st.st_mode)
            else "a block device"
            if stat.S_ISBLK(st.st_mode)
            else "a socket"
            if stat.S_ISSOCK(st.st_mode)
            else "not a regular file"
        )
        via = f" (via symlink to {os.path.realpath(path)})" if path.is_symlink() else ""
        msg = f"{path}: is {kind}{via}; only regular trace files are read"
        raise TraceFormatError(msg)


def expansion_limit(compressed_bytes: int) -> int:
    """Uncompressed bytes a gzip file of ``compressed_bytes`` may hold before it is a bomb.

    ``PRISM_GZIP_MAX_RATIO`` and ``PRISM_GZIP_FLOOR_BYTES`` override the defaults.
    """
    ratio = _env_int("PRISM_GZIP_MAX_RATIO", GZIP_MAX_RATIO)
    floor = _env_int("PRISM_GZIP_FLOOR_BYTES", GZIP_FLOOR_BYTES)
    return max(floor, ratio * compressed_bytes)


@contextmanager
def gzip_errors(path: Path | str) -> Iterator[None]:
    """Reads of a gzip stream in this block: a cut or corrupt stream is one line naming ``path``.

    Raises:
        TruncatedTraceError: the stream ends before the compressed data does (``EOFError``).
        TraceFormatError: the compressed data is corrupt (``OSError``, ``zlib.error``).
    """
    try:
        yield
    except EOFError as exc:
        msg = f"{path}: truncated gzip stream (file ends before the compressed data does)"
        raise TruncatedTraceError(msg) from exc
    except (OSError, zlib.error) as exc:
        msg = f"{path}: corrupt gzip data: {exc}"
        raise TraceFormatError(msg) from exc


class BoundedGzip(gzip.GzipFile):
    """A gzip reader that refuses to inflate past ``expansion_limit`` of the file's size.

    Every damage is named as our error: a cut stream (``TruncatedTraceError``), corrupt data and a
    bomb (``TraceFormatError``), so no reader has to know gzip's exception types.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._limit = expansion_limit(path.stat().st_size)
        self._seen = 0
        super().__init__(filename=str(path), mode="rb")

    def read(self, size: int | None = -1) -> bytes:
        """Read at most ``size`` bytes (never the whole stream in one go)."""
        want = (1 << 22) if size is None or size < 0 else size
        if size is None or size < 0:
            parts = []
            while chunk := self.read(want):
                parts.append(chunk)
            return b"".join(parts)
        with gzip_errors(self._path):
            data = super().read(min(want, self._limit + 1 - self._seen))
        self._seen += len(data)
        if self._seen > self._limit:
            msg = (
                f"{self._path}: gzip data expands past {self._limit} bytes"
                f" ({GZIP_MAX_RATIO}x the file, a decompression bomb?);"
                " set PRISM_GZIP_MAX_RATIO to allow more"
            )
            raise TraceFormatError(msg)
        return data

    def read1(self, size: int = -1) -> bytes:  # buffered readers call this
        """As ``read``."""
        return self.read(size if size >= 0 else 1 << 22)


def open_bounded(path: Path) -> IO[bytes]:
    """Open a regular file for binary reading, through ``BoundedGzip`` when it is gzipped."""
    check_regular_file(path)
    with path.open("rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return BoundedGzip(path)  # type: ignore[return-value]
    return path.open("rb")

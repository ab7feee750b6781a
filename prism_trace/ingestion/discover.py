"""Find the trace files under the paths a user gives, and tell each file's format from its bytes.

Detection looks at content, not names, so renamed files still work: a Kineto trace is a JSON object
with ``traceEvents``, a host execution trace one with ``nodes`` and ``schema``, a Chakra ET a
length-delimited protobuf whose first record is ``GlobalMetadata``, an op timeline a parquet file
(with its ``meta*.yaml`` beside it). Inside folders, files of no known kind (READMEs, sidecar JSON,
ASTRA-sim XML) are skipped and listed; a file named explicitly must be a trace.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prism_trace.errors import PrismError, TraceFormatError, UnknownFormatError
from prism_trace.formats.base import FormatName
from prism_trace.limits import check_regular_file, gzip_errors

__all__ = [
    "FormatArg",
    "Found",
    "TraceFile",
    "describe_non_trace",
    "detect_format",
    "discover",
    "find",
    "fingerprint",
    "no_trace_message",
    "shown",
]

FormatArg = Literal["auto", "kineto", "host_et", "chakra", "op_timeline"]
"""What ``--format`` may say: a format forced on every file, or ``auto`` (detected per file)."""

_HEAD_BYTES = 1 << 16
_OP_TIMELINE_SIDECARS = re.compile(r"^(meta|result|timeline)[-_].*", re.IGNORECASE)


@dataclass(frozen=True)
class TraceFile:
    """One input: its path and detected (or forced) format."""

    path: Path
    format: FormatName


def _head(path: Path) -> bytes:
    with path.open("rb") as fh:
        raw = fh.read(_HEAD_BYTES)
    if raw[:2] != b"\x1f\x8b":
        return raw
    with gzip_errors(path), gzip.open(path, "rb") as gz:
        return gz.read(_HEAD_BYTES)


def shown(path: Path) -> str:
    """``path`` as a message shows it: bytes of a name that are not UTF-8 as ``\\xff``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _check_name(path: Path) -> None:
    """Refuse a path whose name is not UTF-8: the store keeps paths as text (``source_file``),
    and DuckDB, which reads the files, takes UTF-8 names only.

    Raises:
        TraceFormatError: naming the path with its odd bytes escaped.
    """
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        msg = f"{shown(path)}: the file name is not valid UTF-8; rename the file"
        raise TraceFormatError(msg) from None


def detect_format(path: Path) -> FormatName | None:
    """The format of ``path`` from its first bytes, or None when it is of no known kind.

    Raises:
        TraceFormatError: the file is a gzip that cannot even be opened, or cannot be read
            (its permissions, say: one line, since a rank left out would go unnoticed).
    """
    _check_name(path)
    check_regular_file(path)  # a FIFO would block, /dev/zero would never end
    try:
        return _detect(path)
    except OSError as exc:
        msg = f"{shown(path)}: cannot read the file ({exc.strerror or exc})"
        raise TraceFormatError(msg) from exc


def _forced(path: Path, format: FormatName) -> FormatName:
    """``format`` for a file whose format the user forced, once it is known to be readable."""
    _check_name(path)
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        msg = f"{shown(path)}: cannot read the file ({exc.strerror or exc})"
        raise TraceFormatError(msg) from exc
    return format


def _detect(path: Path) -> FormatName | None:
    if path.suffix == ".parquet":
        return "op_timeline"
    head = _head(path)
    if head[:4] == b"PAR1":
        return "op_timeline"
    text = head.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()  # a UTF-8 BOM is allowed
    if text[:1] == b"{":
        if b'"traceEvents"' in head:
            return "kineto"
        if b'"nodes"' in head and b'"schema"' in head:
            return "host_et"
        return None
    from prism_trace.formats.chakra.records import sniff_chakra

    return "chakra" if sniff_chakra(path) else None


_EXPECTED = (
    "expected a Kineto trace (JSON with `traceEvents`), a host execution trace (JSON with `nodes`"
    " and `schema`), a Chakra ET protobuf or an op-timeline parquet"
)


def describe_non_trace(path: Path) -> str:
    """What ``path`` looks like, for a message about a file that is not a trace.

    Says enough to recognise the file (its JSON top-level keys, YAML, text, empty, binary), so a
    user who named the wrong file of a set sees which one it was.
    """
    import json

    if not _is_regular(path):
        return "not a regular file"
    if _OP_TIMELINE_SIDECARS.match(path.name) and _is_op_timeline_dir(path.parent):
        tables = ", ".join(f.name for f in sorted(path.parent.glob("*.parquet"))[:3])
        return f"a companion file of the op timeline in its folder; ingest {tables} (or the folder)"
    try:
        head = _head(path)
    except (OSError, PrismError):
        return "unreadable"
    if not head.strip():
        return "empty"
    text = head.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()
    if text[:1] in (b"{", b"["):
        try:
            doc = json.loads(text) if len(head) < _HEAD_BYTES else None
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            keys = ", ".join(f"`{k}`" for k in list(doc)[:5])
            return f"a JSON object with keys {keys}" if keys else "an empty JSON object"
        if isinstance(doc, list):
            return f"a JSON array of {len(doc)} items"
        return "JSON" + (" (an object)" if text[:1] == b"{" else " (an array)")
    try:
        decoded = head.decode("utf-8")
    except UnicodeDecodeError:
        return "binary data of no known kind"
    if re.match(r"^\s*[\w.-]+\s*:", decoded):
        return "YAML or other text of `key: value` lines"
    return "text"


def no_trace_message(paths: list[Path], skipped: list[Path]) -> str:
    """The one line for paths that hold no trace: what was given and what was expected."""
    if len(paths) == 1 and paths[0].is_file():
        return f"{paths[0]}: not a trace: {describe_non_trace(paths[0])}; {_EXPECTED}"
    shown = "; ".join(f"{f.name}: {describe_non_trace(f)}" for f in skipped[:3])
    more = f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    found = f" ({shown}{more})" if skipped else " (no files)"
    return f"{', '.join(map(str, paths))}: no trace files found{found}; {_EXPECTED}"


def _is_regular(path: Path) -> bool:
    """Whether ``path`` is (or links to) a regular file."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def _is_op_timeline_dir(folder: Path) -> bool:
    return any(folder.glob("*.parquet")) and any(folder.glob("meta*.yaml"))


def discover(
    paths: list[Path], *, format: FormatArg = "auto"
) -> tuple[list[TraceFile], list[Path]]:
    """Expand files and folders into trace files.

    Args:
        paths: files or folders (folders are searched recursively, in sorted order).
        format: force one format for every file instead of detecting it.

    Returns:
        The trace files, and the files inside folders that were skipped as not traces.

    Raises:
        UnknownFormatError: a file given by name is of no known kind.
        TraceFormatError: a path does not exist.
    """
    found: list[TraceFile] = []
    skipped: list[Path] = []
    for p in paths:
        _check_name(p)
        if not p.exists():
            msg = f"{p}: no such file or folder"
            raise TraceFormatError(msg)
        if p.is_dir():
            if format in ("auto", "op_timeline") and _is_op_timeline_dir(p):
                for f in sorted(p.glob("*.parquet")):
                    check_regular_file(f)
                    found.append(TraceFile(f, _forced(f, "op_timeline")))
                skipped += [f for f in sorted(p.iterdir()) if f.suffix != ".parquet"]
                continue
            for f in sorted(x for x in p.rglob("*") if not x.is_dir()):
                if not _is_regular(f):  # FIFOs, devices, dangling links: listed as skipped
                    skipped.append(f)
                    continue
                _check_name(f)
                fmt = detect_format(f) if format == "auto" else _forced(f, format)
                if fmt is None:
                    skipped.append(f)
                else:
                    found.append(TraceFile(f, fmt))
            continue
        check_regular_file(p)
        fmt = detect_format(p) if format == "auto" else _forced(p, format)
        if fmt is None:
            if _OP_TIMELINE_SIDECARS.match(p.name) and _is_op_timeline_dir(p.parent):
                skipped.append(p)
                continue
            msg = (
                f"{p}: unknown trace format: {describe_non_trace(p)}; {_EXPECTED}"
                " (--format forces one)"
            )
            raise UnknownFormatError(msg)
        found.append(TraceFile(p, fmt))
    return found, skipped


@dataclass(frozen=True)
class Found:
    """``discover``'s answer for the paths of one ingest, asked once (``find``).

    The CLI needs the files before it opens the store, to plan the worker processes it forks
    (``plan.reader_processes``), and ``ingest`` needs them to read: it takes this answer
    instead of walking the folders and sniffing every file again. An error ``discover`` raised
    is kept and raised where ``ingest`` asks for the files (``checked``, after it checked the
    run name), so a bad path is reported exactly as when ingest discovered the files itself.
    """

    paths: list[Path]
    format: FormatArg
    files: list[TraceFile]
    skipped: list[Path]
    error: PrismError | None = None

    def checked(self) -> tuple[list[TraceFile], list[Path]]:
        """The trace files and the skipped ones, as ``discover`` returns them (copies: ingest
        reorders its list).

        Raises:
            What ``discover`` raised for these paths.
        """
        if self.error is not None:
            raise self.error
        return list(self.files), list(self.skipped)


def find(paths: list[Path], *, format: FormatArg = "auto") -> Found:
    """``discover(paths, format=format)`` once, its error kept for later (``Found``).

    Only a ``PrismError`` (a missing path, a file of no known kind, a bad gzip) is kept; any
    other error (a file that cannot be read) is raised here.
    """
    try:
        files, skipped = discover(paths, format=format)
    except PrismError as exc:
        return Found(list(paths), format, [], [], exc)
    return Found(list(paths), format, files, skipped)


def fingerprint(path: Path, *, edge_bytes: int = 4 << 20) -> str:
    """sha256 of the size and the first and last ``edge_bytes``: cheap for multi-GB traces."""
    try:
        size = path.stat().st_size
        h = hashlib.sha256(str(size).encode())
        with path.open("rb") as fh:
            h.update(fh.read(edge_bytes))
            if size > 2 * edge_bytes:
                fh.seek(size - edge_bytes)
            h.update(fh.read(edge_bytes))
    except OSError as exc:  # its permissions, or gone since it was found
        msg = f"{shown(path)}: cannot read the file ({exc.strerror or exc})"
        raise TraceFormatError(msg) from exc
    return h.hexdigest()

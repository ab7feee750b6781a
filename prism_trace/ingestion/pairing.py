"""The rank each file of an ingest is read with, before any is read: ``--rank`` for one rank's
files, and otherwise the rank of the Kineto trace a host ET pairs with.

Why: a host execution trace often states no rank (no ``distributedInfo``, no communication
node, a name such as ``resnet_et.json``) while the Kineto trace recorded beside it in the same
process does, or is the only trace of a single-GPU job. Each reader can only tell its own
file's rank, so the pair was refused unless the files were renamed, and ``--rank`` refused
two files. Here the files are paired first (cheaply, from their first bytes and names) and
each file gets a rank to fall back on; a file that states its rank keeps it (the Kineto reader
refuses a ``--rank`` that disagrees with its ``distributedInfo``; the host ET reader takes the
given rank only when nothing in the file tells one).

Pairing, for a host ET whose rank its name does not show, in this order, a match counting
only when it is the one candidate: the process id (the ET's ``pid`` among the Kineto trace's
event pids), the file name (the same stem once words such as ``et``, ``kineto``, ``trace``
and version numbers are dropped), and the only Kineto trace of the ingest. The only timeline
file of an ingest that states no rank at all (no ``distributedInfo`` in its header, none in
its name: a single-process job) is rank 0.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

from prism_trace.errors import UsageError
from prism_trace.formats.host_et.reader import rank_from_file_name as et_rank_from_name
from prism_trace.formats.kineto.header import rank_from_file_name as kineto_rank_from_name
from prism_trace.ingestion.discover import TraceFile

__all__ = ["file_ranks"]

_HEAD = 1 << 16
_PID = re.compile(rb'"pid"\s*:\s*"?(\d+)')
_NOISE = re.compile(
    r"(^|[._-])(et|ets|host|kineto|trace|traces|pt|chakra|eg|json|gz|pytorch|profile|"
    r"[0-9]+(\.[0-9]+)*|v[0-9]+)(?=$|[._-])"
)


def _head(path: Path) -> bytes:
    """The first uncompressed bytes of ``path`` (empty when it cannot be read: the reader
    will say why)."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(_HEAD)
            if raw[:2] != b"\x1f\x8b":
                return raw
        with gzip.open(path, "rb") as gz:
            return gz.read(_HEAD)
    except (OSError, EOFError, gzip.BadGzipFile):
        return b""


def _stem(path: Path) -> str:
    """The name without the words that tell a trace's kind or version (``resnet_et_1.1.0``
    and ``resnet_kineto`` -> ``resnet``)."""
    name = path.name.lower()
    while True:
        shorter = _NOISE.sub(r"\1", name).strip("._-")
        shorter = re.sub(r"[._-]{2,}", "_", shorter)
        if shorter == name:
            return name
        name = shorter


def _stated_kineto_rank(path: Path, head: bytes) -> int | bool | None:
    """The rank a Kineto file's header or name states; False when its header has
    ``distributedInfo`` without one we can read here (its reader decides)."""
    at = head.find(b'"distributedInfo"')
    if at >= 0:
        text = head[at:].decode("utf-8", "replace")
        start = text.find("{")
        try:
            info, _ = json.JSONDecoder().raw_decode(text, start)
        except ValueError:  # cut off by the head's end, or not an object
            return False
        rank = info.get("rank") if isinstance(info, dict) else None
        return rank if isinstance(rank, int) and not isinstance(rank, bool) else False
    return kineto_rank_from_name(path)


def _one(candidates: list[TraceFile]) -> TraceFile | None:
    return candidates[0] if len(candidates) == 1 else None


def file_ranks(files: list[TraceFile], rank: int | None) -> dict[Path, int]:
    """The rank to read each file with where one is known before reading it.

    Args:
        files: the ingest's files.
        rank: ``--rank``: the rank of one rank's files (a trace, its host ET, or both).

    Returns:
        ``path -> rank`` for the files that get one (the others' readers tell their own).

    Raises:
        UsageError: ``--rank`` with files of more than one rank (two traces, two host ETs).
    """
    timelines = [f for f in files if f.format != "host_et"]
    ets = [f for f in files if f.format == "host_et"]
    if rank is not None:
        if len(timelines) > 1 or len(ets) > 1:
            msg = (
                f"{files[0].path}: --rank applies to one rank's files (a trace and its host"
                f" ET), but {len(timelines)} traces and {len(ets)} host ETs were given;"
                " give each rank's files in an ingest of their own, or none (their names or"
                " headers tell the ranks)"
            )
            raise UsageError(msg)
        return {f.path: rank for f in files}
    kineto = [f for f in timelines if f.format == "kineto"]
    heads = {f.path: _head(f.path) for f in kineto}
    out: dict[Path, int] = {}
    stated = {f.path: _stated_kineto_rank(f.path, heads[f.path]) for f in kineto}
    if len(timelines) == 1 and kineto and stated[kineto[0].path] is None:
        out[kineto[0].path] = 0  # the one trace of a single-process job
    known = {
        p: r if isinstance(r, int) and not isinstance(r, bool) else out.get(p)
        for p, r in stated.items()
    }
    pids = {f.path: {int(x) for x in _PID.findall(heads[f.path])} for f in kineto}
    for et in ets:
        if et_rank_from_name(et.path) is not None:
            continue
        m = _PID.search(_head(et.path))
        pid = int(m.group(1)) if m else None
        pair = (
            (_one([k for k in kineto if pid in pids[k.path]]) if pid is not None else None)
            or _one([k for k in kineto if _stem(k.path) == _stem(et.path)])
            or _one(kineto)
        )
        if pair is not None and known.get(pair.path) is not None:
            out[et.path] = int(known[pair.path])  # type: ignore[arg-type]
    return out

"""What a Kineto file's header and name say of its rank: the rank (checked against the one
given), the world size, the time base, and the rank's row."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from prism_trace.errors import RankUnknownError, TraceFormatError
from prism_trace.formats.kineto.comms import _json_list
from prism_trace.formats.kineto.sql import _MAX_BASE_NS
from prism_trace.limits import check_rank

__all__ = ["rank_from_file_name", "ranks_frame_of"]

_RANK_NAME_RES = (
    re.compile(r"(?:^|[^a-z])(?:rank|worker)[_-]?(\d{1,6})(?!\d)", re.IGNORECASE),
    re.compile(r"\.(\d{1,6})(?:\.pt\.trace)?\.json(?:\.gz)?$", re.IGNORECASE),
)


def rank_from_file_name(path: Path) -> int | None:
    """The rank a file name states: ``worker3_step_12...``, ``rank3_trace.json``, ``x.3.json``.

    Args:
        path: the trace file.

    Returns:
        The rank, or None when the name states none.
    """
    for pattern in _RANK_NAME_RES:
        m = pattern.search(path.name)
        if m:
            return int(m.group(1))
    return None


def _resolve_rank(path: Path, meta: dict[str, Any], rank: int | None) -> int:
    info = meta.get("distributedInfo")
    traced = info.get("rank") if isinstance(info, dict) else None
    if traced is not None:
        traced = check_rank(path, traced, "distributedInfo.rank")
        if rank is not None and rank != traced:
            msg = f"{path}: `rank` {rank} disagrees with distributedInfo.rank {traced}"
            raise TraceFormatError(msg)
        return traced
    if rank is not None:
        return check_rank(path, rank, "the rank given")
    named = rank_from_file_name(path)
    if named is not None:
        return named
    msg = (
        f"{path}: cannot tell the rank (no distributedInfo.rank, none in the file name);"
        " pass --rank"
    )
    raise RankUnknownError(msg)


def _base_ns(path: Path, base: Any) -> int:
    """``baseTimeNanoseconds`` checked: a non-negative integer (or integral float) in range."""
    if base is None:
        return 0
    ok = isinstance(base, int) and not isinstance(base, bool)
    if isinstance(base, float) and math.isfinite(base) and base.is_integer():
        base, ok = int(base), True
    if not ok or not 0 <= base < _MAX_BASE_NS:
        msg = (
            f"{path}: `baseTimeNanoseconds` = {str(base)[:40]} is not an integer in"
            f" [0, {_MAX_BASE_NS:.0e})"
        )
        raise TraceFormatError(msg)
    return int(base)


def ranks_frame_of(
    rank: int, meta: dict[str, Any], info: dict[str, Any], pid: int | None, device_id: int | None
) -> pl.DataFrame:
    """The ``ranks`` row of a file: its header's facts, its process and device ids."""
    props = meta.get("deviceProperties")
    props = props if isinstance(props, list) else []
    entry = next((p for p in props if isinstance(p, dict) and p.get("id") == device_id), None)
    if entry is None and len(props) == 1 and isinstance(props[0], dict):
        entry = props[0]
    if entry is not None:
        device = str(entry.get("name"))
    else:
        device = "cpu" if device_id is None else f"device {device_id}"
    args = {
        k: v
        for k, v in {
            "device_properties": entry,
            "trace_name": meta.get("traceName"),
            "base_time_ns": meta.get("baseTimeNanoseconds"),
            "nccl_version": info.get("nccl_version"),
            "schema_version": meta.get("schemaVersion"),
        }.items()
        if v is not None
    }
    layout = _json_list(meta.get("prism_layout"))  # our generator's rank coordinates
    if isinstance(layout, dict):
        args["prism_layout"] = layout
    host = meta.get("host_name") or meta.get("hostname")
    return pl.DataFrame(
        {
            "rank": [rank],
            "backend": [info.get("backend")],
            "hostname": [host if isinstance(host, str) else None],
            "pid": [pid],
            "device": [device],
            "args": [orjson.dumps(args).decode()],
        },
        schema={
            "rank": pl.Int32,
            "backend": pl.Utf8,
            "hostname": pl.Utf8,
            "pid": pl.Int64,
            "device": pl.Utf8,
            "args": pl.Utf8,
        },
    )

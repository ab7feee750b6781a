"""Test inputs unlike the traces they are made of: stripped args, other ranks, other sizes.

A trace this project did not make often says less than ours: ``record_param_comms`` without
args, no process-group descriptions, one rank of a large job. These helpers write such variants
of a Kineto trace (gzip JSON) to a folder of the caller's choosing, so that tests and benchmarks
exercise the readers on them without copying the public traces into the repository.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

__all__ = ["kineto_variant", "two_ranks_of_many"]

Event = dict[str, Any]

_PG_SEQ = re.compile(r"(?:pg|desc|seq)=[^;]*;")


def kineto_variant(
    src: Path,
    dst: Path,
    *,
    strip_comm_args: bool = False,
    drop: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    only_default_group: bool = False,
    edit: Callable[[Event], Event | None] | None = None,
) -> Path:
    """Write a modified copy of one Kineto trace.

    Args:
        src: a Kineto trace (``.json`` or ``.json.gz``).
        dst: the file to write (gzip JSON).
        strip_comm_args: empty the args of every ``record_param_comms`` event (as traces of
            older or stripped-down profilers have them).
        drop: a regular expression; events whose name matches are left out.
        rank: the rank to state in ``distributedInfo`` (the file name should agree).
        world_size: the world size to state in ``distributedInfo``.
        only_default_group: make every call one of the default group without a sequence number
            and drop every other group and the rank coordinates from the header (a job whose
            trace shows only ``default_pg``, as NCCL traces without group descriptions do).
        edit: called on every event; returns the event to keep (possibly changed) or None.

    Returns:
        ``dst``.
    """
    raw = src.read_bytes()
    data = orjson.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    pattern = re.compile(drop) if drop else None
    out: list[Event] = []
    for ev in data.get("traceEvents", []):
        name = str(ev.get("name", ""))
        if pattern is not None and pattern.search(name):
            continue
        if strip_comm_args and name == "record_param_comms":
            ev = {**ev, "args": {}}
        if only_default_group and name.startswith("prism_comm:"):
            name = _PG_SEQ.sub("", name).replace("prism_comm:", "prism_comm:pg=0;", 1)
            ev = {**ev, "name": name}
        if edit is not None:
            ev = edit(ev)
            if ev is None:
                continue
        out.append(ev)
    data["traceEvents"] = out
    info = data.get("distributedInfo")
    if only_default_group:
        data.pop("prism_groups", None)
        data.pop("prism_layout", None)
        if isinstance(info, dict):
            info["pg_config"] = [
                g for g in info.get("pg_config") or [] if g.get("pg_desc") == "default_pg"
            ]
    if isinstance(info, dict):
        if rank is not None:
            info["rank"] = rank
        if world_size is not None:
            info["world_size"] = world_size
            for g in info.get("pg_config") or []:  # the default group is the world
                if isinstance(g, dict) and g.get("pg_desc") == "default_pg":
                    g.update(ranks=list(range(world_size)), pg_size=world_size)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(gzip.compress(orjson.dumps(data), compresslevel=1))
    return dst


def _all_to_all_scaled(factor: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(ev: dict[str, Any]) -> dict[str, Any]:
        if str(ev.get("name", "")).startswith("nccl:all_to_all"):
            args = dict(ev.get("args") or {})
            dims = args.get("Input Dims")
            if dims and dims[0]:
                args["Input Dims"] = [[dims[0][0] * factor], *dims[1:]]
            ev = {**ev, "args": args}
        return ev

    return edit


def two_ranks_of_many(
    src: Sequence[Path], out: Path, *, world_size: int = 128, factor: int = 1000
) -> None:
    """Ranks 0 and ``world_size // 2`` of a large job, made from two DLRM Kineto files, with
    their ``record_param_comms`` args stripped and the second rank's all-to-alls ``factor``
    times larger: a partial recording whose calls must not be matched by order."""
    kineto_variant(src[0], out / "rank0.json.gz", strip_comm_args=True, world_size=world_size)
    half = world_size // 2
    kineto_variant(
        src[1],
        out / f"rank{half}.json.gz",
        strip_comm_args=True,
        world_size=world_size,
        rank=half,
        edit=_all_to_all_scaled(factor),
    )

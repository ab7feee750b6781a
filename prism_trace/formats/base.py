"""The contract every format reader fulfils: ``read_<format>(path, *, rank) -> TraceTables``.

A reader turns one file into polars frames shaped like the store's tables (see ``schema.py``),
minus ``run_id`` (which ingest assigns) and with communicator *names* instead of minted group ids.
Readers never read or write the store's tables: a reader is tested alone, and ingest checks each
file's frames before it appends them (a failure rolls the whole ingest back).

Where a reader's work runs is another matter, for Kineto. ``read_kineto`` works in a DuckDB
connection of its own. Ingest instead calls ``stage_kineto`` (one file) and
``try_read_kineto_batch`` (several small ones), which run their SQL on a connection the caller
gives and make their work tables in that connection's default database, which the caller makes
fresh for the file and drops after it. In a worker process that is the worker's own connection;
in the ingest's own process it is a cursor of the *store's* connection, with a work database
attached and made its default (``ingest.readers._work_database``: in memory, or a file for a
trace larger than the memory limit). So the statements run inside the store's DuckDB, but they
never name the store's database or its tables, and the store's transaction never reads the work
database (a transaction keeps every database it read attached until it ends): the frames come
back as polars frames, and ``stage_kineto``'s events as a relation handed to the caller's sink,
which ingest streams into ``event`` as Arrow batches (``ingest.append._stream_events``).

Why the store's DuckDB rather than one of the reader's own: one DuckDB in the process is one
memory limit, one buffer pool and one thread pool for the whole ingest (``ingest.memory``). A
second database instance would bring its own limit, so the ingest's peak could reach twice it,
and its threads would compete with the store's for the cores; the events would cross between
the two the same way (an Arrow stream), so nothing would be gained in speed.

Frames and their columns (each frame may hold several ranks; every frame has a ``rank`` column):

- ``ranks``: rank, backend, hostname, pid, device, args (JSON text)
- ``tracks``: as table ``track`` minus run_id
- ``events``: as table ``event`` minus run_id; ``parent_id``/``depth``/``iteration`` may be left
  null, ingest derives them (nesting per track, iteration by time or by launch correlation)
- ``collectives``: as table ``collective`` minus run_id, with ``group_name`` (VARCHAR) instead of
  ``group_id``; ``seq`` may be null, ingest numbers calls per (rank, group) in host-time order
- ``p2p``: as table ``p2p`` minus run_id, with ``group_name`` instead of ``group_id``
- ``memory``, ``flows``, ``iterations``, ``et_ops``: as their tables minus run_id
- ``comm_groups``: name, description, backend, size, ranks (list[int]); one row per group name
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import polars as pl

from prism_trace.errors import TraceFormatError
from prism_trace.limits import gzip_errors, open_bounded
from prism_trace.store import tables

__all__ = [
    "ET_IO_COLUMNS",
    "FRAME_SCHEMAS",
    "FormatName",
    "TraceTables",
    "empty_frame",
    "open_maybe_gzip",
    "read_all_bytes",
]

FormatName = Literal["kineto", "host_et", "chakra", "op_timeline"]

_DUCK_TO_POLARS: dict[str, pl.DataType] = {
    "INTEGER": pl.Int32(),
    "BIGINT": pl.Int64(),
    "VARCHAR": pl.Utf8(),
    "JSON": pl.Utf8(),
    "BOOLEAN": pl.Boolean(),
    "DOUBLE": pl.Float64(),
    "TIMESTAMP": pl.Datetime(),
    "INTEGER[]": pl.List(pl.Int32()),
}


def _frame_schema(table_name: str, *, group_name: bool = False) -> dict[str, pl.DataType]:
    out: dict[str, pl.DataType] = {}
    for c in tables.table(table_name).columns:
        if c.name == "run_id":
            continue
        if group_name and c.name == "group_id":
            out["group_name"] = pl.Utf8()
            continue
        out[c.name] = _DUCK_TO_POLARS[c.type]
    return out


FRAME_SCHEMAS: dict[str, dict[str, pl.DataType]] = {
    "ranks": {
        "rank": pl.Int32(),
        "backend": pl.Utf8(),
        "hostname": pl.Utf8(),
        "pid": pl.Int64(),
        "device": pl.Utf8(),
        "args": pl.Utf8(),
    },
    "tracks": _frame_schema("track"),
    "events": _frame_schema("event"),
    "collectives": _frame_schema("collective", group_name=True),
    "p2p": _frame_schema("p2p", group_name=True),
    "memory": _frame_schema("memory"),
    "flows": _frame_schema("flow"),
    "iterations": _frame_schema("iteration"),
    "et_ops": _frame_schema("et_op"),
    "comm_groups": {
        "name": pl.Utf8(),
        "description": pl.Utf8(),
        "backend": pl.Utf8(),
        "size": pl.Int32(),
        "ranks": pl.List(pl.Int32()),
    },
}


ET_IO_COLUMNS = (
    "inputs",
    "input_shapes",
    "input_types",
    "outputs",
    "output_shapes",
    "output_types",
)
"""The ``et_ops`` columns holding an op's inputs and outputs (JSON lists), named after the flat
lists of a 1.0.1 host execution trace node."""


# ``FRAME_SCHEMAS`` as polars schemas, to tell a frame that is already conformed.
_SCHEMAS = {name: pl.Schema(want) for name, want in FRAME_SCHEMAS.items()}


def empty_frame(name: str) -> pl.DataFrame:
    """An empty frame with the contract's columns for ``name``."""
    return pl.DataFrame(schema=FRAME_SCHEMAS[name])


@dataclass
class TraceTables:
    """What a reader returns: the frames of one file, conformed to ``FRAME_SCHEMAS`` by ``conform``.

    ``world_size`` is the job's world when the file says (Kineto ``distributedInfo``, Chakra
    metadata, op-timeline meta); ``format`` and ``path`` are for messages and ``source_file`` rows.
    """

    path: Path
    format: FormatName
    world_size: int | None = None
    ranks: pl.DataFrame = field(default_factory=lambda: empty_frame("ranks"))
    tracks: pl.DataFrame = field(default_factory=lambda: empty_frame("tracks"))
    events: pl.DataFrame = field(default_factory=lambda: empty_frame("events"))
    collectives: pl.DataFrame = field(default_factory=lambda: empty_frame("collectives"))
    p2p: pl.DataFrame = field(default_factory=lambda: empty_frame("p2p"))
    memory: pl.DataFrame = field(default_factory=lambda: empty_frame("memory"))
    flows: pl.DataFrame = field(default_factory=lambda: empty_frame("flows"))
    iterations: pl.DataFrame = field(default_factory=lambda: empty_frame("iterations"))
    et_ops: pl.DataFrame = field(default_factory=lambda: empty_frame("et_ops"))
    comm_groups: pl.DataFrame = field(default_factory=lambda: empty_frame("comm_groups"))
    cycle: str | None = None
    """A dependency cycle the reader found, in words (a Chakra graph; the PyTorch converter of
    2023 wrote some): ingest refuses the file unless cycles are allowed (``--allow-cycles``),
    since no emulation or slice can order it."""

    def conform(self) -> TraceTables:
        """Cast every frame to the contract (adding missing nullable columns, ordering them).

        Raises:
            TraceFormatError: a frame has a column the contract does not know, or a bad type.
        """
        for name, want in FRAME_SCHEMAS.items():
            df: pl.DataFrame = getattr(self, name)
            if df.schema == _SCHEMAS[name]:  # already conformed: a select per frame costs ~0.3 ms
                continue
            extra = set(df.columns) - set(want)
            if extra:
                msg = f"{self.path}: reader produced unknown columns {sorted(extra)} in `{name}`"
                raise TraceFormatError(msg)
            try:
                df = df.select(
                    [
                        (pl.col(c) if c in df.columns else pl.lit(None)).cast(t).alias(c)
                        for c, t in want.items()
                    ]
                )
            except pl.exceptions.PolarsError as exc:
                msg = f"{self.path}: bad value types in `{name}`: {exc}".splitlines()[0]
                raise TraceFormatError(msg) from exc
            setattr(self, name, df)
        return self

    @property
    def rank_ids(self) -> list[int]:
        """The ranks this file describes."""
        return sorted(int(r) for r in self.ranks["rank"].to_list())


def open_maybe_gzip(path: Path) -> IO[bytes]:
    """Open a regular file for binary reading, un-gzipping it (bounded: ``limits``) if gzipped."""
    return open_bounded(path)


def read_all_bytes(path: Path, *, max_bytes: int | None = None) -> bytes:
    """Read a whole (possibly gzipped) file, turning a cut or corrupt gzip into a clear error.

    Args:
        path: the file.
        max_bytes: refuse a file whose (uncompressed) content is larger: the caller holds it in
            memory whole, so this is its memory cap.

    Raises:
        TruncatedTraceError: the gzip stream ends early.
        TraceFormatError: the gzip stream is corrupt, expands like a bomb, or exceeds ``max_bytes``.
    """
    parts: list[bytes] = []
    seen = 0
    with gzip_errors(path), open_maybe_gzip(path) as fh:
        while chunk := fh.read(1 << 22):
            seen += len(chunk)
            if max_bytes is not None and seen > max_bytes:
                msg = (
                    f"{path}: more than {max_bytes} bytes of JSON, the limit for a file read"
                    " whole (set PRISM_MAX_JSON_BYTES to allow more)"
                )
                raise TraceFormatError(msg)
            parts.append(chunk)
    return b"".join(parts)

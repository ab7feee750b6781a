"""Read a Kineto (torch.profiler Chrome-trace JSON) file of one rank into the contract's frames.

The ``traceEvents`` array is copied into files of its own (``json_array``; cut in parts DuckDB
parses in parallel) and parsed by DuckDB; every transformation is SQL (plus vectorised nesting, a
slice of a track at a time), so no Python object is made per event.

Conventions:

- ``ts``/``dur`` are integer ns. When the trace has ``baseTimeNanoseconds`` (Kineto >= 2024), its
  ``ts`` are microseconds after that base and ``ts`` here is ``base + ts * 1000``, i.e. ns since the
  epoch, like older traces whose ``ts`` are epoch microseconds.
- Categories: the device model of every backend (``formats.device``): ``cpu_op``,
  ``user_annotation``, ``python_function``; device ops ``kernel`` (CUDA's ``kernel``, MTIA's
  ``mtia_ccp_events``), ``memcpy``, ``memset``, ``gpu_user_annotation``, ``cuda_sync``; the
  runtime and driver calls of any backend (``cuda_runtime``, ``hip_runtime``, ``mtia_runtime``,
  ``xpu_runtime``, ...) as ``cuda_runtime``/``cuda_driver``; ``i``/``I`` instants -> ``instant``
  (``[memory]`` goes to ``memory``); any other ``X`` -> ``other``. The profiler's own ``Trace``
  span and the ``Spans``/``Traces`` pids are skipped.
- Tracks: a ``stream`` per (device, stream) holding device events (its ``tid`` the stream id,
  from ``args.stream`` where the trace's ``tid`` is text such as ``"stream 7"``), a ``thread``
  per (pid, tid) otherwise; ``track_id`` and ``event_id`` are minted densely in (track, ts,
  -dur) order.
- Collectives come from, in order of preference, ``prism_comm:`` annotations (our generator's),
  ``record_param_comms`` ops with ``Collective name`` (PyTorch >= 2.1), and older
  ``record_param_comms`` ops enclosing an ``nccl:<op>`` annotation (group ``0`` of all ranks),
  then the ``c10d::<op>`` op itself where nothing better describes the call (its input tensor's
  size), then, in a file where nothing of these describes any call (older PyTorch on CPU), the
  backend's ``gloo:<op>`` spans on the worker threads that ran the calls. A call whose host
  record names no group takes the group (and ``Seq``) from its NCCL kernel's args when they
  have them; one naming it by ``Process Group ID`` only (PyTorch 2.2-2.3) gets a group every
  rank shares (``comms.groups_by_id``). Call names are normalised (``c10d::_allgather_base_``,
  ``nccl:_all_gather_base``, ``all_gather_into_tensor``, the ``_coalesced`` forms, ``isend``).
  A comm op inside another one on the same thread is not counted again. ``wait``, coalescing
  markers (``coalesced``) and unknown names are not collectives. ``Seq`` (1-based per group)
  becomes 0-based ``seq``; calls without one are numbered in order at ingest and matched across
  ranks only where the ranks agree (``prism_trace.graph.matching``).
  A p2p call whose peer the trace does not state has a null ``peer``.
- Memory: the ``traceEvents`` args are held once (in ``raw``, with the three ids moved to typed
  columns); every join between events is an equi-join, an ASOF join, a window or a sorted search,
  never a range join.

This module is the entry points and the pipeline's order (``_Reader.read``); each stage is a
module of its own, over one work database (``work``): the header's rank and time base
(``header``), the records' load and checks (``load``), tracks, events and iterations
(``events``), memory, flows and the rank row (``frames``), and the calls and groups (``comms``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from prism_trace.errors import TraceFormatError
from prism_trace.formats.base import TraceTables
from prism_trace.formats.kineto.comms import _CommTables
from prism_trace.formats.kineto.events import _Events
from prism_trace.formats.kineto.frames import _Frames
from prism_trace.formats.kineto.header import _base_ns, _resolve_rank
from prism_trace.formats.kineto.json_array import TraceEventsFile, split_trace_events
from prism_trace.formats.kineto.load import _OBJECT_BYTES, _Load
from prism_trace.formats.unseen_frees import with_unseen_frees
from prism_trace.limits import check_world_size

__all__ = ["EventsSink", "read_kineto", "stage_kineto"]

EventsSink = Callable[[int, duckdb.DuckDBPyRelation], None]
"""Takes the rank and the events relation of a file (``stage_kineto``) and consumes it."""

# A trace of at least this many JSON bytes has its work tables freed as soon as they are done
# with (``_Reader.free``); ~15 statements, ~10 ms a file, that a small trace does without.
_FREE_BYTES = 32 << 20


def read_kineto(path: Path, *, rank: int | None = None, tmp_dir: Path | None = None) -> TraceTables:
    """Read one rank's Kineto trace (``.json`` or ``.json.gz``, any size) into conformed frames.

    Args:
        path: the trace file.
        rank: the rank, when neither ``distributedInfo.rank`` nor the file name tells it; it wins
            over the file name, and must agree with ``distributedInfo.rank``.
        tmp_dir: where to put the temporary copy of the events array (default: system temp dir).

    Returns:
        The frames of the file, conformed to ``FRAME_SCHEMAS``.

    Raises:
        RankUnknownError: no rank in the trace, its name or the arguments.
        TruncatedTraceError: the gzip stream or the JSON ends early.
        MissingFieldError: the JSON has no ``traceEvents``.
        TraceFormatError: corrupt data, or ``rank`` disagrees with the trace.
    """
    path = Path(path)
    with split_trace_events(path, tmp_dir=tmp_dir) as tef:
        the_rank = _resolve_rank(path, tef.meta, rank)
        con = duckdb.connect()
        spill = str(tef.parts[0].parent).replace("'", "''")
        con.execute(f"SET temp_directory = '{spill}'")  # spill next to the events copy
        try:
            return _Reader(path, the_rank, tef, con).read()
        finally:
            con.close()


def stage_kineto(
    path: Path,
    *,
    con: duckdb.DuckDBPyConnection,
    events_into: EventsSink,
    rank: int | None = None,
    tmp_dir: Path | None = None,
) -> TraceTables:
    """Read one rank's Kineto trace on ``con``, handing its events to ``events_into`` as SQL.

    Ingest's path: the events (the one table as large as the trace) are never made a frame;
    ``events_into`` gets a relation on ``con`` (columns of ``FRAME_SCHEMAS["events"]``, sorted
    by ``event_id``) and consumes it, e.g. streams it in Arrow batches into the store, so at most
    a few batches of them exist outside DuckDB's tables at a time. ``con``'s default database is
    where the reader makes its work tables; the caller gives a fresh one per file and drops it
    afterwards. ``preserve_insertion_order`` must be on (DuckDB's default): records are numbered
    by the order it keeps.

    Args:
        path: the trace file.
        con: the connection to run the reader's SQL on.
        events_into: called once with the file's rank and its events relation, which it must
            consume before returning; what it raises propagates as is (the data are typed by
            then, so an error there is the sink's, e.g. the store's, not the trace's).
        rank: as for ``read_kineto``.
        tmp_dir: as for ``read_kineto``.

    Returns:
        The other frames of the file, conformed; ``events`` is empty.

    Raises:
        The errors of ``read_kineto``.
    """
    path = Path(path)
    with split_trace_events(path, tmp_dir=tmp_dir) as tef:
        the_rank = _resolve_rank(path, tef.meta, rank)
        return _Reader(path, the_rank, tef, con).read(events_into=events_into)


class _Reader(_CommTables, _Frames, _Events, _Load):
    """One file's SQL pipeline: the stages' methods (``load``, ``events``, ``frames``,
    ``comms``) run in ``read``'s order on one work database."""

    def __init__(
        self, path: Path, rank: int, tef: TraceEventsFile, con: duckdb.DuckDBPyConnection
    ) -> None:
        self.path = path
        self.rank = rank
        self.meta = tef.meta
        self.tef = tef
        self.con = con
        info = self.meta.get("distributedInfo")
        self.info: dict[str, Any] = info if isinstance(info, dict) else {}
        ws = self.info.get("world_size")
        self.world_size = (
            None if ws is None else check_world_size(path, ws, "distributedInfo.world_size")
        )
        if self.world_size is not None and rank >= self.world_size:
            msg = f"{path}: rank {rank} is not below distributedInfo.world_size {self.world_size}"
            raise TraceFormatError(msg)
        self.base_ns = _base_ns(path, self.meta.get("baseTimeNanoseconds"))
        self.bound = pl.DataFrame()  # fwd-bwd flow points' events, from ``event_ids`` to ``flows``
        self.object_bytes = _OBJECT_BYTES
        # Whether to free work tables as soon as they are done with: worth it for a large trace,
        # but for a small one the statements cost more than the memory (the caller drops the
        # work database after the file anyway).
        self.free = tef.json_bytes >= _FREE_BYTES

    def read(self, events_into: EventsSink | None = None) -> TraceTables:
        """All frames; with ``events_into``, the events go there (as SQL) instead of a frame."""
        self.load()
        self.build_tracks()
        self.keep_side_records()
        self.build_events()
        if self.free:  # raw keeps only the args (ev holds the rest): frees the other columns
            for column in self.rows(
                "SELECT column_name FROM duckdb_columns()"
                " WHERE table_name = 'raw' AND column_name <> 'args'"
                " AND database_name = current_database() AND schema_name = current_schema()"
            ):
                self.sql(f'ALTER TABLE raw DROP COLUMN "{column[0]}"')
        self.assign_iterations()
        tables = TraceTables(path=self.path, format="kineto", world_size=self.world_size)
        tables.tracks = self.frame(
            f"SELECT {self.rank} AS rank, track_id, kind, pid, tid, name"
            " FROM track ORDER BY track_id"
        )
        tables.iterations = self.frame(
            f"SELECT {self.rank} AS rank, iteration, ts, dur, name FROM step ORDER BY iteration"
        )
        tables.memory = self.memory()
        tables.flows = self.flows()
        groups = self.comm_groups_from_meta()
        tables.collectives, tables.p2p = self.comms(groups)
        tables.comm_groups = self.comm_groups(groups, tables.collectives, tables.p2p)
        tables.ranks = self.ranks_frame()
        with_unseen_frees(tables)
        # Last, with the other tables gone: the one frame as large as the trace.
        # (``_bound`` is a temporary table: it would outlive the work database)
        done = ("comm_raw", "flow_point", "mem_record", "arg_row", "track", "step")
        for name in ("_bound", *(done if self.free else ())):
            self.sql(f"DROP TABLE IF EXISTS {name}")
        events = self.events_sql()
        if events_into is None:
            tables.events = self.frame(events)
        else:
            try:
                events_into(self.rank, self.con.sql(events))
            except duckdb.OutOfMemoryException as exc:  # the sort of the whole trace's events
                raise self._fail(exc) from exc
        return tables.conform()

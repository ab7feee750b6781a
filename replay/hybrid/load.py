"""Hybrid replay, loading: a real rank's ops, events, iterations and peer schedule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import polars as pl
from prism_trace.replay.peers import PeerSchedule

from prism_trace.errors import RunStateError, SelectionError

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__: list[str] = []


@dataclass
class _RankInputs:
    rank: int
    source_rank: int
    ops: pl.DataFrame
    events: pl.DataFrame  # event_id, ts, dur, category, track_id, iteration
    iterations: pl.DataFrame  # iteration, ts, dur, name (recorded, of the source rank)
    schedule: PeerSchedule
    # Recorded CPU allocator level (``total_allocated`` before the first event) per iteration.
    cpu_levels: dict[int, int] = field(default_factory=dict)
    # The source rank's allocator events with addresses (``replay.memory.lifetimes``).
    allocator: pl.DataFrame = field(default_factory=pl.DataFrame)


def _source_of(store: Store, run_id: int) -> tuple[str, int]:
    line = store.run_ancestry(run_id)
    kind = line[0].kind
    if kind not in ("recorded", "sliced"):
        msg = f"{store.path}: run id {run_id} is {kind}; replay needs a recorded or sliced run"
        raise RunStateError(msg)
    return kind, line[1].run_id if kind == "sliced" else run_id


def _load_rank(
    store: Store, run_id: int, source_run: int, rank: int, schedule: PeerSchedule
) -> _RankInputs:
    rows = store.con.execute(
        "SELECT coalesce(represented_by, rank) FROM rank WHERE run_id = ? AND rank = ?",
        [run_id, rank],
    ).fetchall()
    if not rows:
        msg = f"{store.path}: rank {rank} is not in the run"
        raise SelectionError(msg)
    src = int(rows[0][0])
    ops = store.con.sql(
        "SELECT o.*, e.iteration FROM et_op o LEFT JOIN event e ON e.run_id = o.run_id"
        " AND e.rank = o.rank AND e.event_id = o.event_id WHERE o.run_id = $1 AND o.rank = $2",
        params=[source_run, src],
    ).pl()
    if ops.is_empty():
        msg = (
            f"{store.path}: rank {src} has no host execution trace (et_op); replay rebuilds ops"
            " from it"
        )
        raise RunStateError(msg)
    events = store.con.sql(
        "SELECT event_id, ts, dur, category, track_id, iteration FROM event"
        " WHERE run_id = $1 AND rank = $2",
        params=[source_run, src],
    ).pl()
    iters = store.con.sql(
        "SELECT iteration, ts, dur, name FROM iteration WHERE run_id = $1 AND rank = $2"
        " ORDER BY iteration",
        params=[source_run, src],
    ).pl()
    levels = store.con.execute(
        "SELECT i.iteration, arg_min(m.total_allocated - m.bytes, m.ts)"
        " FROM iteration i JOIN memory m ON m.run_id = i.run_id AND m.rank = i.rank"
        " AND m.ts >= i.ts AND m.ts < i.ts + i.dur"
        " WHERE i.run_id = ? AND i.rank = ? AND m.device_type = 'cpu'"
        " AND m.total_allocated IS NOT NULL GROUP BY i.iteration",
        [source_run, src],
    ).fetchall()
    cpu_levels = {int(i): int(v) for i, v in levels if v is not None}
    allocator = store.con.sql(
        "SELECT ts, addr, bytes, device_type FROM memory"
        " WHERE run_id = $1 AND rank = $2 AND addr IS NOT NULL",
        params=[source_run, src],
    ).pl()
    return _RankInputs(rank, src, ops, events, iters, schedule, cpu_levels, allocator)

"""Emulation, the write stage: the emulated run in the command's transaction, the events on a
worker thread while the memory and iterations are worked out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.frames import (
    _comm_frames,
    _event_frame,
    _kept,
    _rank_step_rows,
    all_iterations,
    recorded_iterations,
)
from prism_trace.replay.emulate.load import _fetch
from prism_trace.replay.emulate.run_memory import _memory_rows, with_memory
from prism_trace.replay.emulate.values import EmulationResult, WrittenRun

from prism_trace.store.connection import Store
from prism_trace.store.write import append, drop_run, new_run

if TYPE_CHECKING:
    import duckdb

__all__ = ["write_run"]


def write_run(
    store: Store,
    res: EmulationResult,
    *,
    out_run: str,
    old_id: int | None,
    config: EmulationConfig,
) -> WrittenRun:
    """The write stage: ``res`` as the emulated run ``out_run``, with its memory and iterations.

    Writes in ``store.transaction()``: the caller's, when it has one (``prism emulate`` writes
    everything in one), else one of its own. The events (every node of every unit: the bulk of
    the write) go in on a worker thread; DuckDB inserts them on one core without the GIL, so the
    memory and iterations, worked out meanwhile through a second connection (which reads only
    the recording: it does not see the transaction's writes), overlap with them. On an error the
    worker's insert is stopped and the transaction rolls back.

    Args:
        store: an open, writable store.
        res: the run stage's result (without memory: it is re-timed here).
        out_run: the new run's name.
        old_id: the run ``out_run`` replaces (``claim_run_name``), dropped first.
        config: the emulation config (``keep_events``; stored in ``run.config_json``).
    """
    with _writing(store, res, out_run=out_run, old_id=old_id, config=config) as w:
        res = with_memory(w.reader, res, config, w.g_size)
        w.queue("memory", _memory_rows(res, w.run_id))
        iters = all_iterations(res, recorded_iterations(w.reader, res.inputs))
        n_events = w.wait()
        append(w.con, "iteration", iters.with_columns(run_id=pl.lit(w.run_id, pl.Int32)))
        coll, p2p = _comm_frames(res, w.run_id, w.g_size)
        append(w.con, "collective", coll)
        append(w.con, "p2p", p2p)
        t = time.perf_counter()
        n_rank_step = append(w.con, "rank_step", _rank_step_rows(res, w.run_id))
        rank_step_s = time.perf_counter() - t
    return WrittenRun(
        result=res,
        iterations=iters,
        run_id=w.run_id,
        n_events=n_events,
        n_rank_step=n_rank_step,
        rank_step_s=rank_step_s,
    )


@dataclass(frozen=True)
class _Writing:
    """An emulated run being written (see ``_writing``): the inserts queued on the worker."""

    con: duckdb.DuckDBPyConnection
    reader: Store  # the store on a second connection: for reads while the events go in
    run_id: int
    g_size: dict[int, int]
    pending: list[Future[int]]  # inserts on the worker thread, in order (events first)
    worker: ThreadPoolExecutor

    def queue(self, table: str, rows: pl.DataFrame) -> None:
        """Queue the insert of ``rows`` into ``table`` on the worker, behind the events."""
        self.pending.append(self.worker.submit(append, self.con, table, rows))

    def wait(self) -> int:
        """Wait for the queued inserts; returns the number of events inserted."""
        n_events = self.pending[0].result()
        for f in self.pending[1:]:
            f.result()
        return n_events


@contextlib.contextmanager
def _writing(
    store: Store,
    res: EmulationResult,
    *,
    out_run: str,
    old_id: int | None,
    config: EmulationConfig,
) -> Iterator[_Writing]:
    """Open (or join) the transaction, write the run, its ranks, groups and tracks, and start
    inserting the events on a worker thread; the caller queues more and waits (``_Writing``).

    The block commits on exit when it opened the transaction, or rolls everything back (after
    stopping the worker's insert) on an error.
    """
    inputs = res.inputs
    sizes = _fetch(
        store.con,
        "SELECT group_id, size FROM comm_group WHERE run_id = $1 AND list_contains($2, group_id)",
        [inputs.run_id, sorted({int(g) for g in res.sync["group_id"].drop_nulls().to_list()})],
    )
    g_size = dict(zip(sizes["group_id"].to_list(), sizes["size"].to_list(), strict=True))
    cursor = store.con.cursor()
    try:
        with ThreadPoolExecutor(max_workers=1) as worker, store.transaction() as con:
            run_id = _write_header(con, res, out_run=out_run, old_id=old_id, config=config)
            frame = _event_frame(res, run_id, config.keep_events)
            events = worker.submit(append, con, "event", frame)
            w = _Writing(
                con=con,
                reader=Store(cursor, store.path, read_only=True),
                run_id=run_id,
                g_size=g_size,
                pending=[events],
                worker=worker,
            )
            try:
                yield w
            except BaseException:
                con.interrupt()  # stop the worker's insert; the transaction rolls back
                wait(w.pending)
                raise
    finally:
        cursor.close()


def _write_header(
    con: duckdb.DuckDBPyConnection,
    res: EmulationResult,
    *,
    out_run: str,
    old_id: int | None,
    config: EmulationConfig,
) -> int:
    """In the open transaction: the run row, ranks, groups and tracks; returns the run id."""
    inputs = res.inputs
    if old_id is not None:
        drop_run(con, old_id)
    run_id = new_run(
        con,
        name=out_run,
        kind="emulated",
        parent_run_id=inputs.parent_run_id or inputs.run_id,
        world_size=inputs.world_size,
        source_format=inputs.source_format,
        config={
            "input_run": inputs.run,
            "input_kind": inputs.kind,
            "config": config.as_dict(),
            # variance=replica: what was estimated (rank effect spread, residual spread, ...)
            **(
                {"variance_fit": inputs.variance_fit.summary}
                if inputs.variance_fit is not None
                else {}
            ),
        },
    )
    # class_id: the rank whose events a rank shares (what-ifs may have expanded replicas);
    # args.what_if: why a rank is left out of the results (a removed GPU and its slot).
    ru = inputs.rank_unit.filter(pl.col("unit") >= 0)
    kept = _kept(res, config.keep_events)
    own = inputs.unit_rank[ru["unit"].to_numpy()].astype(np.int32)
    r_all = ru["rank"].to_numpy().astype(np.int32)
    if kept:  # a rank with events of its own is its own class exemplar
        k = np.array([r for r, _, _ in kept], dtype=np.int32)
        own = np.where(np.isin(r_all, k), r_all, own)
    owner = pl.DataFrame({"rank": r_all, "owner": own}).join(
        pl.DataFrame(
            {"rank": list(inputs.left_out), "why": list(inputs.left_out.values())},
            schema={"rank": pl.Int32, "why": pl.Utf8},
        ),
        on="rank",
        how="left",
    )
    con.register("_emu_owner", owner.to_arrow())
    try:
        con.execute(
            "INSERT INTO rank (run_id, rank, backend, hostname, pid, device, class_id,"
            " represented_by, tp, cp, ep, dp, pp, et_ops, et_ops_linked, args)"
            " SELECT $1, r.rank, backend, hostname, pid, device,"
            " CASE WHEN r.class_id IS NULL THEN NULL ELSE coalesce(o.owner, r.class_id) END,"
            " coalesce(represented_by, r.rank), tp, cp, ep, dp, pp, et_ops, et_ops_linked,"
            " CASE WHEN o.why IS NULL THEN args ELSE json_merge_patch(coalesce(args, '{}'),"
            " json_object('what_if', o.why)) END"
            " FROM rank r LEFT JOIN _emu_owner o ON o.rank = r.rank WHERE r.run_id = $2",
            [run_id, inputs.run_id],
        )
    finally:
        con.unregister("_emu_owner")
    con.execute(
        "INSERT INTO comm_group (run_id, group_id, name, description, backend, size, ranks,"
        " axis) SELECT $1, group_id, name, description, backend, size, ranks, axis"
        " FROM comm_group WHERE run_id = $2",
        [run_id, inputs.run_id],
    )
    units = pl.DataFrame(
        {
            "rank": np.concatenate([inputs.unit_rank, [r for r, _, _ in kept]]).astype(np.int64),
            "source_rank": np.concatenate(
                [inputs.unit_source, [inputs.unit_source[u] for _, u, _ in kept]]
            ).astype(np.int64),
        }
    )
    con.register("_emu_units", units.to_arrow())
    try:
        con.execute(
            "INSERT INTO track (run_id, rank, track_id, kind, pid, tid, name)"
            " SELECT $1, u.rank, t.track_id, t.kind, t.pid, t.tid, t.name"
            " FROM track t JOIN _emu_units u ON t.rank = u.source_rank WHERE t.run_id = $2",
            [run_id, inputs.source_run_id],
        )
    finally:
        con.unregister("_emu_units")
    return run_id

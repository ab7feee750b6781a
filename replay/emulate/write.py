"""Emulation, writing: the emulated run in one transaction, the events on a worker thread."""

from __future__ import annotations

import contextlib
import dataclasses
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
    _memory_rows,
    _rank_step_rows,
)
from prism_trace.replay.emulate.load import _fetch
from prism_trace.replay.emulate.run import _Result

from prism_trace.store.write import append, drop_run, new_run

if TYPE_CHECKING:
    import duckdb

    from prism_trace.store.connection import Store


@dataclass
class _Writing:
    """An emulated run being written (see ``_writing``)."""

    con: duckdb.DuckDBPyConnection
    reader: Store  # the store on a second connection: for reads while the events go in
    res: _Result
    run_id: int
    g_size: dict[int, int]
    pending: list[Future[int]]  # inserts on the worker thread, in order (events first)
    worker: ThreadPoolExecutor
    n_events: int = 0
    n_rank_step: int = 0
    rank_step_s: float = 0.0  # working out and inserting the rank_step rows

    def memory(self) -> None:
        """Queue the memory rows (``res.memory``, once worked out) behind the events."""
        rows = _memory_rows(self.res, self.run_id)
        self.pending.append(self.worker.submit(append, self.con, "memory", rows))

    def finish(self, iters: pl.DataFrame) -> int:
        """Wait for the queued inserts, write the iterations and the communication rows.

        Returns:
            The number of iteration rows.
        """
        self.n_events = self.pending[0].result()
        for f in self.pending[1:]:
            f.result()
        n_iter = append(
            self.con, "iteration", iters.with_columns(run_id=pl.lit(self.run_id, pl.Int32))
        )
        coll, p2p = _comm_frames(self.res, self.run_id, self.g_size)
        append(self.con, "collective", coll)
        append(self.con, "p2p", p2p)
        t = time.perf_counter()
        self.n_rank_step = append(self.con, "rank_step", _rank_step_rows(self.res, self.run_id))
        self.rank_step_s = time.perf_counter() - t
        return n_iter


@contextlib.contextmanager
def _writing(
    store: Store,
    res: _Result,
    *,
    out_run: str,
    old_id: int | None,
    config: EmulationConfig,
) -> Iterator[_Writing]:
    """Write the emulated run in one transaction, the events while the caller works on.

    Opens the transaction, writes the run, its ranks, groups and tracks, and starts inserting the
    events (every node of every unit: the bulk of the write) on a worker thread. DuckDB inserts
    them on one core without the GIL, so the caller's work meanwhile (the memory and iterations,
    reading through ``reader``, a second connection) overlaps. The caller queues the memory rows
    (``_Writing.memory``) and ends with ``_Writing.finish``; the block commits on exit, or rolls
    everything back (after stopping the worker's insert) on an error.
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
                reader=dataclasses.replace(store, con=cursor),
                res=res,
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
    res: _Result,
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
        config={"input_run": inputs.run, "input_kind": inputs.kind, "config": config.as_dict()},
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

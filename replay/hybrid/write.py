"""Hybrid replay, writing: a ``replayed`` run's header (run row, ranks, groups) and its frames."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import polars as pl
from prism_trace.replay.hybrid.options import RankReplay

from prism_trace.store.write import append, drop_run, new_run

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["write_replayed_header"]


_COMM_FROM_CALL = {
    "group_id": "coalesce(f.call_group_id, c.group_id)",
    "seq": "coalesce(f.call_seq, c.seq)",
    "msg_bytes": "coalesce(f.call_bytes, c.msg_bytes)",
    "group_size": "coalesce(f.call_size, c.group_size)",
    "peer": "coalesce(f.call_peer, c.peer)",
    "bytes": "coalesce(f.call_bytes, c.bytes)",
}
"""Columns of a replayed call taken from the run's emulated call (``PeerCall``) where it has
them: a sliced run's groups, sequence numbers, peers and rescaled sizes."""


def write_replayed_header(
    con: Any,
    *,
    old_id: int | None,
    out_run: str,
    input_run_id: int,
    config: dict[str, Any],
    ranks: list[int],
    device: str | None = None,
    backend: str | None = None,
) -> int:
    """Inside an open transaction: drop the run being replaced, then write a ``replayed`` run's
    ``run`` row (parent ``input_run_id``), its ranks (copied, ``represented_by`` kept; ``device``
    and ``backend`` replaced when given) and the input run's communicators. Shared by
    ``prism replay`` and ``prism run --out-run`` (``replay.pg.launched_run``).

    Returns:
        The new run's id.
    """
    if old_id is not None:
        drop_run(con, old_id)
    ((world_size, source_format),) = con.execute(
        "SELECT world_size, source_format FROM run WHERE run_id = ?", [input_run_id]
    ).fetchall()
    run_id = new_run(
        con,
        name=out_run,
        kind="replayed",
        parent_run_id=input_run_id,
        world_size=int(world_size),
        source_format=source_format,
        config=config,
    )
    con.execute(
        "INSERT INTO rank (run_id, rank, backend, hostname, pid, device, class_id,"
        " represented_by, tp, cp, ep, dp, pp, et_ops, et_ops_linked, args)"
        " SELECT $1, rank, coalesce($5, backend), hostname, pid, coalesce($3, device), class_id,"
        " coalesce(represented_by, rank), tp, cp, ep, dp, pp, et_ops, et_ops_linked, args"
        " FROM rank WHERE run_id = $2 AND list_contains($4, rank)",
        [run_id, input_run_id, device, ranks, backend],
    )
    con.execute(
        "INSERT INTO comm_group (run_id, group_id, name, description, backend, size, ranks,"
        " axis) SELECT $1, group_id, name, description, backend, size, ranks, axis"
        " FROM comm_group WHERE run_id = $2",
        [run_id, input_run_id],
    )
    return run_id


def _write(
    store: Store,
    *,
    input_run_id: int,
    source_run_id: int,
    out_run: str,
    old_id: int | None,
    results: list[RankReplay],
    config: dict[str, Any],
    device_name: str,
) -> int:
    """Write the replayed run: header, tracks, events, iterations, memory and communication rows.

    In ``store.transaction()``: the command's when it has one (``replay_run`` writes everything
    in one, the graph its emulation may build included), else one of its own.

    Returns:
        The new run's id.
    """
    with store.transaction() as con:
        run_id = write_replayed_header(
            con,
            old_id=old_id,
            out_run=out_run,
            input_run_id=input_run_id,
            config=config,
            ranks=[r.rank for r in results],
            device=device_name,
        )
        for r in results:
            con.execute(
                "INSERT INTO track (run_id, rank, track_id, kind, pid, tid, name)"
                " SELECT $1, $2, track_id, kind, pid, tid, name FROM track"
                " WHERE run_id = $3 AND rank = $4",
                [run_id, r.rank, source_run_id, r.source_rank],
            )
            f = r.frames
            lit = pl.lit(run_id, pl.Int32).alias("run_id")
            append(con, "event", f["event"].with_columns(lit))
            append(con, "iteration", f["iteration"].with_columns(lit))
            if not f["memory"].is_empty():
                append(con, "memory", f["memory"].with_columns(lit))
            if not f["comm"].is_empty():
                con.register("_replay_comm", f["comm"].to_arrow())
                try:
                    for table, cols in (
                        (
                            "collective",
                            "group_id, seq, kind, dtype, in_bytes, out_bytes, msg_bytes,"
                            " group_size, iteration",
                        ),
                        (
                            "p2p",
                            "group_id, seq, direction, peer, bytes, tag, dtype, iteration",
                        ),
                    ):
                        sel = ", ".join(
                            _COMM_FROM_CALL.get(c.strip(), f"c.{c.strip()}")
                            for c in cols.split(",")
                        )
                        con.execute(
                            f"INSERT INTO {table} (run_id, rank, event_id, host_ts, host_dur,"
                            f" {cols}) SELECT $1, $2, f.new_event_id, f.host_ts, f.host_dur, {sel}"
                            f" FROM {table} c JOIN _replay_comm f ON c.event_id = f.src_event_id"
                            " WHERE c.run_id = $3 AND c.rank = $4",
                            [run_id, r.rank, source_run_id, r.source_rank],
                        )
                finally:
                    con.unregister("_replay_comm")
    return run_id

"""What `prism run` measured, stored as a ``replayed`` run so that `prism validate` compares it.

`prism run --world N --ranks 0 --db DB --run RUN --out-run NAME -- python train.py` runs the
unmodified script as some ranks of ``RUN``'s world (``replay.pg.launch``). Each rank's `prism`
backend marks the script's steps (``torch.profiler``'s ``step()``, else the end of an optimizer
step; ``replay.pg.backend``) on ``time.perf_counter_ns``, one clock for every process of the
machine, and reports them. This module writes them as a run of kind ``replayed`` whose parent is
``RUN``:

- ``run``: ``kind = 'replayed'``, ``config_json = {input_run, source: "prism run", command,
  world_size, ranks, per_rank}``;
- ``rank``: the ranks that ran, copied from ``RUN`` (``backend = 'prism'``, ``represented_by``
  kept, so a sliced run's rank is compared with the recorded rank it stands for);
- ``comm_group``: copied from ``RUN``;
- ``iteration``: one per rank and complete step (a step between two marks), ``ProfilerStep#<n>``.

Step ``n`` is the script's own step ``n``: with a profiling script, the span of its
``ProfilerStep#n``, the recorded iteration ``n`` of a Kineto recording. The rows are laid on the
recording's clock: the earliest measured start of the first step that was both measured and
recorded, on the earliest recorded start of that step among the same ranks. Ops, communication
calls and memory are not in this run (the backend sees calls, not ops; memory would need the
script's allocator); a script that profiles itself writes its own traces, ingest them for those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import polars as pl
from prism_trace.replay.hybrid.write import write_replayed_header

from prism_trace.errors import ProcessFailedError, RunStateError
from prism_trace.store.write import append, claim_run_name

if TYPE_CHECKING:
    from collections.abc import Sequence

    from prism_trace.replay.pg.launch import LaunchResult

    from prism_trace.store.connection import Store

__all__ = ["write_launched_run"]


def _steps(result: LaunchResult) -> pl.DataFrame:
    rows = [
        (r.rank, int(step), int(span[0]), int(span[1]) - int(span[0]))
        for r in result.ranks
        for step, span in ((r.report or {}).get("step_ns") or {}).items()
    ]
    return pl.DataFrame(
        rows,
        schema={"rank": pl.Int32, "iteration": pl.Int32, "ts": pl.Int64, "dur": pl.Int64},
        orient="row",
    )


def write_launched_run(
    store: Store,
    *,
    run: str,
    out_run: str,
    result: LaunchResult,
    command: Sequence[str],
    replace: bool = False,
) -> int:
    """Store the step times of a finished `prism run` as the replayed run ``out_run``.

    Args:
        store: an open, writable store holding ``run``.
        run: the run whose timing the virtual peers followed (``--run``).
        out_run: the name of the new run.
        result: what ``replay.pg.launch.launch`` returned.
        command: the command that ran (kept in ``config_json``).
        replace: overwrite an existing replayed run of that name.

    Returns:
        The new run's id.

    Raises:
        PrismError: a rank failed, no rank marked two consecutive steps, or ``out_run`` exists
            (without ``replace``) or is another kind of run.
    """
    if result.returncode != 0:
        msg = f"prism run: rank {result.failed_rank} failed; nothing written to {out_run!r}"
        raise ProcessFailedError(msg)
    steps = _steps(result)
    if steps.is_empty():
        msg = (
            f"prism run: no complete step was measured, so {out_run!r} would be empty (steps are"
            " marked by torch.profiler's step() or an optimizer step)"
        )
        raise RunStateError(msg)
    # One transaction from the name's claim to the last row: what is checked is what is written,
    # and a refusal anywhere leaves the store as it was.
    with store.transaction() as con:
        old_id = claim_run_name(store, out_run, replace=replace, over=("replayed",))
        input_id = store.require_run(run)
        ranks = [r.rank for r in result.ranks]
        recorded = _recorded_starts(store, input_id, ranks)
        # Anchor: the first step both measured and recorded (a warm-up step may be unrecorded).
        common = set(steps["iteration"].to_list()) & set(recorded["iteration"].to_list())
        first = min(common) if common else int(steps["iteration"].min())  # type: ignore[arg-type]
        rec_first = recorded.filter(pl.col("iteration") == first)["ts"]
        measured_first = steps.filter(pl.col("iteration") == first)["ts"].min()
        origin = (int(rec_first.min()) if rec_first.len() else 0) - int(measured_first)  # type: ignore[arg-type]
        iters = steps.with_columns(
            (pl.col("ts") + origin).alias("ts"),
            pl.format("ProfilerStep#{}", pl.col("iteration")).alias("name"),
        )
        config: dict[str, Any] = {
            "input_run": run,
            "source": "prism run",
            "command": list(command),
            "world_size": result.world_size,
            "ranks": ranks,
            "per_rank": [
                {k: v for k, v in (r.report or {}).items() if k not in ("calls", "log")}
                | {"rank": r.rank, "returncode": r.returncode}
                for r in result.ranks
            ],
        }
        run_id = write_replayed_header(
            con,
            old_id=old_id,
            out_run=out_run,
            input_run_id=input_id,
            config=config,
            ranks=ranks,
            backend="prism",
        )
        append(con, "iteration", iters.with_columns(pl.lit(run_id, pl.Int32).alias("run_id")))
    return run_id


def _recorded_starts(store: Store, run_id: int, ranks: list[int]) -> pl.DataFrame:
    """Recorded iteration starts of the ranks (of the recorded ranks they stand for, when ``run``
    is sliced and has no iterations of its own)."""
    sql = (
        "WITH m AS (SELECT rank, coalesce(represented_by, rank) AS src FROM rank"
        " WHERE run_id = $1 AND list_contains($2, rank)),"
        " src_run AS (SELECT CASE WHEN kind = 'sliced' THEN parent_run_id ELSE run_id END AS id"
        " FROM run WHERE run_id = $1)"
        " SELECT i.iteration, i.ts FROM iteration i JOIN m ON i.rank = m.src"
        " WHERE i.run_id = (SELECT id FROM src_run)"
    )
    return store.con.sql(sql, params=[run_id, ranks]).pl()

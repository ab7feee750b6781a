"""The emulator's I/O shell: a run's graph in the store → the stages → an emulated run.

``emulate_run`` passes one immutable value from stage to stage (``values``): ``load.load_run``
reads the execution graph of a recorded or sliced run, ``prepare.prepare`` applies the what-ifs,
``run.run_emulation`` resolves its communication instances (collectives by ``(group, seq)``, sends
with their receives), times each instance's transfer from the recording (``replay.timing``) and
runs the core once per *unit* (a recorded rank, or a class exemplar of a sliced run), and
``write.write_run`` writes a run of kind ``emulated`` in the same schema: ``rank`` (every rank of
the world, with ``class_id``), ``comm_group``, ``track``, ``event``, ``collective``/``p2p`` and
``memory`` (units only; memory re-timed by ``replay.memory``), ``iteration`` (every rank). The
whole command is one transaction. See docs/emulator.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import duckdb
import polars as pl
from prism_trace.replay.emulate.config import EmulationConfig, EmulationReport
from prism_trace.replay.emulate.frames import all_iterations, recorded_iterations
from prism_trace.replay.emulate.load import _run_layout, load_run
from prism_trace.replay.emulate.prepare import check_rank_targets, prepare
from prism_trace.replay.emulate.run import run_emulation
from prism_trace.replay.emulate.run_memory import with_memory
from prism_trace.replay.emulate.values import EmulationResult, PreparedRun, WrittenRun
from prism_trace.replay.emulate.write import write_run
from prism_trace.replay.memory.retime import memory_peaks
from prism_trace.replay.whatif.config import WhatIfError

from prism_trace.errors import UsageError
from prism_trace.store.write import claim_run_name, drop_run

if TYPE_CHECKING:
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.store.connection import Store

__all__ = [
    "emulate_in_memory",
    "emulate_run",
    "temporary_slice",
]


def _iteration_summary(iters: pl.DataFrame) -> list[dict[str, Any]]:
    """Mean and max duration of each iteration over the ranks, for the report."""
    if iters.is_empty():
        return []
    s = (
        iters.group_by("iteration")
        .agg(
            pl.col("dur").mean().alias("mean_ns"),
            pl.col("dur").max().alias("max_ns"),
            pl.len().alias("ranks"),
        )
        .sort("iteration")
    )
    return [
        {
            "iteration": int(r["iteration"]),
            "mean_ns": float(r["mean_ns"]),
            "max_ns": int(r["max_ns"]),
            "ranks": int(r["ranks"]),
        }
        for r in s.iter_rows(named=True)
    ]


def emulate_in_memory(
    store: Store, *, run: str, config: EmulationConfig | None = None
) -> tuple[EmulationResult, pl.DataFrame]:
    """Emulate ``run`` without writing: the result and every rank's iterations.

    In one transaction (the caller's, when it has one): a graph built for a recorded run
    without one is kept only when the emulation succeeds, and the dp what-if's re-slice never
    reaches the file.

    Args:
        store: an open store (writable if a recorded run has no graph yet).
        run: a recorded or sliced run.
        config: the emulation config (default ``EmulationConfig()``).

    Returns:
        The result, with its memory, and the ``iteration`` rows (``rank, iteration, ts, dur,
        name``).
    """
    config = config or EmulationConfig()
    with store.transaction(), _dp_what_if(store, run, config) as target:
        prepared = _load_and_prepare(store, target, config, input_run=run)
        res = with_memory(store, run_emulation(store, prepared, config), config)
        return res, all_iterations(res, recorded_iterations(store, prepared))


def _load_and_prepare(
    store: Store, run: str, config: EmulationConfig, *, input_run: str
) -> PreparedRun:
    """The load and prepare stages; ``run`` may be the temporary re-slice of ``input_run``.

    The ranks the config names are checked against the run's world first, so a refused config
    builds no graph for a recorded run without one (the transaction would undo it, but a large
    run's graph takes a while to build).
    """
    if run == input_run:
        ((world,),) = store.con.execute(
            "SELECT world_size FROM run WHERE run_id = ?", [store.require_run(run)]
        ).fetchall()
        config.check_world(world, input_run)
        check_rank_targets(config, world, input_run)
    loaded = load_run(store, run)
    if run == input_run:
        return prepare(store, loaded, config)
    # the dp what-if: report against the run the user named
    loaded = dataclasses.replace(loaded, run=input_run)
    config.check_world(loaded.world_size, input_run)  # the re-slice's world
    return prepare(store, loaded, config, parent_run_id=store.require_run(input_run))


@contextlib.contextmanager
def _dp_what_if(store: Store, run: str, config: EmulationConfig) -> Iterator[str]:
    """The run to emulate: ``run`` itself, or, for the ``dp`` what-if, a temporary re-slice.

    A recorded run is sliced to its inferred layout with the new dp; a sliced run is re-sliced
    from its parent with the same representatives. The temporary run is deleted afterwards.
    """
    dp = config.what_if.dp
    if dp is None:
        yield run
        return
    from prism_trace.layout.choice import infer_layout

    run_id = store.require_run(run)
    line = store.run_ancestry(run_id)
    kind = line[0].kind
    from_ranks: list[int] | None = None
    batch: dict[str, Any] = {}
    if kind == "sliced":
        layout = _run_layout(store, run_id)
        source = line[1].name
        batch = _batch_options(store, run_id)
        from_ranks = sorted(
            int(r)
            for (r,) in store.con.execute(
                "SELECT DISTINCT represented_by FROM rank WHERE run_id = ?", [run_id]
            ).fetchall()
        )
    elif kind == "recorded":
        layout, source = infer_layout(store, run), run
    else:
        msg = f"{store.path}: run {run!r} is {kind}; the dp what-if needs a recorded or sliced run"
        raise WhatIfError(msg)
    if layout is None:
        msg = f"{store.path}: run {run!r} has no layout to change dp in"
        raise WhatIfError(msg)
    if config.what_if.global_batch is not None:  # asked: overrides a sliced run's own choice
        batch = {"global_batch": config.what_if.global_batch}
    target = dataclasses.replace(layout, dp=dp)
    _check_dp_world(run, layout.world_size // layout.dp, dp)
    with temporary_slice(
        store,
        run=source,
        layout=target,
        from_ranks=from_ranks,
        name=f"_what_if_dp{dp}_{run}",
        **batch,
    ) as tmp:
        yield tmp


def _batch_options(store: Store, run_id: int) -> dict[str, Any]:
    """The global-batch options a sliced run was made with (``prism slice --global-batch``,
    ``--microbatches``), for its re-slice: a fixed global batch stays fixed at the new dp."""
    ((config,),) = store.con.execute(
        "SELECT config_json FROM run WHERE run_id = ?", [run_id]
    ).fetchall()
    cfg = json.loads(config or "{}")
    mode = cfg.get("global_batch", "per-rank")
    if mode == "explicit":
        return {"microbatches": int(cfg["microbatches"]["target"])}
    return {"global_batch": mode} if mode == "fixed" else {}


def _check_dp_world(run: str, per_replica: int, dp: int) -> None:
    """Refuse a dp what-if whose world passes ``MAX_RANKS``, before the re-slice allocates it
    (``dp=99999999`` on a 16-rank slice grew to 24 GB before it was killed).

    Raises:
        WhatIfError: ``per_replica * dp > MAX_RANKS``.
    """
    from prism_trace.limits import MAX_RANKS

    if per_replica * dp > MAX_RANKS:
        msg = (
            f"what-if dp={dp}: run {run!r} has {per_replica} ranks per replica, so the world"
            f" would be {per_replica * dp} ranks, past the limit of {MAX_RANKS}"
        )
        raise WhatIfError(msg)


@contextlib.contextmanager
def temporary_slice(
    store: Store,
    *,
    run: str,
    layout: ParallelLayout,
    from_ranks: list[int] | None,
    name: str,
    global_batch: str = "per-rank",
    microbatches: int | None = None,
) -> Iterator[str]:
    """Slice ``run`` to ``layout`` as run ``name`` for the duration of the block, then delete it
    (also on error): the dp what-if and the validation's slice check leave nothing behind.
    ``global_batch`` and ``microbatches`` are ``slice_run``'s.

    The block is one transaction (the caller's, when it has one) and the slice is deleted before
    it ends, so the slice is never committed: a command that fails leaves no trace of it, one that
    succeeds commits its own writes without it.
    """
    from prism_trace.slicing.slicer import slice_run

    with store.transaction():
        slice_run(
            store,
            run=run,
            layout=layout,
            world=layout.world_size,
            from_ranks=from_ranks,
            out_run=name,
            replace=True,
            global_batch=global_batch,
            microbatches=microbatches,
        )
        try:
            yield name
        except BaseException:
            # A failed statement aborts a DuckDB transaction: the drop then fails too, and the
            # rollback the error is on its way to removes the slice instead.
            with contextlib.suppress(duckdb.Error):
                _drop_run_named(store, name)
            raise
        _drop_run_named(store, name)


def _drop_run_named(store: Store, name: str) -> None:
    """Delete run ``name`` (if it exists) inside the open transaction."""
    run_id = store.run_id(name)
    if run_id is not None:
        drop_run(store.con, run_id)


def emulate_run(
    store: Store,
    *,
    run: str,
    out_run: str,
    replace: bool = False,
    config: EmulationConfig | None = None,
) -> EmulationReport:
    """Emulate a recorded or sliced run and store the result as a run of kind ``emulated``.

    Every unit (recorded rank, or class exemplar of a sliced run) executes its graph in
    dependency order with recorded durations; collectives complete when every participant has
    arrived plus the instance's transfer time, sends/receives when both sides have. See
    docs/emulator.md.

    The stages (``load_run``, ``prepare``, ``run_emulation``, ``write_run``) pass one immutable
    value each to the next, and run in one transaction: the graph a recorded run gets, the dp
    what-if's temporary re-slice (deleted before the commit) and the emulated run commit
    together, or a refusal at any stage leaves the store as it was.

    Args:
        store: an open, writable store.
        run: the recorded or sliced run (a recorded run without a graph gets one first).
        out_run: name of the new run.
        replace: overwrite an existing emulated run of that name.
        config: the emulation config (default ``EmulationConfig()``), stored in
            ``run.config_json``.

    Returns:
        What was emulated and written.

    Raises:
        MissingParticipantError: a collective or send/recv that some participant never issues.
        DeadlockError: the graph cannot make progress (communication out of order).
        DuplicateRunError: ``out_run`` exists and ``replace`` is false.
        PrismError: no such run, a run without a graph, or ``out_run`` names a non-emulated run.
    """
    t0 = time.perf_counter()
    config = config or EmulationConfig()
    if out_run == run:
        msg = f"{store.path}: --out-run {out_run!r} is the input run itself; choose a new name"
        raise UsageError(msg)
    with store.transaction():
        old_id = claim_run_name(store, out_run, replace=replace, over=("emulated",))
        with _dp_what_if(store, run, config) as target:
            prepared = _load_and_prepare(store, target, config, input_run=run)
            t_load = time.perf_counter() - t0
            res = run_emulation(store, prepared, config)
            t1 = time.perf_counter()
            written = write_run(store, res, out_run=out_run, old_id=old_id, config=config)
    t_write = time.perf_counter() - t1  # with the commit, as when the write committed alone
    seconds = {
        "load": t_load,
        "emulate": res.seconds,
        "prepare_and_emulate": t1 - t0 - t_load,
        "write": t_write,  # with the memory and iterations, worked out while events go in
        "rank_step": written.rank_step_s,  # of which the rank_step rows
        "total": time.perf_counter() - t0,
    }
    return _report(written, input_run=run, out_run=out_run, seconds=seconds)


def _report(
    written: WrittenRun, *, input_run: str, out_run: str, seconds: dict[str, float]
) -> EmulationReport:
    """What ``emulate_run`` did, from the write stage's value."""
    res = written.result
    inputs = res.inputs
    members = inputs.rank_unit.filter(pl.col("unit") >= 0).group_by("unit").len()
    per_unit_nodes = inputs.nodes.group_by("unit").len().rename({"len": "nodes"})
    represented = int(
        per_unit_nodes.join(members, on="unit", how="left")
        .select((pl.col("nodes") * pl.col("len").fill_null(1)).sum())
        .item()
    )
    return EmulationReport(
        run=out_run,
        run_id=written.run_id,
        input_run=input_run,
        input_run_id=inputs.parent_run_id or inputs.run_id,
        input_kind=inputs.kind,
        world_size=inputs.world_size,
        units=int(inputs.unit_rank.size),
        nodes=inputs.nodes.height,
        edges=inputs.edges.height,
        collective_instances=res.n_collective,
        p2p_instances=res.n_p2p,
        rounds=res.timeline.rounds,
        events_written=written.n_events,
        iteration_rows=written.iterations.height,
        rank_step_rows=written.n_rank_step,
        represented_events=represented,
        seconds=seconds,
        iterations=_iteration_summary(written.iterations),
        peak_memory={
            int(inputs.unit_rank[u]): int(p)
            for u, p in memory_peaks(res.memory, by="unit").iter_rows()
        }
        if res.memory is not None
        else {},
        notes=list(inputs.notes),
    )

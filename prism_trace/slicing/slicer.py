"""Slicing: a recorded run of a few ranks → the full-scale graph of a larger data-parallel world.

``slice_run`` is the store shell: it reads the recording, plans the slice (``plan``), writes the
new run (``write``) and reports it (``report``), all in one transaction. A sliced run stores one
graph per equivalence class of target ranks, never one per rank. See docs/slicing.md for the
rules, with formulas.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from prism_trace.errors import PrismError
from prism_trace.graph.build import build_graph
from prism_trace.layout.assign import write_axes
from prism_trace.layout.choice import infer_layout
from prism_trace.layout.mesh import EMBD, WORLD, ParallelAxis, ParallelLayout, parse_axes
from prism_trace.layout.roles import described_axis, group_axis
from prism_trace.limits import MAX_RANKS
from prism_trace.slicing.batch import plan_batch
from prism_trace.slicing.members import rewrite_member_ops
from prism_trace.slicing.plan import (
    SliceError,
    check_layouts,
    map_comm_ops,
    plan_classes,
    target_groups,
)
from prism_trace.slicing.report import SliceReport
from prism_trace.slicing.write import count_rows, write_graph, write_groups, write_ranks
from prism_trace.store.write import claim_run_name, drop_run, new_run

if TYPE_CHECKING:
    import duckdb

    from prism_trace.store.connection import Store

__all__ = ["slice_run"]


def slice_run(
    store: Store,
    *,
    run: str,
    layout: ParallelLayout,
    world: int,
    from_ranks: list[int] | None = None,
    out_run: str,
    replace: bool = False,
    global_batch: str = "per-rank",
    microbatches: int | None = None,
) -> SliceReport:
    """Build the full-scale graph of ``run`` under ``layout`` as a new run of kind ``sliced``.

    Only data parallelism may differ from the recording. Target ranks are grouped into one
    class per (pp, tp, cp, ep) role; each class replays the graph of one recorded rank of that
    role, written once under the class's exemplar (its lowest target rank). Communicators are
    rebuilt at target scale for every axis the recorded groups use, comm nodes point at the
    exemplar's group of the same axis, and p2p peers at its neighbour in the target layout.

    Args:
        store: an open, writable store.
        run: the recorded run to slice (its graph is built first if it has none).
        layout: the target layout.
        world: the target world size; must equal ``layout.world_size``.
        from_ranks: recorded ranks to take representatives from (default: all recorded ranks;
            of several of one role, dp coordinate 0 wins, then the lowest rank).
        out_run: name of the new run.
        replace: overwrite an existing run of that name.
        global_batch: ``per-rank`` (each rank keeps its recorded microbatches) or ``fixed``
            (the job keeps its recorded global batch: each rank runs
            ``m * dp_recorded / dp_target`` microbatches; ``batch``).
        microbatches: the target's microbatches per rank and step, outright (instead of
            ``global_batch='fixed'``).

    Returns:
        What was written.

    Raises:
        SliceError: world is outside ``[1, MAX_RANKS]`` or disagrees with the layout, an axis
            other than dp differs from the recording, a role has no representative, or an op's
            group or peer cannot be mapped (the message names the op, its group and rank), or
            the microbatches cannot be changed (a schedule not recognised, a count that is not
            whole).
        LayoutError: the recorded run's groups fit no layout.
        DuplicateRunError: ``out_run`` exists and ``replace`` is false.
    """
    t0 = time.perf_counter()
    if not 1 <= world <= MAX_RANKS:  # before anything is sized by it
        msg = f"--world {world} is outside [1, {MAX_RANKS}] (the world-size limit)"
        raise SliceError(msg)
    # One transaction for the whole command: building the recording's graph, its axes and the
    # new run commit together, or a refused slice leaves the store exactly as it was.
    with store.transaction() as con:
        rec_id = store.require_run(run)
        ((kind, source_format),) = con.execute(
            "SELECT kind, source_format FROM run WHERE run_id = ?", [rec_id]
        ).fetchall()
        if kind != "recorded":
            msg = f"{store.path}: run {run!r} is {kind}; only a recorded run can be sliced"
            raise SliceError(msg)
        if out_run == run:
            msg = (
                f"{store.path}: --out-run {out_run!r} is the recorded run itself; choose a new name"
            )
            raise SliceError(msg)
        old_id = claim_run_name(
            store, out_run, replace=replace, over=("sliced", "emulated", "replayed")
        )

        recorded = infer_layout(store, run)
        check_layouts(recorded, layout, world)
        recorded_ranks = np.array(
            [
                r[0]
                for r in con.execute(
                    "SELECT rank FROM rank WHERE run_id = ? ORDER BY rank", [rec_id]
                ).fetchall()
            ],
            dtype=np.int64,
        )
        classes = plan_classes(recorded, layout, recorded_ranks, from_ranks)
        dp_from_one = _check_dp_recorded(con, rec_id, recorded, layout)

        built = not count_rows(con, "graph_node", rec_id)
        if built:
            build_graph(store, run)
        rec_axes = write_axes(con, rec_id, recorded, run=run)
        rec_groups = {
            int(g): (name, desc, backend, list(ranks or []))
            for g, name, desc, backend, ranks in con.execute(
                "SELECT group_id, name, description, backend, ranks FROM comm_group"
                " WHERE run_id = ? ORDER BY group_id",
                [rec_id],
            ).fetchall()
        }
        # Axis values in order of first use by the recorded groups.
        axes_used = list(dict.fromkeys(rec_axes[g] for g in sorted(rec_axes)))
        tgt = target_groups(layout, axes_used)
        comm = con.sql(
            "SELECT rank, group_id, peer, kind, comm_kind, count(*)::BIGINT AS n,"
            " arg_min(node_id, node_id) AS node_id, arg_min(name, node_id) AS name,"
            " arg_min(event_id, node_id) AS event_id"
            " FROM graph_node WHERE run_id = $1 AND list_contains($2, rank)"
            " AND (group_id IS NOT NULL OR peer IS NOT NULL"
            " OR kind IN ('collective', 'send', 'recv'))"
            " GROUP BY ALL ORDER BY rank, node_id",
            params=[rec_id, [c.representative for c in classes]],
        ).pl()
        mapping = map_comm_ops(comm, classes, rec_groups, rec_axes, tgt, recorded, layout)
        batch, rewritten = plan_batch(
            con,
            rec_id,
            classes,
            recorded,
            layout,
            rec_axes,
            global_batch=global_batch,
            microbatches=microbatches,
        )

        # Ops run once per member of a list collective follow its group's target size.
        sizes = {
            gid: (len(ranks), int((tgt.members[rec_axes[gid]][0] >= 0).sum()))
            for gid, (_, _, _, ranks) in rec_groups.items()
            if gid in rec_axes and ranks and rec_axes[gid] in tgt.members
        }
        rewritten, member_runs = rewrite_member_ops(
            con,
            rec_id,
            sorted({c.representative for c in classes}),
            {g: s for g, s in sizes.items() if s[0] != s[1]},
            rewritten,
        )

        if old_id is not None:
            drop_run(con, old_id)
        config = {
            "parent_run": run,
            "layout": layout.spec,
            "order": layout.order_spec,
            "world": world,
            "from_ranks": from_ranks,
            "recorded_layout": recorded.spec,
            "recorded_order": recorded.order_spec,
            **batch.as_config(),
            **({"dp_from_one_member": True} if dp_from_one else {}),
        }
        run_id = new_run(
            con,
            name=out_run,
            kind="sliced",
            parent_run_id=rec_id,
            world_size=world,
            source_format=source_format,
            config=config,
        )
        write_ranks(con, run_id, rec_id, layout, classes)
        n_groups = write_groups(con, run_id, tgt, rec_axes, rec_groups)
        n_nodes, n_edges = write_graph(
            con, run_id, rec_id, classes, mapping.group_rows, mapping.peer_rows, rewritten
        )

    return SliceReport(
        run=out_run,
        run_id=run_id,
        parent_run=run,
        parent_run_id=rec_id,
        recorded_layout=recorded,
        layout=layout,
        world_size=world,
        classes=classes,
        groups=n_groups,
        nodes=n_nodes,
        edges=n_edges,
        rescaled=mapping.rescaled,
        other_ops=sorted(mapping.other_ops),
        built_graph=built,
        elapsed_s=time.perf_counter() - t0,
        microbatches=batch.as_config(),
        member_runs=member_runs,
        dp_from_one_member=dp_from_one,
    )


def _check_dp_recorded(
    con: duckdb.DuckDBPyConnection, rec_id: int, recorded: ParallelLayout, target: ParallelLayout
) -> bool:
    """Refuse a new dp when the recording holds no data-parallel communication to scale.

    A dp=1 recording (or one whose calls all stay inside a replica) says nothing about the
    gradient reductions of a larger dp: building them from another axis's groups would be wrong.
    A dp=1 recording whose all-reduces or reduce-scatters run on a one-member data-parallel group
    does hold them: a group its description names data-parallel (Megatron's and torchtitan's, the
    generator's ``--dp-sync-always``), or the default group of a one-rank job (DDP at world size
    1; a barrier or a broadcast alone is no gradient reduction). Those calls are the gradient
    reductions of every dp; their transfer at the target comes from the
    network model alone (a one-member call has none to scale), and the other replicas' speeds
    from nothing recorded.

    Returns:
        Whether the target's data-parallel calls grow from one-member groups (a report note).
    """
    if target.dp == recorded.dp:
        return False
    rows = con.execute(
        "SELECT g.name, g.description, g.ranks, EXISTS (SELECT 1 FROM collective c"
        " WHERE c.run_id = g.run_id AND c.group_id = g.group_id"
        " AND c.kind IN ('all_reduce', 'reduce_scatter')) FROM comm_group g WHERE g.run_id = ?"
        " AND g.ranks IS NOT NULL AND (EXISTS (SELECT 1 FROM collective c"
        " WHERE c.run_id = g.run_id AND c.group_id = g.group_id) OR EXISTS (SELECT 1 FROM p2p p"
        " WHERE p.run_id = g.run_id AND p.group_id = g.group_id) OR EXISTS (SELECT 1"
        " FROM graph_node n WHERE n.run_id = g.run_id AND n.group_id = g.group_id))",
        [rec_id],
    ).fetchall()
    spans_dp = one_member = False
    for name, desc, ranks, reduces in rows:
        try:
            value = group_axis(recorded, ranks, desc, name=name)
        except PrismError:
            continue
        if value == WORLD or (value != EMBD and ParallelAxis.DP in parse_axes(value)):
            spans_dp = spans_dp or recorded.dp > 1
            one = recorded.dp == 1 and reduces and len(ranks) == 1
            if one and _one_member_dp(recorded, value, desc):
                spans_dp = one_member = True
    if not spans_dp:
        need = (
            "its data-parallel calls must be matched across the replicas (see `prism graph`:"
            " calls left unmatched run alone)"
            if recorded.dp > 1
            else "record at least two data-parallel replicas, or one whose gradient reductions"
            " run on a one-member group described as data-parallel (or declare the recorded"
            " layout with `prism graph --layout`)"
        )
        msg = (
            f"axis `dp`: the recording (layout {recorded.spec}) has no matched data-parallel"
            f" communication, so dp={target.dp} cannot be built from it; {need}"
        )
        raise SliceError(msg)
    return one_member


def _one_member_dp(recorded: ParallelLayout, value: str, description: str | None) -> bool:
    """A dp=1 recording's group that is its data-parallel group: named so, or the world of one."""
    described = described_axis(description)
    if described is not None and described not in (WORLD, EMBD):
        return ParallelAxis.DP in parse_axes(described)
    return value == WORLD and recorded.world_size == 1

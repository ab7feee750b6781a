"""Slicing: a recorded run of a few ranks → the full-scale graph of a larger data-parallel world.

A sliced run stores one graph per equivalence class of target ranks, never one per rank: the
ranks of a class (all data-parallel replicas of one (pp, tp, cp, ep) role) replay the graph of
one recorded *representative*, stored once under the class's *exemplar* (its lowest target
rank). See docs/slicing.md for the rules, with formulas.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from prism_trace.errors import PrismError
from prism_trace.layout.parallel import (
    AXES,
    EMBD,
    WORLD,
    ParallelAxis,
    ParallelLayout,
    _write_axes,
    group_axis,
    infer_layout,
    parse_axes,
)
from prism_trace.limits import MAX_RANKS

if TYPE_CHECKING:
    import duckdb

    from prism_trace.store.connection import Store
from prism_trace.store.write import append, claim_run_name, drop_run, new_run

__all__ = ["RULES", "SliceClass", "SliceError", "SliceReport", "slice_run"]


class SliceError(PrismError, ValueError):
    """A run cannot be sliced to the asked layout.

    An axis other than dp differs, a role has no representative, or an op cannot be mapped to
    the target world.
    """


# Axes slicing must keep: only data parallelism (hence the world) may change.
_KEPT = (ParallelAxis.TP, ParallelAxis.CP, ParallelAxis.EP, ParallelAxis.PP)
_COMM_KINDS = ("collective", "send", "recv")

RULES: dict[str, str] = {
    "same_size": "group size unchanged (axis without dp, or dp unchanged): msg_bytes copied",
    "all_reduce": "all_reduce on a resized dp group: msg_bytes (the full buffer) unchanged",
    "reduce_scatter_all_gather": (
        "reduce_scatter / all_gather on a resized dp group: msg_bytes = full buffer unchanged;"
        " the per-rank shard is msg_bytes / n_target"
    ),
    "all_to_all": "all_to_all on a resized group: per-rank buffer (msg_bytes) unchanged",
    "p2p": "send / recv: msg_bytes unchanged, peer remapped",
    "other": "another collective kind on a resized group: msg_bytes unchanged (names listed)",
}
"""How each comm node's size was treated; the keys of ``SliceReport.rescaled``."""


def _ranges(first: int, count: int, step: int) -> str:
    if count == 1:
        return str(first)
    last = first + (count - 1) * step
    return f"{first}..{last}" + ("" if step == 1 else f" step {step}")


@dataclass(frozen=True)
class SliceClass:
    """One equivalence class: the target ranks that replay one recorded rank's graph."""

    exemplar: int
    representative: int
    count: int
    pp: int
    tp: int
    cp: int
    ep: int
    step: int
    """Rank distance between successive members (the dp stride)."""
    symmetric: bool = False
    """The representative has another TP/CP coordinate than the class (a symmetric peer)."""

    @property
    def ranks(self) -> str:
        """The members, compactly: ``first..last step s``."""
        return _ranges(self.exemplar, self.count, self.step)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "exemplar": self.exemplar,
            "representative": self.representative,
            "count": self.count,
            "pp": self.pp,
            "tp": self.tp,
            "cp": self.cp,
            "ep": self.ep,
            "ranks": self.ranks,
            "symmetric": self.symmetric,
        }


@dataclass
class SliceReport:
    """What ``slice_run`` wrote: enough for the CLI to print and for tests to assert."""

    run: str
    run_id: int
    parent_run: str
    parent_run_id: int
    recorded_layout: ParallelLayout
    layout: ParallelLayout
    world_size: int
    classes: list[SliceClass]
    groups: int
    nodes: int
    edges: int
    rescaled: dict[str, int] = field(default_factory=dict)
    other_ops: list[str] = field(default_factory=list)
    """Names of comm ops that fell under the ``other`` rule (kept unchanged)."""
    built_graph: bool = False
    elapsed_s: float = 0.0

    @property
    def mapping(self) -> dict[int, str]:
        """Recorded rank → the target ranks it represents, compactly (``; `` between classes)."""
        out: dict[int, list[str]] = {}
        for c in sorted(self.classes, key=lambda c: c.exemplar):
            out.setdefault(c.representative, []).append(c.ranks)
        return {k: "; ".join(v) for k, v in out.items()}

    @property
    def notes(self) -> list[str]:
        """Classes whose representative is a symmetric TP/CP peer, one line each."""
        return [
            f"rank {c.representative} stands in for tp={c.tp}, cp={c.cp} (pp={c.pp}, ep={c.ep}):"
            " no recorded rank has that coordinate; its TP/CP peers run the same program"
            for c in self.classes
            if c.symmetric
        ]

    def summary(self) -> str:
        """The mapping report as text: which recorded rank stands for which target ranks."""
        lines = [
            f"run {self.run!r} (sliced from {self.parent_run!r}): {self.world_size} ranks,"
            f" layout {self.layout.spec} (order {self.layout.order_spec}),"
            f" {len(self.classes)} classes, {self.groups} groups,"
            f" {self.nodes} nodes / {self.edges} edges stored, {self.elapsed_s:.2f} s",
            "recorded rank -> target ranks:",
        ]
        lines += [f"  {rep:>6} -> {ranks}" for rep, ranks in self.mapping.items()]
        lines += [f"  note: {n}" for n in self.notes]
        if self.rescaled:
            rules = ", ".join(f"{k} {v}" for k, v in sorted(self.rescaled.items()))
            lines.append(f"communication ops by size rule: {rules}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (for ``--json``)."""
        return {
            "run": self.run,
            "run_id": self.run_id,
            "parent_run": self.parent_run,
            "parent_run_id": self.parent_run_id,
            "recorded_layout": self.recorded_layout.spec,
            "recorded_order": self.recorded_layout.order_spec,
            "layout": self.layout.spec,
            "order": self.layout.order_spec,
            "world_size": self.world_size,
            "classes": [c.as_dict() for c in self.classes],
            "mapping": {str(k): v for k, v in self.mapping.items()},
            "notes": self.notes,
            "groups": self.groups,
            "nodes": self.nodes,
            "edges": self.edges,
            "rescaled": self.rescaled,
            "other_ops": self.other_ops,
            "built_graph": self.built_graph,
            "elapsed_s": round(self.elapsed_s, 3),
        }


# --- pure parts ---------------------------------------------------------------------------


def _check_layouts(recorded: ParallelLayout, target: ParallelLayout, world: int) -> None:
    if world != target.world_size:
        msg = (
            f"--world {world} does not match the layout {target.spec}, whose sizes multiply"
            f" to {target.world_size}"
        )
        raise SliceError(msg)
    for a in _KEPT:
        if recorded.size(a) != target.size(a):
            msg = (
                f"axis `{a}` differs: recorded {a}={recorded.size(a)}, target {a}={target.size(a)};"
                " slicing only changes dp (hence the world); changing"
                f" {a} is a what-if of the emulator, not slicing (recorded layout {recorded.spec})"
            )
            raise SliceError(msg)


def _check_dp_recorded(
    con: duckdb.DuckDBPyConnection, rec_id: int, recorded: ParallelLayout, target: ParallelLayout
) -> None:
    """Refuse a new dp when the recording holds no data-parallel communication to scale.

    A dp=1 recording (or one whose calls all stay inside a replica) says nothing about the
    gradient reductions of a larger dp: building them from another axis's groups would be wrong.
    """
    if target.dp == recorded.dp:
        return
    rows = con.execute(
        "SELECT g.name, g.description, g.ranks FROM comm_group g WHERE g.run_id = ?"
        " AND g.ranks IS NOT NULL AND (EXISTS (SELECT 1 FROM collective c"
        " WHERE c.run_id = g.run_id AND c.group_id = g.group_id) OR EXISTS (SELECT 1 FROM p2p p"
        " WHERE p.run_id = g.run_id AND p.group_id = g.group_id) OR EXISTS (SELECT 1"
        " FROM graph_node n WHERE n.run_id = g.run_id AND n.group_id = g.group_id))",
        [rec_id],
    ).fetchall()
    spans_dp = False
    for name, desc, ranks in rows:
        try:
            value = group_axis(recorded, ranks, desc, name=name)
        except PrismError:
            continue
        if value == WORLD or (value != EMBD and ParallelAxis.DP in parse_axes(value)):
            spans_dp = spans_dp or recorded.dp > 1
    if not spans_dp:
        need = (
            "its data-parallel calls must be matched across the replicas (see `prism graph`:"
            " calls left unmatched run alone)"
            if recorded.dp > 1
            else "record at least two data-parallel replicas (or declare the recorded layout"
            " with `prism graph --layout`)"
        )
        msg = (
            f"axis `dp`: the recording (layout {recorded.spec}) has no matched data-parallel"
            f" communication, so dp={target.dp} cannot be built from it; {need}"
        )
        raise SliceError(msg)


def _classes(
    recorded: ParallelLayout,
    target: ParallelLayout,
    recorded_ranks: np.ndarray,
    from_ranks: list[int] | None,
) -> list[SliceClass]:
    """One class per (pp, tp, cp, ep) role of the target, with its representative.

    The representative is a candidate of the same role, dp coordinate 0 preferred, then the
    lowest rank.
    """
    if from_ranks is not None:
        cand = np.asarray(sorted(set(from_ranks)), dtype=np.int64)
        unknown = sorted(set(cand.tolist()) - set(recorded_ranks.tolist()))
        if unknown:
            msg = (
                f"--from-ranks {unknown} are not recorded ranks of the run"
                f" (recorded: {_compact(recorded_ranks)})"
            )
            raise SliceError(msg)
    else:
        cand = np.sort(recorded_ranks)
    cc = recorded.coords(cand)
    # Sort key: role, then dp != 0, then rank → the first of each role is its representative.
    best: dict[tuple[int, ...], int] = {}
    order = np.lexsort((cand, cc[ParallelAxis.DP] != 0))
    # Of another TP/CP coordinate, by (ep, pp): TP and CP peers run one program (symmetry).
    peer: dict[tuple[int, int], int] = {}
    sym_order = np.lexsort(
        (cand, cc[ParallelAxis.DP] != 0, cc[ParallelAxis.CP], cc[ParallelAxis.TP])
    )
    for i in order:
        key = tuple(int(cc[a][i]) for a in _KEPT)
        best.setdefault(key, int(cand[i]))
    for i in sym_order:
        peer.setdefault((int(cc[ParallelAxis.EP][i]), int(cc[ParallelAxis.PP][i])), int(cand[i]))
    dp_groups = target.groups((ParallelAxis.DP,))
    exemplars = dp_groups[:, 0]
    ec = target.coords(exemplars)
    step = target.strides[ParallelAxis.DP]
    classes: list[SliceClass] = []
    missing: list[str] = []
    for i, ex in enumerate(exemplars):
        key = tuple(int(ec[a][i]) for a in _KEPT)
        role = dict(zip((a.value for a in _KEPT), key, strict=True))
        rep = best.get(key)
        symmetric = rep is None
        if rep is None:
            rep = peer.get((role["ep"], role["pp"]))
        if rep is None:
            missing.append(",".join(f"{a}={v}" for a, v in role.items()))
            continue
        classes.append(
            SliceClass(
                int(ex),
                rep,
                target.dp,
                role["pp"],
                role["tp"],
                role["cp"],
                role["ep"],
                step,
                symmetric=symmetric,
            )
        )
    if missing:
        where = "the recorded ranks" if from_ranks is None else f"--from-ranks {_compact(cand)}"
        msg = (
            f"no representative for the roles {'; '.join(missing)}"
            f" among {where}"
            f" (recorded layout {recorded})"
        )
        raise SliceError(msg)
    return classes


def _compact(ranks: np.ndarray | list[int]) -> str:
    values = sorted(int(r) for r in ranks)
    parts: list[str] = []
    start = prev = None
    for v in values:
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts) or "none"


def _rule(axis: str, kind: str, comm_kind: str | None, n_rec: int, n_tgt: int) -> str:
    if kind in ("send", "recv"):
        return "p2p"
    if n_rec == n_tgt:
        return "same_size"
    if comm_kind == "all_reduce":
        return "all_reduce"
    if comm_kind in ("reduce_scatter", "all_gather"):
        return "reduce_scatter_all_gather"
    if comm_kind == "all_to_all":
        return "all_to_all"
    return "other"


@dataclass(frozen=True)
class _TargetGroups:
    """The target run's communicators: for each axis value, a contiguous block of group ids."""

    base: dict[str, int]
    members: dict[str, np.ndarray]

    def group_id(self, layout: ParallelLayout, axis: str, rank: int) -> int:
        index = int(layout.group_index(axis, [rank])[0])
        return -1 if index < 0 else self.base[axis] + index


def _target_groups(target: ParallelLayout, axes: list[str]) -> _TargetGroups:
    base: dict[str, int] = {}
    members: dict[str, np.ndarray] = {}
    next_id = 0
    for axis in axes:
        groups = target.groups(axis)
        base[axis] = next_id
        members[axis] = groups
        next_id += groups.shape[0]
    return _TargetGroups(base, members)


# --- the store shell ------------------------------------------------------------------------


def _fetch(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> pl.DataFrame:
    return con.sql(sql, params=params).pl()


def _op_label(row: dict[str, Any]) -> str:
    return f"{row['kind']} {row['name']!r} (node {row['node_id']}, event {row['event_id']})"


def slice_run(
    store: Store,
    *,
    run: str,
    layout: ParallelLayout,
    world: int,
    from_ranks: list[int] | None = None,
    out_run: str,
    replace: bool = False,
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

    Returns:
        What was written.

    Raises:
        SliceError: world is outside ``[1, MAX_RANKS]`` or disagrees with the layout, an axis
            other than dp differs from the recording, a role has no representative, or an op's
            group or peer cannot be mapped (the message names the op, its group and rank).
        LayoutError: the recorded run's groups fit no layout.
        DuplicateRunError: ``out_run`` exists and ``replace`` is false.
    """
    t0 = time.perf_counter()
    if not 1 <= world <= MAX_RANKS:  # before anything is sized by it
        msg = f"--world {world} is outside [1, {MAX_RANKS}] (the world-size limit)"
        raise SliceError(msg)
    con = store.con
    rec_id = store.require_run(run)
    ((kind, source_format),) = con.execute(
        "SELECT kind, source_format FROM run WHERE run_id = ?", [rec_id]
    ).fetchall()
    if kind != "recorded":
        msg = f"{store.path}: run {run!r} is {kind}; only a recorded run can be sliced"
        raise SliceError(msg)
    if out_run == run:
        msg = f"{store.path}: --out-run {out_run!r} is the recorded run itself; choose a new name"
        raise SliceError(msg)
    old_id = claim_run_name(
        store, out_run, replace=replace, over=("sliced", "emulated", "replayed")
    )

    recorded = infer_layout(store, run)
    _check_layouts(recorded, layout, world)

    recorded_ranks = np.array(
        [
            r[0]
            for r in con.execute(
                "SELECT rank FROM rank WHERE run_id = ? ORDER BY rank", [rec_id]
            ).fetchall()
        ],
        dtype=np.int64,
    )
    classes = _classes(recorded, layout, recorded_ranks, from_ranks)
    _check_dp_recorded(con, rec_id, recorded, layout)
    reps = [c.representative for c in classes]

    # Built in its own transaction, before ours (DuckDB has no nested transactions); only after
    # every check that needs no graph, so that a refused slice leaves the store untouched.
    built = False
    if not _count(con, "graph_node", rec_id):
        from prism_trace.graph.build import build_graph

        build_graph(store, run)
        built = True

    with store.transaction() as con:
        rec_axes = _write_axes(con, rec_id, recorded, run=run)
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
        tgt = _target_groups(layout, axes_used)

        comm = _fetch(
            con,
            "SELECT rank, group_id, peer, kind, comm_kind, count(*)::BIGINT AS n,"
            " arg_min(node_id, node_id) AS node_id, arg_min(name, node_id) AS name,"
            " arg_min(event_id, node_id) AS event_id"
            " FROM graph_node WHERE run_id = $1 AND list_contains($2, rank)"
            " AND (group_id IS NOT NULL OR peer IS NOT NULL"
            " OR kind IN ('collective', 'send', 'recv'))"
            " GROUP BY ALL ORDER BY rank, node_id",
            [rec_id, reps],
        )
        by_rep: dict[int, list[SliceClass]] = {}
        for c in classes:
            by_rep.setdefault(c.representative, []).append(c)
        group_rows: dict[tuple[int, int], int] = {}
        peer_rows: dict[tuple[int, int], int] = {}
        rescaled = dict.fromkeys(RULES, 0)
        other_ops: set[str] = set()
        for row in comm.iter_rows(named=True):
            rep = int(row["rank"])
            # One representative may stand for several classes (symmetric TP/CP peers).
            for k, cls in enumerate(by_rep[rep]):
                first = k == 0
                where = f"{_op_label(row)} on recorded rank {rep}"
                gid = row["group_id"]
                axis = None
                n_rec = n_tgt = 1
                if gid is None:
                    if row["kind"] == "collective":
                        msg = f"{where}: a collective without a communicator cannot be sliced"
                        raise SliceError(msg)
                else:
                    gid = int(gid)
                    name, desc, _, members = rec_groups.get(gid, (None, None, None, []))
                    axis = rec_axes.get(gid)
                    if axis is None:
                        msg = (
                            f"{where}: group {gid} ({name!r}, description {desc!r}) has no axis"
                            " (no member list); it cannot be mapped to the target world"
                        )
                        raise SliceError(msg)
                    if rep not in members:
                        msg = f"{where}: rank {rep} is not a member of its group {name!r} {members}"
                        raise SliceError(msg)
                    new = tgt.group_id(layout, axis, cls.exemplar)
                    if new < 0:
                        ex = cls.exemplar
                        msg = f"{where}: exemplar {ex} is in no `{axis}` group of {layout}"
                        raise SliceError(msg)
                    group_rows[(cls.exemplar, gid)] = new
                    n_rec = len(members)
                    n_tgt = tgt.members[axis].shape[1]
                if row["peer"] is not None:
                    old_peer = int(row["peer"])
                    new_peer = _map_peer(recorded, layout, rep, cls.exemplar, old_peer, where)
                    if axis is not None:
                        at = group_rows[(cls.exemplar, gid)] - tgt.base[axis]
                        row_members = tgt.members[axis][at]
                        if new_peer not in row_members:
                            msg = (
                                f"{where}: peer {row['peer']} maps to {new_peer}, outside the"
                                f" exemplar's `{axis}` group {row_members.tolist()}"
                            )
                            raise SliceError(msg)
                    peer_rows[(cls.exemplar, int(row["peer"]))] = new_peer
                if row["kind"] in _COMM_KINDS and first:
                    rule = _rule(axis or "", row["kind"], row["comm_kind"], n_rec, n_tgt)
                    rescaled[rule] += int(row["n"])
                    if rule == "other":
                        other_ops.add(f"{row['comm_kind']} {row['name']!r} on `{axis}`")
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
        append(con, "rank", _rank_frame(con, run_id, rec_id, layout, classes))
        n_groups = _write_groups(con, run_id, tgt, rec_axes, rec_groups)
        n_nodes, n_edges = _write_graph(con, run_id, rec_id, classes, group_rows, peer_rows)

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
        rescaled=rescaled,
        other_ops=sorted(other_ops),
        built_graph=built,
        elapsed_s=time.perf_counter() - t0,
    )


def _map_peer(
    recorded: ParallelLayout, target: ParallelLayout, rep: int, exemplar: int, peer: int, where: str
) -> int:
    """The exemplar's counterpart of ``rep``'s peer.

    The same coordinate offset on every axis, taken modulo the target axis size (only dp can
    differ in size).
    """
    if not 0 <= peer < recorded.world_size:
        msg = (
            f"{where}: peer {peer} is outside the recorded world of"
            f" {recorded.world_size} ranks ({recorded})"
        )
        raise SliceError(msg)
    rc = recorded.coords([rep, peer])
    ec = target.coords([exemplar])
    new = {a: (int(ec[a][0]) + int(rc[a][1]) - int(rc[a][0])) % target.size(a) for a in AXES}
    return int(target.rank_of(new))


def _rank_frame(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    rec_id: int,
    layout: ParallelLayout,
    classes: list[SliceClass],
) -> pl.DataFrame:
    ranks = np.arange(layout.world_size, dtype=np.int64)
    coords = layout.coords(ranks)
    cls_index = layout.group_index((ParallelAxis.DP,), ranks)
    exemplar = np.array([c.exemplar for c in classes], dtype=np.int64)[cls_index]
    rep = np.array([c.representative for c in classes], dtype=np.int64)[cls_index]
    facts = _fetch(
        con,
        "SELECT rank AS represented_by, backend, device FROM rank WHERE run_id = $1",
        [rec_id],
    )
    frame = pl.DataFrame(
        {
            "run_id": np.full(ranks.size, run_id, dtype=np.int32),
            "rank": ranks.astype(np.int32),
            "class_id": exemplar.astype(np.int32),
            "represented_by": rep.astype(np.int32),
            **{a.value: coords[a].astype(np.int32) for a in AXES},
        }
    )
    return frame.join(facts.cast({"represented_by": pl.Int32}), on="represented_by", how="left")


def _write_groups(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    tgt: _TargetGroups,
    rec_axes: dict[int, str],
    rec_groups: dict[int, tuple[Any, ...]],
) -> int:
    frames = []
    for axis, base in tgt.base.items():
        members = tgt.members[axis]
        first = min(g for g, a in rec_axes.items() if a == axis)
        _, desc, backend, _ = rec_groups[first]
        n, size = members.shape
        frames.append(
            pl.DataFrame(
                {
                    "group_id": np.arange(base, base + n, dtype=np.int32),
                    "name": [f"{axis}:{i}" for i in range(n)],
                    "ranks": pl.Series(members.astype(np.int32)).cast(pl.List(pl.Int32)),
                }
            ).with_columns(
                run_id=pl.lit(run_id, pl.Int32),
                description=pl.lit(desc, pl.Utf8),
                backend=pl.lit(backend, pl.Utf8),
                size=pl.lit(size, pl.Int32),
                axis=pl.lit(axis, pl.Utf8),
            )
        )
    if not frames:
        return 0
    df = pl.concat(frames)
    append(con, "comm_group", df)
    return df.height


def _write_graph(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    rec_id: int,
    classes: list[SliceClass],
    group_rows: dict[tuple[int, int], int],
    peer_rows: dict[tuple[int, int], int],
) -> tuple[int, int]:
    """Copy each class's representative graph under its exemplar; ``group_rows`` and
    ``peer_rows`` map ``(exemplar, recorded group or peer)`` to the target's."""
    cls = pl.DataFrame(
        {
            "rep": [c.representative for c in classes],
            "exemplar": [c.exemplar for c in classes],
        },
        schema={"rep": pl.Int32, "exemplar": pl.Int32},
    )
    gmap = pl.DataFrame(
        {
            "ex": [k[0] for k in group_rows],
            "old": [k[1] for k in group_rows],
            "new": list(group_rows.values()),
        },
        schema={"ex": pl.Int32, "old": pl.Int32, "new": pl.Int32},
    )
    pmap = pl.DataFrame(
        {
            "ex": [k[0] for k in peer_rows],
            "old": [k[1] for k in peer_rows],
            "new": list(peer_rows.values()),
        },
        schema={"ex": pl.Int32, "old": pl.Int32, "new": pl.Int32},
    )
    con.register("_slice_class", cls.to_arrow())
    con.register("_slice_group", gmap.to_arrow())
    con.register("_slice_peer", pmap.to_arrow())
    try:
        before_n = _count(con, "graph_node", run_id)
        con.execute(
            "INSERT INTO graph_node (run_id, rank, node_id, kind, track_id, event_id, name, ts,"
            " dur, iteration, group_id, seq, peer, msg_bytes, comm_kind)"
            " SELECT $1, c.exemplar, n.node_id, n.kind, n.track_id, n.event_id, n.name, n.ts,"
            " n.dur, n.iteration, g.new, n.seq, p.new, n.msg_bytes, n.comm_kind"
            " FROM graph_node n JOIN _slice_class c ON n.rank = c.rep"
            " LEFT JOIN _slice_group g ON g.ex = c.exemplar AND g.old = n.group_id"
            " LEFT JOIN _slice_peer p ON p.ex = c.exemplar AND p.old = n.peer"
            " WHERE n.run_id = $2",
            [run_id, rec_id],
        )
        con.execute(
            "INSERT INTO graph_edge (run_id, rank, src, dst, kind, anchor, delay)"
            " SELECT $1, c.exemplar, e.src, e.dst, e.kind, e.anchor, e.delay"
            " FROM graph_edge e JOIN _slice_class c ON e.rank = c.rep WHERE e.run_id = $2",
            [run_id, rec_id],
        )
    finally:
        for name in ("_slice_class", "_slice_group", "_slice_peer"):
            con.unregister(name)
    return _count(con, "graph_node", run_id) - before_n, _count(con, "graph_edge", run_id)


def _count(con: duckdb.DuckDBPyConnection, table_name: str, run_id: int) -> int:
    ((n,),) = con.execute(
        f"SELECT count(*) FROM {table_name} WHERE run_id = ?", [run_id]
    ).fetchall()
    return int(n)

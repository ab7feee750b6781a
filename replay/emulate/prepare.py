"""Emulation, the prepare stage: a loaded run with the what-ifs that change the graph applied
(slow ranks, a removed GPU, re-indexed or vectorised replicas)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
from prism_trace.replay.des.replicas import class_groups, replica_grid, vector_eligible
from prism_trace.replay.emulate.config import _COMM, EmulationConfig
from prism_trace.replay.emulate.load import _fetch, _lookup, _node_index, _run_layout
from prism_trace.replay.emulate.values import LoadedRun, PreparedRun
from prism_trace.replay.whatif.config import WhatIfError
from prism_trace.replay.whatif.expansion import expand_replicas, spans_dp
from prism_trace.replay.whatif.slow import check_slow_matches, slow_factors
from prism_trace.replay.whatif.variance import resample_durations
from prism_trace.replay.whatif.variance_fit import VarianceFit, fit_variance
from prism_trace.replay.whatif.variance_replica import describe_fit, unit_durations

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["check_rank_targets", "prepare"]


def prepare(
    store: Store, loaded: LoadedRun, config: EmulationConfig, *, parent_run_id: int | None = None
) -> PreparedRun:
    """The prepare stage: ``loaded`` with ``config.what_if`` applied (see ``_apply_what_if``).

    Args:
        store: the store ``loaded`` came from (for the run's coordinates, groups and layout).
        loaded: the load stage's value; not changed.
        config: the emulation config.
        parent_run_id: the dp what-if: the run the user named, of which ``loaded`` is a re-slice.

    Raises:
        WhatIfError: a what-if this run cannot take.
    """
    base = {f.name: getattr(loaded, f.name) for f in dataclasses.fields(LoadedRun)}
    prepared = PreparedRun(**base, parent_run_id=parent_run_id)
    if config.what_if.active:
        return _apply_what_if(store, prepared, config)
    return prepared


def _reindex(
    inputs: PreparedRun,
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    follow: np.ndarray,
    edge_rows: tuple[np.ndarray, np.ndarray] | None = None,
) -> PreparedRun:
    """``inputs`` on new nodes and edges: units, node indices and edge endpoints recomputed after
    the units changed.

    ``edge_rows``: the edges' ends as rows of ``nodes`` when known (``Expansion.edge_rows``);
    used when ``nodes`` is sorted by ``(rank, node_id)`` already, else looked up.
    """
    rank = nodes["rank"].to_numpy().astype(np.int64)
    n_id = nodes["node_id"].to_numpy().astype(np.int64)
    step = np.diff(rank)
    if not ((step > 0) | ((step == 0) & (np.diff(n_id) > 0))).all():  # expand_replicas sorts
        nodes = nodes.sort("rank", "node_id")
        rank = nodes["rank"].to_numpy().astype(np.int64)
        edge_rows = None
    first = np.flatnonzero(np.diff(rank, prepend=rank[:1] - 1) != 0)
    unit_rank = rank[first]
    unit = np.repeat(np.arange(first.size, dtype=np.int64), np.diff(np.append(first, rank.size)))
    nodes = nodes.with_columns(
        pl.Series("unit", unit), pl.Series("idx", np.arange(nodes.height, dtype=np.int64))
    )
    if edge_rows is not None:
        s, d = edge_rows
    else:
        keys, _ = _node_index(nodes, unit_rank)
        e_unit = np.searchsorted(unit_rank, edges["rank"].to_numpy()).astype(np.int64)
        s = _lookup(keys, e_unit, edges["src"].to_numpy(), "source")
        d = _lookup(keys, e_unit, edges["dst"].to_numpy(), "destination")
    pos = np.minimum(np.searchsorted(unit_rank, follow), unit_rank.size - 1)
    r_unit = np.where(unit_rank[pos] == follow, pos, -1)
    return dataclasses.replace(
        inputs,
        nodes=nodes,
        edges=edges.with_columns(pl.Series("s", s), pl.Series("d", d)),
        unit_rank=unit_rank,
        unit_source=nodes["source_rank"].to_numpy()[first].astype(np.int64),
        rank_unit=pl.DataFrame(
            {"rank": np.arange(follow.size, dtype=np.int64), "unit": r_unit.astype(np.int64)}
        ),
    )


def _coords(store: Store, run_id: int) -> pl.DataFrame:
    return _fetch(
        store.con,
        "SELECT rank, coalesce(class_id, rank) AS class_id, tp, dp FROM rank WHERE run_id = $1"
        " ORDER BY rank",
        [run_id],
    )


def check_rank_targets(config: EmulationConfig, world: int, run: str) -> None:
    """Refuse what-if ranks (``slow-ranks``, ``remove-gpu``) outside ``run``'s world.

    Raises:
        WhatIfError: the first such rank.
    """
    bad = sorted(r for r in config.what_if.rank_targets() if not 0 <= r < world)
    if bad:
        msg = f"what-if rank {bad[0]} is outside the world of {world} ranks of run {run!r}"
        raise WhatIfError(msg)


def _apply_what_if(store: Store, inputs: PreparedRun, config: EmulationConfig) -> PreparedRun:
    """``inputs`` with ``config.what_if`` turned into units, durations and group sizes.

    Expands the data-parallel replicas that a rank-targeted what-if or the variance mode makes
    distinct (sliced runs only: a recorded run's units are its ranks already), then sets each
    node's ``emu_dur`` (drawn, then scaled) and ``factor`` (multiplies a communication node's
    transfer). See ``replay.whatif``.
    """
    w = config.what_if
    targets = w.rank_targets()
    check_rank_targets(config, inputs.world_size, inputs.run)
    coords = _coords(store, inputs.run_id)
    notes = list(inputs.notes)
    layout = None
    dp_of = dict(zip(coords["rank"].to_list(), coords["dp"].fill_null(0).to_list(), strict=True))
    if inputs.kind == "sliced" and (targets or w.variance):
        layout = _run_layout(store, inputs.run_id)
        if layout is None:
            msg = f"run {inputs.run!r}: sliced run without a layout in its config"
            raise WhatIfError(msg)
        if vector_eligible(w):
            distinct = None if w.variance else {int(dp_of[r]) for r in targets}
            inputs = dataclasses.replace(
                inputs, grid=replica_grid(layout, inputs.unit_rank, distinct)
            )
    if inputs.grid is not None:
        assert layout is not None
        n_dp, n_col = inputs.grid.grid.shape[1], inputs.grid.n_columns
        notes.append(
            f"{n_dp} data-parallel replicas simulated as {n_col} distinct columns of a vector"
            f" over the {inputs.unit_rank.size} class graphs (replay.vector); events are the"
            " class exemplars' (replica 0), iterations every rank's"
        )
    elif inputs.kind == "sliced" and (targets or w.variance):
        assert layout is not None
        replicas = set(range(layout.dp)) if w.variance else {int(dp_of[r]) for r in targets}
        groups = _fetch(
            store.con,
            "SELECT group_id, axis, ranks FROM comm_group WHERE run_id = $1",
            [inputs.run_id],
        )
        exp = expand_replicas(
            inputs.nodes.drop("unit", "idx"),
            inputs.edges.drop("s", "d"),
            ranks=coords.select("rank", "class_id"),
            groups=groups,
            layout=layout,
            replicas=replicas,
        )
        inputs = _reindex(inputs, exp.nodes, exp.edges, exp.rank_unit_rank, exp.edge_rows)
        notes += exp.notes

    nodes = inputs.nodes
    check_slow_matches(nodes, w.slow, inputs.run)
    extra = np.ones(nodes.height)
    if w.remove_gpu is not None:
        extra, left_out, size_override, note = _remove_gpu(store, inputs, coords, w.remove_gpu)
        notes.append(note)
        inputs = dataclasses.replace(inputs, left_out=left_out, size_override=size_override)
        if inputs.grid is not None:  # the failed replica is a column: replay.vector
            n_tp = int(coords["tp"].max()) + 1  # type: ignore[arg-type]  # an Int column's max
            f = n_tp / (n_tp - 1)
            failed = _failed_column(store, inputs, int(dp_of[w.remove_gpu]), f)
            # the column carries the failed replica's factor and group sizes instead
            inputs = dataclasses.replace(inputs, size_override={}, failed_column=failed)
            extra = np.ones_like(extra)
    dur = nodes["dur"].fill_null(0).to_numpy().astype(np.int64)
    if w.variance:
        inputs, dur, said = _draw_variance(store, inputs, config, dp_of, dur)
        notes += said
    # with the replica vector, a slow rank is a column of replay.vector's durations instead
    slow = w.slow if inputs.grid is None else tuple(s for s in w.slow if not s.ranks)
    factor = slow_factors(nodes, slow, extra=extra)
    is_comm = nodes["kind"].is_in(_COMM).to_numpy()
    # the rank-targeted slow-downs the replica vector applies: at most their product per node
    on_columns = float(np.prod([s.factor for s in w.slow if s not in slow]))
    _check_scaled(inputs, dur, np.where(is_comm, 1.0, factor) * on_columns)
    if inputs.grid is not None:  # scaled per replica column (replay.vector.scale_replicas)
        nodes = nodes.with_columns(
            pl.Series("emu_dur", dur),
            pl.Series("factor", np.where(is_comm, factor, 1.0)),
            pl.Series("scale", np.where(is_comm, 1.0, factor)),
        )
    else:
        emu = np.where(is_comm, dur, np.rint(dur * factor)).astype(np.int64)
        nodes = nodes.with_columns(
            pl.Series("emu_dur", emu), pl.Series("factor", np.where(is_comm, factor, 1.0))
        )
    return dataclasses.replace(inputs, nodes=nodes, notes=tuple(notes))


def _draw_variance(
    store: Store,
    inputs: PreparedRun,
    config: EmulationConfig,
    dp_of: Mapping[int, int],
    dur: np.ndarray,
) -> tuple[PreparedRun, np.ndarray, list[str]]:
    """The variance what-if: ``inputs`` (with the ``replica`` mode's fit), the units' durations
    (drawn here unless the replica vector draws its columns in the run stage) and the notes.

    In a sliced run the representative replica (dp 0, the class exemplars) keeps its recorded
    timing: it *is* the recording; every other replica is a virtual peer and draws. In a
    recorded run every rank draws; in the ``replica`` mode it keeps its own rank effect (it is
    that GPU) and draws its residuals only.
    """
    w = config.what_if
    mode, seed = w.variance_mode, config.seed
    if mode == "replica" and w.no_stragglers:
        return (
            inputs,
            dur,
            [
                "variance (replica mode): nothing drawn, no-stragglers gives every"
                " op its type's typical time"
            ],
        )
    notes = []
    fit = None
    if mode == "replica":
        fit = _variance_fit(store, inputs)
        inputs = dataclasses.replace(inputs, variance_fit=fit)
        notes.append(f"variance fit (replica mode) on the recorded replicas: {describe_fit(fit)}")
    if inputs.grid is not None:
        source = (
            "its own rank effect and recorded rank-steps' residuals (the fit)"
            if fit is not None
            else "its class's recorded iterations"
        )
        notes.append(
            f"variance ({mode} mode, seed {seed}): every replica but 0 (the recording) draws its"
            f" durations from {source}"
        )
        return inputs, dur, notes
    unit_rank = inputs.unit_rank
    sliced = inputs.kind == "sliced"
    replica = np.array([dp_of.get(int(r), 0) for r in unit_rank], dtype=np.int64)
    draw = replica != 0 if sliced else np.ones(unit_rank.size, dtype=bool)
    if mode != "replica":
        dur = resample_durations(inputs.nodes, draw, seed=seed, mode=mode)
        notes.append(
            f"variance ({mode} mode, seed {seed}): {int(draw.sum())} of {draw.size} units draw"
            " their durations from their representative's iterations"
        )
        return inputs, dur, notes
    assert fit is not None
    dur = unit_durations(
        inputs.nodes,
        fit,
        _held(inputs.edges, inputs.nodes.height),
        draw=draw,
        replica=replica,
        keep_effect=np.full(unit_rank.size, not sliced),
        seed=seed,
    )
    drawn = "their rank effect and residuals" if sliced else "their residuals (rank effect kept)"
    notes.append(
        f"variance (replica mode, seed {seed}): {int(draw.sum())} of {draw.size} units draw {drawn}"
    )
    return inputs, dur, notes


def _held(edges: pl.DataFrame, n: int) -> np.ndarray:
    """Per node, whether a ``sync`` edge holds its end (its recorded duration was waiting)."""
    held = np.zeros(n, dtype=bool)
    held[edges.filter(pl.col("kind") == "sync")["d"].to_numpy()] = True
    return held


def _variance_fit(store: Store, inputs: PreparedRun) -> VarianceFit:
    """``variance=replica``: the model fitted on every recorded replica of the roles the run
    replays (``replay.whatif.variance_fit``), read from the recording's graph.

    A role is the recorded ranks that differ only in their dp coordinate; a rank without
    coordinates (no layout inferred) is a role of its own (one replica: no rank effect).
    """
    src = inputs.source_run_id
    ranks = _fetch(
        store.con, "SELECT rank, tp, cp, ep, dp, pp FROM rank WHERE run_id = $1", [src]
    ).with_columns(
        pl.when(pl.col("dp").is_not_null())
        .then(
            pl.concat_str(
                [pl.col(c).fill_null(0).cast(pl.Utf8) for c in ("tp", "cp", "ep", "pp")],
                separator=",",
            )
        )
        .otherwise(pl.concat_str([pl.lit("rank "), pl.col("rank").cast(pl.Utf8)]))
        .alias("role_key"),
        pl.col("dp").fill_null(pl.col("rank")).alias("dp"),
    )
    ranks = ranks.with_columns(pl.col("role_key").rank("dense").cast(pl.Int64).alias("role"))
    reps = set(inputs.nodes["source_rank"].unique().to_list())
    roles = set(ranks.filter(pl.col("rank").is_in(list(reps)))["role"].to_list())
    peers = ranks.filter(pl.col("role").is_in(list(roles)))
    listed = ",".join(str(int(r)) for r in peers["rank"].to_list()) or "-1"
    nodes = _fetch(
        store.con,
        "SELECT n.rank AS source_rank, n.node_id, n.kind, n.name, n.ts, n.dur, n.iteration,"
        " e.dst IS NOT NULL AS held"
        " FROM graph_node n LEFT JOIN (SELECT DISTINCT rank, dst FROM graph_edge"
        "  WHERE run_id = $1 AND kind = 'sync') e ON e.rank = n.rank AND e.dst = n.node_id"
        " WHERE n.run_id = $1 AND n.kind NOT IN ('collective', 'send', 'recv')"
        f" AND n.iteration IS NOT NULL AND n.dur > 0 AND n.rank IN ({listed})",
        [src],
    )
    peers = peers.select(pl.col("rank").alias("source_rank"), "role", "dp")
    return fit_variance(nodes.join(peers, on="source_rank"))


_MAX_UNIT_NS = 2.0**62
"""The most nanoseconds a unit's scaled durations may add up to: half of int64's range, leaving
the other half for the recorded gaps, the transfers and the start time."""


def _check_scaled(inputs: PreparedRun, dur: np.ndarray, factor: np.ndarray) -> None:
    """Refuse slow-downs whose scaled durations could overflow int64 ns on this run.

    Each factor is bounded (``whatif.MAX_SLOW_FACTOR``), but a long run times a large factor
    still overflows: the durations wrapped to -2**63 and the timeline ran backwards. A unit's
    timeline moves by at most the sum of its scaled durations, so that sum is checked.

    Raises:
        WhatIfError: a unit whose scaled durations add up past ``_MAX_UNIT_NS``.
    """
    if dur.size == 0:
        return
    unit = inputs.nodes["unit"].to_numpy().astype(np.int64)
    total = np.bincount(unit, weights=np.abs(dur.astype(np.float64)) * factor)
    worst = int(np.argmax(total))
    if not total[worst] <= _MAX_UNIT_NS:
        msg = (
            f"run {inputs.run!r}: the slow-downs make rank {int(inputs.unit_rank[worst])}'s"
            f" durations add up to {total[worst]:.3g} ns, past what int64 ns can hold"
            f" ({_MAX_UNIT_NS:.3g}); use smaller factors"
        )
        raise WhatIfError(msg)


def _failed_column(
    store: Store, inputs: PreparedRun, replica: int, f: float
) -> tuple[int, Mapping[int, int], float]:
    """remove-gpu on the replica vector: the failed replica's column, its smaller tp groups and
    its compute and transfer factor (``PreparedRun.failed_column``), which take the place of the
    per-node factor and the group sizes ``_remove_gpu`` gave every column."""
    assert inputs.grid is not None
    groups = _fetch(
        store.con, "SELECT group_id, ranks FROM comm_group WHERE run_id = $1", [inputs.run_id]
    )
    sizes = class_groups(inputs.grid, replica, groups, dict(inputs.size_override))
    return int(inputs.grid.column[replica]), sizes, f


def _remove_gpu(
    store: Store, inputs: PreparedRun, coords: pl.DataFrame, rank: int
) -> tuple[np.ndarray, dict[int, str], dict[int, int], str]:
    """The failed-GPU what-if: the per-node compute factor, the ranks it leaves out (with why),
    the tp groups it shrinks (group id: new size) and its note."""
    c = coords.filter(pl.col("rank") == rank)
    if c.is_empty() or c["tp"][0] is None or c["dp"][0] is None:
        msg = (
            f"run {inputs.run!r}: rank {rank} has no tp/dp coordinates (run `prism graph` so the"
            " layout is inferred)"
        )
        raise WhatIfError(msg)
    tp_of, dp_of = int(c["tp"][0]), int(c["dp"][0])
    n_tp = int(coords["tp"].max()) + 1  # type: ignore[arg-type]  # an Int column's max
    if n_tp < 2:
        msg = (
            f"run {inputs.run!r}: removing rank {rank} leaves tp = 0 in its replica; with tp = 1"
            " a failed GPU removes the whole replica: use the what-if dp=N-1 instead"
        )
        raise WhatIfError(msg)
    replica = coords.filter(pl.col("dp") == dp_of)
    slot = replica.filter(pl.col("tp") == tp_of)["rank"].to_list()
    left_out = {int(r): ("removed" if r == rank else "idle") for r in slot}
    scale = n_tp / (n_tp - 1)
    in_replica = np.isin(inputs.nodes["rank"].to_numpy(), replica["rank"].to_numpy())
    groups = _fetch(
        store.con,
        "SELECT group_id, size, ranks, axis FROM comm_group WHERE run_id = $1",
        [inputs.run_id],
    )
    size_override: dict[int, int] = {}
    for gid, size, members, axis in groups.iter_rows():
        tp_group = axis is not None and "tp" in str(axis).split("-") and not spans_dp(axis)
        if tp_group and members and any(int(m) in left_out for m in members):
            size_override[int(gid)] = int(size) - 1
    note = (
        f"remove-gpu {rank}: replica dp={dp_of} runs at tp={n_tp - 1}; its compute x{scale:.4f},"
        f" {len(size_override)} tp groups at {n_tp - 1} members; ranks"
        f" {sorted(left_out)} (tp slot {tp_of}) leave the results"
    )
    return np.where(in_replica, scale, 1.0), left_out, size_override, note

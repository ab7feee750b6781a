"""The global batch of a slice: how many microbatches each target rank runs, and the
representatives' graphs rewritten to that many.

``--global-batch per-rank`` (the default) keeps every rank's recorded work: the job's global batch
grows with dp. ``--global-batch fixed`` keeps the recorded global batch: each rank runs
``m_target = m_recorded * dp_recorded / dp_target`` microbatches (refused when that is not a whole
number >= 1). ``--microbatches M`` gives the target's count outright. The recorded count and the
schedule are read from the representatives' graphs (``schedule``), which must agree; the graphs
are then rewritten (``rebatch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from prism_trace.graph.base import EDGE_SCHEMA, NODE_SCHEMA
from prism_trace.layout.mesh import AXES, ParallelAxis, ParallelLayout
from prism_trace.slicing.interleaved import (
    MAX_CHUNKS,
    markers_per_microbatch,
    min_target_microbatches,
    recognise_interleaved,
)
from prism_trace.slicing.plan import SliceClass, SliceError
from prism_trace.slicing.rebatch import RankSteps, RebatchError, rebatch_rank
from prism_trace.slicing.schedule import (
    RECV_NEXT,
    RECV_PREV,
    SEND_NEXT,
    SEND_PREV,
    Periods,
    ScheduleNotRecognised,
    StepShape,
    recognise_step,
)

if TYPE_CHECKING:
    import duckdb

__all__ = ["GLOBAL_BATCH", "BatchPlan", "plan_batch", "read_graphs", "target_microbatches"]

GLOBAL_BATCH = ("per-rank", "fixed")
"""``--global-batch`` values: keep each rank's recorded work, or keep the job's global batch."""

_COMM = ("collective", "send", "recv")


@dataclass(frozen=True)
class BatchPlan:
    """What a slice does to the microbatches.

    Attributes:
        global_batch: ``per-rank``, ``fixed``, or ``explicit`` (``--microbatches``).
        recorded: microbatches per rank and step in the recording (None: not read).
        target: microbatches per rank and step in the slice (None: as recorded).
        schedule: the recognised schedule (``1f1b``, ``gpipe``, ``interleaved``; None: not
            read).
        chunks: model chunks per stage of an interleaved schedule (1 otherwise).
    """

    global_batch: str
    recorded: int | None = None
    target: int | None = None
    schedule: str | None = None
    chunks: int = 1

    @property
    def changes(self) -> bool:
        """Whether the slice's graphs differ from the representatives' in microbatches."""
        return self.target is not None and self.target != self.recorded

    def as_config(self) -> dict[str, Any]:
        """The sliced run's ``config_json`` entries."""
        out: dict[str, Any] = {"global_batch": self.global_batch}
        if self.recorded is not None:
            out["microbatches"] = {
                "recorded": self.recorded,
                "target": self.target,
                "schedule": self.schedule,
            }
            if self.chunks > 1:
                out["microbatches"]["chunks"] = self.chunks
        return out


@dataclass(frozen=True)
class _Recognised:
    """The representatives' steps on one schedule: the count and how a period counts."""

    steps: dict[int, RankSteps]
    schedule: str
    microbatches: int
    chunks: int = 1
    per_period: int = 1


class _NotRecognised(SliceError):
    """A representative's step fits no schedule tried (worded for the user)."""


def target_microbatches(m: int, dp_recorded: int, dp_target: int) -> int:
    """``m * dp_recorded / dp_target`` at a fixed global batch.

    Raises:
        SliceError: it is not a whole number >= 1 (the message names both counts).
    """
    num = m * dp_recorded
    if num % dp_target or num < dp_target:
        msg = (
            f"--global-batch fixed: the recording runs {m} microbatches per rank at"
            f" dp={dp_recorded}; at dp={dp_target} that is {m} * {dp_recorded} / {dp_target}"
            f" = {num / dp_target:g} per rank, not a whole number >= 1"
        )
        raise SliceError(msg)
    return num // dp_target


def _check_options(global_batch: str, microbatches: int | None) -> None:
    if global_batch not in GLOBAL_BATCH:
        msg = f"--global-batch {global_batch!r}: expected one of {', '.join(GLOBAL_BATCH)}"
        raise SliceError(msg)
    if microbatches is not None and microbatches < 1:
        msg = f"--microbatches {microbatches}: a rank runs at least one microbatch"
        raise SliceError(msg)
    if microbatches is not None and global_batch == "fixed":
        msg = (
            "--microbatches and --global-batch fixed both set the target's microbatches;"
            " give one of them"
        )
        raise SliceError(msg)


def plan_batch(
    con: duckdb.DuckDBPyConnection,
    rec_id: int,
    classes: list[SliceClass],
    recorded: ParallelLayout,
    target: ParallelLayout,
    rec_axes: dict[int, str],
    *,
    global_batch: str,
    microbatches: int | None,
) -> tuple[BatchPlan, tuple[pl.DataFrame, pl.DataFrame] | None]:
    """The slice's microbatches, and the representatives' graphs rewritten to them.

    Returns:
        The plan, and (nodes, edges) of every representative when their graphs change (None when
        they are copied as recorded).

    Raises:
        SliceError: a bad option, a schedule not recognised, representatives that disagree on
            the count, a target count that is not whole, or microbatches that cannot be repeated.
    """
    _check_options(global_batch, microbatches)
    if global_batch == "per-rank" and microbatches is None:
        return BatchPlan("per-rank"), None
    if microbatches is None and recorded.dp == target.dp:
        return BatchPlan("fixed"), None  # the same dp: the same microbatches, nothing to read
    reps = sorted({c.representative for c in classes})
    nodes, edges = read_graphs(con, rec_id, reps)
    found = _recognise_all(nodes, reps, recorded, rec_axes)
    m = found.microbatches
    mode = "explicit" if microbatches is not None else "fixed"
    m_new = (
        microbatches if microbatches is not None else target_microbatches(m, recorded.dp, target.dp)
    )
    plan = BatchPlan(mode, m, m_new, found.schedule, found.chunks)
    if not plan.changes:
        return plan, None
    _check_target(found, m_new, recorded.pp)
    per_mb = markers_per_microbatch(recorded.pp, found.chunks) if found.chunks > 1 else 1
    out_nodes, out_edges = [], []
    for rep in reps:
        try:
            n, e = rebatch_rank(
                nodes.filter(pl.col("rank") == rep),
                edges.filter(pl.col("rank") == rep),
                found.steps[rep],
                (m_new - m) // found.per_period,
            )
        except RebatchError as exc:
            what = (
                f" (a period: {recorded.pp} microbatches through its {found.chunks} chunks)"
                if found.chunks > 1
                else " (a period: one microbatch)"
            )
            msg = f"recorded rank {rep}: {m} -> {m_new} microbatches: {exc}{what}"
            raise SliceError(msg) from exc
        _check_counts(n, rep, recorded, rec_axes, m_new * per_mb)
        out_nodes.append(n)
        out_edges.append(e)
    return plan, (pl.concat(out_nodes), pl.concat(out_edges))


def _check_target(found: _Recognised, m_new: int, pp: int) -> None:
    """Refuse a target count the recorded schedule's shape cannot take (one line)."""
    m = found.microbatches
    if found.schedule == "1f1b" and m_new < pp:
        msg = (
            f"{m} -> {m_new} microbatches per rank: 1F1B on {pp} pipeline stages needs"
            f" at least {pp} per rank to keep its warm-up and one forward/backward pair"
        )
        raise SliceError(msg)
    least = min_target_microbatches(pp)
    if found.schedule == "interleaved" and (m_new % pp or m_new < least):
        msg = (
            f"{m} -> {m_new} microbatches per rank: interleaved 1F1B on {pp} pipeline stages"
            f" ({found.chunks} chunks each) needs a multiple of {pp} and at least {least}"
            " per rank (with fewer, every forward runs before the first backward)"
        )
        raise SliceError(msg)


def read_graphs(
    con: duckdb.DuckDBPyConnection, rec_id: int, ranks: list[int]
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The graphs of ``ranks`` of run ``rec_id``, as nodes and edges frames typed as stored."""
    nodes = con.sql(
        f"SELECT {', '.join(NODE_SCHEMA)} FROM graph_node WHERE run_id = $1"
        " AND list_contains($2, rank) ORDER BY rank, node_id",
        params=[rec_id, ranks],
    ).pl()
    edges = con.sql(
        f"SELECT {', '.join(EDGE_SCHEMA)} FROM graph_edge WHERE run_id = $1"
        " AND list_contains($2, rank)",
        params=[rec_id, ranks],
    ).pl()
    return (
        nodes.cast({c: t for c, t in NODE_SCHEMA.items()}),
        edges.cast({c: t for c, t in EDGE_SCHEMA.items()}),
    )


def _recognise_all(
    nodes: pl.DataFrame, reps: list[int], layout: ParallelLayout, rec_axes: dict[int, str]
) -> _Recognised:
    """Every representative's steps, on one schedule and one microbatch count.

    With few microbatches a stage can read as either schedule (1F1B with one steady pair is
    all forwards, then all backwards); when the stages disagree, GPipe is tried on all of them.
    When a stage fits neither, interleaved 1F1B is tried on all of them, with 2, 3, ... chunks
    per stage (``interleaved``).
    """
    try:
        return _one_f_one_b_or_gpipe(nodes, reps, layout, rec_axes)
    except _NotRecognised as exc:
        if layout.pp < 2:
            raise
        first = exc
    why = ""
    for chunks in range(2, MAX_CHUNKS + 1):
        try:
            return _interleaved(nodes, reps, layout, rec_axes, chunks)
        except _NotRecognised as exc:
            why = why or str(exc).rsplit(": ", 1)[-1]
    msg = f"{first}; nor interleaved 1F1B with 2-{MAX_CHUNKS} chunks per stage ({why})"
    raise _NotRecognised(msg) from first


def _interleaved(
    nodes: pl.DataFrame,
    reps: list[int],
    layout: ParallelLayout,
    rec_axes: dict[int, str],
    chunks: int,
) -> _Recognised:
    steps: dict[int, RankSteps] = {}
    counts: set[int] = set()
    for rep in reps:
        steps[rep], shape = _recognise_rank(
            nodes.filter(pl.col("rank") == rep), rep, layout, rec_axes, chunks=chunks
        )
        counts.add(shape.microbatches)
    if len(counts) > 1:
        msg = f"with {chunks} chunks the stages run different numbers of microbatches"
        raise _NotRecognised(msg)
    return _Recognised(steps, "interleaved", counts.pop(), chunks, layout.pp)


def _one_f_one_b_or_gpipe(
    nodes: pl.DataFrame, reps: list[int], layout: ParallelLayout, rec_axes: dict[int, str]
) -> _Recognised:
    steps: dict[int, RankSteps] = {}
    seen: dict[tuple[str, int], int] = {}
    for rep in reps:
        steps[rep], shape = _recognise_rank(
            nodes.filter(pl.col("rank") == rep), rep, layout, rec_axes
        )
        seen.setdefault((shape.schedule, shape.microbatches), rep)
    if len({m for _, m in seen}) > 1:
        said = "; ".join(f"rank {r}: {m} ({s})" for (s, m), r in seen.items())
        msg = f"the representatives run different numbers of microbatches per step: {said}"
        raise _NotRecognised(msg)
    if len(seen) > 1:
        try:
            for rep in reps:
                steps[rep], _ = _recognise_rank(
                    nodes.filter(pl.col("rank") == rep), rep, layout, rec_axes, only="gpipe"
                )
        except SliceError as exc:
            said = "; ".join(f"rank {r}: {s}" for (s, _), r in seen.items())
            msg = f"the pipeline stages disagree on the schedule: {said}"
            raise _NotRecognised(msg) from exc
        return _Recognised(steps, "gpipe", next(iter(seen))[1])
    (schedule, m), _ = next(iter(seen.items()))
    return _Recognised(steps, schedule, m)


def _markers(
    nodes: pl.DataFrame, rank: int, layout: ParallelLayout, rec_axes: dict[int, str]
) -> tuple[np.ndarray, list[str]]:
    """Per node: its pipeline send/recv marker, and its token text (kind and name; for a
    communication op its kind, axis, peer offset and size instead of its name)."""
    kind = nodes["kind"].to_list()
    group = nodes["group_id"].to_list()
    peer = nodes["peer"].to_list()
    own = layout.coords([rank])
    peers = [p for p in peer if p is not None and 0 <= p < layout.world_size]
    pc = layout.coords(peers) if peers else None
    at = {p: i for i, p in enumerate(peers)}
    marker = np.zeros(nodes.height, dtype=np.int64)
    text: list[str] = []
    for i, (k, g, p, name, ck, nb) in enumerate(
        zip(
            kind,
            group,
            peer,
            nodes["name"].to_list(),
            nodes["comm_kind"].to_list(),
            nodes["msg_bytes"].to_list(),
            strict=True,
        )
    ):
        axis = rec_axes.get(g) if g is not None else None
        if k not in _COMM:
            text.append(f"{k}|{name}")
            continue
        offs = ""
        if p is not None and pc is not None and p in at:
            d = {a: int(pc[a][at[p]]) - int(own[a][0]) for a in AXES}
            offs = ",".join(str(d[a]) for a in AXES)
            dpp = d[ParallelAxis.PP]
            only_pp = all(v == 0 for a, v in d.items() if a != ParallelAxis.PP)
            if k in ("send", "recv") and only_pp and abs(dpp) == 1:
                recv = k == "recv"
                marker[i] = (
                    (RECV_PREV if recv else SEND_PREV)
                    if dpp < 0
                    else (RECV_NEXT if recv else SEND_NEXT)
                )
        text.append(f"{k}|{ck}|{axis}|{offs}|{nb}")
    return marker, text


def _main_nodes(nodes: pl.DataFrame) -> pl.DataFrame:
    """The rank's program in order: the track with the most send/recv (else with the most host
    ops) when it also holds other ops (a host thread that computes and communicates); else every
    node of the rank (an op timeline keeps compute, send/recv and collectives on separate
    streams)."""
    for kinds in (["send", "recv"], ["host", "collective"]):
        per = (
            nodes.filter(pl.col("kind").is_in(kinds) & pl.col("track_id").is_not_null())
            .group_by("track_id")
            .len()
            .sort("len", "track_id", descending=[True, False])
        )
        if per.height:
            track = nodes.filter(pl.col("track_id") == per["track_id"][0])
            if track["kind"].is_in(["send", "recv"]).all():
                break
            return track.sort("ts", "node_id", nulls_last=True)
    return nodes.sort("ts", "node_id", nulls_last=True)


def _recognise_rank(
    nodes: pl.DataFrame,
    rank: int,
    layout: ParallelLayout,
    rec_axes: dict[int, str],
    only: str | None = None,
    chunks: int = 1,
) -> tuple[RankSteps, StepShape]:
    """Every step of one recorded rank, recognised (as interleaved 1F1B of ``chunks`` chunks
    when ``chunks > 1``); they must agree."""
    main = _main_nodes(nodes)
    marker, text = _markers(main, rank, layout, rec_axes)
    token = pl.Series(text).rank("dense").to_numpy().astype(np.int64)
    comm = main["kind"].is_in(_COMM).to_numpy()
    it = main["iteration"].to_numpy()
    stage = int(layout.coords([rank])[ParallelAxis.PP][0])
    out = RankSteps(main["node_id"].to_numpy().astype(np.int64))
    shapes: dict[int, StepShape] = {}
    for step in sorted({int(i) for i in main["iteration"].drop_nulls().to_list()}):
        pos = np.flatnonzero(it == step)
        try:
            shape = (
                recognise_interleaved(
                    token[pos], marker[pos], stage=stage, pp=layout.pp, chunks=chunks
                )
                if chunks > 1
                else recognise_step(
                    token[pos], marker[pos], comm[pos], stage=stage, pp=layout.pp, only=only
                )
            )
        except ScheduleNotRecognised as exc:
            msg = f"recorded rank {rank}, step {step}: schedule not recognised: {exc}"
            raise _NotRecognised(msg) from exc
        shapes[step] = shape
        out.runs[step] = tuple(
            Periods(int(pos[0]) + r.start, r.length, r.count) for r in shape.runs
        )
    if not shapes:
        msg = f"recorded rank {rank}: no step (ProfilerStep) to read microbatches from"
        raise SliceError(msg)
    first = next(iter(shapes.values()))
    for step, shape in shapes.items():
        if (shape.schedule, shape.microbatches) != (first.schedule, first.microbatches):
            msg = (
                f"recorded rank {rank}: steps differ: {first.microbatches} microbatches"
                f" ({first.schedule}) in one, {shape.microbatches} ({shape.schedule}) in step"
                f" {step}"
            )
            raise SliceError(msg)
    return out, first


def _check_counts(
    nodes: pl.DataFrame, rank: int, layout: ParallelLayout, rec_axes: dict[int, str], m: int
) -> None:
    """After the rewrite each step holds ``m`` of every pipeline send/recv kind it uses."""
    marker, _ = _markers(nodes, rank, layout, rec_axes)
    frame = pl.DataFrame({"it": nodes["iteration"], "marker": marker}).filter(
        (pl.col("marker") > 0) & pl.col("it").is_not_null()
    )
    bad = frame.group_by("it", "marker").len().filter(pl.col("len") != m)
    if bad.height:
        row = bad.row(0, named=True)
        msg = (
            f"recorded rank {rank}: after the rewrite step {row['it']} holds {row['len']}"
            f" pipeline send/recv of one kind instead of {m}"
        )
        raise SliceError(msg)

"""Run diff: how two runs of one job differ, per iteration, per rank and per op.

Any two runs (recorded vs emulated, two emulations, two recordings) are compared through the one
schema. Ranks are matched by global rank; a class member of an emulated sliced run reads its
class exemplar's events (``rank.class_id``). Iterations are matched by number. Ops are aligned:

- ``node``: when one run was emulated from the other (``run.parent_run_id``) or both from the
  same run, through the execution graph: an emulated event's ``event_id`` is the parent's
  ``graph_node.node_id``, whose ``event_id`` is the recorded event.
- ``ordinal`` otherwise: by (rank, iteration, name, occurrence in start order).

An op's start is taken relative to its rank's iteration start in its own run, so runs on
different clocks compare. The first divergence of an iteration is the op (earliest start in run
``a``) whose start shifted by more than the threshold: ``threshold_pct`` of the rank's iteration
in ``a``, or ``threshold_ns``. Contributors rank op names by their total duration difference and
by their largest start shift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import polars as pl
from prism_trace.analysis.diff_map import resolve_map

from prism_trace.errors import RunStateError, UsageError
from prism_trace.query.steps import step_windows
from prism_trace.store.connection import Store

__all__ = ["RunDiff", "run_diff"]


@dataclass
class RunDiff:
    """The difference ``b - a`` of two runs (times in ns)."""

    a: str
    b: str
    alignment: str
    """``node`` (through the execution graph) or ``ordinal``."""
    iterations: pl.DataFrame
    """Per iteration: ``ranks, a_ns, b_ns`` (mean over ranks, whole ns), ``diff_ns, diff_pct``,
    and the first divergent op (``first_rank, first_op, first_shift_ns``)."""
    ranks: pl.DataFrame
    """Per rank and iteration: ``a_ns, b_ns, diff_ns, diff_pct``."""
    divergence: pl.DataFrame
    """Per iteration, the first op whose start shifted beyond the threshold: ``rank, name,
    ordinal, a_ts, a_rel_ns, b_rel_ns, shift_ns, threshold_ns, a_dur, b_dur``."""
    contributors: pl.DataFrame
    """Per op name: ``ops, a_ns, b_ns, dur_diff_ns, mean_shift_ns, max_abs_shift_ns,
    dur_rank, shift_rank``, largest absolute duration difference first."""
    matched_ops: int = 0
    unmatched_a: int = 0
    unmatched_b: int = 0
    notes: list[str] = field(default_factory=list)
    pairing: list[str] = field(default_factory=list)
    """The rank and iteration pairs the diff made without being given them (``diff_map``)."""

    def frames(self) -> dict[str, pl.DataFrame]:
        """The sections as named frames (for printing or JSON); ``pairing`` when the diff
        paired ranks or iterations itself."""
        out = {
            "iterations": self.iterations,
            "divergence": self.divergence,
            "contributors": self.contributors,
            "ranks": self.ranks,
        }
        if self.pairing:
            out["pairing"] = pl.DataFrame({"note": self.pairing}, schema={"note": pl.Utf8})
        return out


def _info(store: Store, run: str) -> tuple[int, str, int | None]:
    run_id = store.require_run(run)
    line = store.run_ancestry(run_id)
    return run_id, line[0].kind, line[1].run_id if len(line) > 1 else None


def _units(store: Store, run_id: int) -> pl.DataFrame:
    """``rank, unit``: the rank whose events stand for each rank (its class exemplar)."""
    return store.con.sql(
        "WITH r AS (SELECT rank, coalesce(class_id, rank) AS cls FROM rank WHERE run_id = $1),"
        " ev AS (SELECT DISTINCT rank FROM event WHERE run_id = $1)"
        " SELECT r.rank, x.unit FROM r JOIN (SELECT r.cls, min(r.rank) AS unit FROM r"
        " JOIN ev USING (rank) GROUP BY r.cls) x USING (cls)",
        params=[run_id],
    ).pl()


def _iterations(store: Store, run_id: int) -> pl.DataFrame:
    """The run's steps, or its whole trace as one window per rank when it has none."""
    return step_windows(store.con, run_id).select(
        "rank", "iteration", pl.col("ts").alias("it_ts"), pl.col("dur").alias("it_dur")
    )


def _ops(store: Store, run_id: int, node_of: int | None) -> pl.DataFrame:
    """Timed ops of a run with their start relative to their rank's iteration and their key.

    ``node_of``: the graph run whose ``graph_node`` maps this run's ``event_id`` to a node id
    (``key``); ``None`` uses the event id itself (emulated runs) or, for ordinal alignment, is
    ignored.
    """
    if node_of is not None:
        sql = (
            "SELECT e.rank, e.iteration, e.name, e.ts, e.dur, n.node_id AS key"
            " FROM event e JOIN graph_node n ON n.run_id = $2 AND n.rank = e.rank"
            " AND n.event_id = e.event_id"
            " WHERE e.run_id = $1 AND e.ts IS NOT NULL AND e.dur IS NOT NULL"
            " AND e.iteration IS NOT NULL"
        )
        params: list[object] = [run_id, node_of]
    else:
        sql = (
            "SELECT rank, iteration, name, ts, dur, event_id AS key FROM event"
            " WHERE run_id = $1 AND ts IS NOT NULL AND dur IS NOT NULL"
            " AND iteration IS NOT NULL AND category <> 'instant'"
        )
        params = [run_id]
    ops = store.con.sql(sql, params=params).pl()
    it = _iterations(store, run_id)
    return (
        ops.join(it, on=["rank", "iteration"], how="inner")
        .sort("rank", "iteration", "ts", "key")
        .with_columns(
            (pl.col("ts") - pl.col("it_ts")).alias("rel"),
            pl.int_range(pl.len(), dtype=pl.Int64)
            .over("rank", "iteration", "name")
            .alias("ordinal"),
        )
    )


def _alignment(
    store: Store, a: tuple[int, str, int | None], b: tuple[int, str, int | None]
) -> tuple[str, int | None, int | None]:
    """How to key ops: ``(mode, graph run for a's keys, graph run for b's keys)``."""
    (ida, kind_a, par_a), (idb, kind_b, par_b) = a, b

    def has_graph(run_id: int) -> bool:
        rows = store.con.execute(
            "SELECT EXISTS (SELECT 1 FROM graph_node WHERE run_id = ?)", [run_id]
        ).fetchall()
        return bool(rows[0][0])

    if kind_b == "emulated" and par_b == ida and kind_a == "recorded" and has_graph(ida):
        return "node", ida, None
    if kind_a == "emulated" and par_a == idb and kind_b == "recorded" and has_graph(idb):
        return "node", None, idb
    if kind_a == kind_b == "emulated" and par_a == par_b and par_a is not None:
        return "node", None, None
    return "ordinal", None, None


def run_diff(
    store: Store,
    a: str,
    b: str,
    *,
    threshold_pct: float = 1.0,
    threshold_ns: int | None = None,
    iteration: int | None = None,
    top: int = 10,
    rank_map: dict[int, int] | None = None,
    iteration_map: dict[int, int] | None = None,
) -> RunDiff:
    """Compare run ``b`` with run ``a`` (differences are ``b - a``).

    Args:
        store: an open store (read-only is fine).
        a: the reference run (e.g. the recording).
        b: the other run (e.g. its emulation).
        threshold_pct: an op's start diverges when it shifts by more than this percentage of its
            rank's iteration in ``a``.
        threshold_ns: an absolute threshold instead (takes precedence).
        iteration: only this iteration.
        top: contributors kept (by duration difference or by start shift).
        rank_map: rank of ``a`` -> rank of ``b`` to compare (``--map 3:1``); None: equal
            ranks, or the one rank of each run (``diff_map.resolve_map``).
        iteration_map: iteration of ``a`` -> iteration of ``b``; None: equal numbers, or in
            order when no number is shared. Rows keep ``a``'s numbers (and ``b``'s in
            ``rank_b``/``iteration_b`` when mapped).

    Returns:
        A ``RunDiff``.

    Raises:
        RunNotFoundError: a run does not exist.
        RunStateError: the runs share no rank-iteration.
        UsageError: a threshold that is not a finite number >= 0 (a NaN made every op's
            shift a NaN, which failed deep in the frame arithmetic).
    """
    for name, value in (("--threshold-pct", threshold_pct), ("threshold_ns", threshold_ns)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            msg = f"{name} must be a finite number >= 0, got {value!r}"
            raise UsageError(msg)
    ia, ib = _info(store, a), _info(store, b)
    ua, ub = _units(store, ia[0]), _units(store, ib[0])
    it_a, it_b = _iterations(store, ia[0]), _iterations(store, ib[0])
    pairing = resolve_map(it_a, it_b, ranks=rank_map, iterations=iteration_map)
    it_a, it_b = pairing.keep_a(it_a), pairing.to_a(it_b)
    ub = pairing.to_a(ub)
    if iteration is not None:
        it_a = it_a.filter(pl.col("iteration") == iteration)
        it_b = it_b.filter(pl.col("iteration") == iteration)
    mapped = [c for c in ("rank_b", "iteration_b") if c in it_b.columns]
    ranks = (
        it_a.join(it_b, on=["rank", "iteration"], how="inner", suffix="_b")
        .select(
            "rank",
            "iteration",
            *mapped,
            pl.col("it_dur").alias("a_ns"),
            pl.col("it_dur_b").alias("b_ns"),
        )
        .with_columns((pl.col("b_ns") - pl.col("a_ns")).alias("diff_ns"))
        .with_columns((100.0 * pl.col("diff_ns") / pl.col("a_ns")).alias("diff_pct"))
        .sort("iteration", "rank")
    )
    if ranks.is_empty():
        msg = (
            f"{store.path}: runs {a!r} and {b!r} share no (rank, iteration); pair them with"
            " --map A:B (rank A of the run with rank B of the other) and --map-iterations A:B"
        )
        raise RunStateError(msg)

    mode, graph_a, graph_b = _alignment(store, ia, ib)
    ops_a = _ops(store, ia[0], graph_a).join(
        it_a.select("rank", "iteration"), on=["rank", "iteration"], how="semi"
    )
    ops_b = pairing.to_a(_ops(store, ib[0], graph_b), rank=False).drop("iteration_b", strict=False)
    it_b_units = it_b.join(ub.select("rank", "unit"), on="rank").select(
        pl.col("unit").alias("rank"), "iteration"
    )
    ops_b = ops_b.join(it_b_units, on=["rank", "iteration"], how="semi")
    pairs = (
        ua.join(ub, on="rank", how="inner", suffix="_b")
        .select(pl.col("unit").alias("rank"), pl.col("unit_b").alias("rank_b"))
        .unique()
    )
    on = ["key"] if mode == "node" else ["iteration", "name", "ordinal"]
    left = ops_a.join(pairs, on="rank", how="inner")
    matched = left.join(
        ops_b.rename({"rank": "rank_b"}),
        left_on=["rank_b", *on],
        right_on=["rank_b", *on],
        how="inner",
        suffix="_b",
    )
    if mode == "node":
        matched = matched.filter(pl.col("iteration") == pl.col("iteration_b"))
    matched = matched.with_columns(
        (pl.col("rel_b") - pl.col("rel")).alias("shift_ns"),
        (pl.col("dur_b") - pl.col("dur")).alias("dur_diff_ns"),
        (
            pl.lit(threshold_ns, pl.Int64)
            if threshold_ns is not None
            else (pl.col("it_dur") * threshold_pct / 100.0).round().cast(pl.Int64)
        ).alias("threshold_ns"),
    )

    divergence = (
        matched.filter(pl.col("shift_ns").abs() > pl.col("threshold_ns"))
        .sort("iteration", "ts", "rank")
        .group_by("iteration", maintain_order=True)
        .first()
        .select(
            "iteration",
            "rank",
            "name",
            "ordinal",
            pl.col("ts").alias("a_ts"),
            pl.col("rel").alias("a_rel_ns"),
            pl.col("rel_b").alias("b_rel_ns"),
            "shift_ns",
            "threshold_ns",
            pl.col("dur").alias("a_dur"),
            pl.col("dur_b").alias("b_dur"),
        )
    )
    iterations = (
        ranks.group_by("iteration")
        .agg(
            pl.len().alias("ranks"),
            # means over ranks, in whole ns like every time of the schema (not 6.0651925e8)
            pl.col("a_ns").mean().round().cast(pl.Int64),
            pl.col("b_ns").mean().round().cast(pl.Int64),
        )
        .with_columns((pl.col("b_ns") - pl.col("a_ns")).alias("diff_ns"))
        .with_columns((100.0 * pl.col("diff_ns") / pl.col("a_ns")).alias("diff_pct"))
        .join(
            divergence.select(
                "iteration",
                pl.col("rank").alias("first_rank"),
                pl.col("name").alias("first_op"),
                pl.col("shift_ns").alias("first_shift_ns"),
            ),
            on="iteration",
            how="left",
        )
        .sort("iteration")
    )
    contributors = (
        matched.group_by("name")
        .agg(
            pl.len().alias("ops"),
            pl.col("dur").sum().alias("a_ns"),
            pl.col("dur_b").sum().alias("b_ns"),
            pl.col("dur_diff_ns").sum(),
            pl.col("shift_ns").mean().round().cast(pl.Int64).alias("mean_shift_ns"),
            pl.col("shift_ns").abs().max().alias("max_abs_shift_ns"),
        )
        .with_columns(
            pl.col("dur_diff_ns").abs().rank("ordinal", descending=True).alias("dur_rank"),
            pl.col("max_abs_shift_ns").rank("ordinal", descending=True).alias("shift_rank"),
        )
        .filter((pl.col("dur_rank") <= top) | (pl.col("shift_rank") <= top))
        .sort("dur_rank")
    )
    notes = list(pairing.notes)
    if mode == "ordinal":
        notes.append("ops aligned by (rank, iteration, name, occurrence)")
    return RunDiff(
        a=a,
        b=b,
        alignment=mode,
        iterations=iterations,
        ranks=ranks,
        divergence=divergence,
        contributors=contributors,
        matched_ops=matched.height,
        unmatched_a=left.height - matched.height,
        unmatched_b=ops_b.join(
            pairs.select(pl.col("rank_b").alias("rank")).unique(), on="rank", how="semi"
        ).height
        - matched.height,
        notes=notes,
        pairing=list(pairing.notes),
    )

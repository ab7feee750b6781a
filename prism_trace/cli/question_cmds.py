"""Commands that answer questions about runs: analyze, report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from prism_trace.cli._group import RANKS, _one_line_errors, main
from prism_trace.cli._options import (
    db_argument,
    follow_symlinks_option,
    json_option,
    max_rows_option,
    run_option,
)
from prism_trace.cli._words import ANALYZE_WORDS, COMPARE_WORDS
from prism_trace.errors import UsageError

__all__ = ["analyze_cmd", "report_cmd"]

_EMPTY_WHY = {
    "idle": " (idle time is per device stream: the selected ranks have no kernels)",
    "kernels": " (the selected ranks have no device ops)",
    "skew": " (no communication calls)",
}
"""Why an analysis can come back empty when the selection itself exists."""


def _json_value(value: object) -> object:
    """Numbers stay numbers in --json: Decimal as float, anything else as its text."""
    from decimal import Decimal

    if isinstance(value, Decimal):
        return float(value)
    return str(value)


def _json_rows(df: Any) -> list[dict[str, Any]]:
    """Rows of a polars frame for --json; NaN becomes null (JSON has no NaN)."""
    import polars as pl

    floats = [c for c, t in df.schema.items() if t in (pl.Float32, pl.Float64)]
    if floats:
        df = df.with_columns(pl.col(c).fill_nan(None) for c in floats)
    rows: list[dict[str, Any]] = df.to_dicts()
    return rows


@main.command("analyze")
@db_argument()
@click.argument(
    "what",
    # The analysis layer's words, plus `slowdown`, which the replay layer computes.
    type=click.Choice([*ANALYZE_WORDS, "slowdown"]),
)
@run_option("Run to analyse (any kind).")
@click.option(
    "--by",
    type=click.Choice(["optype", "rank", "stage", "dp_rank"]),
    default=None,
    help="slowdown: attribute it to op types, ranks, pipeline stages or data-parallel ranks.",
)
@click.option("--compare", default=None, help="diff: the other run (differences are OTHER - RUN).")
@click.option("--iteration", type=int, default=None, help="Only this iteration.")
@click.option(
    "--ranks", "ranks_text", type=RANKS, default=None, help="Only these ranks, e.g. 0,3,5..7."
)
@click.option(
    "--window",
    type=click.Choice(["step", "hta"]),
    default="step",
    show_default=True,
    help="temporal/kernels/overlap/idle: device work counts to the step that launched it (step),"
    " or HTA's one window per rank over all but the last step (hta).",
)
@click.option(
    "--threshold-pct",
    type=float,
    default=1.0,
    show_default=True,
    help="diff: an op diverges when its start shifts by more than this % of its iteration.",
)
@click.option(
    "--min-ns",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="bubbles: shortest window.",
)
@click.option(
    "--map",
    "rank_map",
    default=None,
    help="diff: compare rank A of RUN with rank B of OTHER (A:B, several as 3:1,2:0).",
)
@click.option(
    "--map-iterations",
    "iteration_map",
    default=None,
    help="diff: compare iteration A of RUN with iteration B of OTHER (A:B,...).",
)
@json_option("Rows as JSON.")
@max_rows_option()
@_one_line_errors
def analyze_cmd(
    db: Path,
    what: str,
    run_name: str,
    compare: str | None,
    iteration: int | None,
    ranks_text: list[int] | None,
    window: str,
    threshold_pct: float,
    min_ns: int,
    as_json: bool,
    max_rows: int,
    by: str | None,
    rank_map: str | None,
    iteration_map: str | None,
) -> None:
    """Answer WHAT about a run: temporal/kernel breakdown, overlap, idle time, collective skew,
    pipeline bubbles, critical path across ranks, its diff with another run, or its straggler
    slowdown (emulated with and without typical op times, `--by` a group)."""
    import polars as pl

    from prism_trace.analysis import analyze, describe_selection, nothing_to_rank
    from prism_trace.analysis.selection import exemplar_hint
    from prism_trace.store.connection import open_store

    ranks = ranks_text
    empty: list[str] = []
    unranked: str | None = None
    if compare is not None and what not in COMPARE_WORDS:  # it would be silently ignored
        msg = f"--compare goes with {', '.join(COMPARE_WORDS)}; `{what}` reads one run"
        raise UsageError(msg)
    if (rank_map or iteration_map) and what not in COMPARE_WORDS:
        msg = f"--map and --map-iterations go with {', '.join(COMPARE_WORDS)}"
        raise UsageError(msg)
    from prism_trace.analysis.diff_map import parse_pairs

    rmap = parse_pairs(rank_map) if rank_map else None
    imap = parse_pairs(iteration_map, "iteration") if iteration_map else None
    if what == "slowdown":
        from prism_trace.replay.emulate.slowdown import slowdown, slowdown_note

        with open_store(db) as store:  # writable: a recorded run gets its graph first
            frames = {what: slowdown(store, run_name, by=by)}
        if not as_json:
            for line in slowdown_note(frames[what]):
                click.echo(line, err=True)
    else:
        with open_store(db, read_only=True) as store:
            frames = analyze(
                store,
                what,
                run_name,
                compare=compare,
                iteration=iteration,
                ranks=ranks,
                window=window,  # type: ignore[arg-type]
                threshold_pct=threshold_pct,
                min_ns=min_ns,
                rank_map=rmap,
                iteration_map=imap,
            )
            empty = [k for k, v in frames.items() if v.is_empty()]
            hint = exemplar_hint(store, run_name, ranks) if empty else ""
            unranked = (
                nothing_to_rank(store, run_name, iteration=iteration)
                if what == "skew" and not empty and not as_json
                else None
            )
    if empty and not as_json:
        where = describe_selection(run_name, ranks=ranks, iteration=iteration)
        for name in empty:
            why = hint or _EMPTY_WHY.get(name if len(frames) > 1 else what, "")
            if what == "diff" and name == "divergence" and not hint:
                click.echo(
                    f"divergence: none between run {run_name!r} and {compare!r}: no op starts"
                    f" more than {threshold_pct:g} % of its iteration away from its place"
                    " (--threshold-pct sets the bar)",
                    err=True,
                )
                continue
            click.echo(f"{name}: nothing for {where}{why}", err=True)
    if unranked is not None:
        # All-zero rows in rank-id order would read as a ranking with rank 0 first.
        where = describe_selection(run_name, ranks=ranks, iteration=iteration)
        click.echo(f"skew: nothing to rank for {where}: {unranked}", err=True)
        frames = {k: v for k, v in frames.items() if k != "skew"}
    if "rank_step" in frames and not as_json:
        click.echo(
            f"{what}: from the collective rows (the class exemplars and --keep-events ranks);"
            " rank_step: every rank of the world, from the rank_step table",
            err=True,
        )
    if as_json:
        out: object = {k: _json_rows(v) for k, v in frames.items()}
        if len(frames) == 1:
            out = _json_rows(next(iter(frames.values())))
        click.echo(json.dumps(out, default=_json_value, indent=1, allow_nan=False))
    else:
        with pl.Config(tbl_rows=max_rows, tbl_cols=-1, fmt_str_lengths=60, tbl_width_chars=200):
            for name, df in frames.items():
                if df.is_empty():
                    continue
                if len(frames) > 1:
                    click.echo(f"{name}:")
                click.echo(str(df))


@main.command("report")
@db_argument()
@run_option("Run to report on (any kind).")
@click.option("--compare", default=None, help="Another run to compare iteration times with.")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="HTML file.")
@follow_symlinks_option()
@_one_line_errors
def report_cmd(
    db: Path, run_name: str, compare: str | None, out: Path, follow_symlinks: bool
) -> None:
    """A self-contained HTML report: timelines, breakdowns, waits, iteration times, memory."""
    from prism_trace.analysis.report.html import write_report
    from prism_trace.store.connection import open_store

    with open_store(db, read_only=True) as store:
        summary = write_report(
            store, run=run_name, out=out, compare=compare, follow_symlinks=follow_symlinks
        )
    click.echo(summary.summary())

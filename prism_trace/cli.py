"""The `prism` command line: parse arguments, call one function, print the result.

Each command imports what it needs inside its function, so `prism ingest` never loads torch and
start-up stays fast. Every ``PrismError`` becomes one line on stderr and exit status 1.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from prism_trace.errors import PrismError
from prism_trace.ranks import RankList

F = TypeVar("F", bound=Callable[..., Any])
RANKS = RankList()


def _one_line_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PrismError as exc:
            click.echo(f"error: {str(exc).splitlines()[0]}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def _given_flags() -> set[str]:
    """The current command's parameters that the user set (not left at their defaults)."""
    ctx = click.get_current_context()
    return {
        name
        for name in ctx.params
        if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)
    }


class _Guarded(click.Group):
    """The top-level group: no raw exception ever escapes a command.

    A ``PrismError`` is one line (``error: <file>: <problem>``); anything else is a bug or an
    input no check foresaw, and also becomes one line naming its type, unless ``--debug`` asks
    for the traceback. Click's own exits (usage errors, ``--help``, Ctrl-C) pass through.
    """

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Click's usage errors print three lines (usage, hint, error): here they are one."""
        standalone = kwargs.pop("standalone_mode", True)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "prism"
            click.echo(f"error: {exc.format_message()} (see `{where} --help`)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        if not standalone:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except PrismError as exc:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {str(exc).splitlines()[0] if str(exc) else exc!r}", err=True)
            sys.exit(1)
        except Exception as exc:  # the last line of defence: one line, not a traceback
            if ctx.params.get("debug"):
                raise
            text = str(exc).splitlines()[0] if str(exc) else ""
            click.echo(
                f"error: unexpected {type(exc).__name__}: {text[:300]} (run with --debug for"
                " the traceback)",
                err=True,
            )
            sys.exit(2)


@click.group(cls=_Guarded)
@click.version_option(package_name="prism-trace")
@click.option("--debug", is_flag=True, help="Show the traceback of an unexpected error.")
def main(debug: bool) -> None:
    """prism: ingest profiler traces of a few ranks, and reason about the whole job."""


@main.command("ingest")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--db", required=True, type=click.Path(path_type=Path), help="DuckDB store.")
@click.option("--run", "run_name", default=None, help="Run name (default: the first path's name).")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["auto", "kineto", "host_et", "chakra", "op_timeline"]),
    default="auto",
    show_default=True,
)
@click.option("--rank", type=int, default=None, help="Rank of a single file that does not say.")
@click.option("--replace", is_flag=True, help="Overwrite an existing run of that name.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Files read at the same time, each in a worker process (default: the number of cores;"
    " 1 reads them in this process). More memory per file in flight.",
)
@click.option("--jobs", type=click.IntRange(min=1), default=None, hidden=True)
@click.option(
    "--engine",
    type=click.Choice(["local", "dask"]),
    default="local",
    show_default=True,
    help="Where workers run: processes here, or dask.distributed (prism-trace[cluster]).",
)
@click.option(
    "--scheduler",
    default=None,
    help="With --engine dask: the scheduler's address (default: a local cluster of --workers).",
)
@click.option(
    "--scratch",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Directory for work files and the workers' parts (default: the temp dir); with"
    " --scheduler, one every worker sees at the same path.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
@click.option("--json", "as_json", is_flag=True, help="Print the ingest report as JSON.")
@click.option(
    "--layout",
    "layout_spec",
    default=None,
    help="The recorded job's layout, e.g. tp=8 (when the trace does not say it).",
)
@click.option("--order", default=None, help="Axis order of --layout (default tp-cp-ep-dp-pp).")
@_one_line_errors
def ingest_cmd(
    paths: tuple[Path, ...],
    db: Path,
    run_name: str | None,
    fmt: str,
    rank: int | None,
    replace: bool,
    workers: int | None,
    jobs: int | None,
    engine: str,
    scheduler: str | None,
    scratch: Path | None,
    quiet: bool,
    as_json: bool,
    layout_spec: str | None,
    order: str | None,
) -> None:
    """Ingest trace files or folders (the ranks of one job) into DB as one run."""
    from prism_trace.ingest import ingest
    from prism_trace.layout import declare_layout
    from prism_trace.parallel import ParallelLayout
    from prism_trace.store import open_store

    declared = None if layout_spec is None else ParallelLayout.parse(layout_spec, order)
    name = run_name or paths[0].resolve().name.split(".")[0]
    with open_store(db) as store:
        report = ingest(
            store,
            list(paths),
            run=name,
            format=fmt,  # type: ignore[arg-type]
            rank=rank,
            replace=replace,
            progress=not quiet and sys.stderr.isatty(),
            workers=workers or jobs or os.cpu_count() or 1,  # --jobs: the former name
            engine=engine,  # type: ignore[arg-type]
            scheduler=scheduler,
            scratch=scratch,
        )
        if declared is not None:
            try:
                declare_layout(store, name, declared)
            except PrismError:
                from prism_trace.ingest import _delete_run

                with store.transaction() as con:  # all or nothing, like the ingest itself
                    _delete_run(con, report.run_id)
                raise
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    elif not quiet:
        rows = ", ".join(f"{v} {k}" for k, v in report.rows.items() if v)
        click.echo(
            f"run {report.run!r}: {len(report.ranks)} ranks of {report.world_size}"
            f" from {len(report.files)} files: {rows}"
        )
        for r, n in sorted(report.et_ops.items()):
            click.echo(f"  rank {r}: {report.et_ops_linked[r]}/{n} host ET ops linked to Kineto")
        if report.skipped:
            click.echo(f"  skipped {len(report.skipped)} files that are not traces")


@main.command("info")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", default=None, help="Only this run, in detail.")
@click.option("--ranks", type=RANKS, default=None, help="With --run: these ranks, one line each.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_one_line_errors
def info_cmd(db: Path, run_name: str | None, ranks: list[int] | None, as_json: bool) -> None:
    """Runs; with --run, its ranks (classes when sliced or emulated), groups and step times."""
    from prism_trace.info import describe_run, list_runs, render_run
    from prism_trace.jsonout import dumps
    from prism_trace.store import open_store

    if ranks is not None and run_name is None:
        msg = "--ranks goes with --run"
        raise PrismError(msg)
    with open_store(db, read_only=True) as store:
        if run_name is None:
            runs = list_runs(store)
            out: Any = {"runs": runs}
            if not as_json:
                for r in runs:
                    click.echo(
                        f"{r['name']:<24} {r['kind']:<9} ranks {r['ranks']}/{r['world_size']}"
                        f"  iterations {r['iterations']}  source {r['source_format']}"
                    )
                return
        else:
            out = describe_run(store, run_name, ranks=ranks)
            if not as_json:
                click.echo(render_run(out))
                return
    click.echo(dumps(out))


@main.command("query")
@click.argument("args", nargs=-1, required=True, metavar="[DB] SQL")
@click.option(
    "--parquet",
    default=None,
    help="Query a `prism export parquet` folder (local path or s3://...) instead of DB.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "csv", "json", "parquet"]),
    default="table",
    show_default=True,
)
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None)
@click.option("--max-rows", type=int, default=50, show_default=True, help="Rows shown as table.")
@_one_line_errors
def query_cmd(
    args: tuple[str, ...], parquet: str | None, fmt: str, output: Path | None, max_rows: int
) -> None:
    """Run SQL against DB (read-only), or against a Parquet export, and print or write it."""
    from prism_trace.analysis import load_views
    from prism_trace.query import run_query
    from prism_trace.store import open_store

    if len(args) != (1 if parquet else 2):
        msg = "give DB and SQL, or --parquet DIR and SQL"
        raise click.UsageError(msg)
    if parquet:
        from prism_trace.parquet import open_parquet

        opened = open_parquet(parquet)
    else:
        opened = open_store(Path(args[0]), read_only=True)
    with opened as store:
        text = run_query(
            store,
            args[-1],
            fmt=fmt,  # type: ignore[arg-type]
            output=output,
            max_rows=max_rows,
            prepare=load_views,
        )
    if text:
        click.echo(text, nl=not text.endswith("\n"))


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
@click.argument("db", type=click.Path(path_type=Path))
@click.argument(
    "what",
    type=click.Choice(
        [
            "temporal",
            "kernels",
            "overlap",
            "idle",
            "skew",
            "bubbles",
            "bubble-windows",
            "critical-path",
            "critical-path-summary",
            "diff",
            "slowdown",
        ]
    ),
)
@click.option("--run", "run_name", required=True, help="Run to analyse (any kind).")
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
@click.option("--min-ns", type=int, default=0, show_default=True, help="bubbles: shortest window.")
@click.option("--json", "as_json", is_flag=True, help="Rows as JSON.")
@click.option("--max-rows", type=int, default=50, show_default=True, help="Rows shown as table.")
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
) -> None:
    """Answer WHAT about a run: temporal/kernel breakdown, overlap, idle time, collective skew,
    pipeline bubbles, critical path across ranks, its diff with another run, or its straggler
    slowdown (emulated with and without typical op times, `--by` a group)."""
    import polars as pl

    from prism_trace.analysis import analyze, describe_selection
    from prism_trace.analysis.selection import exemplar_hint
    from prism_trace.store import open_store

    ranks = ranks_text
    empty: list[str] = []
    if what == "slowdown":
        from prism_trace.replay.slowdown import slowdown

        with open_store(db) as store:  # writable: a recorded run gets its graph first
            frames = {what: slowdown(store, run_name, by=by)}
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
            )
            empty = [k for k, v in frames.items() if v.is_empty()]
            hint = exemplar_hint(store, run_name, ranks) if empty else ""
    if empty and not as_json:
        where = describe_selection(run_name, ranks=ranks, iteration=iteration)
        for name in empty:
            why = hint or _EMPTY_WHY.get(name if len(frames) > 1 else what, "")
            click.echo(f"{name}: nothing for {where}{why}", err=True)
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


@main.command("graph")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Recorded run.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--layout",
    "layout_spec",
    default=None,
    help="Declare (or correct) the recorded layout, e.g. tp=8.",
)
@click.option("--order", default=None, help="Axis order of --layout (default tp-cp-ep-dp-pp).")
@_one_line_errors
def graph_cmd(
    db: Path, run_name: str, as_json: bool, layout_spec: str | None, order: str | None
) -> None:
    """Build the per-rank execution graph of a run and check collectives match across ranks."""
    from prism_trace.collectives import match_comms
    from prism_trace.graph import build_graph
    from prism_trace.layout import choose_layout, declare_layout
    from prism_trace.parallel import ParallelLayout, assign_axes
    from prism_trace.store import open_store
    from prism_trace.symmetry import missing_ranks, symmetric_partners

    declared = None if layout_spec is None else ParallelLayout.parse(layout_spec, order)
    with open_store(db) as store:
        if declared is not None:
            declare_layout(store, run_name, declared)
        report = build_graph(store, run_name)
        # Give every rank its role coordinates and every group its axis, when the groups allow.
        choice = choose_layout(store, run_name)
        copies: list[int] = []
        if choice.layout is not None:
            copies = symmetric_partners(choice.layout, list(report.ranks))[0].tolist()
        match = match_comms(store, run_name, copies=copies)
        if choice.layout is not None:
            try:
                assign_axes(store, run_name, choice.layout)
            except PrismError as exc:
                choice.error = str(exc).splitlines()[0]
                choice.layout = None
        layout_text = choice.text()
        ((world,),) = store.con.execute(
            "SELECT world_size FROM run WHERE run_id = ?", [report.run_id]
        ).fetchall()
        missing = missing_ranks(int(world or 0), list(report.ranks), choice.layout)
    if as_json:
        out = {
            "graph": report.as_dict(),
            "comms": match.as_dict(),
            "layout": choice.as_dict(),
            "missing_ranks": missing,
        }
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(
            f"run {run_name!r}: {report.nodes} nodes, {report.edges} edges over"
            f" {len(report.ranks)} ranks in {report.seconds:.2f} s"
        )
        for note in report.notes():
            click.echo(f"  {note}")
        m = match.as_dict()
        with_copies = (
            f" ({m['complete_with_copies']} with the TP/CP copies)"
            if m["complete_with_copies"] != m["complete"]
            else ""
        )
        click.echo(
            f"collectives: {m['complete']}/{m['instances']} instances complete{with_copies};"
            f" p2p: {m['p2p_pairs']} pairs, {m['p2p_unpaired']} unpaired"
        )
        by_trace = [e for e in match.matching if e["mode"] == "trace"]
        if by_trace:
            click.echo(
                f"  {len(by_trace)} groups ({sum(int(e['calls']) for e in by_trace)} calls)"  # type: ignore[call-overload]
                " matched by trace: group and sequence from the trace"
            )
        for entry in match.matching:
            mode = entry["mode"]
            if mode == "trace":
                continue
            how = "left unmatched" if mode == "unmatched" else f"matched by {mode}"
            click.echo(
                f"  group {entry['group']!r}: {entry['calls']} calls {how} ({entry['reason']})"
            )
        if match.mixed:
            click.echo(f"warning: {match.mixed} instances join calls of different kinds or sizes")
        if not match.ok:
            click.echo(f"warning: {match.message()}")
        if missing:
            label = "partial recording" if "not recorded" in missing else "recording"
            click.echo(f"{label}: {missing}")
        click.echo(layout_text)


@main.command("slice")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Recorded run to slice.")
@click.option("--layout", required=True, help="Target layout, e.g. tp=8,cp=1,ep=1,dp=128,pp=8.")
@click.option("--world", type=int, required=True, help="Target world size.")
@click.option("--order", default=None, help="Axis order, fastest first (default tp-cp-ep-dp-pp).")
@click.option(
    "--from-ranks", type=RANKS, default=None, help="Recorded ranks to take roles from, e.g. 0,3."
)
@click.option("--out-run", required=True, help="Name of the sliced run.")
@click.option("--replace", is_flag=True, help="Overwrite an existing run of that name.")
@click.option("--json", "as_json", is_flag=True, help="Print the mapping report as JSON.")
@_one_line_errors
def slice_cmd(
    db: Path,
    run_name: str,
    layout: str,
    world: int,
    order: str | None,
    from_ranks: list[int] | None,
    out_run: str,
    replace: bool,
    as_json: bool,
) -> None:
    """Build the full-scale graph of WORLD ranks from the recorded ranks of RUN."""
    from prism_trace.parallel import ParallelLayout
    from prism_trace.slicing import slice_run
    from prism_trace.store import open_store

    with open_store(db) as store:
        report = slice_run(
            store,
            run=run_name,
            layout=ParallelLayout.parse(layout, order),
            world=world,
            from_ranks=from_ranks,
            out_run=out_run,
            replace=replace,
        )
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        click.echo(report.summary())


@main.command("emulate")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Recorded or sliced run.")
@click.option("--out-run", required=True, help="Name of the emulated run.")
@click.option("--replace", is_flag=True, help="Overwrite an existing run of that name.")
@click.option(
    "--what-if",
    "what_ifs",
    multiple=True,
    help="Repeatable: slow-ranks=3,5..7@1.2 | slow-ops=GLOB@1.5 | slow-kind=kernel@1.1 |"
    " remove-gpu=RANK | dp=N | bandwidth=FACTOR | variance[=iteration|op].",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the variance mode.")
@click.option(
    "--keep-events",
    "keep_events",
    type=RANKS,
    default=None,
    help="Ranks whose own per-op events are written (default: class exemplars only): 5,9..11.",
)
@click.option(
    "--topology",
    "system",
    type=click.Choice(["generic", "a100", "h100", "h200"]),
    default="generic",
    show_default=True,
    help="Network preset of the transfer model (docs/network.md).",
)
@click.option(
    "--timing",
    "timing_model",
    type=click.Choice(["scaled", "recorded", "alpha_beta"]),
    default="scaled",
    show_default=True,
    help="Transfer times: recorded, carried to a new scale by the model, or the pure model.",
)
@click.option("--calibrate", is_flag=True, help="Fit the network model to recorded collectives.")
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path),
    default=None,
    help="TOML of the emulation's sections (docs/network.md); flags given override it.",
)
@click.option(
    "--partial",
    is_flag=True,
    help="A recording of some ranks: complete each collective over the ranks present.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_one_line_errors
def emulate_cmd(
    db: Path,
    run_name: str,
    out_run: str,
    replace: bool,
    what_ifs: tuple[str, ...],
    seed: int,
    keep_events: list[int] | None,
    system: str,
    timing_model: str,
    calibrate: bool,
    config_file: Path | None,
    partial: bool,
    as_json: bool,
) -> None:
    """Discrete-event emulation of RUN's graph; the result is a run of kind `emulated`."""
    from dataclasses import replace as with_

    from prism_trace.replay import EmulationConfig, emulate_run
    from prism_trace.replay.config_file import load_emulation_config
    from prism_trace.replay.whatif import parse_what_if
    from prism_trace.store import open_store

    config = EmulationConfig() if config_file is None else load_emulation_config(config_file)
    given = _given_flags()
    if what_ifs:
        config = with_(config, what_if=parse_what_if(what_ifs))
    if "seed" in given or config_file is None:
        config = with_(config, seed=seed)
    if "system" in given or config_file is None:
        config = with_(config, topology=with_(config.topology, system=system))
    if "timing_model" in given or config_file is None:
        config = with_(config, timing=with_(config.timing, model=timing_model))
    if calibrate:
        config = with_(config, timing=with_(config.timing, calibrate=True))
    if partial:
        config = with_(config, replay=with_(config.replay, allow_partial=True))
    if keep_events:
        config = with_(config, keep_events=tuple(keep_events))
    with open_store(db) as store:
        report = emulate_run(store, run=run_name, out_run=out_run, replace=replace, config=config)
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else report.summary())


@main.command("replay")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Recorded or sliced run.")
@click.option("--ranks", type=RANKS, required=True, help="Ranks to replay with real kernels: 0,5.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--out-run", required=True, help="Name of the replayed run.")
@click.option("--iterations", type=int, default=3, show_default=True, help="Measured passes.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Passes not measured.")
@click.option("--substitute-recorded", is_flag=True, help="Unsupported ops: recorded duration.")
@click.option("--gaps", type=click.Choice(["recorded", "none"]), default="recorded")
@click.option("--instrument", type=click.Choice(["none", "profiler"]), default="none")
@click.option(
    "--call-overhead/--no-call-overhead",
    default=True,
    show_default=True,
    help="Under --instrument profiler, spend the recorded gaps less the replay's own cost of"
    " calling each op outside its profiled span (measured in two calibration passes).",
)
@click.option("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads).")
@click.option(
    "--recorded-lifetimes/--op-lifetimes",
    default=True,
    show_default=True,
    help="Free each result when the recording's allocator did (when it has allocator events"
    " and that is after the result's last use), or right after its last use.",
)
@click.option(
    "--wait",
    type=click.Choice(["auto", "spin", "sleep"]),
    default="auto",
    show_default=True,
    help="Waits for gaps and virtual peers: spin on the clock, or sleep through long ones"
    " (auto: spin when each replaying process has cores of its own).",
)
@click.option(
    "--together/--one-by-one",
    default=True,
    show_default=True,
    help="Several ranks: one process each, talking through torch.distributed; or one after the"
    " other in this process, each seeing the others as virtual peers.",
)
@click.option("--replace", is_flag=True, help="Overwrite an existing replayed run.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_one_line_errors
def replay_cmd(
    db: Path,
    run_name: str,
    ranks: list[int],
    device: str,
    out_run: str,
    iterations: int,
    warmup: int,
    substitute_recorded: bool,
    gaps: str,
    instrument: str,
    call_overhead: bool,
    threads: int | None,
    recorded_lifetimes: bool,
    wait: str,
    together: bool,
    replace: bool,
    as_json: bool,
) -> None:
    """Replay RANKS of RUN with real kernels; the other ranks are virtual peers."""
    from prism_trace.replay.hybrid import ReplayOptions, replay_run
    from prism_trace.store import open_store

    options = ReplayOptions(
        device=device,  # type: ignore[arg-type]
        iterations=iterations,
        warmup=warmup,
        substitute_recorded=substitute_recorded,
        gaps=gaps,  # type: ignore[arg-type]
        instrument=instrument,  # type: ignore[arg-type]
        call_overhead=call_overhead,
        threads=threads,
        recorded_lifetimes=recorded_lifetimes,
        wait=wait,
        together=together,
    )
    with open_store(db) as store:
        report = replay_run(
            store, run=run_name, ranks=ranks, out_run=out_run, options=options, replace=replace
        )
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else report.summary())


@main.command("validate")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", default=None, help="A run whose ranks were all recorded.")
@click.option("--replayed", default=None, help="Instead: a replayed run against its recording.")
@click.option("--slice-ranks", type=RANKS, default=None, help="Ranks to slice from, e.g. 0..6:2.")
@click.option(
    "--variance",
    type=click.Choice(["iteration", "op"]),
    default=None,
    help="Also emulate the slice with each replica drawing its durations (seeded).",
)
@click.option("--seeds", type=int, default=5, show_default=True, help="Seeds of --variance.")
@click.option(
    "--allow-partial",
    is_flag=True,
    help="A run missing ranks: replay the recorded ones (collectives over the ranks present).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_one_line_errors
def validate_cmd(
    db: Path,
    run_name: str | None,
    replayed: str | None,
    slice_ranks: list[int] | None,
    variance: str | None,
    seeds: int,
    allow_partial: bool,
    as_json: bool,
) -> None:
    """Iteration-time error of emulating RUN from all its ranks, and from a slice of them."""
    from prism_trace.replay import validate_run
    from prism_trace.store import open_store

    if replayed is not None:
        from prism_trace.replay.validate import validate_replayed

        with open_store(db, read_only=True) as store:
            rv = validate_replayed(store, replayed=replayed)
        click.echo(json.dumps(rv.as_dict(), indent=2) if as_json else rv.summary())
        return
    if run_name is None:
        msg = "give --run RUN (or --replayed NAME)"
        raise click.UsageError(msg)
    with open_store(db) as store:
        report = validate_run(
            store,
            run=run_name,
            slice_ranks=slice_ranks,
            variance=variance,  # type: ignore[arg-type]
            seeds=seeds,
            allow_partial=allow_partial,
        )
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else report.summary())


@main.command(
    "run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option("--world", "world_size", required=True, type=int, help="Ranks of the emulated job.")
@click.option(
    "--ranks", type=RANKS, default="0", show_default=True, help="Ranks to run for real, e.g. 0,1."
)
@click.option("--db", type=click.Path(path_type=Path), default=None, help="Store with --run.")
@click.option("--run", "run_name", default=None, help="Run whose timing the virtual peers follow.")
@click.option("--timeout-s", type=float, default=None, help="Stop every rank after this long.")
@click.option("--out-run", default=None, help="Store the step times as this replayed run.")
@click.option("--replace", is_flag=True, help="Overwrite an existing replayed run (--out-run).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_one_line_errors
def run_cmd(
    world_size: int,
    ranks: list[int],
    db: Path | None,
    run_name: str | None,
    timeout_s: float | None,
    out_run: str | None,
    replace: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Run an unmodified training COMMAND as --ranks of a --world job; the rest are virtual."""
    from prism_trace.replay.launch import launch

    if out_run is not None and (db is None or run_name is None):
        msg = "--out-run needs --db and --run (the replayed run's parent)"
        raise PrismError(msg)
    res = launch(
        list(command),
        world_size=world_size,
        ranks=ranks,
        db=db,
        run=run_name,
        timeout_s=timeout_s,
    )
    click.echo(json.dumps(res.as_dict(), indent=2) if as_json else res.summary(), err=not as_json)
    if out_run is not None and res.returncode == 0:
        from prism_trace.replay.launched_run import write_launched_run
        from prism_trace.store import open_store

        with open_store(db) as store:  # type: ignore[arg-type]
            write_launched_run(
                store, run=run_name, out_run=out_run, result=res, command=command, replace=replace
            )  # type: ignore[arg-type]
        click.echo(
            f"wrote replayed run {out_run!r}; compare: prism validate {db} --replayed {out_run}",
            err=True,
        )
    sys.exit(res.returncode)


@main.command("report")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Run to report on (any kind).")
@click.option("--compare", default=None, help="Another run to compare iteration times with.")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="HTML file.")
@_one_line_errors
def report_cmd(db: Path, run_name: str, compare: str | None, out: Path) -> None:
    """A self-contained HTML report: timelines, breakdowns, waits, iteration times, memory."""
    from prism_trace.analysis.report import write_report
    from prism_trace.store import open_store

    with open_store(db, read_only=True) as store:
        summary = write_report(store, run=run_name, out=out, compare=compare)
    click.echo(summary.summary())


@main.group("export")
def export_group() -> None:
    """Write a run in another tool's format."""


@export_group.command("chakra")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Run to export (recorded or sliced).")
@click.option("-o", "--out-dir", required=True, type=click.Path(path_type=Path))
@click.option("--prefix", default=None, help="File prefix (default: the run name).")
@click.option(
    "--size-bandwidth",
    type=float,
    default=50.0,
    show_default=True,
    help="GB/s of the size rule for communication without a recorded size (docs/export.md).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_one_line_errors
def export_chakra_cmd(
    db: Path,
    run_name: str,
    out_dir: Path,
    prefix: str | None,
    size_bandwidth: float,
    quiet: bool,
    as_json: bool,
) -> None:
    """One Chakra ET protobuf per rank, `<prefix>.<rank>.et`, streamed (8192 ranks included)."""
    from prism_trace.export import export_chakra
    from prism_trace.store import open_store

    with open_store(db) as store:
        report = export_chakra(
            store,
            run=run_name,
            out_dir=out_dir,
            prefix=prefix,
            progress=not quiet and sys.stderr.isatty(),
            size_bandwidth_gbps=size_bandwidth,
        )
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    elif not quiet:
        click.echo(report.summary())
    elif report.warnings():
        click.echo("\n".join(report.warnings()), err=True)


@export_group.command("perfetto")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Run to export (any kind).")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help=".json[.gz]")
@click.option(
    "--ranks",
    "ranks_text",
    type=RANKS,
    default=None,
    help="Expand: one process per listed rank (e.g. 0,5,4096..4099), each from its own events or"
    " its class exemplar's. Default: one process per stored rank (a class exemplar, named with"
    " its ranks).",
)
@_one_line_errors
def export_perfetto_cmd(db: Path, run_name: str, out: Path, ranks_text: list[int] | None) -> None:
    """A Chrome trace JSON that Perfetto and chrome://tracing open, for any run."""
    from prism_trace.export_perfetto import export_perfetto
    from prism_trace.store import open_store

    ranks = ranks_text
    with open_store(db, read_only=True) as store:
        info = export_perfetto(store, run=run_name, out=out, ranks=ranks)
    click.echo(
        f"wrote {info['path']}: {info['events']} events of {info['ranks']} ranks,"
        f" {info['bytes'] / 1e6:.1f} MB in {info['seconds']:.2f} s"
    )


@export_group.command("parquet")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "runs", multiple=True, help="Run to export (repeatable; default: all).")
@click.option("-o", "--out-dir", required=True, type=click.Path(path_type=Path))
@_one_line_errors
def export_parquet_cmd(db: Path, runs: tuple[str, ...], out_dir: Path) -> None:
    """Every table as hive-partitioned Parquet, DIR/<table>/rank=<r>/*.parquet (any engine)."""
    from prism_trace.parquet import export_parquet
    from prism_trace.store import open_store

    with open_store(db, read_only=True) as store:
        report = export_parquet(store, out_dir, runs=list(runs) or None)
    click.echo(report.summary())


if __name__ == "__main__":
    main()

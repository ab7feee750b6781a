"""The `prism` command line: parse arguments, call one function, print the result.

Each command imports what it needs inside its function, so `prism ingest` never loads torch and
start-up stays fast. Every ``PrismError`` becomes one line on stderr and exit status 1.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from prism_trace.errors import PrismError

F = TypeVar("F", bound=Callable[..., Any])


def _one_line_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PrismError as exc:
            click.echo(f"error: {str(exc).splitlines()[0]}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


class _Guarded(click.Group):
    """The top-level group: no raw exception ever escapes a command.

    A ``PrismError`` is one line (``error: <file>: <problem>``); anything else is a bug or an
    input no check foresaw, and also becomes one line naming its type, unless ``--debug`` asks
    for the traceback. Click's own exits (usage errors, ``--help``, Ctrl-C) pass through.
    """

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
    "--jobs",
    type=int,
    default=1,
    show_default=True,
    help="Files read at the same time: faster on idle cores, more memory per file in flight.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
@click.option("--json", "as_json", is_flag=True, help="Print the ingest report as JSON.")
@_one_line_errors
def ingest_cmd(
    paths: tuple[Path, ...],
    db: Path,
    run_name: str | None,
    fmt: str,
    rank: int | None,
    replace: bool,
    jobs: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Ingest trace files or folders (the ranks of one job) into DB as one run."""
    from prism_trace.ingest import ingest
    from prism_trace.store import open_store

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
            jobs=jobs,
        )
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
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_one_line_errors
def info_cmd(db: Path, run_name: str | None, as_json: bool) -> None:
    """Runs, ranks, world size, iterations, process groups and per-rank iteration times."""
    from prism_trace.info import describe_run, list_runs, render_run
    from prism_trace.store import open_store

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
            out = describe_run(store, run_name)
            if not as_json:
                click.echo(render_run(out))
                return
    click.echo(json.dumps(out, indent=2, default=str))


@main.command("query")
@click.argument("db", type=click.Path(path_type=Path))
@click.argument("sql")
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
def query_cmd(db: Path, sql: str, fmt: str, output: Path | None, max_rows: int) -> None:
    """Run SQL against DB (read-only) and print or write the result."""
    from prism_trace.analysis import load_views
    from prism_trace.query import run_query
    from prism_trace.store import open_store

    with open_store(db, read_only=True) as store:
        text = run_query(
            store,
            sql,
            fmt=fmt,  # type: ignore[arg-type]
            output=output,
            max_rows=max_rows,
            prepare=load_views,
        )
    if text:
        click.echo(text, nl=not text.endswith("\n"))


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
        ]
    ),
)
@click.option("--run", "run_name", required=True, help="Run to analyse (any kind).")
@click.option("--compare", default=None, help="diff: the other run (differences are OTHER - RUN).")
@click.option("--iteration", type=int, default=None, help="Only this iteration.")
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
    threshold_pct: float,
    min_ns: int,
    as_json: bool,
    max_rows: int,
) -> None:
    """Answer WHAT about a run: temporal/kernel breakdown, overlap, idle time, collective skew,
    pipeline bubbles, critical path across ranks, or its diff with another run."""
    import polars as pl

    from prism_trace.analysis import analyze
    from prism_trace.store import open_store

    with open_store(db, read_only=True) as store:
        frames = analyze(
            store,
            what,
            run_name,
            compare=compare,
            iteration=iteration,
            threshold_pct=threshold_pct,
            min_ns=min_ns,
        )
    if as_json:
        out: object = {k: v.to_dicts() for k, v in frames.items()}
        if len(frames) == 1:
            out = next(iter(frames.values())).to_dicts()
        click.echo(json.dumps(out, default=str, indent=1))
    else:
        with pl.Config(tbl_rows=max_rows, tbl_cols=-1, fmt_str_lengths=60, tbl_width_chars=200):
            for name, df in frames.items():
                if len(frames) > 1:
                    click.echo(f"{name}:")
                click.echo(str(df))


@main.command("graph")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Recorded run.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_one_line_errors
def graph_cmd(db: Path, run_name: str, as_json: bool) -> None:
    """Build the per-rank execution graph of a run and check collectives match across ranks."""
    from prism_trace.collectives import match_comms
    from prism_trace.graph import build_graph
    from prism_trace.parallel import assign_axes, infer_layout
    from prism_trace.store import open_store

    with open_store(db) as store:
        report = build_graph(store, run_name)
        match = match_comms(store, run_name)
        # Give every rank its role coordinates and every group its axis, when the groups allow.
        try:
            layout = infer_layout(store, run_name)
            assign_axes(store, run_name, layout)
            layout_text = f"layout {layout.spec} (order {layout.order_spec})"
        except PrismError as exc:
            layout_text = f"layout not inferred: {str(exc).splitlines()[0]}"
    if as_json:
        out = {"graph": report.as_dict(), "comms": match.as_dict(), "layout": layout_text}
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(
            f"run {run_name!r}: {report.nodes} nodes, {report.edges} edges over"
            f" {len(report.ranks)} ranks in {report.seconds:.2f} s"
        )
        for note in report.notes():
            click.echo(f"  {note}")
        m = match.as_dict()
        click.echo(
            f"collectives: {m['complete']}/{m['instances']} instances complete;"
            f" p2p: {m['p2p_pairs']} pairs, {m['p2p_unpaired']} unpaired"
        )
        if not match.ok:
            click.echo(f"warning: {match.message()}")
        click.echo(layout_text)


@main.command("slice")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Recorded run to slice.")
@click.option("--layout", required=True, help="Target layout, e.g. tp=8,cp=1,ep=1,dp=128,pp=8.")
@click.option("--world", type=int, required=True, help="Target world size.")
@click.option("--order", default=None, help="Axis order, fastest first (default tp-cp-ep-dp-pp).")
@click.option("--from-ranks", default=None, help="Recorded ranks to take roles from, e.g. 0,3.")
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
    from_ranks: str | None,
    out_run: str,
    replace: bool,
    as_json: bool,
) -> None:
    """Build the full-scale graph of WORLD ranks from the recorded ranks of RUN."""
    from prism_trace.parallel import ParallelLayout
    from prism_trace.slicing import slice_run
    from prism_trace.store import open_store

    ranks = None if from_ranks is None else [int(r) for r in from_ranks.split(",") if r.strip()]
    with open_store(db) as store:
        report = slice_run(
            store,
            run=run_name,
            layout=ParallelLayout.parse(layout, order),
            world=world,
            from_ranks=ranks,
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
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_one_line_errors
def emulate_cmd(
    db: Path,
    run_name: str,
    out_run: str,
    replace: bool,
    what_ifs: tuple[str, ...],
    seed: int,
    system: str,
    timing_model: str,
    calibrate: bool,
    as_json: bool,
) -> None:
    """Discrete-event emulation of RUN's graph; the result is a run of kind `emulated`."""
    from prism_trace.replay import EmulationConfig, TimingConfig, Topology, emulate_run
    from prism_trace.replay.whatif import parse_what_if
    from prism_trace.store import open_store

    config = EmulationConfig(
        what_if=parse_what_if(what_ifs),
        seed=seed,
        topology=Topology(system=system),
        timing=TimingConfig(model=timing_model, calibrate=calibrate),  # type: ignore[arg-type]
    )
    with open_store(db) as store:
        report = emulate_run(store, run=run_name, out_run=out_run, replace=replace, config=config)
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else report.summary())


@main.command("replay")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Recorded or sliced run.")
@click.option("--ranks", required=True, help="Ranks to replay with real kernels, e.g. 0,5.")
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
    ranks: str,
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
    rank_list = [int(r) for r in ranks.split(",") if r.strip()]
    with open_store(db) as store:
        report = replay_run(
            store, run=run_name, ranks=rank_list, out_run=out_run, options=options, replace=replace
        )
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else report.summary())


@main.command("validate")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", default=None, help="A run whose ranks were all recorded.")
@click.option("--replayed", default=None, help="Instead: a replayed run against its recording.")
@click.option("--slice-ranks", default=None, help="Recorded ranks to slice from, e.g. 0,2,4,6.")
@click.option(
    "--variance",
    type=click.Choice(["iteration", "op"]),
    default=None,
    help="Also emulate the slice with each replica drawing its durations (seeded).",
)
@click.option("--seeds", type=int, default=5, show_default=True, help="Seeds of --variance.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_one_line_errors
def validate_cmd(
    db: Path,
    run_name: str | None,
    replayed: str | None,
    slice_ranks: str | None,
    variance: str | None,
    seeds: int,
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
    ranks = None if slice_ranks is None else [int(r) for r in slice_ranks.split(",") if r]
    with open_store(db) as store:
        report = validate_run(
            store,
            run=run_name,
            slice_ranks=ranks,
            variance=variance,  # type: ignore[arg-type]
            seeds=seeds,
        )
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else report.summary())


@main.command(
    "run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option("--world", "world_size", required=True, type=int, help="Ranks of the emulated job.")
@click.option("--ranks", default="0", show_default=True, help="Ranks to run for real, e.g. 0,1.")
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
    ranks: str,
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
        ranks=[int(r) for r in ranks.split(",") if r],
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
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_one_line_errors
def export_chakra_cmd(
    db: Path, run_name: str, out_dir: Path, prefix: str | None, quiet: bool, as_json: bool
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
        )
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    elif not quiet:
        click.echo(report.summary())


@export_group.command("perfetto")
@click.argument("db", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Run to export (any kind).")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help=".json[.gz]")
@_one_line_errors
def export_perfetto_cmd(db: Path, run_name: str, out: Path) -> None:
    """A Chrome trace JSON that Perfetto and chrome://tracing open, for any run."""
    from prism_trace.export_perfetto import export_perfetto
    from prism_trace.store import open_store

    with open_store(db, read_only=True) as store:
        info = export_perfetto(store, run=run_name, out=out)
    click.echo(
        f"wrote {info['path']}: {info['events']} events of {info['ranks']} ranks,"
        f" {info['bytes'] / 1e6:.1f} MB in {info['seconds']:.2f} s"
    )


if __name__ == "__main__":
    main()

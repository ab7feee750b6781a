"""Commands over traces and the store: ingest, info, query, graph, slice."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import click

from prism_trace.cli._group import RANKS, _one_line_errors, main
from prism_trace.cli._options import (
    WORLD,
    check_run_name_option,
    db_argument,
    declared_layout,
    echo_report,
    follow_symlinks_option,
    json_option,
    layout_options,
    max_rows_option,
    out_run_option,
    quiet_option,
    replace_option,
    run_option,
)
from prism_trace.errors import RunStateError, UsageError
from prism_trace.ranks import AsciiInt

__all__ = ["graph_cmd", "info_cmd", "ingest_cmd", "query_cmd", "slice_cmd"]


@main.command("ingest")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--db", required=True, type=click.Path(path_type=Path), help="DuckDB store.")
@click.option(
    "--run",
    "run_name",
    default=None,
    callback=check_run_name_option,
    help="Run name (default: the first path's name).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["auto", "kineto", "host_et", "chakra", "op_timeline"]),
    default="auto",
    show_default=True,
)
@click.option(
    "--rank",
    type=AsciiInt(),
    default=None,
    help="Rank of one rank's files (a trace and its host ET) that do not say.",
)
@replace_option()
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Files read at the same time, each in a worker process; 1 reads them in this process."
    " Default: one per idle core, but a set of less than 16 MB of JSON, or a machine with fewer"
    " than 2 idle cores, is read in this process, where workers cost more than they save."
    " More memory per file in flight.",
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
@click.option(
    "--allow-empty",
    is_flag=True,
    help="Keep a rank whose trace holds no events or nodes (refused by default).",
)
@click.option(
    "--allow-cycles",
    is_flag=True,
    help="Keep a Chakra graph whose dependencies form a cycle (refused by default: emulate and"
    " slice cannot order it).",
)
@quiet_option()
@json_option("Print the ingest report as JSON.")
@layout_options("The recorded job's layout, e.g. tp=8 (when the trace does not say it).")
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
    allow_empty: bool,
    allow_cycles: bool,
    quiet: bool,
    as_json: bool,
    layout_spec: str | None,
    order: str | None,
) -> None:
    """Ingest trace files or folders (the ranks of one job) into DB as one run."""
    from prism_trace.ingestion.discover import find
    from prism_trace.ingestion.memory import ingest_memory_limit
    from prism_trace.ingestion.parts import preforked
    from prism_trace.ingestion.pipeline import ingesting
    from prism_trace.ingestion.plan import reader_processes
    from prism_trace.layout.declare import declare_layout
    from prism_trace.store.connection import open_store, removed_if_new_and_failed
    from prism_trace.store.write import check_run_name

    ingest_memory_limit()  # a bad PRISM_INGEST_MEMORY_LIMIT stops here, before the store opens
    declared = declared_layout(layout_spec, order)
    name = run_name or check_run_name(
        paths[0].resolve().name.split(".")[0], where=f"{paths[0]}: the run name from its name"
    )
    given = workers or jobs  # --jobs: the former name
    found = find(list(paths), format=fmt)  # type: ignore[arg-type]
    n = reader_processes(found, workers=given or "auto")
    # The workers are forked before the store is opened: a fork must not copy a DuckDB database.
    # The layout is declared inside the ingest's transaction: a refused layout leaves the store
    # as it was, a replaced run included.
    with (
        removed_if_new_and_failed(db) as db_file,
        preforked(n if engine == "local" else 0),
        open_store(db_file, shown_as=db) as store,
        ingesting(
            store,
            list(paths),
            run=name,
            format=fmt,  # type: ignore[arg-type]
            rank=rank,
            replace=replace,
            progress=not quiet and sys.stderr.isatty(),
            workers=given or "auto",
            engine=engine,  # type: ignore[arg-type]
            scheduler=scheduler,
            scratch=scratch,
            found=found,
            allow_empty=allow_empty,
            allow_cycles=allow_cycles,
        ) as report,
    ):
        if declared is not None:
            declare_layout(store, name, declared)
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
@db_argument()
@run_option("Only this run, in detail.", required=False)
@click.option("--ranks", type=RANKS, default=None, help="With --run: these ranks, one line each.")
@click.option(
    "--config",
    "show_config",
    is_flag=True,
    help="With --run: the run's resolved config as TOML (--json: as JSON), which the command"
    " that made it reads back with --config to make the same run.",
)
@json_option("Machine-readable output.")
@_one_line_errors
def info_cmd(
    db: Path, run_name: str | None, ranks: list[int] | None, show_config: bool, as_json: bool
) -> None:
    """Runs; with --run, its ranks (classes when sliced or emulated), groups and step times."""
    from prism_trace.query.info import describe_run, list_runs, render_run
    from prism_trace.query.jsonout import dumps
    from prism_trace.store.connection import open_store

    if ranks is not None and run_name is None:
        msg = "--ranks goes with --run"
        raise UsageError(msg)
    if show_config:
        if run_name is None:
            msg = "--config goes with --run"
            raise UsageError(msg)
        _show_config(db, run_name, as_json=as_json)
        return
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


def _show_config(db: Path, run_name: str, *, as_json: bool) -> None:
    """Print a run's stored resolved config, as TOML for the ``--config`` of its command."""
    from prism_trace.query.info import CONFIGURED_BY, stored_config
    from prism_trace.query.jsonout import dumps
    from prism_trace.store.connection import open_store

    with open_store(db, read_only=True) as store:
        kind, config = stored_config(store, run_name)
    if config is None:
        msg = (
            f"{db}: run {run_name!r} ({kind}) was not made from a config file; its parameters"
            f' are in run.config_json (prism query {db} "SELECT config_json FROM run")'
        )
        raise RunStateError(msg)
    if as_json:
        click.echo(dumps(config))
        return
    from prism_trace.replay.config_file import to_toml

    command = CONFIGURED_BY.get(kind, kind)
    click.echo(f"# resolved config of run {run_name!r}: prism {command} ... --config FILE")
    click.echo(to_toml(config), nl=False)


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
@follow_symlinks_option()
@max_rows_option()
@_one_line_errors
def query_cmd(
    args: tuple[str, ...],
    parquet: str | None,
    fmt: str,
    output: Path | None,
    follow_symlinks: bool,
    max_rows: int,
) -> None:
    """Run SQL against DB (read-only), or against a Parquet export, and print or write it."""
    from prism_trace.analysis import load_views, names_in
    from prism_trace.query.sql import run_query
    from prism_trace.store.connection import open_store

    if len(args) != (1 if parquet else 2):
        msg = "give DB and SQL, or --parquet DIR and SQL"
        raise click.UsageError(msg)
    if parquet:
        from prism_trace.export.parquet import open_parquet

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
            follow_symlinks=follow_symlinks,
            echo=functools.partial(click.echo, nl=False),
            # Only the views the SQL names: creating all of them binds every one.
            prepare=functools.partial(load_views, names=names_in(args[-1])),
        )
    if text:
        click.echo(text, nl=not text.endswith("\n"))
    elif fmt == "json" and output is None:
        click.echo("")  # the streamed JSON ends without a newline


@main.command("graph")
@db_argument()
@run_option("Recorded run.")
@json_option()
@layout_options("Declare (or correct) the recorded layout, e.g. tp=8.")
@_one_line_errors
def graph_cmd(
    db: Path, run_name: str, as_json: bool, layout_spec: str | None, order: str | None
) -> None:
    """Build the per-rank execution graph of a run and check collectives match across ranks."""
    from prism_trace.graph.set_up import set_up_graph
    from prism_trace.store.connection import open_store

    declared = declared_layout(layout_spec, order)
    with open_store(db) as store:
        setup = set_up_graph(store, run_name, declared=declared)
    if as_json:
        click.echo(json.dumps(setup.as_dict(), indent=2))
    else:
        click.echo("\n".join(setup.lines(run_name)))


@main.command("slice")
@db_argument()
@run_option("Recorded run to slice.")
@click.option("--layout", required=True, help="Target layout, e.g. tp=8,cp=1,ep=1,dp=128,pp=8.")
@click.option("--world", type=WORLD, required=True, help="Target world size.")
@click.option("--order", default=None, help="Axis order, fastest first (default tp-cp-ep-dp-pp).")
@click.option(
    "--from-ranks", type=RANKS, default=None, help="Recorded ranks to take roles from, e.g. 0,3."
)
@click.option(
    "--global-batch",
    type=click.Choice(["per-rank", "fixed"]),
    default="per-rank",
    show_default=True,
    help="per-rank: each rank keeps its recorded microbatches; fixed: the job keeps its global"
    " batch, each rank runs m * dp_recorded / dp_target.",
)
@click.option(
    "--microbatches",
    type=click.IntRange(min=1),
    default=None,
    help="The target's microbatches per rank and step (instead of --global-batch fixed).",
)
@out_run_option("Name of the sliced run.")
@replace_option()
@json_option("Print the mapping report as JSON.")
@_one_line_errors
def slice_cmd(
    db: Path,
    run_name: str,
    layout: str,
    world: int,
    order: str | None,
    from_ranks: list[int] | None,
    global_batch: str,
    microbatches: int | None,
    out_run: str,
    replace: bool,
    as_json: bool,
) -> None:
    """Build the full-scale graph of WORLD ranks from the recorded ranks of RUN."""
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.slicer import slice_run
    from prism_trace.store.connection import open_store

    with open_store(db) as store:
        report = slice_run(
            store,
            run=run_name,
            layout=ParallelLayout.parse(layout, order),
            world=world,
            from_ranks=from_ranks,
            out_run=out_run,
            replace=replace,
            global_batch=global_batch,
            microbatches=microbatches,
        )
    echo_report(report, as_json)

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


@click.group()
@click.version_option(package_name="prism-trace")
def main() -> None:
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
    from prism_trace.query import run_query
    from prism_trace.store import open_store

    with open_store(db, read_only=True) as store:
        text = run_query(store, sql, fmt=fmt, output=output, max_rows=max_rows)  # type: ignore[arg-type]
    if text:
        click.echo(text, nl=not text.endswith("\n"))


if __name__ == "__main__":
    main()

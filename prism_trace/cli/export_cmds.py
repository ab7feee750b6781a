"""`prism export`: a run in another tool's format (Chakra, Perfetto, Parquet)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from prism_trace.cli._group import RANKS, _one_line_errors, main
from prism_trace.cli._options import (
    db_argument,
    echo_report,
    follow_symlinks_option,
    json_option,
    quiet_option,
    run_option,
)

__all__ = ["export_chakra_cmd", "export_group", "export_parquet_cmd", "export_perfetto_cmd"]


@main.group("export")
def export_group() -> None:
    """Write a run in another tool's format."""


@export_group.command("chakra")
@db_argument()
@run_option("Run to export (recorded or sliced).")
@click.option("-o", "--out-dir", required=True, type=click.Path(path_type=Path))
@follow_symlinks_option()
@click.option("--prefix", default=None, help="File prefix (default: the run name).")
@click.option(
    "--size-bandwidth",
    type=float,
    default=50.0,
    show_default=True,
    help="GB/s of the size rule for communication without a recorded size (docs/export.md).",
)
@quiet_option()
@json_option()
@_one_line_errors
def export_chakra_cmd(
    db: Path,
    run_name: str,
    out_dir: Path,
    follow_symlinks: bool,
    prefix: str | None,
    size_bandwidth: float,
    quiet: bool,
    as_json: bool,
) -> None:
    """One Chakra ET protobuf per rank, `<prefix>.<rank>.et`, streamed (8192 ranks included)."""
    from prism_trace.export.chakra.writer import export_chakra
    from prism_trace.store.connection import open_store

    with open_store(db) as store:
        report = export_chakra(
            store,
            run=run_name,
            out_dir=out_dir,
            prefix=prefix,
            progress=not quiet and sys.stderr.isatty(),
            size_bandwidth_gbps=size_bandwidth,
            follow_symlinks=follow_symlinks,
        )
    if as_json or not quiet:
        echo_report(report, as_json)
    elif report.warnings():
        click.echo("\n".join(report.warnings()), err=True)


@export_group.command("perfetto")
@db_argument()
@run_option("Run to export (any kind).")
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
@follow_symlinks_option()
@_one_line_errors
def export_perfetto_cmd(
    db: Path, run_name: str, out: Path, ranks_text: list[int] | None, follow_symlinks: bool
) -> None:
    """A Chrome trace JSON that Perfetto and chrome://tracing open, for any run."""
    from prism_trace.export.perfetto import export_perfetto
    from prism_trace.store.connection import open_store

    ranks = ranks_text
    with open_store(db, read_only=True) as store:
        info = export_perfetto(
            store, run=run_name, out=out, ranks=ranks, follow_symlinks=follow_symlinks
        )
    click.echo(
        f"wrote {info['path']}: {info['events']} events of {info['ranks']} ranks,"
        f" {info['bytes'] / 1e6:.1f} MB in {info['seconds']:.2f} s"
    )


@export_group.command("parquet")
@db_argument()
@click.option("--run", "runs", multiple=True, help="Run to export (repeatable; default: all).")
@click.option("-o", "--out-dir", required=True, type=click.Path(path_type=Path))
@follow_symlinks_option()
@_one_line_errors
def export_parquet_cmd(
    db: Path, runs: tuple[str, ...], out_dir: Path, follow_symlinks: bool
) -> None:
    """Every table as hive-partitioned Parquet, DIR/<table>/rank=<r>/*.parquet (any engine)."""
    from prism_trace.export.parquet import export_parquet
    from prism_trace.store.connection import open_store

    with open_store(db, read_only=True) as store:
        report = export_parquet(
            store, out_dir, runs=list(runs) or None, follow_symlinks=follow_symlinks
        )
    click.echo(report.summary())

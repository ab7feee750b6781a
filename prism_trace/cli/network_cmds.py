"""`prism network fit|predict`: a network model fitted on nccl-tests logs, and its predictions.

The emulator reads the fitted file with ``prism emulate --network net.toml`` or a config's
``[network] file = "net.toml"`` (docs/network.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from prism_trace.cli._group import _one_line_errors, main
from prism_trace.cli._options import json_option

__all__ = ["network_fit_cmd", "network_group", "network_predict_cmd"]


@main.group("network")
def network_group() -> None:
    """A network model fitted on nccl-tests logs (docs/network.md)."""


@network_group.command("fit")
@click.argument("logs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--out",
    "out",
    required=True,
    type=click.Path(path_type=Path),
    help="The model file to write (TOML, one [network] table).",
)
@json_option("Print the fitted model as JSON.")
@_one_line_errors
def network_fit_cmd(logs: tuple[Path, ...], out: Path, as_json: bool) -> None:
    """Fit bandwidths, latencies, algorithm choice and efficiencies to nccl-tests LOGS.

    LOGS are the outputs of all_reduce_perf, all_gather_perf, reduce_scatter_perf,
    alltoall_perf or sendrecv_perf, with their `# Using devices` blocks (ranks and nodes).
    """
    from prism_trace.replay.network.fit import fit_network, log_errors
    from prism_trace.replay.network.io import write_network_file
    from prism_trace.replay.network.parse import read_nccl_logs
    from prism_trace.replay.network.predict import choice_by_size

    parsed = read_nccl_logs(list(logs))
    model = fit_network(parsed)
    header = "written by `prism network fit " + " ".join(str(p) for p in logs) + "`"
    write_network_file(model, out, header=header)
    scales = sorted({(lg.op, lg.ranks or 0, lg.nodes or 0) for lg in parsed})
    choices = {f"{op}@{r}r/{n}n": choice_by_size(model, op, r, n) for op, r, n in scales if r and n}
    if as_json:
        table = model.as_table()
        table["choice_by_size"] = {k: [list(p) for p in v] for k, v in choices.items()}
        click.echo(json.dumps(table, indent=2))
        return
    click.echo(
        f"fitted {len(parsed)} test(s), {sum(len(lg.rows) for lg in parsed)} rows:"
        f" {', '.join(model.fitted_from)}"
    )
    click.echo(
        f"intra {model.intra_gbps:.1f} GB/s, inter {model.inter_gbps:.1f} GB/s per GPU,"
        f" NVLS {model.nvls_gbps:.1f} GB/s; latency scales base {model.base_latency_scale:.3g},"
        f" intra {model.intra_latency_scale:.3g}, inter {model.inter_latency_scale:.3g}"
    )
    err = model.fit_error if model.fit_error is not None else float("nan")
    click.echo(f"median |error| on the fitted rows: {100 * err:.1f} %")
    per_log = ", ".join(
        f"{k} {'no rows' if v is None else f'{100 * v:.1f} %'}"
        for k, v in log_errors(model, parsed)
    )
    click.echo(f"median |error| per log: {per_log}")
    failed = [(lg.path, r.line) for lg in parsed for r in lg.rows if r.failed_check]
    if failed:
        where = ", ".join(f"{Path(f).name}:{line}" for f, line in failed[:5])
        more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
        click.echo(
            f"data check failed (#wrong > 0) on {len(failed)} row(s), whose failed columns are"
            f" left out: {where}{more}"
        )
    click.echo(f"determined by the logs: {', '.join(model.determined) or 'none'}")
    for label, pairs in choices.items():
        steps = ", ".join(f"{c} from {_size(b)}" for b, c in pairs)
        click.echo(f"choice by size, {label}: {steps}")
    click.echo(f"wrote {out}")


def _size(b: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift:
            return f"{b >> shift} {unit}"
    return f"{b} B"


@network_group.command("predict")
@click.argument("model_file", type=click.Path(path_type=Path))
@click.option("--op", required=True, help="all_reduce, all_gather, reduce_scatter, alltoall, ...")
@click.option("--ranks", type=int, required=True, help="Participating ranks.")
@click.option(
    "--ranks-per-node",
    type=int,
    default=None,
    help="Ranks per node (default: the fitted cluster's).",
)
@click.option(
    "--bytes",
    "sizes",
    multiple=True,
    required=True,
    help="Repeatable: message size in nccl-tests' terms (1048576, 1M, 8G).",
)
@json_option("Print the predictions as JSON.")
@_one_line_errors
def network_predict_cmd(
    model_file: Path,
    op: str,
    ranks: int,
    ranks_per_node: int | None,
    sizes: tuple[str, ...],
    as_json: bool,
) -> None:
    """Predicted time (us) and bus bandwidth of OP over RANKS ranks for each --bytes size."""
    from prism_trace.replay.network.io import read_network_file
    from prism_trace.replay.network.predict import parse_size, predict_sizes

    model = read_network_file(model_file)
    rows = predict_sizes(
        model, op, ranks, [parse_size(s) for s in sizes], ranks_per_node=ranks_per_node
    )
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    first = rows[0]
    click.echo(f"# {first.op}, {first.ranks} ranks on {first.nodes} node(s)")
    click.echo(f"{'bytes':>14} {'time_us':>12} {'algbw_GB/s':>11} {'busbw_GB/s':>11}  algorithm")
    for r in rows:
        click.echo(
            f"{r.bytes:>14} {r.time_us:>12.2f} {r.algbw_gbps:>11.2f} {r.busbw_gbps:>11.2f}"
            f"  {r.algorithm}"
        )

"""The arguments and options several `prism` commands share, declared once so they read alike.

Each helper returns a click decorator; the help text is the command's own where its meaning differs
(which run `--run` names, what `--json` prints), and the name, type and default are the same
everywhere. `echo_report` is how every command prints its report, as text or as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import click

from prism_trace.errors import NotAStoreError, UsageError
from prism_trace.limits import MAX_RANKS
from prism_trace.ranks import AsciiInt

if TYPE_CHECKING:
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.replay.emulate.config import EmulationConfig

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "WORLD",
    "WorldSize",
    "check_run_name_option",
    "config_option",
    "db_argument",
    "declared_layout",
    "echo_report",
    "emulation_config",
    "existing_store",
    "follow_symlinks_option",
    "json_option",
    "layout_options",
    "max_rows_option",
    "out_run_option",
    "partial_option",
    "quiet_option",
    "replace_option",
    "run_option",
]


def existing_store(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """Refuse a missing ``DB`` before the command opens it: opening a missing file writable
    would create an empty store, and every command taking ``DB`` works on runs already in one
    (only `prism ingest --db` creates a store)."""
    if value is not None and not (value.exists() or value.is_symlink()):
        msg = f"{value}: no such database"
        raise NotAStoreError(msg)
    return value


def db_argument() -> Callable[[F], F]:
    """``DB``: the DuckDB store the command reads or writes; it must exist."""
    return click.argument("db", type=click.Path(path_type=Path), callback=existing_store)


def run_option(help: str, *, required: bool = True) -> Callable[[F], F]:
    """``--run NAME`` (the function's ``run_name``): the run the command works on."""
    return click.option("--run", "run_name", required=required, default=None, help=help)


def check_run_name_option(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> str | None:
    """A click callback: refuse a run name no run may be stored under, before any store opens.

    The rule is ``store_write.check_run_name``'s, which every writer applies again.
    """
    if value is not None:
        from prism_trace.store.write import check_run_name

        check_run_name(value, where=param.opts[0] if param.opts else "--run")
    return value


def out_run_option(help: str, *, required: bool = True) -> Callable[[F], F]:
    """``--out-run NAME``: the run the command writes (a name ``check_run_name`` accepts)."""
    return click.option(
        "--out-run", required=required, default=None, help=help, callback=check_run_name_option
    )


class WorldSize(click.ParamType):
    """A world size in ``[1, MAX_RANKS]``: refused while parsing, before anything is sized by it
    (a world of 10**12 ranks would otherwise be allocated, rank by rank)."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """``value`` as an int in range, or one usage-error line."""
        n = value if isinstance(value, int) else AsciiInt().convert(value, param, ctx)
        if not 1 <= n <= MAX_RANKS:
            self.fail(f"{n} is outside [1, {MAX_RANKS}] (the world-size limit)", param, ctx)
        return n


WORLD = WorldSize()


def replace_option(help: str = "Overwrite an existing run of that name.") -> Callable[[F], F]:
    """``--replace``: overwrite the run the command writes when one of that name exists."""
    return click.option("--replace", is_flag=True, help=help)


def json_option(help: str = "Print the report as JSON.") -> Callable[[F], F]:
    """``--json`` (the function's ``as_json``): machine-readable output."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def partial_option(help: str) -> Callable[[F], F]:
    """``--partial``: a recording of some ranks (``--allow-partial`` is its old name)."""
    return click.option("--partial", "--allow-partial", "partial", is_flag=True, help=help)


def config_option(help: str) -> Callable[[F], F]:
    """``--config FILE.toml`` (``config_file``): the command's typed sections; flags override it."""
    return click.option(
        "--config", "config_file", type=click.Path(path_type=Path), default=None, help=help
    )


def network_option() -> Callable[[F], F]:
    """``--network net.toml`` (``network_file``): a fitted network model prices every
    collective (``emulation_config``)."""
    return click.option(
        "--network",
        "network_file",
        type=click.Path(path_type=Path),
        default=None,
        help="A network model from `prism network fit` (net.toml): it prices every collective.",
    )


def emulation_config(config_file: Path | None, network_file: Path | None) -> EmulationConfig:
    """The emulation config of ``--config`` (its notes on stderr; the defaults without one),
    with ``--network``'s model where given: one reading for every command that emulates."""
    from dataclasses import replace as with_

    from prism_trace.replay.config_file import load_emulation_config
    from prism_trace.replay.emulate.config import EmulationConfig

    notes: list[str] = []
    config = EmulationConfig() if config_file is None else load_emulation_config(config_file, notes)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if network_file is not None:
        from prism_trace.replay.network.io import read_network_file

        config = with_(config, network=read_network_file(network_file))
    return config


def quiet_option() -> Callable[[F], F]:
    """``--quiet``/``-q``: no progress bar or summary."""
    return click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")


def follow_symlinks_option() -> Callable[[F], F]:
    """``--follow-symlinks``: write where a symbolic link at ``-o`` points, even out of its
    folder (``prism_trace.outputs``); without it such a link is refused."""
    return click.option(
        "--follow-symlinks",
        is_flag=True,
        help="Write where a symbolic link given as -o points, even outside its folder.",
    )


def max_rows_option() -> Callable[[F], F]:
    """``--max-rows N``: rows shown when the result prints as a table."""
    return click.option(
        "--max-rows",
        type=click.IntRange(min=0),  # a negative count was taken (and shown every row)
        default=50,
        show_default=True,
        help="Rows shown as table.",
    )


def layout_options(help: str) -> Callable[[F], F]:
    """``--layout SPEC`` (``layout_spec``) and ``--order``: a recorded layout the user declares."""
    layout = click.option("--layout", "layout_spec", default=None, help=help)
    order = click.option(
        "--order", default=None, help="Axis order of --layout (default tp-cp-ep-dp-pp)."
    )

    def decorator(f: F) -> F:
        return layout(order(f))

    return decorator


def declared_layout(spec: str | None, order: str | None) -> ParallelLayout | None:
    """The layout ``--layout``/``--order`` declare, or None when ``--layout`` is not given.

    Raises:
        UsageError: ``--order`` without ``--layout`` (it would be silently ignored).
    """
    if spec is None:
        if order is not None:
            msg = "--order goes with --layout (it orders the axes --layout sizes)"
            raise UsageError(msg)
        return None
    from prism_trace.layout.mesh import ParallelLayout  # here: `prism --help` stays fast

    return ParallelLayout.parse(spec, order)


class _Report(Protocol):
    def as_dict(self) -> dict[str, Any]: ...

    def summary(self) -> str: ...


def echo_report(report: _Report, as_json: bool, *, err: bool = False) -> None:
    """Print ``report`` as indented JSON (``--json``) or as its summary."""
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else report.summary(), err=err)

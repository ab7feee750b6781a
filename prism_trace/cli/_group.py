"""The `prism` group itself: one-line errors, and the helpers every command module shares.

Commands live in the sibling modules, one per layer they drive; each imports what it needs inside
its function, so `prism ingest` never loads torch and start-up stays fast.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from prism_trace.errors import PrismError
from prism_trace.ranks import RankList

__all__ = ["RANKS", "_given_flags", "_one_line_errors", "main"]

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


def _damaged_store(exc: BaseException) -> str | None:
    """DuckDB's word that a store's block is damaged, met in the middle of a command (DuckDB
    reads data blocks lazily), as one line naming the store last opened; else None."""
    import duckdb

    if not isinstance(exc, duckdb.Error | OSError):
        return None
    from prism_trace.store.connection import opened_stores
    from prism_trace.store.integrity import corrupt_store_error

    opened = opened_stores()
    if not opened:
        return None
    damaged = corrupt_store_error(opened[-1], exc)
    return None if damaged is None else str(damaged)


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
            # click types main() by its overloads on standalone_mode; this passes it through.
            rv = super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
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
            # (not one f-string: `!r` would apply to the whole conditional, quoting every message)
            line = str(exc).splitlines()[0] if str(exc) else repr(exc)
            click.echo(f"error: {line}", err=True)
            sys.exit(1)
        except Exception as exc:  # the last line of defence: one line, not a traceback
            if ctx.params.get("debug"):
                raise
            damaged = _damaged_store(exc)
            if damaged is not None:
                click.echo(f"error: {damaged}", err=True)
                sys.exit(1)
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

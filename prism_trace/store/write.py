"""Every write of a run to the store: minting its id and row, updating it, its rows, dropping it.

The only module that writes `run` rows. Ingest, slicing, emulation, replay and declaring a
layout call these inside one ``Store.transaction()``, so a run appears whole or not at all, and
each rule (ids are ``max + 1``; a name is taken only with ``--replace`` and only over a run of
the same kind; rows match the table by column name) lives in one place.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import unicodedata
from datetime import datetime, timezone
from typing import Any

import duckdb
import polars as pl

from prism_trace.errors import DuplicateRunError, RunStateError, UsageError
from prism_trace.store.connection import Store
from prism_trace.store.tables import TABLES, table

__all__ = [
    "RUN_TABLES",
    "append",
    "check_run_name",
    "claim_run_name",
    "drop_run",
    "new_run",
    "next_run_id",
    "set_run_config",
    "set_run_world_size",
]

RUN_TABLES = tuple(t.name for t in TABLES if t.name not in ("meta", "run"))
"""The tables whose rows belong to one run (keyed by ``run_id``)."""

_frames = itertools.count()
_LAST_RUN_ID = "last_run_id"
"""The `meta` key holding the highest run id given so far."""


def append(
    con: duckdb.DuckDBPyConnection, table_name: str, df: pl.DataFrame, *, run_id: int | None = None
) -> int:
    """Insert ``df``'s rows into ``table_name``, columns matched by name; returns the row count.

    Args:
        con: the connection of the open transaction.
        table_name: a table of ``prism_trace.store.tables``.
        df: rows; columns the table lacks are ignored, columns it has but ``df`` lacks get their
            default (NULL).
        run_id: the run the rows belong to, when ``df`` has no ``run_id`` column.
    """
    if df.is_empty():
        return 0
    cols = [c for c in table(table_name).column_names if c in df.columns]
    if run_id is not None:
        cols = [c for c in cols if c != "run_id"]
    name = f"_prism_frame_{next(_frames)}"
    con.register(name, df.select(cols).to_arrow())
    target = (["run_id"] if run_id is not None else []) + cols
    source = ([str(int(run_id))] if run_id is not None else []) + cols
    try:
        con.execute(
            f"INSERT INTO {table_name} ({', '.join(target)}) SELECT {', '.join(source)} FROM {name}"
        )
    finally:
        # After a failed insert the transaction is aborted and unregistering fails too; the
        # insert's own error is the one to report.
        with contextlib.suppress(duckdb.Error):
            con.unregister(name)
    return df.height


def drop_run(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Delete a run: its rows in every run table, then its `run` row."""
    for table_name in RUN_TABLES:
        con.execute(f"DELETE FROM {table_name} WHERE run_id = ?", [run_id])
    con.execute("DELETE FROM run WHERE run_id = ?", [run_id])


def new_run(
    con: duckdb.DuckDBPyConnection,
    *,
    name: str,
    kind: str,
    world_size: int,
    source_format: str | None,
    config: dict[str, Any],
    parent_run_id: int | None = None,
    run_id: int | None = None,
) -> int:
    """Insert a run's row, minting its id unless ``run_id`` (from ``next_run_id``) is given.

    The id is recorded as the store's last one, so an id is never reused, not even by a run that
    replaces the last run: a stale id can never name another run.
    """
    if run_id is None:
        run_id = next_run_id(con)
    con.execute("DELETE FROM meta WHERE key = ?", [_LAST_RUN_ID])
    con.execute("INSERT INTO meta VALUES (?, ?)", [_LAST_RUN_ID, str(run_id)])
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    con.execute(
        "INSERT INTO run (run_id, name, kind, parent_run_id, world_size, source_format,"
        " created_at, config_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [run_id, name, kind, parent_run_id, world_size, source_format, now, json.dumps(config)],
    )
    return run_id


def set_run_config(con: duckdb.DuckDBPyConnection, run_id: int, config: dict[str, Any]) -> None:
    """Replace a run's ``config_json`` (declaring a layout keeps it there, beside the rest).

    Args:
        con: the connection of the open transaction.
        run_id: the run.
        config: the whole new configuration (read it, change it, write it back).
    """
    con.execute("UPDATE run SET config_json = ? WHERE run_id = ?", [json.dumps(config), run_id])


def set_run_world_size(con: duckdb.DuckDBPyConnection, run_id: int, world_size: int) -> None:
    """Set a run's ``world_size``: a declared layout larger than the recorded world widens it (a
    recording of some ranks of a larger job)."""
    con.execute("UPDATE run SET world_size = ? WHERE run_id = ?", [world_size, run_id])


def next_run_id(con: duckdb.DuckDBPyConnection) -> int:
    """The id the next run gets (for a writer that stores rows before the run's own row).

    One more than the highest id the store ever gave, so ids are minted inside the writer's
    transaction, which holds DuckDB's write lock: two writers never mint the same one.
    """
    ((next_id,),) = con.execute(
        "SELECT greatest((SELECT coalesce(max(run_id), 0) FROM run),"
        " (SELECT coalesce(max(TRY_CAST(value AS BIGINT)), 0) FROM meta WHERE key = ?)) + 1",
        [_LAST_RUN_ID],
    ).fetchall()
    return int(next_id)


def check_run_name(name: str, *, where: str = "run name") -> str:
    """``name`` if a run may be called so: not blank, and no control characters.

    A blank name cannot be told apart in ``prism info`` or typed back as ``--run``, and a newline
    or escape in one breaks every one-line message and table that prints it.

    Raises:
        UsageError: the name is empty or only spaces, or holds a control character.
    """
    if not name.strip():
        msg = f"{where} {name!r}: a run name cannot be blank"
        raise UsageError(msg)
    if any(unicodedata.category(ch).startswith("C") for ch in name):
        msg = f"{where} {name!r}: a run name cannot hold control characters"
        raise UsageError(msg)
    return name


def claim_run_name(
    store: Store, name: str, *, replace: bool, over: tuple[str, ...] | None = None
) -> int | None:
    """Check that a new run may take ``name``; returns the id of the run it replaces, if any.

    Args:
        store: the store.
        name: the new run's name.
        replace: ``--replace`` was given.
        over: the kinds of run ``--replace`` may overwrite (None: any). An emulation never
            overwrites a recording, say, whatever the flag.

    Raises:
        DuplicateRunError: the name exists and ``replace`` is False.
        UsageError: the name is not one ``check_run_name`` accepts.
        RunStateError: it belongs to a run of a kind not in ``over``.
    """
    check_run_name(name, where=f"{store.path}: run name")
    old = store.run_id(name)
    if old is None:
        return None
    if not replace:
        msg = f"{store.path}: run {name!r} already exists; pass --replace to overwrite it"
        raise DuplicateRunError(msg)
    ((old_kind,),) = store.con.execute("SELECT kind FROM run WHERE run_id = ?", [old]).fetchall()
    if over is not None and old_kind not in over:
        msg = (
            f"{store.path}: run {name!r} is a {old_kind} run; --replace only overwrites"
            f" {' or '.join(over)} runs"
        )
        raise RunStateError(msg)
    return old

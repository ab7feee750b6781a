"""The DuckDB settings of the store's connection while an ingest runs, put back afterwards."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import duckdb

from prism_trace.ingestion import memory as ingest_memory
from prism_trace.store.connection import Store

__all__: list[str] = []


@contextlib.contextmanager
def _ingest_settings(store: Store, memory_limit: int) -> Iterator[float]:
    """DuckDB settings for the ingest, put back afterwards (they are the whole database's);
    yields the memory limit in force, in bytes.

    - ``memory_limit`` set to ``memory_limit`` (``ingest_memory.ingest_memory_limit``) when the
      store's is DuckDB's default (80% of RAM, which lets one large trace's sorts and joins grow
      to several times the file); under it they spill to the store's temporary directory. A
      limit the caller set on the store is kept, and is the one in force. DuckDB shows the limit
      rounded, so ours is put back by RESET.
    - ``preserve_insertion_order`` on: the Kineto reader numbers the records of a trace by the
      order a CREATE TABLE AS keeps (``formats.kineto``).
    """
    con = store.con
    limit_sql = "SELECT current_setting('memory_limit')"
    (limit,) = con.execute(limit_sql).fetchall()[0]
    ours = limit == _default_memory_limit()
    (keep_order,) = con.execute("SELECT current_setting('preserve_insertion_order')").fetchall()[0]
    if ours:
        con.execute(f"SET memory_limit = '{memory_limit}B'")
    con.execute("SET preserve_insertion_order = true")
    try:
        yield memory_limit if ours else ingest_memory.size_bytes(str(limit))
    finally:
        if ours:
            con.execute("RESET memory_limit")
        con.execute(f"SET preserve_insertion_order = {'true' if keep_order else 'false'}")


@functools.cache
def _default_memory_limit() -> str:
    """DuckDB's default ``memory_limit`` as it shows it, asked once a process: opening a
    connection to ask costs ~20 ms, twice an ingest."""
    with duckdb.connect() as fresh:
        (default,) = fresh.execute("SELECT current_setting('memory_limit')").fetchall()[0]
    return str(default)

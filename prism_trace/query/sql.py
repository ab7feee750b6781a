"""`prism query`: run read-only SQL and render it as a table, CSV, JSON or parquet."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import duckdb
import polars as pl

from prism_trace.errors import QueryError, UsageError
from prism_trace.outputs import output_file, write_errors
from prism_trace.query.jsonout import dumps
from prism_trace.store.connection import Store

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["check_one_reading_statement", "run_query"]

_WRITES_FILES = {
    duckdb.StatementType.COPY: "COPY writes files",
    duckdb.StatementType.EXPORT: "EXPORT DATABASE writes files",
    duckdb.StatementType.ATTACH: "ATTACH creates or opens another database",
}
"""Statements a read-only query refuses: the store is opened read-only, but these would still
write (or create) files beside it. The answer is `-o FILE` or `prism export parquet`."""


def check_one_reading_statement(sql: str) -> None:
    """Refuse SQL that is not exactly one statement, or one that writes files.

    An empty statement printed an empty table; of several, only the last one's result was
    shown; and ``COPY ... TO`` wrote a file through a command that promises to be read-only.

    Raises:
        QueryError: no statement, more than one, or a COPY, EXPORT or ATTACH.
    """
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error:
        return  # running it reports the syntax error, naming the store
    if not statements:
        msg = 'the SQL is empty; give one statement, e.g. "SELECT name FROM run"'
        raise QueryError(msg)
    if len(statements) > 1:
        msg = f"the SQL holds {len(statements)} statements; give one (its result is printed)"
        raise QueryError(msg)
    why = _WRITES_FILES.get(statements[0].type)
    if why is not None:
        msg = (
            f"the query is read-only and {why}; write a result with -o FILE"
            " (--format csv|json|parquet), or a whole store with `prism export parquet`"
        )
        raise QueryError(msg)


def run_query(
    store: Store,
    sql: str,
    *,
    fmt: Literal["table", "csv", "json", "parquet"] = "table",
    output: Path | None = None,
    max_rows: int = 50,
    prepare: Callable[[duckdb.DuckDBPyConnection], object] | None = None,
) -> str:
    """Run ``sql`` and return its text rendering, or write it to ``output`` and return "".

    ``prepare`` runs on the query's cursor first: the CLI uses it to define the analysis views,
    which this layer may not import.

    Raises:
        QueryError: the SQL fails (the message is DuckDB's first line), is not one statement
            or writes files (``check_one_reading_statement``).
        UsageError: parquet without ``-o``.
        OutputError: ``output`` is a folder or cannot be written.
    """
    if fmt == "parquet" and output is None:
        msg = "parquet output needs -o FILE"
        raise UsageError(msg)
    check_one_reading_statement(sql)
    try:
        # A cursor has no pending result of earlier statements, which ``sql()`` requires.
        cur = store.con.cursor()
        if prepare is not None:
            prepare(cur)
        rel = cur.sql(sql)
        df = pl.DataFrame() if rel is None else _frame(rel.to_arrow_table())
    except duckdb.Error as exc:
        msg = f"{store.path}: query failed: {str(exc).splitlines()[0]}"
        raise QueryError(msg) from exc
    if output is not None:
        output_file(output)
    if fmt == "parquet":
        with write_errors(output):  # type: ignore[arg-type]
            df.write_parquet(output)  # type: ignore[arg-type]
        return ""
    if fmt == "csv":
        text = _flat(df).write_csv()
    elif fmt == "json":
        text = dumps(df.to_dicts(), indent=1)
    else:
        with pl.Config(tbl_rows=max_rows, tbl_cols=-1, fmt_str_lengths=60, tbl_width_chars=200):
            text = str(df)
    if output is not None:
        with write_errors(output):
            output.write_text(text)
        return ""
    return text


def _flat(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with its list and struct columns as JSON text: CSV has no nested values."""
    nested = [name for name, dtype in df.schema.items() if dtype.is_nested()]
    return df.with_columns(
        pl.when(pl.col(name).is_null())
        .then(None)
        # Encoding a one-field struct gives '{"v":<value>}'; the value's JSON is what is inside.
        .otherwise(
            pl.struct(pl.col(name).alias("v")).struct.json_encode().str.slice(5).str.head(-1)
        )
        .alias(name)
        for name in nested
    )


def _frame(table: pa.Table) -> pl.DataFrame:
    """A query result as a DataFrame (``pl.from_arrow`` is typed to return a Series too)."""
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)  # a Table always converts to a DataFrame
    return df

"""`prism query`: run read-only SQL and render it as a table, CSV, JSON or parquet."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import duckdb
import polars as pl

from prism_trace.errors import PrismError, QueryError, UsageError
from prism_trace.outputs import atomic_file, output_file
from prism_trace.query.jsonout import dumps
from prism_trace.store.connection import Store
from prism_trace.store.integrity import corrupt_store_error

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
    echo: Callable[[str], None] | None = None,
    follow_symlinks: bool = False,
) -> str:
    """Run ``sql`` and return its text rendering, or write it to ``output`` and return "".

    Work is bounded by what is shown: a table fetches ``max_rows + 1`` rows (one more tells
    whether there are more), so ``select * from range(600000000)`` prints 50 rows without
    materialising the rest; CSV, JSON and Parquet stream in batches of ``_BATCH`` rows, to
    ``output`` (written beside it and renamed into place, ``atomic_file``) or to ``echo``.

    ``prepare`` runs on the query's cursor first: the CLI uses it to define the analysis views,
    which this layer may not import.

    Raises:
        QueryError: the SQL fails (the message is DuckDB's first line), is not one statement
            or writes files (``check_one_reading_statement``).
        UsageError: parquet without ``-o``.
        OutputError: ``output`` is a folder, a device, FIFO or socket, a link out of its
            folder, or cannot be written.
    """
    if fmt == "parquet" and output is None:
        msg = "parquet output needs -o FILE"
        raise UsageError(msg)
    if max_rows < 0:
        msg = f"`--max-rows` {max_rows} is negative"
        raise UsageError(msg)
    check_one_reading_statement(sql)
    if output is not None:
        output_file(output, create=False, follow_symlinks=follow_symlinks)
    with _failures(store):
        # A cursor has no pending result of earlier statements, which ``sql()`` requires.
        cur = store.con.cursor()
        if prepare is not None:
            prepare(cur)
        rel = cur.sql(sql)
        if fmt == "table" and output is None:
            return _table(rel, max_rows)
    if output is None:
        chunks: list[str] = []
        _stream(store, rel, fmt, echo or chunks.append)
        return "".join(chunks)
    with atomic_file(output, follow_symlinks=follow_symlinks) as tmp:
        if fmt == "parquet":
            _parquet(store, rel, tmp)
        elif fmt == "table":
            tmp.write_text(_table(rel, max_rows))
        else:
            with tmp.open("w") as fh:
                _stream(store, rel, fmt, fh.write)
    return ""


_BATCH = 65536
"""Rows per batch when a result is streamed (CSV, JSON, Parquet)."""


@contextlib.contextmanager
def _failures(store: Store) -> Iterator[None]:
    """DuckDB's errors while the query runs: one ``QueryError`` line naming the store (an
    error met while a result streams comes through Arrow's reader as an ``OSError``)."""
    try:
        yield
    except (duckdb.Error, OSError) as exc:
        raise _query_error(store, exc) from exc


def _query_error(store: Store, exc: BaseException) -> PrismError:
    """DuckDB's error while a query runs: a damaged store (``CorruptStoreError``) or the SQL's
    own failure (``QueryError``), each one line naming the store."""
    damaged = corrupt_store_error(store.path, exc)
    if damaged is not None:
        return damaged
    return QueryError(f"{store.path}: query failed: {str(exc).splitlines()[0]}")


def _table(rel: duckdb.DuckDBPyRelation | None, max_rows: int) -> str:
    """The first ``max_rows`` rows as a table; only ``max_rows + 1`` are fetched."""
    if rel is None:
        return str(pl.DataFrame())
    # A LIMIT (an ORDER BY becomes a top-N, not a sort of every row) read as a stream: DuckDB's
    # producers stop once its small result buffer is full. (Materialised, an order-preserving
    # LIMIT buffered 1.8 GB for `range(600000000)` once on a loaded host.)
    reader = rel.limit(max_rows + 1).to_arrow_reader(max_rows + 1)
    batches, n = [], 0
    while n <= max_rows:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            break
        batches.append(batch)
        n += batch.num_rows
    reader.close()
    frames = [_frame(_batch_table(b)) for b in batches]
    df = pl.concat(frames) if frames else _frame(reader.schema.empty_table())
    df = df.head(max_rows + 1)
    more = df.height > max_rows
    with pl.Config(tbl_rows=max_rows, tbl_cols=-1, fmt_str_lengths=60, tbl_width_chars=200):
        text = str(df.head(max_rows))
    if more:
        text += (
            f"\nfirst {max_rows} rows shown; the result has more, not fetched"
            " (--max-rows N, a LIMIT, or -o FILE for all of them)"
        )
    return text


def _batches(store: Store, rel: duckdb.DuckDBPyRelation | None) -> Iterator[pl.DataFrame]:
    """The result as DataFrames of at most ``_BATCH`` rows (one empty frame for no rows)."""
    if rel is None:
        yield pl.DataFrame()
        return
    with _failures(store):
        reader = rel.to_arrow_reader(_BATCH)
    first = True
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            break
        except OSError as exc:  # DuckDB's error, raised through Arrow's stream
            raise _query_error(store, exc) from exc
        first = False
        yield _frame(_batch_table(batch))
    if first:
        yield _frame(reader.schema.empty_table())


def _stream(
    store: Store,
    rel: duckdb.DuckDBPyRelation | None,
    fmt: str,
    write: Callable[[str], object],
) -> None:
    """CSV or JSON text of the result, batch by batch, as ``write_csv`` and ``dumps`` of the
    whole frame would give it."""
    if fmt == "csv":
        for i, df in enumerate(_batches(store, rel)):
            write(_flat(df).write_csv(include_header=i == 0))
        return
    n = 0
    for df in _batches(store, rel):
        for row in df.to_dicts():
            text = dumps(row, indent=1).replace("\n", "\n ")
            write(("[\n " if n == 0 else ",\n ") + text)
            n += 1
    write("[]" if n == 0 else "\n]")


def _parquet(store: Store, rel: duckdb.DuckDBPyRelation | None, path: Path) -> None:
    """The result as one Parquet file, written batch by batch."""
    import pyarrow.parquet as pq

    writer = None
    try:
        for df in _batches(store, rel):
            table = df.to_arrow()
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema, compression="zstd")
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()


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


def _batch_table(batch: pa.RecordBatch) -> pa.Table:
    """One record batch as a table (``pl.from_arrow`` of a batch loses nothing either way)."""
    import pyarrow as pa

    return pa.Table.from_batches([batch])


def _frame(table: pa.Table) -> pl.DataFrame:
    """A query result as a DataFrame (``pl.from_arrow`` is typed to return a Series too)."""
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)  # a Table always converts to a DataFrame
    return df

"""A store as hive-partitioned Parquet: `prism export parquet`, and querying such a folder.

``DIR/<table>/rank=<r>/*.parquet`` for the per-rank event and graph tables,
``DIR/<table>/data.parquet`` for the tables of a few rows per rank or run (`_ONE_FILE`),
with one ``DIR/_prism.json`` naming the schema version. Plain DuckDB, polars and Spark read it;
`open_parquet` puts a view named after each table over its files (local paths, or object storage
through DuckDB's httpfs), then the schema's own views, so the same SQL and the analysis views run
on a folder as on a store, and a store can outgrow one file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb

from prism_trace.errors import MissingExtensionError, NotAStoreError, SchemaVersionError
from prism_trace.outputs import atomic_dir, output_dir
from prism_trace.store.connection import Store
from prism_trace.store.declaration import Table
from prism_trace.store.schema import SCHEMA_VERSION
from prism_trace.store.tables import TABLES
from prism_trace.store.views import VIEWS

__all__ = ["ParquetExport", "export_parquet", "open_parquet"]

_MARKER = "_prism.json"

# Tables of a few rows per rank stay one file: at 8192 ranks a folder per rank of a 2-row table is
# 8192 files whose opening (1-3 ms each) costs far more than their data. Tables of events and
# graph nodes, thousands of rows per rank, are partitioned by rank, so a query on a few ranks
# reads only their folders.
_ONE_FILE = frozenset({"meta", "run", "rank", "source_file", "comm_group", "iteration"})


def _partitioned(table: Table) -> bool:
    return table.name not in _ONE_FILE and "rank" in {c.name for c in table.columns}


def _is_remote(root: str) -> bool:
    return "://" in root


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class ParquetExport:
    """What `export_parquet` wrote."""

    out_dir: Path
    runs: list[str]
    rows: dict[str, int]
    seconds: float

    def summary(self) -> str:
        """One paragraph for the CLI."""
        total = sum(self.rows.values())
        tables = ", ".join(f"{n} {t}" for t, n in self.rows.items() if n)
        return (
            f"wrote {self.out_dir}: runs {', '.join(self.runs)}; {total} rows in"
            f" {sum(1 for n in self.rows.values() if n)} tables ({tables}) in {self.seconds:.2f} s"
        )


def export_parquet(
    store: Store,
    out_dir: Path,
    *,
    runs: Sequence[str] | None = None,
    follow_symlinks: bool = False,
) -> ParquetExport:
    """Write ``runs`` (default: all) of ``store`` under ``out_dir`` as hive-partitioned Parquet.

    The ``run`` table is written whole, so names and ancestry resolve; every other table holds
    the chosen runs' rows. DuckDB's COPY does the partitioning, file by file, without Python rows.
    The folder is filled beside ``out_dir`` and renamed into place when complete
    (``atomic_dir``): a failed or killed export leaves no partial folder under its name.

    Raises:
        RunNotFoundError: a run does not exist.
        OutputError: ``out_dir`` is a file, a device, a folder that is not empty, a link out of
            its folder, or cannot be created.
    """
    t0 = time.perf_counter()
    out_dir = output_dir(Path(out_dir), create=False, follow_symlinks=follow_symlinks)
    names = (
        [r[0] for r in store.con.execute("SELECT name FROM run ORDER BY run_id").fetchall()]
        if runs is None
        else list(runs)
    )
    ids = [store.require_run(n) for n in names]
    rows: dict[str, int] = {}
    id_list = ", ".join(map(str, ids)) or "NULL"
    with atomic_dir(out_dir) as tmp:
        for t in TABLES:
            cols = {c.name for c in t.columns}
            where = (
                "" if t.name == "run" or "run_id" not in cols else f" WHERE run_id IN ({id_list})"
            )
            n = store.con.execute(f"SELECT count(*) FROM {t.name}{where}").fetchall()[0][0]
            rows[t.name] = int(n)
            if not n:
                continue
            target = tmp / t.name
            part = ", PARTITION_BY (rank), OVERWRITE_OR_IGNORE" if _partitioned(t) else ""
            dest = target if part else target / "data.parquet"
            target.mkdir(exist_ok=True)
            store.con.execute(
                f"COPY (SELECT * FROM {t.name}{where}) TO {_sql_str(str(dest))}"
                f" (FORMAT parquet, COMPRESSION zstd{part})"
            )
        (tmp / _MARKER).write_text(
            json.dumps({"schema_version": SCHEMA_VERSION, "runs": names}, indent=1) + "\n"
        )
    return ParquetExport(out_dir, names, rows, time.perf_counter() - t0)


def _empty_select(table: Table) -> str:
    cols = ", ".join(f"NULL::{c.type} AS {c.name}" for c in table.columns)
    return f"SELECT {cols} WHERE false"


def open_parquet(root: str | Path) -> Store:
    """A read-only in-memory store whose tables are views over the Parquet folder ``root``.

    Each table's columns are cast to the schema's types (hive partitions come back as strings
    or another integer width otherwise), and a table with no files is an empty view, so every
    query and analysis view of a store works unchanged.

    Raises:
        NotAStoreError: a local ``root`` that is not a prism Parquet export.
        SchemaVersionError: an export of another schema version.
    """
    text = str(root)
    # Extensions load when installed (httpfs for s3:// and https://), never download.
    con = duckdb.connect(
        config={"autoinstall_known_extensions": False, "autoload_known_extensions": True}
    )
    if not _is_remote(text):
        marker = Path(text) / _MARKER
        if not marker.is_file():
            con.close()
            msg = f"{text}: not a prism Parquet export (no {_MARKER}; see `prism export parquet`)"
            raise NotAStoreError(msg)
        found = json.loads(marker.read_text()).get("schema_version")
        if found != SCHEMA_VERSION:
            con.close()
            msg = (
                f"{text}: Parquet export has schema version {found}, this prism-trace reads"
                f" {SCHEMA_VERSION}; export it again (docs/schema-changes.md)"
            )
            raise SchemaVersionError(msg)
    base, remote = text.rstrip("/"), _is_remote(text)
    for t in TABLES:
        pattern = f"{base}/{t.name}/" + ("*/*.parquet" if _partitioned(t) else "*.parquet")
        casts = ", ".join(f"{c.name}::{c.type} AS {c.name}" for c in t.columns)
        src = f"read_parquet({_sql_str(pattern)}, hive_partitioning = {_partitioned(t)})"
        if remote or any((Path(text) / t.name).glob("**/*.parquet")):
            try:
                con.execute(f"CREATE VIEW {t.name} AS SELECT {casts} FROM {src}")
                continue
            except duckdb.IOException:
                if not remote:
                    raise
            except duckdb.Error as exc:
                con.close()
                if remote and "extension" in str(exc).lower():
                    msg = (
                        f"{text}: reading a remote Parquet export needs DuckDB's httpfs"
                        " extension, which is not installed and is never downloaded implicitly:"
                        " install it once with duckdb's `INSTALL httpfs`"
                    )
                    raise MissingExtensionError(msg) from exc
                raise
        con.execute(f"CREATE VIEW {t.name} AS {_empty_select(t)}")  # no rows of this table
    for v in VIEWS:
        con.execute(f"CREATE VIEW {v.name} AS {v.sql}")
    return Store(con, Path(text), read_only=True)

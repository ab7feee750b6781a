"""The store's schema as a whole: its version, creating it in a store, and docs/schema.md.

Generated from the declarations (``tables``, ``views``): ``create_all`` writes the DDL with
``COMMENT ON`` for every table, column and view, and ``render_markdown`` the docs, so neither
can drift from the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prism_trace.store.tables import TABLES
from prism_trace.store.views import VIEWS

if TYPE_CHECKING:
    import duckdb

__all__ = ["SCHEMA_VERSION", "create_all", "render_markdown"]

SCHEMA_VERSION = 4
"""Bump on every breaking change, with an entry in docs/schema-changes.md."""


def _sql_str(text: str) -> str:
    """``text`` as a SQL string literal (``COMMENT ON`` takes no parameters)."""
    return "'" + text.replace("'", "''") + "'"


def create_all(con: duckdb.DuckDBPyConnection) -> None:
    """Create every table and view; ``COMMENT ON`` shows the docs in ``duckdb_columns()``."""
    for t in TABLES:
        con.execute(t.ddl())
        con.execute(f"COMMENT ON TABLE {t.name} IS {_sql_str(t.doc)}")
        for c in t.columns:
            con.execute(f"COMMENT ON COLUMN {t.name}.{c.name} IS {_sql_str(c.doc)}")
    for v in VIEWS:
        con.execute(f"CREATE OR REPLACE VIEW {v.name} AS {v.sql}")
        con.execute(f"COMMENT ON VIEW {v.name} IS {_sql_str(v.doc)}")


def render_markdown() -> str:
    """Render docs/schema.md from the declarations (a test keeps the file in sync)."""
    out = [
        "# Store schema",
        "",
        "Generated from `prism_trace/store/schema.py`"
        " by `python -m prism_trace.store.schema > docs/schema.md`;",
        "do not edit by hand. Times are integer nanoseconds on one clock per run. Every per-rank",
        "table is keyed by `(run_id, rank, ...)`, and recorded, sliced, emulated and replayed runs",
        f"share the same tables (`run.kind`). Schema version: {SCHEMA_VERSION}.",
        "",
    ]
    for t in TABLES:
        out += [f"## `{t.name}`", "", t.doc, ""]
        if t.key:
            out += [f"Key: `({', '.join(t.key)})`", ""]
        out += ["| column | type | joins | description |", "|---|---|---|---|"]
        for c in t.columns:
            join = f"`{c.join}`" if c.join else ""
            null = "" if c.nullable else " NOT NULL"
            out.append(f"| `{c.name}` | {c.type}{null} | {join} | {c.doc} |")
        out.append("")
    out += ["# Views", ""]
    for v in VIEWS:
        out += [f"## `{v.name}`", "", v.doc, ""]
        if v.columns:
            out += ["| column | type | description |", "|---|---|---|"]
            out += [f"| `{c.name}` | {c.type} | {c.doc} |" for c in v.columns]
            out.append("")
        out += ["```sql", "\n".join(line.strip() for line in v.sql.strip().splitlines()), "```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render_markdown(), end="")

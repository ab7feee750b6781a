"""The declared schema is the documentation: the DDL, COMMENT ON and docs/schema.md agree."""

from __future__ import annotations

from pathlib import Path

from prism_trace.store import schema
from prism_trace.store.connection import open_store
from prism_trace.store.tables import TABLES

REPO = Path(__file__).resolve().parents[2]


def test_docs_schema_md_is_current() -> None:
    doc = (REPO / "docs" / "schema.md").read_text()
    assert doc == schema.render_markdown(), (
        "docs/schema.md is stale: run `python -m prism_trace.store.schema > docs/schema.md`"
    )


def test_every_column_is_created_with_its_comment(tmp_path: Path) -> None:
    with open_store(tmp_path / "s.duckdb") as store:
        rows = store.con.execute(
            "SELECT table_name, column_name, comment FROM duckdb_columns()"
            " WHERE schema_name = 'main'"
        ).fetchall()
    found = {(t, c): doc for t, c, doc in rows}
    for t in TABLES:
        for c in t.columns:
            assert found.get((t.name, c.name)) == c.doc, (t.name, c.name)


def test_every_per_rank_table_is_keyed_by_run() -> None:
    for t in TABLES:
        if t.name != "meta":
            assert t.columns[0].name == "run_id", t.name


def test_new_store_records_schema_version(tmp_path: Path) -> None:
    with open_store(tmp_path / "s.duckdb") as store:
        row = store.con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    assert row == (str(schema.SCHEMA_VERSION),)

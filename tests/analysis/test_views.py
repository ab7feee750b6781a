"""The SQL modules follow the conventions, load on read-only stores and are documented."""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import pytest
from prism_trace.analysis import views

from prism_trace.errors import PrismError
from prism_trace.store.connection import Store

DOC = Path(__file__).resolve().parents[2] / "docs" / "analysis.md"


def test_every_public_view_and_column_has_a_comment(sample_store: Store) -> None:
    objects = views.load_views(sample_store.con, force=True)
    public = [o for o in objects if o.public and o.kind == "VIEW"]
    assert {o.module for o in objects} == {"core", "breakdown", "comm", "pipeline"}
    for o in public:
        row = sample_store.con.execute(
            "SELECT comment FROM duckdb_views() WHERE view_name = ? AND temporary", [o.name]
        ).fetchone()
        assert row is not None, o.name
        assert row[0], o.name
        cols = sample_store.con.execute(
            "SELECT column_name, comment FROM duckdb_columns()"
            " WHERE table_name = ? AND database_name = 'temp'",
            [o.name],
        ).fetchall()
        assert cols, o.name
        assert all(c for _, c in cols), (o.name, cols)


def test_views_are_temporary_and_store_is_untouched(sample_store: Store) -> None:
    assert sample_store.read_only
    names = {o.name for o in views.load_views(sample_store.con)}
    persistent = sample_store.con.execute(
        "SELECT view_name FROM duckdb_views() WHERE NOT temporary AND NOT internal"
    ).fetchall()
    # None of ours is stored, and none shadows a schema view.
    assert {"collective_instance", "host_op", "kernel"} <= {v for (v,) in persistent}
    assert not names & {v for (v,) in persistent}


def test_loader_is_idempotent(sample_store: Store) -> None:
    a = views.load_views(sample_store.con)
    b = views.load_views(sample_store.con)
    assert [o.name for o in a] == [o.name for o in b]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-- doc\n-- @column a x\nCREATE VIEW other_v AS SELECT 1 AS a;\n", "module name"),
        ("CREATE VIEW m_v AS SELECT 1 AS a;\n", "no comment block"),
        ("-- doc\nINSERT INTO t VALUES (1);\n", "only CREATE"),
        ("-- doc\nCREATE VIEW m_v AS\nSELECT 1 AS a\n", "does not end"),
    ],
)
def test_malformed_module_names_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "m.sql"
    path.write_text(text)
    with pytest.raises(PrismError, match=message) as exc:
        views._parse(path)
    assert "m.sql" in str(exc.value)


def test_docs_reference_is_current() -> None:
    text = DOC.read_text()
    begin, end = "<!-- views:begin -->\n", "<!-- views:end -->"
    assert begin in text
    assert end in text
    body = text.split(begin, 1)[1].split(end, 1)[0]
    assert body.strip() == views.render_markdown().strip(), (
        "docs/analysis.md is stale: regenerate the reference with "
        "`python -m prism_trace.analysis.views`"
    )


def _names(node: object, out: set[str]) -> set[str]:
    """Every table and function name in a DuckDB parse tree (``json_serialize_sql``)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("table_name", "function_name") and isinstance(value, str):
                out.add(value.lower())
            _names(value, out)
    elif isinstance(node, list):
        for item in node:
            _names(item, out)
    return out


def test_references_found_in_the_text_are_those_duckdb_parses() -> None:
    """The loader finds what an object reads by the names in its text; DuckDB's own parser, asked
    independently, must find no reference the loader misses (else loading it alone fails)."""
    con = duckdb.connect()
    known = {o.name for o in views.modules()}
    for obj in views.modules():
        split = r"\bAS\s+" if obj.kind == "VIEW" else r"\)\s*AS\s+TABLE\s"
        body = re.split(split, obj.sql, maxsplit=1, flags=re.IGNORECASE)[1]
        row = con.execute("SELECT json_serialize_sql(?)", [body]).fetchone()
        assert row is not None
        tree = json.loads(row[0])
        assert not tree.get("error"), (obj.name, tree)
        parsed = _names(tree, set()) & known
        assert parsed <= views._refers_to()[obj.name], obj.name


def test_a_query_loads_only_what_it_names(sample_store: Store) -> None:
    cur = sample_store.con.cursor()
    names = views.names_in("SELECT * FROM comm_collective_skew JOIN kernel USING (rank)")
    assert names == {"comm_collective_skew"}
    loaded = {o.name for o in views.load_views(cur, names=names)}
    present = {
        r[0] for r in cur.execute("SELECT view_name FROM duckdb_views() WHERE temporary").fetchall()
    }
    assert "comm_collective_skew" in present
    assert not any(n.startswith("pipeline_") for n in present)
    ours = {o.name for o in views.modules()}
    assert present & ours == loaded
    # A query of the catalog may look for any object: all of them are loaded.
    assert views.names_in("SELECT * FROM duckdb_views() WHERE view_name LIKE 'pipeline%'") is None
    assert views.names_in("PRAGMA show_tables") is None
    assert views.names_in("SHOW ALL TABLES") is None
    assert views.names_in("select 1") == set()
    cur.close()
    # The deepest closure (13 objects) loads alone on a fresh cursor and binds.
    cur = sample_store.con.cursor()
    views.load_views(cur, names=["pipeline_bubble_at"])
    assert cur.sql("DESCRIBE SELECT * FROM pipeline_bubble_at(0)").fetchall()
    cur.close()

"""The SQL modules follow the conventions, load on read-only stores and are documented."""

from __future__ import annotations

from pathlib import Path

import pytest
from prism_trace.analysis import views

from prism_trace.errors import PrismError
from prism_trace.store import Store

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


def _positional_arity(sql: str) -> int:
    """How many arguments a macro needs: those without a ``:=`` default."""
    params = sql.split("(", 1)[1].split(")", 1)[0]
    return sum(1 for p in params.split(",") if p.strip() and ":=" not in p)


def test_each_object_loads_alone_with_what_it_reads(sample_store: Store) -> None:
    """Loading one object on a fresh cursor creates exactly its closure, and it then runs: the
    references found in the SQL text are complete (a missing one fails to bind or to run)."""
    for obj in views.modules():
        if not obj.public:
            continue
        cur = sample_store.con.cursor()
        loaded = views.load_views(cur, names=[obj.name])
        assert obj.name in {o.name for o in loaded}
        if obj.kind == "VIEW":
            cur.sql(f"SELECT * FROM {obj.name} LIMIT 1").fetchall()
        else:
            args = ", ".join(["0"] * _positional_arity(obj.sql))
            cur.sql(f"SELECT * FROM {obj.name}({args}) LIMIT 1").fetchall()
        cur.close()


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
    assert views.names_in("select 1") == set()
    cur.close()

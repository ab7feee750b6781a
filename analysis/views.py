"""Load the SQL modules in ``analysis/sql/`` as documented TEMP views and macros on a connection.

A module (``<name>.sql``) holds only ``CREATE VIEW`` / ``CREATE MACRO`` statements, each ending
with ``;`` at the end of a line and preceded by its comment block. ``-- include: a, b`` lines at the
top name the modules it reads. Public objects start with the module's name and document every
column with ``-- @column <name> <doc>``; helpers start with ``_``. Objects are created as
``TEMP`` views on the given connection: the analyses never write to the store, read-only stores
work, and the definitions always match the installed code. Each comment block becomes
``COMMENT ON``, so ``duckdb_views()`` and ``duckdb_columns()`` show the docs.

Creating a view binds its query, and a view over views re-binds the chain below it: loading all
of them costs about 1 s on a store and several seconds over a Parquet export, where every bind
lists files. So a caller names what it reads and only those objects and the ones they refer to are
created (``names``; ``names_in`` finds them in a query's text).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING

import duckdb
import polars as pl

from prism_trace.errors import PrismError
from prism_trace.store.connection import Store

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = [
    "SQL_DIR",
    "SqlObject",
    "load_views",
    "modules",
    "names_in",
    "render_markdown",
    "run_view",
]

# Read through importlib.resources, so the modules are found in a wheel as in a checkout.
SQL_DIR = resources.files("prism_trace.analysis") / "sql"

_INCLUDE = re.compile(r"^--\s*include:\s*(.+)$")
_CREATE = re.compile(r"^CREATE\s+(VIEW|MACRO)\s+([A-Za-z_][A-Za-z0-9_]*)", re.IGNORECASE)
_COLUMN = re.compile(r"^@column\s+(\w+)\s+(.*)$")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A query that reads the catalog may look for any object, so it gets them all.
_CATALOG = re.compile(
    r"\b(duckdb_views|duckdb_columns|duckdb_functions|information_schema|show\s+(all\s+)?tables"
    r"|show_tables(_expanded)?)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class SqlObject:
    """One view or table macro of a module, with its docs."""

    module: str
    kind: str
    name: str
    doc: str
    columns: tuple[tuple[str, str], ...]
    sql: str

    @property
    def public(self) -> bool:
        """Public objects are documented and start with the module's name."""
        return not self.name.startswith("_")


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _parse(path: Traversable) -> tuple[list[str], list[SqlObject]]:
    module = path.name.removesuffix(".sql")
    includes: list[str] = []
    objects: list[SqlObject] = []
    comments: list[str] = []
    body: list[str] | None = None
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.rstrip()
        if body is not None:
            body.append(line)
            if line.endswith(";"):
                objects.append(_object(path, module, comments, body))
                body, comments = None, []
            continue
        if m := _INCLUDE.match(line):
            includes += [x.strip() for x in m.group(1).split(",") if x.strip()]
        elif line.startswith("--"):
            comments.append(line[2:].strip())
        elif not line.strip():
            comments = []
        elif _CREATE.match(line):
            body = [line]
            if line.endswith(";"):
                objects.append(_object(path, module, comments, body))
                body, comments = None, []
        else:
            msg = (
                f"{path}: only CREATE VIEW/MACRO statements and comments allowed, at line {lineno}"
            )
            raise PrismError(msg)
    if body is not None:
        msg = f"{path}: statement {body[0]!r} does not end with ';'"
        raise PrismError(msg)
    return includes, objects


def _object(path: Traversable, module: str, comments: list[str], body: list[str]) -> SqlObject:
    m = _CREATE.match(body[0])
    assert m is not None
    kind, name = m.group(1).upper(), m.group(2)
    doc_lines: list[str] = []
    columns: list[tuple[str, str]] = []
    for c in comments:
        if cm := _COLUMN.match(c):
            columns.append((cm.group(1), cm.group(2).strip()))
        elif columns and c:
            columns[-1] = (columns[-1][0], f"{columns[-1][1]} {c}")
        else:
            doc_lines.append(c)
    doc = " ".join(" ".join(doc_lines).split())
    if not name.startswith("_"):
        if not name.startswith(f"{module}_"):
            msg = f"{path}: public {name!r} must start with the module name `{module}_`"
            raise PrismError(msg)
        if not doc:
            msg = f"{path}: public {name!r} has no comment block"
            raise PrismError(msg)
    sql = "\n".join(body).rstrip().rstrip(";")
    sql = _CREATE.sub(lambda mm: f"CREATE OR REPLACE TEMP {mm.group(1).upper()} {name}", sql, 1)
    return SqlObject(module, kind, name, doc, tuple(columns), sql)


def modules() -> list[SqlObject]:
    """Every object of every module, in load order (includes first, then file order).

    Raises:
        PrismError: a module breaks the conventions or includes an unknown or cyclic module.
    """
    return list(_modules())


@cache
def _modules() -> tuple[SqlObject, ...]:
    """The parsed modules, once per process: they are files of the installed package."""
    files = sorted((p for p in SQL_DIR.iterdir() if p.name.endswith(".sql")), key=lambda p: p.name)
    parsed = {p.name.removesuffix(".sql"): _parse(p) for p in files}
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str, by: str) -> None:
        if name in order:
            return
        if name not in parsed:
            msg = f"{SQL_DIR / (by + '.sql')}: includes unknown module {name!r}"
            raise PrismError(msg)
        if name in visiting:
            msg = f"{SQL_DIR / (name + '.sql')}: include cycle through {by!r}"
            raise PrismError(msg)
        visiting.add(name)
        for dep in parsed[name][0]:
            visit(dep, name)
        visiting.discard(name)
        order.append(name)

    for name in parsed:
        visit(name, name)
    return tuple(obj for name in order for obj in parsed[name][1])


@cache
def _refers_to() -> dict[str, frozenset[str]]:
    """For each object, the other objects its SQL names."""
    known = {o.name for o in _modules()}
    return {
        o.name: frozenset(t.lower() for t in _IDENTIFIER.findall(o.sql) if t.lower() in known)
        - {o.name}
        for o in _modules()
    }


def names_in(sql: str) -> set[str] | None:
    """The objects a query names (``None``: it reads the catalog, so it may need any of them)."""
    if _CATALOG.search(sql):
        return None
    known = {o.name for o in _modules()}
    return {t.lower() for t in _IDENTIFIER.findall(sql) if t.lower() in known}


def _needed(names: Iterable[str] | None) -> list[SqlObject]:
    """The objects ``names`` read, directly or through others, in load order."""
    if names is None:
        return list(_modules())
    refers = _refers_to()
    need: set[str] = set()
    todo = [n.lower() for n in names if n.lower() in refers]
    while todo:
        name = todo.pop()
        if name not in need:
            need.add(name)
            todo.extend(refers[name])
    return [o for o in _modules() if o.name in need]


def _present(con: duckdb.DuckDBPyConnection) -> set[str]:
    """Our TEMP views and macros already on ``con``."""
    rows = con.execute(
        "SELECT view_name FROM duckdb_views() WHERE temporary"
        " UNION ALL SELECT function_name FROM duckdb_functions()"
        " WHERE database_name = 'temp' AND function_type = 'table_macro'"
    ).fetchall()
    return {r[0] for r in rows}


def load_views(
    con: duckdb.DuckDBPyConnection,
    *,
    force: bool = False,
    names: Iterable[str] | None = None,
) -> list[SqlObject]:
    """Create the modules' views and macros as TEMP objects on ``con``, with their comments.

    Idempotent: an object already on the connection is not re-created unless ``force``. TEMP
    objects belong to one connection; call it again for a cursor.

    Args:
        con: an open DuckDB connection to a store (read-only is fine).
        force: re-create even when already loaded.
        names: create only these objects and those they read (``None``: every object).

    Returns:
        The objects asked for and those they read, in load order.

    Raises:
        PrismError: a module is malformed, fails to create, or leaves a public column undocumented.
    """
    objects = _needed(names)
    present = set() if force else _present(con)
    for obj in objects:
        if obj.name in present:
            continue
        where = SQL_DIR / f"{obj.module}.sql"
        try:
            con.execute(obj.sql)
        except duckdb.Error as exc:
            msg = f"{where}: cannot create {obj.name!r}: {str(exc).splitlines()[0]}"
            raise PrismError(msg) from exc
        if not obj.public:
            continue
        target = "VIEW" if obj.kind == "VIEW" else "MACRO TABLE"
        con.execute(f"COMMENT ON {target} {obj.name} IS {_sql_str(obj.doc)}")
        if obj.kind != "VIEW":
            continue
        actual = [
            r[0]
            for r in con.execute(
                "SELECT column_name FROM duckdb_columns()"
                " WHERE table_name = ? AND database_name = 'temp' ORDER BY column_index",
                [obj.name],
            ).fetchall()
        ]
        documented = dict(obj.columns)
        missing = [c for c in actual if c not in documented]
        extra = [c for c in documented if c not in actual]
        if missing or extra:
            msg = (
                f"{where}: view {obj.name!r} columns and @column docs differ"
                f" (undocumented: {missing}, documented but absent: {extra})"
            )
            raise PrismError(msg)
        for col in actual:
            con.execute(f"COMMENT ON COLUMN {obj.name}.{col} IS {_sql_str(documented[col])}")
    return objects


def run_view(
    store: Store,
    source: str,
    run: str,
    *,
    order_by: str,
    ranks: list[int] | None = None,
    iteration: int | None = None,
    params: list[object] | None = None,
) -> pl.DataFrame:
    """Rows of ``source`` (a view, or a macro call) for run ``run``, without ``run_id``.

    Args:
        store: an open store (read-only is fine).
        source: a loaded view name or table-macro call, e.g. ``breakdown_idle_at(30)``; ``?``
            placeholders in it take ``params``.
        run: the run's name.
        order_by: the ORDER BY list of the result.
        ranks: keep only rows of these ranks (the source needs a ``rank`` column).
        iteration: keep only rows of this iteration (the source needs an ``iteration`` column).
        params: values of the ``?`` placeholders in ``source``.

    Returns:
        The rows as a polars frame.

    Raises:
        PrismError: no run of that name, or the views cannot be loaded.
    """
    run_id = store.require_run(run)
    load_views(store.con, names=[source.split("(", 1)[0].strip()])
    where = ["run_id = ?"]
    values: list[object] = [*(params or []), run_id]
    if ranks is not None:
        where.append("list_contains(?, rank)")
        values.append(list(ranks))
    if iteration is not None:
        where.append("iteration = ?")
        values.append(int(iteration))
    rel = store.con.sql(
        f"SELECT * EXCLUDE (run_id) FROM {source} WHERE {' AND '.join(where)} ORDER BY {order_by}",
        params=values,
    )
    return rel.pl()


def render_markdown() -> str:
    """The view reference of docs/analysis.md (a test keeps the file in sync)."""
    out: list[str] = []
    for obj in modules():
        if not obj.public:
            continue
        kind = "view" if obj.kind == "VIEW" else "table macro"
        out += [f"### `{obj.name}` ({kind}, `analysis/sql/{obj.module}.sql`)", "", obj.doc, ""]
        if obj.columns:
            out += ["| column | description |", "|---|---|"]
            out += [f"| `{c}` | {d} |" for c, d in obj.columns]
            out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render_markdown(), end="")

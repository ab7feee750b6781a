"""The vocabulary of the declared schema: a documented column, a table with its key, a view.

The declarations (``tables``, ``views``) are the one source for the DDL, DuckDB's comments and
docs/schema.md (``schema``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Column", "Table", "View", "col"]


@dataclass(frozen=True)
class Column:
    """One typed, documented column; ``join`` names the column it references, if any."""

    name: str
    type: str
    doc: str
    join: str | None = None
    nullable: bool = True


@dataclass(frozen=True)
class Table:
    """A declared table: its columns, primary key and a doc saying what one row is."""

    name: str
    doc: str
    columns: tuple[Column, ...]
    key: tuple[str, ...] = ()

    @property
    def column_names(self) -> list[str]:
        """Column names in declaration order (the order readers must produce)."""
        return [c.name for c in self.columns]

    def ddl(self) -> str:
        """``CREATE TABLE`` text for DuckDB."""
        cols = [f"    {c.name} {c.type}{'' if c.nullable else ' NOT NULL'}" for c in self.columns]
        if self.key:
            cols.append(f"    PRIMARY KEY ({', '.join(self.key)})")
        return f"CREATE TABLE IF NOT EXISTS {self.name} (\n" + ",\n".join(cols) + "\n)"


@dataclass(frozen=True)
class View:
    """A declared view over the tables, with its documented columns."""

    name: str
    doc: str
    sql: str
    columns: tuple[Column, ...] = field(default_factory=tuple)


def col(name: str, type_: str, doc: str, join: str | None = None, *, null: bool = True) -> Column:
    """A column, briefly: the declarations list hundreds of them."""
    return Column(name, type_, doc, join, null)

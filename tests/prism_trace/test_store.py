"""The store's transactions: a nested block joins the outer one, so a command commits once."""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_trace.store.connection import Store, open_store


def _names(path: Path) -> list[str]:
    with open_store(path, read_only=True) as store:
        return [r[0] for r in store.con.execute("SELECT key FROM meta ORDER BY key").fetchall()]


def test_a_nested_transaction_commits_with_the_outer_one(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    with open_store(db) as store:
        before = _names_of(store)
        with store.transaction() as outer:
            outer.execute("INSERT INTO meta VALUES ('a', '1')")
            with store.transaction() as inner:
                assert inner is outer
                inner.execute("INSERT INTO meta VALUES ('b', '2')")
            assert store.in_transaction
        assert not store.in_transaction
    assert _names(db) == sorted([*before, "a", "b"])


def test_an_error_in_a_nested_block_undoes_the_whole_command(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    with open_store(db) as store:
        before = _names_of(store)
        with pytest.raises(ValueError, match="refused"):
            _two_writes_then_a_refusal(store)
        assert not store.in_transaction
        # The store is usable again: the next command opens its own transaction.
        with store.transaction() as con:
            con.execute("INSERT INTO meta VALUES ('c', '3')")
    assert _names(db) == sorted([*before, "c"])


def _names_of(store: Store) -> list[str]:
    con = store.con
    return [r[0] for r in con.execute("SELECT key FROM meta ORDER BY key").fetchall()]


def _two_writes_then_a_refusal(store: Store) -> None:
    with store.transaction() as outer:
        outer.execute("INSERT INTO meta VALUES ('a', '1')")
        with store.transaction() as inner:
            inner.execute("INSERT INTO meta VALUES ('b', '2')")
            msg = "refused"
            raise ValueError(msg)

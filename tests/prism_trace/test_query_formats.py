"""`prism query`'s nested values: CSV cannot hold a list, so it gets the list's JSON."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from prism_trace.query.sql import run_query
from prism_trace.store.connection import open_store

NESTED = (
    "SELECT 1 AS n, [1, 2] AS ids, {'x': 1, 'y': 'a\"b'} AS attrs, ['p,q'] AS names "
    "UNION ALL SELECT 2, [], NULL, NULL ORDER BY n"
)


@pytest.fixture
def store(tmp_path: Path):
    s = open_store(tmp_path / "q.duckdb")
    yield s
    s.con.close()


def test_csv_writes_lists_and_structs_as_json(store) -> None:
    rows = list(csv.DictReader(io.StringIO(run_query(store, NESTED, fmt="csv"))))
    assert [r["n"] for r in rows] == ["1", "2"]
    assert json.loads(rows[0]["ids"]) == [1, 2]
    assert json.loads(rows[0]["attrs"]) == {"x": 1, "y": 'a"b'}
    assert json.loads(rows[0]["names"]) == ["p,q"]
    assert json.loads(rows[1]["ids"]) == []
    # A NULL stays an empty field, not the text "null".
    assert rows[1]["attrs"] == ""
    assert rows[1]["names"] == ""


def test_csv_and_json_agree_on_nested_values(store) -> None:
    as_json = json.loads(run_query(store, NESTED, fmt="json"))
    as_csv = list(csv.DictReader(io.StringIO(run_query(store, NESTED, fmt="csv"))))
    for j, c in zip(as_json, as_csv, strict=True):
        assert json.loads(c["ids"]) == j["ids"]
        assert (json.loads(c["attrs"]) if c["attrs"] else None) == j["attrs"]

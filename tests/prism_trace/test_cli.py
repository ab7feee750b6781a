"""The CLI shape scripts rely on: ingest, info --json, query in every format."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from prism_trace.cli import main

pytestmark = pytest.mark.shared_data


def invoke(*args: object) -> str:
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.slow
def test_ingest_info_query(shared_datasets: Path, tmp_path: Path) -> None:
    db = tmp_path / "c.duckdb"
    ring = shared_datasets / "chakra-et/astrasim_et_examples/custom_ring_allreduce_8npus_1MB"
    report = json.loads(invoke("ingest", ring, "--db", db, "--run", "ring", "--json"))
    assert report["ranks"] == list(range(8))
    assert len(report["skipped"]) == 1  # the ASTRA-sim XML beside the ETs

    info = json.loads(invoke("info", db, "--run", "ring", "--json"))
    assert [r["rank"] for r in info["ranks"]] == list(range(8))
    assert info["world_size"] == 8
    runs = json.loads(invoke("info", db, "--json"))["runs"]
    assert [r["name"] for r in runs] == ["ring"]
    assert "ring" in invoke("info", db)

    sql = "SELECT rank, count(*) AS n FROM p2p GROUP BY rank ORDER BY rank"
    rows = json.loads(invoke("query", db, sql, "--format", "json"))
    assert rows == [{"rank": r, "n": 28} for r in range(8)]
    csv = invoke("query", db, sql, "--format", "csv")
    assert csv.splitlines()[0] == "rank,n"
    out = tmp_path / "p.parquet"
    invoke("query", db, sql, "--format", "parquet", "-o", out)
    assert pl.read_parquet(out)["n"].to_list() == [28] * 8
    assert "rank" in invoke("query", db, sql)


def test_query_error_is_one_line(shared_datasets: Path, tmp_path: Path) -> None:
    db = tmp_path / "c.duckdb"
    invoke(
        "ingest",
        shared_datasets / "chakra-et/astrasim_et_examples/microbenchmarks/all_reduce/4npus_1MB",
        "--db",
        db,
        "-q",
    )
    res = CliRunner().invoke(main, ["query", str(db), "SELECT nope FROM nowhere"])
    assert res.exit_code == 1
    assert len(res.output.strip().splitlines()) == 1
    assert "query failed" in res.output
    res = CliRunner().invoke(main, ["info", str(db), "--run", "missing"])
    assert res.exit_code == 1
    assert "no run named 'missing'" in res.output


@pytest.mark.slow
def test_graph_command_assigns_roles(tmp_path: Path) -> None:
    sample = Path(__file__).resolve().parents[2] / "datasets" / "sample"
    db = tmp_path / "g.duckdb"
    invoke("ingest", sample, "--db", db, "--run", "sample", "--jobs", "2", "-q")
    out = json.loads(invoke("graph", db, "--run", "sample", "--json"))
    assert out["layout"]["spec"] == "tp=2,cp=1,ep=1,dp=2,pp=2"
    assert out["layout"]["source"] == "inferred"
    assert out["comms"]["ok"]
    axes = json.loads(
        invoke(
            "query", db, "SELECT DISTINCT axis FROM comm_group ORDER BY axis", "--format", "json"
        )
    )
    assert [a["axis"] for a in axes] == ["dp", "pp", "tp", "world"]

"""`prism export parquet` and `prism query --parquet`: the rows and SQL of the store."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.errors import NotAStoreError, OutputError
from prism_trace.export.parquet import export_parquet, open_parquet
from prism_trace.store.schema import SCHEMA_VERSION
from prism_trace.store.tables import TABLES


@pytest.fixture(scope="module")
def exported(sample_store: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pq") / "sample"
    export_parquet(sample_store, out)  # type: ignore[arg-type]
    return out


def test_every_table_round_trips(sample_store: object, exported: Path) -> None:
    pq = open_parquet(exported)
    for t in TABLES:
        cols = ", ".join(c.name for c in t.columns)
        order = ", ".join(str(i + 1) for i in range(len(t.columns)))
        want = sample_store.con.sql(f"SELECT {cols} FROM {t.name} ORDER BY {order}").pl()  # type: ignore[attr-defined]
        got = pq.con.sql(f"SELECT {cols} FROM {t.name} ORDER BY {order}").pl()
        assert got.equals(want), t.name


def test_layout_is_hive_by_rank_and_polars_reads_it(exported: Path) -> None:
    assert sorted(p.name for p in (exported / "event").iterdir())[:2] == ["rank=0", "rank=1"]
    assert (exported / "iteration" / "data.parquet").is_file()
    df = pl.read_parquet(exported / "event" / "**" / "*.parquet", hive_partitioning=True)
    assert sorted(df["rank"].unique().to_list()) == list(range(8))
    assert json.loads((exported / "_prism.json").read_text())["schema_version"] == SCHEMA_VERSION


@pytest.mark.slow
def test_query_and_views_on_parquet_match_the_store(sample_store: object, exported: Path) -> None:
    sql = (
        "SELECT group_name, seq, kind, participants, arrival_spread FROM collective_instance"
        " ORDER BY ALL"
    )
    run = CliRunner().invoke
    a = run(main, ["query", "--parquet", str(exported), sql, "--format", "csv"])
    assert a.exit_code == 0, a.output
    want = sample_store.con.sql(sql).pl().write_csv()  # type: ignore[attr-defined]
    assert a.output == want
    views = "SELECT count(*) AS n FROM comm_collective_wait"
    a = run(main, ["query", "--parquet", str(exported), views, "--format", "json"])
    assert a.exit_code == 0, a.output
    assert json.loads(a.output)[0]["n"] > 0


def test_not_an_export_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(NotAStoreError, match="not a prism Parquet export"):
        open_parquet(tmp_path)
    res = CliRunner().invoke(main, ["query", "--parquet", str(tmp_path), "SELECT 1"])
    assert res.exit_code == 1
    assert res.output.count("\n") == 1


def test_export_refuses_a_non_empty_folder(sample_store: object, exported: Path) -> None:
    with pytest.raises(OutputError, match="not empty"):
        export_parquet(sample_store, exported)  # type: ignore[arg-type]

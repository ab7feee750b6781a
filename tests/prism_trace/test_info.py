"""`prism info` stays readable at scale: classes for sliced/emulated runs, numbers as numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.query.info import compact_ranks


def _cli(*args: object) -> str:
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.output


@pytest.fixture(scope="module")
def sliced_db(sample_store: object) -> Path:
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.slicer import slice_run

    layout = ParallelLayout.parse("tp=2,dp=2048,pp=2", None)
    slice_run(sample_store, run="sample", layout=layout, world=8192, out_run="big")  # type: ignore[arg-type]
    path = sample_store.path  # type: ignore[attr-defined]
    sample_store.close()  # type: ignore[attr-defined]
    return Path(path)


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([0, 2, 4, 6, 9], "0..6:2,9"),
        ([3], "3"),
        ([1, 2], "1,2"),
        (list(range(8)), "0..7"),
        ([], ""),
    ],
)
def test_compact_ranks(ranks: list[int], text: str) -> None:
    assert compact_ranks(ranks) == text


@pytest.mark.slow
def test_sliced_run_is_one_line_per_class(sliced_db: Path) -> None:
    text = _cli("info", sliced_db, "--run", "big")
    assert len(text) < 2_000, len(text)  # not one row per rank (it was 660 KB at 8192 ranks)
    assert "0..4094:2" in text
    info = json.loads(_cli("info", sliced_db, "--run", "big", "--json"))
    assert len(json.dumps(info)) < 10_000
    assert info["rank_count"] == 8192
    assert [c["size"] for c in info["classes"]] == [2048] * 4
    assert sum(g["groups"] for g in info["comm_groups"]) == 8197


@pytest.mark.slow
def test_ranks_picks_ranks_and_json_keeps_numbers(sliced_db: Path) -> None:
    info = json.loads(_cli("info", sliced_db, "--run", "big", "--ranks", "4096..4097", "--json"))
    assert [r["rank"] for r in info["ranks"]] == [4096, 4097]
    assert all(isinstance(r["graph_nodes"], int) for r in info["ranks"])
    rec = json.loads(_cli("info", sliced_db, "--run", "sample", "--json"))
    r0 = rec["ranks"][0]
    assert isinstance(r0["mean_iteration_ns"], float)
    assert all(isinstance(t, int) for t in r0["iteration_times_ns"])


def test_query_json_keeps_sums_numeric(sliced_db: Path) -> None:
    out = _cli("query", sliced_db, "SELECT rank, sum(dur) AS s FROM event GROUP BY rank LIMIT 1",
               "--format", "json")  # fmt: skip
    row = json.loads(out)[0]
    assert isinstance(row["s"], int)

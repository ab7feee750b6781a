"""The driver's appends: many files' rows in one statement a table, a refusal still names its file.

``ingest_append.Pending`` holds the rows of several files and appends them per table. When the
store refuses the combined rows, the message must name the file whose rows it refuses, as a
per-file append did, and the store is left as it was (the transaction rolls back).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from prism_trace.errors import TraceFormatError
from prism_trace.ingestion.append import Pending
from prism_trace.store.connection import open_store


def _steps(rank: int, iterations: list[int]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "rank": [rank] * len(iterations),
            "iteration": iterations,
            "ts": [1000 * i for i in iterations],
            "dur": [10] * len(iterations),
        },
        schema={"rank": pl.Int32, "iteration": pl.Int32, "ts": pl.Int64, "dur": pl.Int64},
    )


def test_rows_of_many_files_are_appended_once_per_table(tmp_path: Path) -> None:
    with open_store(tmp_path / "s.duckdb") as store:
        pending = Pending(run_id=7)
        for r in range(3):
            pending.add("iteration", Path(f"rank{r}.json"), _steps(r, [0, 1]))
        pending.add("iteration", Path("empty.json"), _steps(3, []))
        assert pending.rows == 6
        with store.transaction() as con:
            pending.flush(con)
        rows = store.con.execute(
            "SELECT run_id, rank, iteration FROM iteration ORDER BY ALL"
        ).fetchall()
    assert rows == [(7, r, i) for r in range(3) for i in (0, 1)]
    assert pending.rows == 0
    assert not pending.frames


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_refused_append_names_the_file_whose_rows_are_refused(tmp_path: Path, bad: int) -> None:
    """File ``bad`` states one step twice: the combined append fails on the store's key; the
    message names that file, not the first of the statement, and nothing is stored."""
    with open_store(tmp_path / "s.duckdb") as store:
        pending = Pending(run_id=1)
        for r in range(3):
            steps = _steps(r, [0, 0] if r == bad else [0, 1])
            pending.add("iteration", Path(f"rank{r}.json"), steps)
        refused = rf"^rank{bad}\.json: its rows cannot be stored"
        with pytest.raises(TraceFormatError, match=refused), store.transaction() as con:
            pending.flush(con)
        assert store.con.execute("SELECT count(*) FROM iteration").fetchall() == [(0,)]


def test_a_key_two_files_give_names_the_second(tmp_path: Path) -> None:
    with open_store(tmp_path / "s.duckdb") as store:
        pending = Pending(run_id=1)
        pending.add("iteration", Path("a.json"), _steps(0, [0]))
        pending.add("iteration", Path("b.json"), _steps(1, [0]))
        pending.add("iteration", Path("c.json"), _steps(0, [0]))
        refused = r"^c\.json: its rows cannot be stored"
        with pytest.raises(TraceFormatError, match=refused), store.transaction() as con:
            pending.flush(con)


def test_events_of_parts_are_appended_by_one_statement(tmp_path: Path) -> None:
    """Parts whose every event is kept go in one ``read_parquet``; a part kept for some of its
    ranks only is filtered; every part is deleted once stored."""
    from prism_trace.formats.base import FRAME_SCHEMAS

    def events(rank: int, n: int) -> pl.DataFrame:
        given = {"rank": rank, "track_id": 0, "category": "cpu_op", "name": "op", "dur": 1}
        return pl.DataFrame(
            {
                c: list(range(n)) if c in ("event_id", "ts") else [given.get(c)] * n
                for c in FRAME_SCHEMAS["events"]
            },
            schema=FRAME_SCHEMAS["events"],
        )

    paths = []
    for i, df in enumerate([events(0, 3), events(1, 2), pl.concat([events(2, 2), events(3, 4)])]):
        p = tmp_path / f"events{i}.parquet"
        df.write_parquet(p)
        paths.append(p)
    with open_store(tmp_path / "s.duckdb") as store:
        pending = Pending(run_id=1)
        pending.add_part(Path("a"), paths[0], [0], whole=True)
        pending.add_part(Path("b"), paths[1], [1], whole=True)
        pending.add_part(Path("c"), paths[2], [3], whole=False)
        with store.transaction() as con:
            pending.flush(con)
        got = store.con.execute("SELECT rank, count(*) FROM event GROUP BY rank ORDER BY rank")
        assert got.fetchall() == [(0, 3), (1, 2), (3, 4)]
    assert not any(p.exists() for p in paths)

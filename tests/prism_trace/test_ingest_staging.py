"""Ingest's staging: the work database kind does not change what is stored, nothing is left over.

Ingest stages every file into a scratch database and copies it into the store in one transaction;
a large Kineto trace is worked on in a database file instead of in memory. Both paths must store
exactly the same rows, and neither may leave anything in the store or on disk.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

import prism_trace.ingest as ingest_mod
from prism_trace.errors import TraceFormatError
from prism_trace.ingest import ingest
from prism_trace.store import Store, open_store

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"
_TABLES = ("track", "event", "flow", "iteration", "memory", "collective", "p2p", "et_op", "rank")


def _dump(store: Store) -> dict[str, list[tuple]]:
    out = {}
    for tbl in _TABLES:
        out[tbl] = store.con.execute(
            f"SELECT * EXCLUDE (run_id) FROM {tbl} ORDER BY ALL"
        ).fetchall()
    return out


def _ingest(db: Path) -> dict[str, list[tuple]]:
    with open_store(db) as store:
        ingest(store, [SAMPLE], run="s", progress=False)
        return _dump(store)


@pytest.fixture(scope="module")
def in_memory(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple]]:
    return _ingest(tmp_path_factory.mktemp("mem") / "m.duckdb")


def test_work_on_disk_stores_the_same_rows(
    in_memory: dict[str, list[tuple]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    real = ingest_mod._json_size_guess

    def guess(path: Path) -> int:
        seen.append(True)
        return real(path)

    monkeypatch.setattr(ingest_mod, "_WORK_ON_DISK_BYTES", 0)
    monkeypatch.setattr(ingest_mod, "_json_size_guess", guess)
    on_disk = _ingest(tmp_path / "d.duckdb")
    assert seen, "the Kineto files were not read through the staged path"
    assert in_memory["event"], "the sample has events"
    assert on_disk == in_memory


def test_scratch_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with open_store(tmp_path / "s.duckdb") as store:
        ingest(store, [SAMPLE], run="s", progress=False)
        dbs = store.con.execute("SELECT database_name FROM duckdb_databases()").fetchall()
        assert not [d for (d,) in dbs if d.startswith("_prism")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.duckdb"]


def test_bad_file_after_good_ones_leaves_store_and_disk_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "job"
    src.mkdir()
    for f in sorted(SAMPLE.glob("rank*.kineto.json.gz"))[:2]:
        (src / f.name).write_bytes(f.read_bytes())
    # Sorted last, so two good files are staged before it fails.
    (src / "rank9.kineto.json").write_text('{"schemaVersion": 1, "traceEvents": [{"ph": "X", ')
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    db = tmp_path / "s.duckdb"
    with open_store(db) as store:
        with pytest.raises(TraceFormatError, match="rank9"):
            ingest(store, [src], run="s", progress=False)
        assert store.con.execute("SELECT count(*) FROM run").fetchall() == [(0,)]
        assert store.con.execute("SELECT count(*) FROM event").fetchall() == [(0,)]
        # The connection is usable and the scratch detached: a good ingest still works.
        (src / "rank9.kineto.json").unlink()
        report = ingest(store, [src], run="s", progress=False)
        assert report.rows["event"] > 0
    assert list(scratch.iterdir()) == []

"""Ingest's scratch work: how it is done does not change what is stored, nothing is left over.

Ingest writes every file's rows into the store inside one transaction; a Kineto trace is worked on
in a scratch database of its own (a file for a large trace, else in memory), and files may be read
by several threads. Every way must store exactly the same rows, and none may leave anything in the
store or on disk when it fails.
"""

from __future__ import annotations

import gzip
import tempfile
from pathlib import Path

import pytest

import prism_trace.ingestion.memory as ingest_memory
import prism_trace.ingestion.pipeline as ingest_mod
import prism_trace.ingestion.readers as ingest_readers
from prism_trace.errors import DuplicateRankError, PrismError, TraceFormatError
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store

# Slow: ingests with work on disk and in parallel; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

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
def in_memory(sample_template: Path) -> dict[str, list[tuple]]:
    """The rows of the sample ingested the default way (work in memory, the default workers): the
    session's template is exactly `ingest(store, [SAMPLE], ...)`."""
    with open_store(sample_template, read_only=True) as store:
        return _dump(store)


def test_work_on_disk_stores_the_same_rows(
    in_memory: dict[str, list[tuple]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    real = ingest_readers.json_size_guess

    def guess(path: Path) -> int:
        seen.append(True)
        return real(path)

    monkeypatch.setattr(ingest_memory, "works_on_disk", lambda *_: True)
    monkeypatch.setattr(ingest_readers, "json_size_guess", guess)
    on_disk = _ingest(tmp_path / "d.duckdb")
    assert seen, "the Kineto files were not read through the staged path"
    assert in_memory["event"], "the sample has events"
    assert on_disk == in_memory


def test_scratch_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "job"
    src.mkdir()
    for r in (0, 1):  # two ranks, each a Kineto trace and a host ET
        for kind in ("kineto", "et"):
            name = f"rank{r}.{kind}.json.gz"
            (src / name).write_bytes((SAMPLE / name).read_bytes())
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with open_store(tmp_path / "s.duckdb") as store:
        ingest(store, [src], run="s", progress=False)
        dbs = store.con.execute("SELECT database_name FROM duckdb_databases()").fetchall()
        assert not [d for (d,) in dbs if d.startswith("_prism")]
    assert list(scratch.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "s.duckdb", "tmp"]


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


def test_files_read_in_parallel_store_the_same_rows(
    in_memory: dict[str, list[tuple]], tmp_path: Path
) -> None:
    with open_store(tmp_path / "p.duckdb") as store:
        ingest(store, [SAMPLE], run="s", progress=False, jobs=3)
        assert _dump(store) == in_memory


@pytest.mark.parametrize("jobs", [1, 2])
def test_rank_given_twice_is_refused_before_its_rows_are_written(tmp_path: Path, jobs: int) -> None:
    src = tmp_path / "job"
    src.mkdir()
    one = SAMPLE / "rank2.kineto.json.gz"
    (src / "rank2.kineto.json.gz").write_bytes(one.read_bytes())
    (src / "rank2_again.kineto.json").write_bytes(gzip.decompress(one.read_bytes()))
    with open_store(tmp_path / "s.duckdb") as store:
        with pytest.raises(DuplicateRankError, match="rank 2 appears twice"):
            ingest(store, [src], run="s", progress=False, jobs=jobs)
        assert store.con.execute("SELECT count(*) FROM event").fetchall() == [(0,)]


def test_settings_are_put_back(tmp_path: Path) -> None:
    """Ingest bounds DuckDB's memory and keeps insertion order while it runs, then restores both;
    a memory limit the caller set is left alone."""
    settings = "SELECT current_setting('memory_limit'), current_setting('preserve_insertion_order')"
    with open_store(tmp_path / "s.duckdb") as store:
        seen: list[tuple] = []
        real = ingest_mod._ingest_files

        def spy(store: Store, **kw: object) -> object:
            seen.extend(store.con.execute(settings).fetchall())
            return real(store, **kw)  # type: ignore[arg-type]

        sample = [SAMPLE / "rank0.kineto.json.gz"]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ingest_mod, "_ingest_files", spy)
            store.con.execute("SET preserve_insertion_order = false")
            before = store.con.execute(settings).fetchall()
            ingest(store, sample, run="a", progress=False)
            assert store.con.execute(settings).fetchall() == before
            store.con.execute("SET memory_limit = '3GB'")
            before = store.con.execute(settings).fetchall()
            ingest(store, sample, run="a", progress=False, replace=True)
            assert store.con.execute(settings).fetchall() == before
    (limit, keep_order), (kept_limit, _) = seen
    assert ingest_memory.size_bytes(limit) <= ingest_memory.ingest_memory_limit()
    assert keep_order is True
    assert kept_limit == before[0][0]


def test_size_settings_parse() -> None:
    assert ingest_memory.size_bytes("512.0 MiB") == 512 << 20
    assert ingest_memory.size_bytes("3GB") == 3e9
    assert ingest_memory.size_bytes("100 bytes") == 100
    assert ingest_memory.size_bytes("no limit") == float("inf")
    assert ingest_memory.size_bytes("1.2.3GB") == float("inf")


def test_memory_limit_follows_the_machine_within_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sixteenth of RAM, clamped to [512 MiB, 2 GiB]; the variable wins; workers share it."""
    assert ingest_memory.memory_limit_for(None) == 512 << 20
    assert ingest_memory.memory_limit_for(4 << 30) == 512 << 20
    assert ingest_memory.memory_limit_for(24 << 30) == 1536 << 20
    assert ingest_memory.memory_limit_for(1 << 40) == 2 << 30
    monkeypatch.delenv("PRISM_INGEST_MEMORY_LIMIT", raising=False)
    monkeypatch.setattr(ingest_memory, "_ram_bytes", lambda: 32 << 30)
    assert ingest_memory.ingest_memory_limit() == 2 << 30
    monkeypatch.setenv("PRISM_INGEST_MEMORY_LIMIT", "3GB")
    assert ingest_memory.ingest_memory_limit() == 3e9
    assert ingest_memory.worker_limit(3e9, 2) == 1.5e9
    assert ingest_memory.worker_limit(3e9, 16) == 512 << 20  # a worker's floor
    assert ingest_memory.worker_limit(300e6, 4) == 300e6  # a limit below the floor is kept


def test_the_limit_in_force_reaches_the_readers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work database's place follows the limit the store runs under: ours, or the lower
    one its caller set (not the variable, not the machine)."""
    seen: list[float] = []

    def spy(json_bytes: int, limit: float) -> bool:
        seen.append(limit)
        return False

    monkeypatch.setattr(ingest_memory, "works_on_disk", spy)
    monkeypatch.setenv("PRISM_INGEST_MEMORY_LIMIT", "3GB")
    sample = [SAMPLE / "rank0.kineto.json.gz"]
    with open_store(tmp_path / "s.duckdb") as store:
        ingest(store, sample, run="a", progress=False, rank=0)
        store.con.execute("SET memory_limit = '1GB'")
        ingest(store, sample, run="a", progress=False, rank=0, replace=True)
    assert seen[0] == 3e9
    assert 0.9e9 <= seen[1] <= 1e9  # DuckDB shows its setting rounded


def test_a_trace_larger_than_the_memory_limit_is_worked_on_disk() -> None:
    assert not ingest_memory.works_on_disk(1 << 30, 1.5 * (1 << 30))  # fits: in memory
    assert ingest_memory.works_on_disk(2 << 30, 1.5 * (1 << 30))
    assert not ingest_memory.works_on_disk(200 << 20, 0)  # small traces: always in memory


@pytest.mark.parametrize("value", ["lots", "-1GB", "100MB", "12", "1.2.3GB"])
def test_a_bad_memory_limit_is_one_line_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("PRISM_INGEST_MEMORY_LIMIT", value)
    with open_store(tmp_path / "s.duckdb") as store:
        with pytest.raises(PrismError, match=r"PRISM_INGEST_MEMORY_LIMIT=.*expected a size"):
            ingest(store, [SAMPLE / "rank0.kineto.json.gz"], run="a", progress=False)
        assert store.con.execute("SELECT count(*) FROM run").fetchall() == [(0,)]


def test_a_bad_memory_limit_leaves_no_store_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI checks the variable before it opens (and so creates) the store."""
    from click.testing import CliRunner

    from prism_trace.cli import main

    monkeypatch.setenv("PRISM_INGEST_MEMORY_LIMIT", "lots")
    db = tmp_path / "new.duckdb"
    res = CliRunner().invoke(
        main, ["ingest", str(SAMPLE / "rank0.kineto.json.gz"), "--db", str(db)]
    )
    assert res.exit_code == 1
    assert res.output.count("\n") == 1
    assert "PRISM_INGEST_MEMORY_LIMIT" in res.output
    assert not db.exists()


def test_running_out_of_memory_while_storing_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An out-of-memory in the driver's appends is not blamed on a file's rows (no search for
    the file that was refused) and leaves the store as it was."""
    import duckdb

    import prism_trace.ingestion.append as ingest_append
    from prism_trace.errors import OutOfMemoryError

    def oom(*_a: object, **_k: object) -> None:
        raise duckdb.OutOfMemoryException("Out of Memory Error: failed to allocate")

    monkeypatch.setattr(ingest_append, "append", oom)
    monkeypatch.setattr(ingest_append, "_first_refused", lambda *_: pytest.fail("searched"))
    with open_store(tmp_path / "s.duckdb") as store:
        with pytest.raises(OutOfMemoryError, match="ran out of memory storing its rows"):
            ingest(store, [SAMPLE], run="a", progress=False)
        assert store.con.execute("SELECT count(*) FROM run").fetchall() == [(0,)]

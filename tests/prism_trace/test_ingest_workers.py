"""Files read by worker processes or a dask cluster store exactly the rows read here would.

``--workers N`` (N > 1) reads files in N processes that hand each file's events back as a Parquet
part; ``--engine dask`` does the same on dask.distributed. Either way the driver appends the
parts in file order in one transaction, so the rows match ``--workers 1`` and a bad file leaves
the store and the scratch directory as they were.
"""

from __future__ import annotations

import gzip
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.errors import DuplicateRankError, ProcessFailedError, TraceFormatError, UsageError
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store
from prism_trace.store.write import RUN_TABLES

# Slow: starts worker processes and a dask cluster; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ranks 0-2 of the sample: a Kineto trace and a host ET each (linking runs too)."""
    out = tmp_path_factory.mktemp("job")
    for f in SAMPLE.glob("rank[0-2].*.json.gz"):
        shutil.copy(f, out / f.name)
    return out


def _dump(store: Store) -> dict[str, list[tuple]]:
    """Every per-run table, sorted, without the run id and the ingest time."""
    out = {}
    for tbl in RUN_TABLES:
        drop = "run_id, ingested_at" if tbl == "source_file" else "run_id"
        out[tbl] = store.con.execute(
            f"SELECT * EXCLUDE ({drop}) FROM {tbl} ORDER BY ALL"
        ).fetchall()
    return out


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory, job: Path) -> dict[str, list[tuple]]:
    db = tmp_path_factory.mktemp("w1") / "w1.duckdb"
    with open_store(db) as store:
        ingest(store, [job], run="s", progress=False, workers=1)
        return _dump(store)


def test_two_workers_store_the_same_rows_as_one(
    one_worker: dict[str, list[tuple]], job: Path, tmp_path: Path
) -> None:
    """The sample mixes Kineto and host ET files per rank: parts, linking and claims all run."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with open_store(tmp_path / "w2.duckdb") as store:
        report = ingest(store, [job], run="s", progress=False, workers=2, scratch=scratch)
        assert _dump(store) == one_worker
    assert one_worker["event"], "the sample has events"
    assert one_worker["et_op"], "the sample has host ET ops"
    assert sum(report.et_ops_linked.values()) > 0, "host ETs were linked to Kineto events"
    assert list(scratch.iterdir()) == [], "parts and work files are removed"


def _job_with_a_cut_file(tmp_path: Path) -> Path:
    """Three of the sample's Kineto ranks and a trace cut off mid-event (rank 9)."""
    src = tmp_path / "job"
    src.mkdir()
    for f in sorted(SAMPLE.glob("rank*.kineto.json.gz"))[:3]:
        shutil.copy(f, src / f.name)
    (src / "rank9.kineto.json").write_text('{"schemaVersion": 1, "traceEvents": [{"ph": "X", ')
    return src


def test_a_bad_file_read_by_a_worker_changes_nothing(tmp_path: Path) -> None:
    src = _job_with_a_cut_file(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with open_store(tmp_path / "s.duckdb") as store:
        ingest(store, [SAMPLE / "rank7.kineto.json.gz"], run="seed", progress=False)
        before = _dump(store)
        with pytest.raises(TraceFormatError, match="rank9"):
            ingest(store, [src], run="s", progress=False, workers=2, scratch=scratch)
        assert _dump(store) == before
        assert store.con.execute("SELECT name FROM run").fetchall() == [("seed",)]
    assert list(scratch.iterdir()) == []


def test_a_rank_given_twice_across_workers_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "job"
    src.mkdir()
    one = SAMPLE / "rank2.kineto.json.gz"
    shutil.copy(one, src / "rank2.kineto.json.gz")
    (src / "rank2_again.kineto.json").write_bytes(gzip.decompress(one.read_bytes()))
    with open_store(tmp_path / "s.duckdb") as store:
        with pytest.raises(DuplicateRankError, match="rank 2 appears twice"):
            ingest(store, [src], run="s", progress=False, workers=2)
        assert store.con.execute("SELECT count(*) FROM event").fetchall() == [(0,)]


def test_cli_workers_bad_file_is_one_line(tmp_path: Path) -> None:
    src = tmp_path / "job"
    src.mkdir()
    for f in sorted(SAMPLE.glob("rank*.kineto.json.gz"))[:2]:
        shutil.copy(f, src / f.name)
    (src / "rank5.kineto.json").write_text('{"schemaVersion": 1, "traceEvents": [{"ph": "X", ')
    db = tmp_path / "c.duckdb"
    res = CliRunner().invoke(main, ["ingest", str(src), "--db", str(db), "--workers", "2", "-q"])
    assert res.exit_code != 0
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1, res.output
    assert "rank5.kineto.json" in lines[0]


def test_cli_rejects_zero_workers(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        main, ["ingest", str(SAMPLE), "--db", str(tmp_path / "z.duckdb"), "--workers", "0"]
    )
    assert res.exit_code != 0
    assert "--workers" in res.output


def test_dask_needs_scratch_with_a_scheduler(tmp_path: Path) -> None:
    with open_store(tmp_path / "s.duckdb") as store, pytest.raises(UsageError, match="--scratch"):
        ingest(store, [SAMPLE], run="s", progress=False, engine="dask", scheduler="tcp://x:1")


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("distributed") is None,
    reason="dask.distributed is not installed (pip install 'prism-trace[cluster]')",
)
def test_dask_local_cluster_stores_the_same_rows(
    one_worker: dict[str, list[tuple]], job: Path, tmp_path: Path
) -> None:
    """A dask LocalCluster of 2 worker processes on this machine; parts under --scratch."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with open_store(tmp_path / "d.duckdb") as store:
        ingest(store, [job], run="s", progress=False, workers=2, engine="dask", scratch=scratch)
        assert _dump(store) == one_worker
        bad = tmp_path / "bad"
        bad.mkdir()
        shutil.copy(SAMPLE / "rank3.kineto.json.gz", bad / "rank3.kineto.json.gz")
        (bad / "rank4.kineto.json").write_text('{"traceEvents": [{"ph": "X"')
        with pytest.raises(TraceFormatError, match=r"rank4\.kineto\.json"):
            ingest(store, [bad], run="b", progress=False, workers=2, engine="dask", scratch=scratch)
        assert _dump(store) == one_worker
    assert list(scratch.iterdir()) == []


def test_a_dead_worker_is_one_error_naming_a_file() -> None:
    """A worker killed (for memory, say) breaks the pool; the driver names the file it awaited."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from prism_trace.ingestion.discover import TraceFile
    from prism_trace.ingestion.parts import _results

    fut: Future = Future()
    fut.set_exception(BrokenProcessPool("a child process terminated abruptly"))
    # a batch of files: the first names the batch
    batch = [TraceFile(Path("/x/rank3.json"), "kineto"), TraceFile(Path("/x/r4.json"), "kineto")]
    with pytest.raises(ProcessFailedError, match=r"^/x/rank3\.json: the worker process reading it"):
        list(_results([fut], [batch]))


def test_zero_workers_is_refused(tmp_path: Path) -> None:
    with open_store(tmp_path / "s.duckdb") as store, pytest.raises(UsageError, match="--workers"):
        ingest(store, [SAMPLE], run="s", progress=False, workers=0)


# The `prism` command forks its workers from itself before it opens the store
# (``ingest_parts.preforked``); a test runner's process is never forked (``_safe_to_fork``), so
# these run the command in a fresh process.
_SPY = """
import sys
from prism_trace.ingestion import parts as ingest_parts
from prism_trace.cli import main

seen = []
parts = ingest_parts.parts


def spy(*args, **kwargs):
    seen.append(ingest_parts.preforked_workers())
    return parts(*args, **kwargs)


ingest_parts.parts = spy
try:
    main.main(args=sys.argv[1:], standalone_mode=False)
finally:
    print("preforked", seen)
"""


def _prism(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SPY, "ingest", *args, "-q"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_cli_forks_its_workers_and_stores_the_same_rows(
    one_worker: dict[str, list[tuple]], job: Path, tmp_path: Path
) -> None:
    db = tmp_path / "f.duckdb"
    res = _prism(str(job), "--db", str(db), "--run", "s", "--workers", "2")
    assert res.returncode == 0, res.stderr
    assert "preforked [2]" in res.stdout, "the workers were forked from the prism process"
    with open_store(db) as store:
        assert _dump(store) == one_worker


def test_a_bad_file_read_by_a_forked_worker_is_one_line_and_changes_nothing(
    tmp_path: Path,
) -> None:
    src = _job_with_a_cut_file(tmp_path)
    db = tmp_path / "s.duckdb"
    with open_store(db) as store:
        ingest(store, [SAMPLE / "rank7.kineto.json.gz"], run="seed", progress=False)
        before = _dump(store)
    cmd = [sys.executable, "-m", "prism_trace.cli", "ingest", str(src), "--db", str(db)]
    res = subprocess.run(
        [*cmd, "--run", "s", "--workers", "2", "-q"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode != 0
    lines = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, res.stdout + res.stderr
    assert "rank9.kineto.json" in lines[0]
    with open_store(db) as store:
        assert _dump(store) == before


def test_the_default_reads_a_small_set_here(tmp_path: Path, job: Path) -> None:
    """Without --workers, a set under the plan's size is read in the prism process (no
    workers: they would cost more than they save); --workers 2 still uses two."""
    from prism_trace.ingestion.discover import find
    from prism_trace.ingestion.plan import reader_processes

    assert reader_processes(find([job])) == 0
    assert reader_processes(find([job]), workers=2) == 2
    assert reader_processes(find([job]), workers=1) == 0
    assert reader_processes(find([SAMPLE / "rank0.kineto.json.gz"]), workers=4) == 0


def test_a_test_runner_process_is_not_forked() -> None:
    """This process runs DuckDB and polars threads: ``preforked`` leaves the fork server to
    start the workers."""
    import duckdb

    from prism_trace.ingestion.parts import _safe_to_fork, preforked, preforked_workers

    with duckdb.connect() as con:
        con.execute("SELECT 1").fetchall()
        assert not _safe_to_fork()
        with preforked(2):
            assert preforked_workers() == 0


def test_the_default_uses_workers_only_on_idle_cores(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the size, the default takes one worker an idle core: none on a busy machine."""
    from prism_trace.ingestion import plan as ingest_plan
    from prism_trace.ingestion.discover import find
    from prism_trace.ingestion.plan import reader_processes

    monkeypatch.setattr(ingest_plan, "_PARALLEL_MIN_BYTES_FORKED", 0)
    monkeypatch.setattr(ingest_plan.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(ingest_plan.os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert reader_processes(find([job]), workers="auto") == 4
    monkeypatch.setattr(ingest_plan.os, "getloadavg", lambda: (2.4, 0.0, 0.0))
    assert reader_processes(find([job]), workers="auto") == 2
    monkeypatch.setattr(ingest_plan.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    assert reader_processes(find([job]), workers="auto") == 0
    assert reader_processes(find([job]), workers=3) == 3, "an explicit --workers is kept"

"""Bad input: a clear one-line error naming the file, a non-zero exit, and an untouched store."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.errors import (
    DuplicateRankError,
    DuplicateRunError,
    MissingFieldError,
    StoreLockedError,
    TraceFormatError,
    TruncatedTraceError,
    UnknownFormatError,
)
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import open_store
from prism_trace.store.schema import SCHEMA_VERSION
from prism_trace.store.tables import TABLES
from tests.conftest import db_contents

pytestmark = pytest.mark.shared_data


def snapshot(db: Path) -> dict[str, int | str]:
    """Row count of every table plus the schema version: what must not change on failure."""
    with open_store(db, read_only=True) as store:
        out: dict[str, int | str] = {
            t.name: store.con.execute(f"SELECT count(*) FROM {t.name}").fetchone()[0]  # type: ignore[index]
            for t in TABLES
        }
        out["schema_version"] = store.con.execute(
            "SELECT value FROM meta WHERE key = 'schema_version'"
        ).fetchone()[0]  # type: ignore[index]
    return out


@pytest.fixture
def kineto_dir(shared_datasets: Path) -> Path:
    return shared_datasets / "param-dlrm-8rank" / "kineto"


@pytest.fixture
def seeded_db(tmp_path: Path, shared_datasets: Path) -> Path:
    """A store already holding one good run, so 'unchanged' is checked against real content."""
    db = tmp_path / "seed.duckdb"
    with open_store(db) as store:
        ingest(
            store,
            [
                shared_datasets
                / "chakra-et/astrasim_et_examples/microbenchmarks/all_reduce/4npus_1MB"
            ],
            run="seed",
            progress=False,
        )
    return db


def run_cli(*args: str | Path) -> tuple[int, str]:
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


def assert_fails_cleanly(db: Path, args: list[str | Path], needle: str) -> str:
    before = snapshot(db)
    code, out = run_cli("ingest", *args, "--db", db, "--quiet")
    assert code != 0
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert needle in lines[0], lines[0]
    assert snapshot(db) == before
    return lines[0]


def test_truncated_gzip(seeded_db: Path, kineto_dir: Path, tmp_path: Path) -> None:
    src = next(kineto_dir.glob("worker0_*"))
    cut = tmp_path / "worker0_cut.pt.trace.json.gz"
    data = src.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    line = assert_fails_cleanly(seeded_db, [cut, "--run", "x"], cut.name)
    assert "truncated" in line
    with open_store(seeded_db) as store, pytest.raises(TruncatedTraceError, match=cut.name):
        ingest(store, [cut], run="x", progress=False)


def test_corrupt_gzip(seeded_db: Path, kineto_dir: Path, tmp_path: Path) -> None:
    src = next(kineto_dir.glob("worker0_*"))
    bad = tmp_path / "worker0_bad.pt.trace.json.gz"
    data = bytearray(src.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\x00" * 64
    bad.write_bytes(bytes(data))
    assert_fails_cleanly(seeded_db, [bad, "--run", "x"], bad.name)


def test_corrupt_json(seeded_db: Path, kineto_dir: Path, tmp_path: Path) -> None:
    src = next(kineto_dir.glob("worker0_*"))
    text = gzip.decompress(src.read_bytes())
    bad = tmp_path / "worker0_json.pt.trace.json"
    mid = len(text) // 2
    bad.write_bytes(text[:mid] + b"}}]],,{{" + text[mid:])
    with open_store(seeded_db) as store, pytest.raises(TraceFormatError, match=bad.name):
        ingest(store, [bad], run="x", progress=False)
    assert_fails_cleanly(seeded_db, [bad, "--run", "x"], bad.name)


def test_corrupt_protobuf(seeded_db: Path, shared_datasets: Path, tmp_path: Path) -> None:
    src = shared_datasets / "chakra-et/astrasim_et_examples/custom_ring_allreduce_8npus_1MB"
    cut = tmp_path / "ring.0.et"
    data = (src / "custom_allreduce.0.et").read_bytes()
    cut.write_bytes(data[: len(data) - 7])
    with open_store(seeded_db) as store, pytest.raises(TruncatedTraceError, match=cut.name):
        ingest(store, [cut], run="x", progress=False)
    assert_fails_cleanly(seeded_db, [cut, "--run", "x"], cut.name)


def test_unknown_kind(seeded_db: Path, tmp_path: Path) -> None:
    odd = tmp_path / "notes.txt"
    odd.write_text("hello, not a trace\n")
    with open_store(seeded_db) as store, pytest.raises(UnknownFormatError, match=odd.name):
        ingest(store, [odd], run="x", progress=False)
    assert_fails_cleanly(seeded_db, [odd, "--run", "x"], "unknown trace format")


def test_missing_fields(seeded_db: Path, tmp_path: Path) -> None:
    bad = tmp_path / "rank0_trace.json"
    bad.write_text('{"distributedInfo": {"rank": 0}, "traceEvents": [{"ph": "X", "name": "a"}]}')
    with open_store(seeded_db) as store, pytest.raises(MissingFieldError, match=bad.name):
        ingest(store, [bad], run="x", progress=False)
    assert_fails_cleanly(seeded_db, [bad, "--run", "x"], bad.name)


@pytest.mark.slow
def test_same_rank_twice(seeded_db: Path, kineto_dir: Path, tmp_path: Path) -> None:
    src = next(kineto_dir.glob("worker0_*"))
    copy = tmp_path / "again" / "worker0_step_12.copy.pt.trace.json.gz"
    copy.parent.mkdir()
    copy.write_bytes(gzip.compress(gzip.decompress(src.read_bytes()), compresslevel=1))
    with open_store(seeded_db) as store, pytest.raises(DuplicateRankError, match="rank 0"):
        ingest(store, [kineto_dir, copy], run="x", progress=False)
    assert_fails_cleanly(seeded_db, [kineto_dir, copy, "--run", "x"], "rank 0 appears twice")


def test_existing_run_name_and_replace(seeded_db: Path, shared_datasets: Path) -> None:
    other = shared_datasets / "chakra-et/astrasim_et_examples/microbenchmarks/all_gather/4npus_1MB"
    with open_store(seeded_db) as store, pytest.raises(DuplicateRunError, match="seed"):
        ingest(store, [other], run="seed", progress=False)
    assert_fails_cleanly(seeded_db, [other, "--run", "seed"], "already exists")
    code, out = run_cli("ingest", other, "--db", seeded_db, "--run", "seed", "--replace", "-q")
    assert code == 0, out
    with open_store(seeded_db, read_only=True) as store:
        kinds = store.con.execute("SELECT DISTINCT kind FROM collective").fetchall()
        assert kinds == [("all_gather",)]


def test_the_same_files_may_be_ingested_into_another_run(
    seeded_db: Path, shared_datasets: Path, tmp_path: Path
) -> None:
    """Two runs may share a file (two views of one recording compared by ``diff``); a file
    given twice in one ingest is still refused."""
    same = shared_datasets / "chakra-et/astrasim_et_examples/microbenchmarks/all_reduce/4npus_1MB"
    db = tmp_path / "copy.duckdb"
    shutil.copyfile(seeded_db, db)
    code, out = run_cli("ingest", same, "--db", db, "--run", "again", "-q")
    assert code == 0, out
    with open_store(db, read_only=True) as store:
        runs = store.con.execute(
            "SELECT r.name, count(*) FROM source_file s JOIN run r USING (run_id)"
            " GROUP BY ALL ORDER BY ALL"
        ).fetchall()
    assert runs == [("again", 4), ("seed", 4)]
    one = sorted(same.glob("*.et"))[0]
    assert_fails_cleanly(seeded_db, [one, one, "--run", "twice"], "each file may be given once")


def test_replace_keeps_old_run_when_new_input_is_bad(seeded_db: Path, tmp_path: Path) -> None:
    odd = tmp_path / "junk.json"
    odd.write_text("[1, 2, 3]")
    assert_fails_cleanly(seeded_db, [odd, "--run", "seed", "--replace"], odd.name)


def test_failure_inside_the_write_rolls_back(
    seeded_db: Path, shared_datasets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import prism_trace.ingestion.pipeline as ingest_mod

    real = ingest_mod.append

    def failing(con: object, table_name: str, df: object, *, run_id: int | None = None) -> int:
        # The rank rows are written last, after every file's tables: fail there.
        if table_name == "rank":
            msg = "disk full (simulated)"
            raise OSError(msg)
        return real(con, table_name, df, run_id=run_id)  # type: ignore[arg-type]

    monkeypatch.setattr(ingest_mod, "append", failing)
    before = snapshot(seeded_db)
    src = shared_datasets / "chakra-et/astrasim_et_examples/microbenchmarks/all_to_all/4npus_1MB"
    with open_store(seeded_db) as store, pytest.raises(OSError, match="simulated"):
        ingest(store, [src], run="y", progress=False)
    assert snapshot(seeded_db) == before


def test_a_refused_layout_leaves_the_replaced_run_as_it_was(
    seeded_db: Path, shared_datasets: Path
) -> None:
    """Issue 33: ``ingest --replace --layout`` whose layout the new run refuses keeps the old
    run, row for row: the ingest and the layout's declaration are one transaction (the
    replacement was committed, then dropped with the refused layout: no run was left)."""
    before = db_contents(seeded_db)
    assert before["event"], "the seeded run has rows to lose"
    src = shared_datasets / "chakra-et/astrasim_et_examples/microbenchmarks/all_to_all/4npus_1MB"
    args = [src, "--run", "seed", "--replace", "--layout", "tp=3"]
    assert_fails_cleanly(seeded_db, args, "records a world of 4")
    assert db_contents(seeded_db) == before


def test_locked_database(seeded_db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that another process holds is refused at once: one attempt to open it, made
    while the holder still holds it (no retry, no waiting for the lock; the holder lets go only
    after 60 s, so a store that waited would open and this would fail)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print('ok', flush=True);"
            " time.sleep(60)",
            str(seeded_db),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ok"
        attempts: list[str] = []
        connect = duckdb.connect

        def counted(database: str, *args: object, **kwargs: object) -> object:
            attempts.append(database)
            return connect(database, *args, **kwargs)

        monkeypatch.setattr(duckdb, "connect", counted)
        with pytest.raises(StoreLockedError, match="locked by another process"):
            open_store(seeded_db)
        monkeypatch.undo()
        assert attempts == [str(seeded_db)]
        assert holder.poll() is None  # refused while the holder still held it
        code, out = run_cli("info", seeded_db)
        assert code != 0
        assert "locked" in out
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


def test_not_a_database(tmp_path: Path) -> None:
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"definitely not duckdb" * 100)
    code, out = run_cli("info", junk)
    assert code != 0
    assert junk.name in out


def test_wrong_schema_version(seeded_db: Path, tmp_path: Path) -> None:
    db = tmp_path / "old.duckdb"
    shutil.copy(seeded_db, db)
    import duckdb

    con = duckdb.connect(str(db))
    con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    con.close()
    code, out = run_cli("info", db)
    assert code != 0
    assert f"store has schema version 1, this prism-trace reads {SCHEMA_VERSION}" in out
    assert len(out.strip().splitlines()) == 1


@pytest.mark.parametrize("gz", [False, True])
def test_malformed_kineto_json_names_the_users_file(
    seeded_db: Path, tmp_path: Path, gz: bool
) -> None:
    """A malformed event: the line names the user's file and where in it, not the reader's
    temporary copy of the events (was: `Malformed JSON in file "/tmp/prism-ingest-...`)."""
    import gzip
    import json

    events = [
        {"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": i, "dur": 1}
        for i in range(30)
    ]
    text = json.dumps({"traceEvents": events}).replace('"ts": 20', '"ts": 2x0', 1)
    bad = tmp_path / ("rank0_trace.json" + (".gz" if gz else ""))
    bad.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    err = assert_fails_cleanly(seeded_db, [bad, "--run", "x"], bad.name)
    assert "prism-" not in err
    assert "malformed JSON at line 1, column" in err


def test_a_named_file_that_is_not_a_trace_says_what_it_is(seeded_db: Path, tmp_path: Path) -> None:
    """A JSON result file, a folder of them, the op timeline's companion: each line says what the
    file is and what was expected (was: "no trace files found" for a file that exists)."""
    result = tmp_path / "d" / "result.json"
    result.parent.mkdir()
    result.write_text('{"step_t_base": [1.0], "job_meta": {}}')
    err = assert_fails_cleanly(seeded_db, [result, "--run", "x"], "`step_t_base`")
    assert "expected a Kineto trace" in err
    err = assert_fails_cleanly(seeded_db, [result.parent, "--run", "x"], "no trace files found")
    assert "result.json: a JSON object with keys `step_t_base`, `job_meta`" in err
    tl = tmp_path / "tl"
    tl.mkdir()
    (tl / "trace-X.parquet").write_bytes(b"PAR1")
    (tl / "meta-X.yaml").write_text("dp: 1\n")
    (tl / "timeline-X.json").write_text("{}")
    err = assert_fails_cleanly(seeded_db, [tl / "timeline-X.json", "--run", "x"], "timeline-X.json")
    assert (
        "not a trace: a companion file of the op timeline in its folder; ingest trace-X.parquet"
        in err
    )

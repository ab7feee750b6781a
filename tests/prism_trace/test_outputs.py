"""One output rule for every `-o`: no device, FIFO or foreign link written through, and a failed
write leaves the old target as it was (written beside it, renamed into place)."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.errors import OutputError
from prism_trace.outputs import atomic_dir, atomic_file
from prism_trace.store.connection import open_store


@pytest.fixture(scope="module")
def sample_db(sample_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed copy of the sample store (the CLI opens it)."""
    from tests.conftest import copy_of_template

    return copy_of_template(sample_template, tmp_path_factory, "outputs")


@pytest.fixture
def empty_db(tmp_path: Path) -> Path:
    db = tmp_path / "e.db"
    open_store(db).close()
    return db


def _commands(db: Path, out: Path) -> dict[str, list[str]]:
    """Every command with `-o`, writing ``out`` (a file or a folder)."""
    return {
        "query": ["query", str(db), "SELECT 1 AS one", "-o", str(out), "--format", "csv"],
        "perfetto": ["export", "perfetto", str(db), "--run", "sample", "-o", str(out)],
        "report": ["report", str(db), "--run", "sample", "-o", str(out)],
        "chakra": ["export", "chakra", str(db), "--run", "sample", "-o", str(out)],
        "parquet": ["export", "parquet", str(db), "-o", str(out)],
    }


def _run(args: list[str]) -> tuple[int, str]:
    r = CliRunner().invoke(main, args)
    return r.exit_code, r.output


@pytest.mark.parametrize("command", ["query", "perfetto", "report", "chakra", "parquet"])
def test_fifo_and_foreign_links_are_refused_and_left_alone(
    command: str, sample_db: Path, tmp_path: Path
) -> None:
    db = sample_db
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, out = _run(_commands(db, fifo)[command])
    assert code == 1, out
    assert out.startswith(f"error: {fifo}: is a FIFO")
    assert out.count("\n") == 1
    assert stat.S_ISFIFO(fifo.lstat().st_mode)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "victim"
    victim.write_text("keep me")
    (tmp_path / "sub").mkdir()
    link = tmp_path / "sub" / "link"
    link.symlink_to(victim)
    code, out = _run(_commands(db, link)[command])
    assert code == 1, out
    assert "is a symbolic link" in out
    assert "--follow-symlinks" in out
    assert victim.read_text() == "keep me"
    assert link.is_symlink()

    stdout_link = tmp_path / "sub" / "stdout"
    stdout_link.symlink_to("/proc/self/fd/1")
    code, out = _run(_commands(db, stdout_link)[command])
    assert code == 1, out
    assert "is a symbolic link to '/proc/self/fd/1'" in out


def test_character_device_is_refused(sample_db: Path) -> None:
    db = sample_db
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    for command in ("query", "perfetto", "report"):
        code, out = _run(_commands(db, Path("/dev/full"))[command])
        assert code == 1, out
        assert "/dev/full: is a character device" in out
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_follow_symlinks_writes_where_the_link_points(empty_db: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.csv"
    target.write_text("old")
    (tmp_path / "sub").mkdir()
    link = tmp_path / "sub" / "link.csv"
    link.symlink_to(target)
    code, out = _run([*_commands(empty_db, link)["query"], "--follow-symlinks"])
    assert code == 0, out
    assert target.read_text() == "one\n1\n"
    assert link.is_symlink()


def test_a_link_inside_its_folder_is_followed(empty_db: Path, tmp_path: Path) -> None:
    (tmp_path / "real.csv").write_text("old")
    (tmp_path / "near.csv").symlink_to("real.csv")
    code, out = _run(_commands(empty_db, tmp_path / "near.csv")["query"])
    assert code == 0, out
    assert (tmp_path / "real.csv").read_text() == "one\n1\n"


def test_a_query_failing_mid_stream_leaves_the_old_file(empty_db: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.csv"
    out.write_text("the old result\n")
    # The error is raised by the 300,000th row: batches before it were already streamed.
    sql = "SELECT CASE WHEN i < 300000 THEN i ELSE error('boom') END AS i FROM range(400000) t(i)"
    code, text = _run(["query", str(empty_db), sql, "-o", str(out), "--format", "csv"])
    assert code == 1, text
    assert "boom" in text
    assert out.read_text() == "the old result\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.db", "r.csv"]


def _fail_in(block: contextlib.AbstractContextManager[Path]) -> None:
    """Write half an output in ``block``, then fail."""
    with block as tmp:
        if tmp.is_dir():
            (tmp / "x").write_text("half")
        else:
            tmp.write_text("half")
        raise RuntimeError


def test_atomic_file_and_dir_keep_the_old_target_on_failure(tmp_path: Path) -> None:
    f = tmp_path / "f.txt"
    f.write_text("old")
    os.chmod(f, 0o640)
    with pytest.raises(RuntimeError):
        _fail_in(atomic_file(f))
    assert f.read_text() == "old"
    with atomic_file(f) as tmp:
        tmp.write_text("new")
    assert f.read_text() == "new"
    assert stat.S_IMODE(f.stat().st_mode) == 0o640
    d = tmp_path / "d"
    with pytest.raises(RuntimeError):
        _fail_in(atomic_dir(d))
    assert not d.exists()
    d.mkdir()
    with atomic_dir(d) as tmpd:
        (tmpd / "x").write_text("whole")
    assert (d / "x").read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f.txt"]
    with pytest.raises(OutputError, match="not empty"), atomic_dir(d):
        pass


def test_table_query_fetches_only_the_rows_shown(empty_db: Path) -> None:
    """600 million rows, 50 shown: the child's peak memory stays far below the 4.9 GB it took
    when the whole result was materialised."""
    code = (
        "import resource, sys; from prism_trace.cli import main\n"
        "try:\n"
        f"    main(['query', {str(empty_db)!r}, 'select * from range(600000000)'])\n"
        "except SystemExit: pass\n"
        "print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert "first 50 rows shown; the result has more" in r.stdout, r.stdout + r.stderr
    assert "│ 49" in r.stdout
    assert "│ 50 " not in r.stdout
    kb = int(r.stderr.split("maxrss_kb")[1])
    # 150 MB on a quiet host (100-145 MB beside three busy processes); in a loaded full test
    # run DuckDB's parallel producers ran ahead of the streamed read to 0.95-1.8 GB, and once
    # (a fresh clone's CI run, 2026-11-27) to 2.8 GB, past the 2 GB. The test holds
    # what does not depend on the host's load: the result is not materialised (600 million
    # BIGINTs are 4.8 GB before any overhead; it took 4.9 GB when it was).
    assert kb < 4_000_000, kb

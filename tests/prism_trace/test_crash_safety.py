"""Crash safety: a write command killed (SIGKILL) leaves the store as before or as after, and an
output absent (or the old one) or whole. ``benchmarks/crash_safety.py`` kills every write command
at drawn delays; here a few cases, and kills timed to land inside the write itself."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "crash_safety", REPO / "benchmarks" / "crash_safety.py"
    )
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["crash_safety"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["graph", "emulate", "export-chakra"])
def test_killed_at_drawn_delays_as_before_or_after(
    name: str, sample_template: Path, tmp_path: Path
) -> None:
    bench = _bench()
    case = next(c for c in bench.CASES if c.name == name)
    assert case.base == "plain"
    r = bench.run_case(case, {"plain": sample_template}, tmp_path, kills=1, rng=random.Random(name))
    assert r.kills == 1
    assert r.torn == 0, r.notes
    assert r.torn_outputs == 0, r.notes


def _kill_when(p: subprocess.Popen[bytes], folder: Path, pattern: str) -> bool:
    """SIGKILL ``p``'s group once a file matching ``pattern`` in ``folder`` holds bytes; False
    when ``p`` ended first."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if any(f.stat().st_size > 0 for f in folder.glob(pattern) if f.is_file()):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return True
        time.sleep(0.005)
    p.wait()
    return False


def _prism(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "prism_trace.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def test_an_export_killed_while_writing_leaves_the_old_file(
    sample_template: Path, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    shutil.copyfile(sample_template, db)
    out = tmp_path / "p.json"
    out.write_text("the old trace")
    p = _prism("export", "perfetto", str(db), "--run", "sample", "-o", str(out))
    assert _kill_when(p, tmp_path, ".p.json.*.part"), "the export ended before it was killed"
    assert out.read_text() == "the old trace"


def test_an_ingest_into_a_new_path_killed_midway_leaves_no_store(tmp_path: Path) -> None:
    from tests.conftest import SAMPLE

    db = tmp_path / "new.db"
    p = _prism("ingest", "--db", str(db), "--run", "k", "--workers", "1", str(SAMPLE))
    # The new store is built beside as `.new.db.*.part`; it gets bytes once the schema is in.
    assert _kill_when(p, tmp_path, ".new.db.*.part"), "the ingest ended before it was killed"
    assert not db.exists()

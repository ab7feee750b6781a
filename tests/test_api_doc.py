"""docs/api.md's session runs: its ```python blocks, in order, in one fresh interpreter, in a
temporary folder, as a notebook would run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# Slow: ingests, slices to 8192 ranks, emulates twice and validates (about half a minute).
pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_api_doc_has_a_session() -> None:
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) >= 6
    assert "import prism_trace as pt" in blocks[0]


def test_the_api_session_runs(tmp_path: Path) -> None:
    blocks = BLOCK.findall(DOC.read_text())
    # One script, each block marked, so a failure names the block it came from.
    script = "".join(f"print('--- block {i}', flush=True)\n{b}" for i, b in enumerate(blocks))
    res = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    out = res.stdout
    assert "8 [0, 1, 2, 3, 4, 5, 6, 7]" in out  # the ingest's world and ranks
    assert "8192" in out  # the slice's world
    assert "SliceError" in out  # the refused slice names its class
    means = re.findall(r"^big-(?:emulated|slow) \[([\d., ]+)\]$", out, re.M)
    assert len(means) == 2
    base, slow = ([float(x) for x in m.split(",")] for m in means)
    assert sum(slow) >= sum(base)  # a slow-down never speeds the run up, in total

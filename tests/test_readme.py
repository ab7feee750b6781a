"""Every shell and SQL example of README.md runs, in order, on the bundled sample.

```bash blocks run line by line in one shell (a temporary folder, `prism` and `python` from this
interpreter's environment); ```sql blocks run through `prism query` on the walkthrough's store.
```console and ```text blocks are not run: they show set-up scripts and the option synopsis.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Slow: runs every README example, the demo included; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall(README.read_text()) if kind == lang]


def _needs_torch(block: str) -> bool:
    return bool(re.search(r"^prism (replay|run)\b", block, re.M))


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run every bash block once; the folder holds the store the SQL examples read."""
    work = tmp_path_factory.mktemp("readme")
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    has_torch = importlib.util.find_spec("torch") is not None
    for block in _blocks("bash"):
        if _needs_torch(block) and not has_torch:
            continue
        res = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        assert res.returncode == 0, (
            f"README block failed:\n{block}\n{res.stdout[-2000:]}\n{res.stderr}"
        )
        assert "Traceback" not in res.stderr
    return work


def test_readme_has_examples() -> None:
    assert len(_blocks("bash")) >= 2
    assert len(_blocks("sql")) >= 4
    assert "issue" not in README.read_text().lower()


@pytest.mark.slow
def test_every_shell_example_runs(walkthrough: Path) -> None:
    for out in ("job.duckdb", "report.html", "trace.json.gz", "et"):
        assert (walkthrough / out).exists(), out
    assert any((walkthrough / "et").glob("*.et"))


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_blocks("sql"))))
def test_every_sql_example_runs(walkthrough: Path, index: int) -> None:
    sql = _blocks("sql")[index]
    prism = Path(sys.executable).parent / "prism"
    res = subprocess.run(
        [str(prism), "query", str(walkthrough / "job.duckdb"), sql.strip().rstrip(";")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert res.returncode == 0, f"{sql}\n{res.stderr}"

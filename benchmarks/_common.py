"""What the benchmark scripts share: where the real traces are, the host label, the dated note,
the ladders' wait-mode job and running a command."""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import os
import platform
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHARED = Path(os.environ.get("PRISM_SHARED_DATASETS", HERE.parents[1] / "shared" / "datasets"))

WAIT_JOB = [
    "--compute", "wait", "--schedule", "1f1b", "--layers", "4", "--steps", "6",
    "--wait-ms-per-layer", "50", "--no-et",
]  # fmt: skip
"""The generator options of the wait-mode ladders (bench_predict, bench_whatif_truth): 2 layers a
stage of pp 2, 1F1B, 50 ms a layer's forward, 6 profiled steps, gloo on CPU."""


def run(cmd: list[str]) -> str:
    """``cmd``'s stdout; its failure raised with the tail of both outputs."""
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        msg = f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        raise RuntimeError(msg)
    return res.stdout


def dataset(name: str) -> Path:
    """A set under ``SHARED``; exits with a clear message when it is absent."""
    path = SHARED / name
    if not path.is_dir():
        raise SystemExit(f"{path}: dataset not found (set PRISM_SHARED_DATASETS)")
    return path


def host_kind(override: str | None = None) -> str:
    """The label in result file names, e.g. ``x86-64-2cpu``."""
    return override or f"{platform.machine()}-{os.cpu_count()}cpu".replace("_", "-")


def table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns: what was measured, and the figure."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_note(theme: str, host: str, *, title: str, command: str, body: str) -> Path:
    """Write ``results/<theme>_<host>_<date>.md`` with the command, the body and the versions."""
    versions = ", ".join(
        f"{p} {md.version(p)}" for p in ("prism-trace", "duckdb", "polars", "numpy")
    )
    note = HERE / "results" / f"{theme}_{host}_{dt.date.today().isoformat()}.md"
    note.parent.mkdir(exist_ok=True)
    note.write_text(
        f"# {title}\n\nCommand: `{command}`\n\n{body}\n\n"
        f"Host: {host}, {platform.processor() or platform.machine()}, Python"
        f" {platform.python_version()}; {versions}; load average {os.getloadavg()}.\n"
    )
    return note

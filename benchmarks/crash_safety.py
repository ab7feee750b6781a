"""Crash safety: SIGKILL every write command at several points; the store must read as before or as
after, and an output must be absent (or the old one) or whole.

Each case runs once to the end on a copy of the base store (its wall time ``T``, the store's digest
"after" and the output's digest), then ``--kills`` times on fresh copies, killed (the whole process
group: ingest's workers too) after a delay drawn from ``[0.05 T, 1.05 T]`` with ``--seed``. A
killed store is opened read-only (DuckDB replays a committed WAL) and its digest compared: every
table's rows, sorted, without the two columns that hold wall-clock times (``run.created_at``,
``source_file.ingested_at``). A killed export must have left its target absent or whole.

    python benchmarks/crash_safety.py                 # every case, 6 kills each
    python benchmarks/crash_safety.py --kills 2 --cases ingest-new,graph,export-perfetto
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "datasets" / "sample"
VOLATILE = {("run", "created_at"), ("source_file", "ingested_at")}
"""Columns of the wall-clock time a row was written: they differ between two identical runs."""


@dataclass(frozen=True)
class Case:
    """One write command: its arguments (``DB``, ``OUT`` and ``SAMPLE`` are filled in), the base
    store it starts from (``plain``: the sample; ``graph``: with its graph; ``none``: no store)
    and what ``OUT`` is (``none``, ``file`` or ``dir``). A ``measured`` command (replay) writes
    times it measures, which differ from run to run: its store is "as after" when the rows of the
    runs it started with are unchanged and every table holds as many rows as after the full run."""

    name: str
    args: tuple[str, ...]
    base: str = "plain"
    out: str = "none"
    measured: bool = False


CASES = (
    Case("ingest-new", ("ingest", "--db", "DB", "--run", "k", "--quiet", "SAMPLE"), base="none"),
    Case("ingest-replace", ("ingest", "--db", "DB", "--run", "sample", "--replace", "SAMPLE")),
    Case("graph", ("graph", "DB", "--run", "sample")),
    Case(
        "slice",
        (
            "slice",
            "DB",
            "--run",
            "sample",
            "--layout",
            "tp=2,dp=8,pp=2",
            "--world",
            "32",
            "--out-run",
            "s",
        ),
        base="graph",
    ),
    Case("emulate", ("emulate", "DB", "--run", "sample", "--out-run", "e")),
    Case(
        "replay",
        (
            "replay",
            "DB",
            "--run",
            "sample",
            "--ranks",
            "0",
            "--out-run",
            "r",
            "--iterations",
            "1",
            "--warmup",
            "0",
        ),
        base="graph",
        measured=True,
    ),
    Case("export-chakra", ("export", "chakra", "DB", "--run", "sample", "-o", "OUT"), out="dir"),
    Case(
        "export-perfetto",
        ("export", "perfetto", "DB", "--run", "sample", "-o", "OUT"),
        base="graph",
        out="file",
    ),
    Case("export-parquet", ("export", "parquet", "DB", "-o", "OUT"), base="graph", out="dir"),
)


def store_digest(db: Path, old_runs: int | None = None) -> str:
    """The digest of every table's rows (sorted) of the store at ``db``; ``absent`` when no file
    is there. Opened read-only: a committed WAL is replayed, nothing is written.

    With ``old_runs``: the store's *shape*, what two runs of a measured command agree on: the rows
    of the runs it had before the command (ids up to ``old_runs``) and every table's row count.
    """
    if not db.exists():
        return "absent"
    from prism_trace.store.connection import open_store
    from prism_trace.store.tables import TABLES

    h = hashlib.sha256()
    with open_store(db, read_only=True) as store:
        for t in TABLES:
            cols = [c.name for c in t.columns if (t.name, c.name) not in VOLATILE]
            where = ""
            if old_runs is not None and "run_id" in cols:
                where = f" WHERE run_id <= {old_runs}"
            rows = store.con.execute(
                f"SELECT {', '.join(cols)} FROM {t.name}{where} ORDER BY ALL"
            ).fetchall()
            if old_runs is None:
                h.update(f"{t.name}:{rows!r}\n".encode())
            else:
                ((n,),) = store.con.execute(f"SELECT count(*) FROM {t.name}").fetchall()
                h.update(f"{t.name}:{n}:{rows!r}\n".encode())
    return h.hexdigest()[:16]


def _last_run(db: Path) -> int:
    """The highest run id in the store at ``db`` (0 when there is none)."""
    if not db.exists():
        return 0
    from prism_trace.store.connection import open_store

    with open_store(db, read_only=True) as store:
        ((last,),) = store.con.execute("SELECT coalesce(max(run_id), 0) FROM run").fetchall()
    return int(last)


def output_digest(out: Path) -> str:
    """The digest of a file, or of a folder's files (names and bytes); ``absent`` when none."""
    if not out.exists():
        return "absent"
    h = hashlib.sha256()
    files = [out] if out.is_file() else sorted(p for p in out.rglob("*") if p.is_file())
    for p in files:
        h.update(str(p.relative_to(out.parent)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _bases(work: Path) -> dict[str, Path]:
    """The base stores, built once: the sample, and the sample with its graph."""
    plain = work / "plain.db"
    prism = [sys.executable, "-m", "prism_trace.cli"]
    subprocess.run(
        [*prism, "ingest", "--db", str(plain), "--run", "sample", "--quiet", str(SAMPLE)],
        check=True,
    )
    graph = work / "graph.db"
    shutil.copyfile(plain, graph)
    subprocess.run(
        [*prism, "graph", str(graph), "--run", "sample"], check=True, text=True, capture_output=True
    )
    return {"plain": plain, "graph": graph}


def _start(case: Case, db: Path, out: Path) -> subprocess.Popen[bytes]:
    fill = {"DB": str(db), "OUT": str(out), "SAMPLE": str(SAMPLE)}
    args = [fill.get(a, a) for a in case.args]
    return subprocess.Popen(
        [sys.executable, "-m", "prism_trace.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: the kill reaches ingest's workers
    )


def _fresh(case: Case, bases: dict[str, Path], where: Path) -> tuple[Path, Path]:
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    db = where / "w.db"
    if case.base != "none":
        shutil.copyfile(bases[case.base], db)
    return db, where / "out"


@dataclass
class Outcome:
    """One case: its full run's time and digests, and what each kill left."""

    case: str
    seconds: float
    kills: int = 0
    as_before: int = 0
    as_after: int = 0
    torn: int = 0
    torn_outputs: int = 0
    notes: str = ""


def run_case(
    case: Case, bases: dict[str, Path], work: Path, *, kills: int, rng: random.Random
) -> Outcome:
    """Run ``case`` whole once, then kill it ``kills`` times at drawn delays."""
    db, out = _fresh(case, bases, work / case.name)
    before = store_digest(db)
    old_runs = _last_run(db)
    t0 = time.perf_counter()
    p = _start(case, db, out)
    _, err = p.communicate()
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        msg = f"{case.name}: the full run failed: {err.decode()[-500:]}"
        raise RuntimeError(msg)
    after, out_after = store_digest(db), output_digest(out)
    after_shape = store_digest(db, old_runs) if case.measured else None
    res = Outcome(case.name, seconds)
    for i in range(kills):
        db, out = _fresh(case, bases, work / f"{case.name}-{i}")
        delay = rng.uniform(0.05, 1.05) * seconds
        p = _start(case, db, out)
        time.sleep(delay)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()  # reaps it and closes its stderr pipe
        res.kills += 1
        got = store_digest(db)
        if got == before:
            res.as_before += 1
        elif got == after or (case.measured and store_digest(db, old_runs) == after_shape):
            res.as_after += 1
        else:
            res.torn += 1
            res.notes += f" kill {i} at {delay:.2f} s: store {got};"
        if case.out != "none" and output_digest(out) not in ("absent", out_after):
            res.torn_outputs += 1
            res.notes += f" kill {i} at {delay:.2f} s: a partial output;"
        shutil.rmtree(work / f"{case.name}-{i}", ignore_errors=True)
    return res


def run(
    cases: list[Case], *, kills: int, seed: int, echo: Callable[[str], object] = print
) -> list[Outcome]:
    """Every case of ``cases``, in a temporary folder; one line per case to ``echo``."""
    rng = random.Random(seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="prism-crash-") as tmp:
        work = Path(tmp)
        bases = _bases(work)
        for case in cases:
            r = run_case(case, bases, work, kills=kills, rng=rng)
            results.append(r)
            echo(
                f"{r.case:16} full run {r.seconds:6.2f} s  kills {r.kills}: as before"
                f" {r.as_before}, as after {r.as_after}, torn stores {r.torn}, torn outputs"
                f" {r.torn_outputs}{'  ' + r.notes if r.notes else ''}"
            )
    return results


def main() -> None:
    """Parse the arguments, run, print a line per case and the totals."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=6, help="Kills per case.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default=None, help="Comma-separated case names (default: all).")
    ap.add_argument("--host", default=None, help="Host kind for the note's name.")
    ap.add_argument("--no-note", action="store_true", help="Do not write benchmarks/results/.")
    a = ap.parse_args()
    chosen = [c for c in CASES if a.cases is None or c.name in a.cases.split(",")]
    lines: list[str] = []

    def echo(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    results = run(chosen, kills=a.kills, seed=a.seed, echo=echo)
    kills = sum(r.kills for r in results)
    torn = sum(r.torn + r.torn_outputs for r in results)
    echo(f"total: {len(results)} commands, {kills} kills, {torn} torn stores or outputs")
    if not a.no_note:
        sys.path.insert(0, str(Path(__file__).parent))
        from _common import host_kind, write_note

        note = write_note(
            "crash_safety",
            host_kind(a.host),
            title="Crash safety: write commands killed with SIGKILL",
            command=f"python benchmarks/crash_safety.py --kills {a.kills} --seed {a.seed}"
            + (f" --cases {a.cases}" if a.cases else ""),
            body="```\n" + "\n".join(lines) + "\n```",
        )
        print(f"wrote {note}")
    sys.exit(1 if torn else 0)


if __name__ == "__main__":
    main()

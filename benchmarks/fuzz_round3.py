"""Issue 33's campaign: mutated inputs of every format and bad calls of every command, in one run.

Question: does any input or call make prism print a traceback, hang, take over 2 GB, write part
of a refused command's work, accept what it should refuse, or clobber an output it was pointed
at? Each class is counted apart.

Two kinds of case, planned together and run two at a time, each in a forked child of this
process (``--jobs``): the parent only imports, so a fork is cheap and safe, and a child that
runs past ``--timeout`` is killed (a hang) while its peak RSS comes from ``wait4``.

- **ingest** (``fuzz_ingest``'s harness): one file of a seed job mutated (bytes, structure, the
  readers' round-three mutations: a key twice at any depth, cycles, empty traces, world sizes
  that disagree, a peer outside the world, a name that is not UTF-8...), ingested into a copy of a
  store holding a run; refused in one line naming the file with the store as it was, or
  accepted as the seed's data (or other data an independent check finds valid).
- **command**: one call of ``info``, ``query``, ``graph``, ``slice``, ``emulate``, ``replay``,
  ``analyze`` (``diff`` included), ``report``, ``export`` or ``ingest`` on a copy of a store
  holding a recorded, a partial, a sliced, an emulated and an op-timeline run. Families:
  ``args`` (values a command must refuse: non-ASCII digits, ranks outside the world, NaN,
  unknown runs...), ``refused_writes`` (refusals that used to leave graph rows or drop a run;
  the store's contents are compared, not its row counts), ``outputs`` (``-o`` onto a character
  device, a symlink to /proc/self/fd/1 or out of its folder, a FIFO, a folder holding a file:
  refused, the target as it was), ``store_files`` (the store argument a random file, an empty
  one, a directory, SQLite, a DuckDB file that is not a store, a store cut in half or with
  flipped bytes: one line, the file unchanged, no DuckDB extension downloaded), ``bombs``
  (a billion-laughs meta YAML: refused; queries of 6e8 rows as a table, a top-N, 2e7 rows of
  CSV and 1e6 of JSON to stdout: accepted within the memory and time limits), ``unreadable``
  (a folder holding a file the user cannot read: the ingest runs as ``nobody`` when this is
  root) and ``valid`` (calls that must work, so that a harness refusing everything would show).

    python benchmarks/fuzz_round3.py [--cases 1100] [--ingest-share 0.5] [--jobs 2] [--seed 33]

Writes ``benchmarks/results/fuzz_round3_<host>_<date>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import fuzz_ingest as fi  # noqa: E402  # the ingest harness, beside this file

FAILURES = ("traceback", "hang", "memory", "partial_write", "invalid_accepted", "clobbered")
"""The classes the issue's targets count (each must be 0), plus ``bad_message`` below."""
OUTCOMES = ("refused", "accepted", *FAILURES, "bad_message", "valid_refused", "skipped")
_MEMORY_MB = 2048
_EXTENSIONS = Path.home() / ".duckdb" / "extensions"


# -- the command cases ----------------------------------------------------------------------------


@dataclass
class CmdCase:
    """One call: ``argv`` (``{db}``, ``{out}``, ``{work}`` filled in), what it must do, and the
    store or output target it is pointed at."""

    id: int
    family: str
    name: str
    argv: list[str]
    expect: str  # refuse | accept
    store: str = "copy"  # copy | a store-file kind (store_files)
    target: str = ""  # an output-target kind (outputs)
    as_nobody: bool = False


_U3 = "\u0663"  # ARABIC-INDIC DIGIT THREE: int() reads it as 3
_ARGS: dict[str, list[list[str]]] = {
    "info": [
        ["info", "{db}", "--run", "nope"],
        ["info", "{db}", "--run", "rec", "--ranks", _U3],
        ["info", "{db}", "--run", "rec", "--ranks", "0..99999999999"],
        ["info", "{db}", "--run", "rec", "--ranks", "-1"],
        ["info", "{db}", "--run", "rec", "--ranks", ""],
    ],
    "query": [
        ["query", "{db}", "DROP TABLE event"],
        ["query", "{db}", "DELETE FROM run"],
        ["query", "{db}", "UPDATE run SET name = 'x'"],
        ["query", "{db}", "CREATE TABLE t AS SELECT 1"],
        ["query", "{db}", "SELECT * FROM no_such_table"],
        ["query", "{db}", "SELECT 1; DROP TABLE run"],
        ["query", "{db}", "SELECT"],
        ["query", "{db}", "SELECT 1", "--max-rows", "-5"],
    ],
    "graph": [
        ["graph", "{db}", "--run", "nope"],
        ["graph", "{db}", "--run", "rec", "--layout", f"tp={_U3}"],
        ["graph", "{db}", "--run", "rec", "--layout", "tp=3"],
        ["graph", "{db}", "--run", "rec", "--layout", "tp=0"],
        ["graph", "{db}", "--run", "rec", "--layout", "tp=2", "--order", "xx-yy"],
    ],
    "slice": [
        [
            "slice",
            "{db}",
            "--run",
            "rec",
            "--layout",
            "tp=2,dp=4,pp=2",
            "--world",
            _U3,
            "--out-run",
            "s2",
        ],
        [
            "slice",
            "{db}",
            "--run",
            "rec",
            "--layout",
            "tp=2,dp=4,pp=2",
            "--world",
            "0",
            "--out-run",
            "s2",
        ],
        [
            "slice",
            "{db}",
            "--run",
            "rec",
            "--layout",
            "tp=2,dp=4,pp=2",
            "--world",
            "17",
            "--out-run",
            "s2",
        ],
        [
            "slice",
            "{db}",
            "--run",
            "rec",
            "--layout",
            f"tp=2,dp={_U3},pp=2",
            "--world",
            "24",
            "--out-run",
            "s2",
        ],
        [
            "slice",
            "{db}",
            "--run",
            "rec",
            "--layout",
            "tp=2,dp=4,pp=2",
            "--world",
            "16",
            "--out-run",
            "rec",
        ],
        [
            "slice",
            "{db}",
            "--run",
            "rec",
            "--layout",
            "tp=2,dp=4,pp=2",
            "--world",
            "16",
            "--from-ranks",
            "99",
            "--out-run",
            "s2",
        ],
        [
            "slice",
            "{db}",
            "--run",
            "rec",
            "--layout",
            "tp=2,dp=4,pp=2",
            "--world",
            "16",
            "--out-run",
            "a\tb",
        ],
    ],
    "emulate": [
        [
            "emulate",
            "{db}",
            "--run",
            "rec",
            "--out-run",
            "e2",
            "--what-if",
            f"slow-ranks={_U3}@1.2",
        ],
        ["emulate", "{db}", "--run", "rec", "--out-run", "e2", "--what-if", "bandwidth=0"],
        ["emulate", "{db}", "--run", "rec", "--out-run", "e2", "--what-if", "bandwidth=nan"],
        ["emulate", "{db}", "--run", "rec", "--out-run", "e2", "--what-if", "dp=0"],
        ["emulate", "{db}", "--run", "rec", "--out-run", "e2", "--keep-events", "99999"],
        ["emulate", "{db}", "--run", "nope", "--out-run", "e2"],
        ["emulate", "{db}", "--run", "rec", "--out-run", "emu"],
    ],
    "replay": [
        ["replay", "{db}", "--run", "rec", "--ranks", _U3, "--out-run", "r2"],
        ["replay", "{db}", "--run", "rec", "--ranks", "99", "--out-run", "r2"],
        ["replay", "{db}", "--run", "nope", "--ranks", "0", "--out-run", "r2"],
        ["replay", "{db}", "--run", "rec", "--ranks", "0", "--out-run", "rec"],
    ],
    "analyze": [
        ["analyze", "{db}", "diff", "--run", "rec", "--compare", "nope"],
        ["analyze", "{db}", "temporal", "--run", "rec", "--ranks", _U3],
        ["analyze", "{db}", "temporal", "--run", "rec", "--ranks", "99"],
        ["analyze", "{db}", "diff", "--run", "rec", "--compare", "emu", "--threshold-pct", "nan"],
        ["analyze", "{db}", "bubbles", "--run", "rec", "--min-ns", "-1"],
        ["analyze", "{db}", "nothing", "--run", "rec"],
        ["analyze", "{db}", "temporal", "--run", "nope"],
    ],
    "report": [
        ["report", "{db}", "--run", "nope", "-o", "{out}/r.html"],
        ["report", "{db}", "--run", "rec", "--compare", "nope", "-o", "{out}/r.html"],
    ],
    "export": [
        ["export", "chakra", "{db}", "--run", "rec", "-o", "{out}/ch", "--prefix", "a\tb"],
        ["export", "chakra", "{db}", "--run", "rec", "-o", "{out}/ch", "--prefix", "a\nb"],
        ["export", "chakra", "{db}", "--run", "rec", "-o", "{out}/ch", "--size-bandwidth", "nan"],
        ["export", "chakra", "{db}", "--run", "rec", "-o", "{out}/ch", "--size-bandwidth", "-1"],
        ["export", "perfetto", "{db}", "--run", "rec", "-o", "{out}/t.json", "--ranks", _U3],
        ["export", "perfetto", "{db}", "--run", "rec", "-o", "{out}/t.json", "--ranks", "99999"],
        ["export", "parquet", "{db}", "--run", "nope", "-o", "{out}/pq"],
    ],
    "ingest": [
        ["ingest", "{work}/k2", "--db", "{db}", "--run", "k2", "--rank", _U3],
        ["ingest", "{work}/k2", "--db", "{db}", "--run", "a\nb"],
        ["ingest", "{work}/nowhere", "--db", "{db}", "--run", "k2"],
        ["ingest", "{work}/k2", "--db", "{db}", "--run", "k2", "--workers", "0"],
        ["ingest", "{work}/k2", "--db", "{db}", "--run", "k2", "--layout", f"tp={_U3}"],
    ],
}
# Refusals that used to write: graph rows built before the refusal, or a replaced run dropped.
_REFUSED_WRITES = [
    ["emulate", "{db}", "--run", "part", "--out-run", "e2"],
    ["export", "chakra", "{db}", "--run", "rec", "-o", "{out}/ch", "--size-bandwidth", "0"],
    ["emulate", "{db}", "--run", "part", "--out-run", "e2", "--what-if", "remove-gpu=0"],
    ["analyze", "{db}", "slowdown", "--run", "part", "--by", "stage"],
    ["ingest", "{work}/k", "--db", "{db}", "--run", "k", "--replace", "--layout", "tp=3"],
]
_VALID = [
    ["info", "{db}"],
    ["info", "{db}", "--run", "rec"],
    ["query", "{db}", "SELECT count(*) FROM event"],
    ["query", "{db}", "SELECT name FROM run", "--format", "csv", "-o", "{out}/q.csv"],
    ["analyze", "{db}", "temporal", "--run", "rec"],
    ["analyze", "{db}", "diff", "--run", "rec", "--compare", "emu"],
    ["export", "perfetto", "{db}", "--run", "rec", "-o", "{out}/t.json"],
    ["export", "parquet", "{db}", "--run", "rec", "-o", "{out}/pq"],
    ["report", "{db}", "--run", "rec", "-o", "{out}/r.html"],
    ["ingest", "{work}/k2", "--db", "{db}", "--run", "k2"],
]
# Commands whose -o is a file (a target kind replaces it) or a folder.
_FILE_OUTPUTS = [
    ["export", "perfetto", "{db}", "--run", "rec", "-o", "{target}"],
    ["report", "{db}", "--run", "rec", "-o", "{target}"],
    ["query", "{db}", "SELECT 1", "--format", "csv", "-o", "{target}"],
]
_DIR_OUTPUTS = [
    ["export", "chakra", "{db}", "--run", "rec", "-o", "{target}"],
    ["export", "parquet", "{db}", "--run", "rec", "-o", "{target}"],
]
_FILE_TARGETS = ("chardev", "symlink_stdout", "symlink_out", "fifo", "folder_with_file")
_DIR_TARGETS = ("chardev", "symlink_out", "fifo", "regular_file")
_STORE_FILES = (
    "random_bytes",
    "json_file",
    "empty_file",
    "directory",
    "sqlite",
    "duckdb_not_store",
    "truncated_store",
    "flipped_store",
)
_ON_STORE_FILES = [
    ["info", "{db}"],
    ["info", "{db}", "--run", "rec"],
    ["query", "{db}", "SELECT count(*) FROM event"],
    ["ingest", "{work}/k2", "--db", "{db}", "--run", "k2"],
    ["graph", "{db}", "--run", "rec"],
    ["analyze", "{db}", "temporal", "--run", "rec"],
    ["emulate", "{db}", "--run", "rec", "--out-run", "e2"],
    ["export", "perfetto", "{db}", "--run", "rec", "-o", "{out}/t.json"],
]
_BOMBS = [
    ["ingest", "{work}/laughs", "--db", "{db}", "--run", "b"],
]
_BOUNDED = [
    # Accepted, within the memory and time limits: a table shows 50 rows and fetches 51 (an
    # ORDER BY is a top-N); JSON to stdout is every row asked for, streamed in batches.
    ["query", "{db}", "SELECT * FROM range(600000000)"],
    ["query", "{db}", "SELECT range % 1000 AS k FROM range(200000000) ORDER BY k DESC"],
    ["query", "{db}", "SELECT * FROM range(20000000)", "--format", "csv"],
    ["query", "{db}", "SELECT * FROM range(1000000)", "--format", "json"],  # ~90k rows/s
]


def command_cases(n: int, rng: random.Random, first_id: int) -> list[CmdCase]:
    """``n`` command cases over the families, each family's calls in turn (then at random)."""
    pool: list[tuple[str, str, list[str], str, str, str]] = []
    for cmd, calls in _ARGS.items():
        pool += [("args", cmd, c, "refuse", "copy", "") for c in calls]
    pool += [("refused_writes", c[0], c, "refuse", "copy", "") for c in _REFUSED_WRITES]
    pool += [("valid", c[0], c, "accept", "copy", "") for c in _VALID]
    for c in _FILE_OUTPUTS:
        pool += [("outputs", c[0], c, "refuse", "copy", t) for t in _FILE_TARGETS]
    for c in _DIR_OUTPUTS:
        pool += [("outputs", c[1], c, "refuse", "copy", t) for t in _DIR_TARGETS]
    for c in _ON_STORE_FILES:
        pool += [("store_files", c[0], c, "refuse", k, "") for k in _STORE_FILES]
    pool += [("bombs", c[0], c, "refuse", "copy", "") for c in _BOMBS]
    pool += [("bombs", c[0], c, "accept", "copy", "") for c in _BOUNDED]
    cases = []
    order = list(pool)
    rng.shuffle(order)
    for i in range(n):
        fam, name, argv, expect, store, target = order[i] if i < len(order) else rng.choice(pool)
        cases.append(CmdCase(first_id + i, fam, name, list(argv), expect, store, target))
    # a folder holding a file its user cannot read (as nobody when root: root reads anything)
    for j in range(max(2, n // 100)):
        cases.append(
            CmdCase(
                first_id + n + j,
                "unreadable",
                "ingest",
                ["ingest", "{work}/locked", "--db", "{db}", "--run", "u"],
                "refuse",
                as_nobody=True,
            )
        )
    return cases


# -- the environment: stores and inputs, made once ------------------------------------------------


def _prism(*args: str) -> None:
    """Run the CLI in a fresh process (the setup's writes), failing loudly."""
    p = subprocess.run(
        [sys.executable, "-m", "prism_trace.cli", *args], capture_output=True, text=True
    )
    if p.returncode:
        raise SystemExit(f"setup: prism {' '.join(args)}: {p.stderr.strip()[-500:]}")


def setup(root: Path) -> None:
    """The command cases' store (``cmd.duckdb``) and inputs, in ``root``."""
    sample = REPO / "datasets" / "sample"
    db = root / "cmd.duckdb"
    _prism("ingest", str(sample), "--db", str(db), "--run", "rec", "--quiet")
    # a partial run (2 of 8 ranks, cut down: the whole files are the run's already)
    part = root / "part"
    part.mkdir()
    for r in (0, 1):
        src = sample / f"rank{r}.kineto.json.gz"
        fi._small_kineto(src, part / f"rank{r}.kineto.json.gz", 2500)
    _prism("ingest", str(part), "--db", str(db), "--run", "part", "--quiet")
    _prism("graph", str(db), "--run", "rec")
    _prism("emulate", str(db), "--run", "rec", "--out-run", "emu")
    _prism(
        "slice",
        str(db),
        "--run",
        "rec",
        "--layout",
        "tp=2,dp=4,pp=2",
        "--world",
        "16",
        "--out-run",
        "sl",
    )
    # inputs: a small Kineto rank stored as run `k` (for --replace) and one that is not (k2), an
    # op timeline whose meta YAML is nested anchors (billion laughs), a locked folder
    k = root / "k"
    k.mkdir()
    fi._small_kineto(sample / "rank0.kineto.json.gz", k / "rank0.kineto.json.gz", 2000)
    _prism("ingest", str(k), "--db", str(db), "--run", "k", "--quiet")
    k2 = root / "k2"
    k2.mkdir()
    fi._small_kineto(sample / "rank0.kineto.json.gz", k2 / "rank0.kineto.json.gz", 1800)
    laughs = root / "laughs"
    laughs.mkdir()
    fi._synthetic_op_timeline(laughs)
    # the anchors under unknown keys, and `dp_size` (a checked key) their last: a refusal
    # that shows the value must not build its repr (9**10 strings)
    lol = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lol += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    meta = next(laughs.glob("meta*.yaml"))
    kept = [ln for ln in meta.read_text().splitlines() if not ln.startswith("dp_size:")]
    meta.write_text("\n".join([*kept, *lol, "dp_size: *a9"]) + "\n")
    locked = root / "locked"
    locked.mkdir()
    fi._small_kineto(sample / "rank0.kineto.json.gz", locked / "rank0.kineto.json.gz", 1600)
    fi._small_kineto(sample / "rank1.kineto.json.gz", locked / "rank1.kineto.json.gz", 1600)
    (locked / "rank1.kineto.json.gz").chmod(0)
    (root / "digest.json").write_text(json.dumps(store_digest(db)))


def store_digest(db: Path) -> str:
    """Every table's rows, as the sorted md5s of their text: equal digests, equal contents."""
    import duckdb

    h = hashlib.sha256()
    con = duckdb.connect(str(db), read_only=True)
    try:
        tables = [
            t
            for (t,) in con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
                " ORDER BY table_name"
            ).fetchall()
        ]
        for t in tables:
            (n, d) = con.execute(
                f"SELECT count(*), md5(coalesce(string_agg(h, ',' ORDER BY h), ''))"
                f' FROM (SELECT md5(t::VARCHAR) AS h FROM "{t}" t)'
            ).fetchall()[0]
            h.update(f"{t}:{n}:{d}".encode())
    finally:
        con.close()
    return h.hexdigest()


# -- running one command case ---------------------------------------------------------------------


def _file_state(path: Path) -> tuple[Any, ...]:
    """What a target is: its kind, and for a file or a folder its contents' digest."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return ("absent",)
    if path.is_symlink():
        return ("symlink", os.readlink(path))
    if path.is_dir():
        return ("dir", sorted((p.name, _file_state(p)) for p in path.iterdir()))
    if path.is_file():
        return ("file", hashlib.md5(path.read_bytes()).hexdigest())
    return ("special", st.st_mode, st.st_rdev)


def _make_target(kind: str, out: Path, outside: Path) -> tuple[Path, list[Path]]:
    """The output target of kind ``kind`` in ``out``; returns it and the paths it must leave as
    they were (itself, and a symlink's destination)."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / "target"
    watch = [target]
    if kind == "chardev":
        os.mknod(target, 0o644 | 0o020000, os.makedev(1, 3))  # a null device of our own
    elif kind == "symlink_stdout":
        target.symlink_to("/proc/self/fd/1")
    elif kind == "symlink_out":
        outside.mkdir(parents=True, exist_ok=True)
        dest = outside / "precious.txt"
        dest.write_text("do not overwrite\n")
        target.symlink_to(dest)
        watch.append(dest)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder_with_file":
        target.mkdir()
        (target / "keep.txt").write_text("keep\n")
    elif kind == "regular_file":
        target.write_text("not a folder\n")
    return target, watch


def _make_store_file(kind: str, base: Path, db: Path) -> None:
    """The store argument of kind ``kind`` at ``db``."""
    rng = random.Random(hash(kind) & 0xFFFF)
    if kind == "random_bytes":
        db.write_bytes(bytes(rng.randrange(256) for _ in range(65536)))
    elif kind == "json_file":
        db.write_text('{"traceEvents": []}')
    elif kind == "empty_file":
        db.write_bytes(b"")
    elif kind == "directory":
        db.mkdir()
    elif kind == "sqlite":
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE run (run_id INTEGER, name TEXT)")
        con.execute("INSERT INTO run VALUES (1, 'rec')")
        con.commit()
        con.close()
    elif kind == "duckdb_not_store":
        import duckdb

        con = duckdb.connect(str(db))
        con.execute("CREATE TABLE run AS SELECT 1 AS run_id, 'rec' AS name")
        con.close()
    elif kind == "truncated_store":
        data = base.read_bytes()
        db.write_bytes(data[: len(data) // 2])
    elif kind == "flipped_store":
        data = bytearray(base.read_bytes())
        for _ in range(64):
            data[rng.randrange(len(data) // 4, len(data))] ^= 0xFF
        db.write_bytes(bytes(data))


def _extensions() -> list[str]:
    return sorted(str(p) for p in _EXTENSIONS.rglob("*")) if _EXTENSIONS.exists() else []


def _run_cli(argv: list[str], log: Path, timeout: float, *, as_nobody: bool) -> tuple[int, str]:
    """The CLI in-process (a fork of this case's child: fast), or as ``nobody`` in a fresh
    process; returns its exit code (-1: killed at ``timeout``) and what it printed."""
    if as_nobody:
        cmd = [sys.executable, "-m", "prism_trace.cli", *argv]
        if os.geteuid() == 0:
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return -1, ""
        return p.returncode, p.stdout + p.stderr
    pid = os.fork()
    if pid == 0:  # the command: its output to ``log``, its exit code as ours
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = 3
        try:
            from prism_trace.cli import main

            main(argv, prog_name="prism")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # escaped the CLI's guard: a traceback
            import traceback

            traceback.print_exc()
            code = 3
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            code = os.waitstatus_to_exitcode(status)
            return code, log.read_text(errors="replace")
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1, log.read_text(errors="replace")
        time.sleep(0.02)


def run_command_case(case: CmdCase, root: Path, timeout: float) -> dict[str, Any]:
    """Run ``case`` in a fresh folder and judge it (in the case's child)."""
    work = root / f"cmd-{case.id}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        base = root / "cmd.duckdb"
        db = work / "cmd.duckdb"
        out = work / "out"
        out.mkdir()
        watch: list[Path] = []
        if case.store == "copy":
            shutil.copyfile(base, db)
        else:
            _make_store_file(case.store, base, db)
        target = None
        if case.target:
            target, watch = _make_target(case.target, work / "o", work / "elsewhere")
        if case.as_nobody:
            for p in (root, work, out):
                p.chmod(0o777)
            db.chmod(0o666)
        fill = {"{db}": str(db), "{out}": str(out), "{work}": str(root), "{target}": str(target)}
        argv = []
        for a in case.argv:
            for k, v in fill.items():
                a = a.replace(k, v)
            argv.append(a)
        before = {p: _file_state(p) for p in [*watch, db]}
        exts = _extensions()
        limit = min(timeout, 15.0) if case.target == "fifo" else timeout  # a FIFO blocks
        code, text = _run_cli(argv, work / "log.txt", limit, as_nobody=case.as_nobody)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("error: ")]
        after_watch = {p: _file_state(p) for p in watch}
        if code == -1:
            return {"outcome": "hang", "detail": f"killed after {limit:.0f} s"}
        if (
            code not in (0, 1, 2)
            or "Traceback" in text
            or any(e.startswith("error: unexpected") for e in errors)
        ):
            return {"outcome": "traceback", "detail": (errors or lines or ["?"])[-1][:300]}
        if any(after_watch[p] != before[p] for p in watch):
            return {"outcome": "clobbered", "detail": f"{case.target} changed; exit {code}"}
        if _extensions() != exts:
            return {"outcome": "invalid_accepted", "detail": "a DuckDB extension was installed"}
        if code == 0:
            if case.family == "outputs":  # written through a target it must refuse
                return {"outcome": "clobbered", "detail": f"{case.target} written; exit 0"}
            if case.expect == "accept":
                return {"outcome": "accepted", "detail": ""}
            return {"outcome": "invalid_accepted", "detail": (lines or [""])[-1][:300]}
        if len(errors) != 1 or len([ln for ln in lines if not ln.startswith("  ")]) > 1 + (
            case.expect == "accept"
        ):
            return {"outcome": "bad_message", "detail": " | ".join(lines)[:300]}
        if case.store == "copy":
            unchanged = _file_state(db) == before[db] or store_digest(db) == json.loads(
                (root / "digest.json").read_text()
            )
            if not unchanged:
                return {"outcome": "partial_write", "detail": errors[0][:300]}
        elif _file_state(db) != before[db]:
            return {"outcome": "partial_write", "detail": f"the {case.store} changed"}
        if case.expect == "accept":
            return {"outcome": "valid_refused", "detail": errors[0][:300]}
        return {"outcome": "refused", "detail": errors[0][:300]}
    finally:
        with contextlib.suppress(OSError):
            for p in work.rglob("*"):
                if p.is_dir() and not p.is_symlink():
                    p.chmod(0o755)
        shutil.rmtree(work, ignore_errors=True)


# -- the campaign ---------------------------------------------------------------------------------


@dataclass
class Done:
    """One finished case, of either kind."""

    id: int
    kind: str  # ingest | command
    family: str  # ingest: the format; command: the family
    name: str  # ingest: the mutation; command: the command
    outcome: str
    detail: str = ""
    wall_s: float = 0.0
    peak_mb: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


_INGEST_OK = {
    "refused": "refused",
    "accepted_same": "accepted",
    "accepted_kept_key": "accepted",
    "accepted_other": "accepted",
    "cut_undetectable": "accepted",
    "valid_refused": "valid_refused",
    "crash": "traceback",
    "hang": "hang",
    "memory": "memory",
    "partial_write": "partial_write",
    "bad_message": "bad_message",
    "invalid_accepted": "invalid_accepted",
    "valid_changed": "invalid_accepted",
    "skipped": "skipped",
}


def _child(case: Any, root: Path, timeout: float, mem_gb: float, out: Path) -> None:
    """The body of a case's child: run it, write its result to ``out``."""
    resource.setrlimit(resource.RLIMIT_AS, (int(mem_gb * (1 << 30)),) * 2)
    if isinstance(case, fi.Case):
        h = fi.Harness(root / "ingest", shared=True, timeout=timeout, mem_gb=mem_gb)
        r = h.run(case)
        res = {"outcome": r.outcome, "detail": r.detail}
    else:
        res = run_command_case(case, root, timeout)
    out.write_text(json.dumps(res))


def _preload() -> None:
    """Import what the cases run, once, before the first fork: a child then starts warm
    (importing duckdb, polars and the commands costs a second or more a process). Imports
    start no threads, so forking after them is safe; nothing here opens a database."""
    import duckdb  # noqa: F401
    import polars  # noqa: F401
    import prism_trace.analysis

    import prism_trace.cli
    import prism_trace.formats.chakra.reader
    import prism_trace.formats.host_et.reader
    import prism_trace.formats.kineto.reader
    import prism_trace.formats.op_timeline.reader
    import prism_trace.ingestion.pipeline
    import prism_trace.store.connection  # noqa: F401


def campaign(cases: list[Any], root: Path, jobs: int, timeout: float, mem_gb: float) -> list[Done]:
    """Run every case in a forked child, ``jobs`` at a time."""
    _preload()
    running: dict[int, tuple[Any, float, Path]] = {}
    done: list[Done] = []
    todo = list(cases)
    while todo or running:
        while todo and len(running) < jobs:
            case = todo.pop(0)
            out = root / "results" / f"{case.id}.json"
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _child(case, root, timeout, mem_gb, out)
                except BaseException:  # the harness's own failure
                    import traceback

                    out.write_text(
                        json.dumps(
                            {"outcome": "traceback", "detail": traceback.format_exc()[-300:]}
                        )
                    )
                    code = 1
                finally:
                    os._exit(code)
            running[pid] = (case, time.monotonic(), out)
        time.sleep(0.05)
        for pid, (case, t0, out) in list(running.items()):
            got, status, usage = os.wait4(pid, os.WNOHANG)
            late = time.monotonic() - t0 > timeout * 2 + 30
            if not got and not late:
                continue
            if not got:
                os.kill(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
            del running[pid]
            peak = usage.ru_maxrss / 1024
            wall = time.monotonic() - t0
            kind = "ingest" if isinstance(case, fi.Case) else "command"
            family = case.format if kind == "ingest" else case.family
            name = case.mutation if kind == "ingest" else case.name
            if out.exists():
                res = json.loads(out.read_text())
                outcome = res["outcome"]
                if kind == "ingest":
                    outcome = _INGEST_OK.get(outcome, outcome)
                detail = res.get("detail", "")
            elif late:
                outcome, detail = "hang", "the case's child overran"
            else:
                outcome, detail = "traceback", f"the case's child died ({status})"
            if outcome in ("refused", "accepted") and peak > _MEMORY_MB:
                outcome, detail = "memory", f"peak {peak:.0f} MB"
            done.append(
                Done(case.id, kind, family, name, outcome, detail, round(wall, 2), round(peak, 1))
            )
            if len(done) % 50 == 0:
                print(f"  {len(done)}/{len(cases)} cases", file=sys.stderr, flush=True)
    return sorted(done, key=lambda d: d.id)


def _mean_wall(done: list[Done], kind: str, family: str) -> float:
    walls = [d.wall_s for d in done if (d.kind, d.family) == (kind, family)]
    return sum(walls) / max(1, len(walls))


def summarize(done: list[Done], wall: float, jobs: int) -> str:
    """The markdown of the campaign: per-class counts per family, the targets, the failures."""
    fams = sorted({(d.kind, d.family) for d in done})
    count = Counter((d.kind, d.family, d.outcome) for d in done)
    head = "| kind | family | cases | " + " | ".join(OUTCOMES) + " |"
    lines = [head, "|---|---|---:|" + "---:|" * len(OUTCOMES)]
    for kind, fam in fams:
        n = sum(1 for d in done if (d.kind, d.family) == (kind, fam))
        cells = " | ".join(str(count[(kind, fam, o)]) for o in OUTCOMES)
        lines.append(f"| {kind} | {fam} | {n} | {cells} |")
    total = Counter(d.outcome for d in done)
    lines.append(
        f"| all | all | {len(done)} | " + " | ".join(str(total[o]) for o in OUTCOMES) + " |"
    )
    targets = ", ".join(f"{o} {total[o]}" for o in FAILURES)
    formats = sorted({d.family for d in done if d.kind == "ingest"})
    commands = sorted({d.name for d in done if d.kind == "command"})
    worst = max(done, key=lambda d: d.peak_mb)
    body = [
        "\n".join(lines),
        "",
        f"- cases: {len(done)} ({sum(d.kind == 'ingest' for d in done)} ingest,"
        f" {sum(d.kind == 'command' for d in done)} command); formats: {', '.join(formats)};"
        f" commands: {', '.join(commands)}",
        f"- targets (each must be 0): {targets}; bad_message {total['bad_message']};"
        f" valid_refused {total['valid_refused']}",
        f"- peak RSS of the worst case: {worst.peak_mb:.0f} MB (#{worst.id} {worst.family}/"
        f"{worst.name}); slowest: {max(d.wall_s for d in done):.1f} s",
        f"- campaign wall time: {wall:.0f} s on {jobs} workers; mean seconds a case: "
        + ", ".join(f"{k}/{f} {_mean_wall(done, k, f):.1f}" for k, f in fams),
    ]
    fails = [d for d in done if d.outcome in (*FAILURES, "bad_message", "valid_refused")]
    if fails:
        body += ["", "Failures (first 60):", ""]
        body += [
            f"- #{d.id} {d.kind}/{d.family}/{d.name}: {d.outcome}: {d.detail[:220]!r}"
            for d in fails[:60]
        ]
    return "\n".join(body)


def _plan(
    root: Path, cases: int, share: float, seed: int, cli_every: int, timeout: float, mem_gb: float
) -> None:
    """The setup and the plan, written to ``root/plan.json`` (``--_plan``: in a process of its
    own, so that the parent, which forks every case, never starts DuckDB's or polars' threads)."""
    setup(root)
    rng = random.Random(seed)
    h = fi.Harness(root / "ingest", shared=True, timeout=timeout, mem_gb=mem_gb)
    n_ingest = round(cases * share)
    ingest_cases = fi.plan(list(h.seeds.values()), n_ingest, rng, cli_every)
    for name, gz in sorted({(c.seed, c.gz) for c in ingest_cases}):
        h.baseline(h.seeds[name], gz=gz)
    h.save_baselines()
    cmd_cases = command_cases(cases - n_ingest, rng, n_ingest)
    (root / "plan.json").write_text(
        json.dumps(
            {
                "ingest": [asdict(c) for c in ingest_cases],
                "command": [asdict(c) for c in cmd_cases],
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", type=int, default=1100)
    ap.add_argument("--ingest-share", type=float, default=0.5)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=33)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take")
    ap.add_argument("--mem-limit-gb", type=float, default=4.0, help="address-space limit")
    ap.add_argument("--cli-every", type=int, default=16)
    ap.add_argument("--host", default=None)
    ap.add_argument("--no-note", action="store_true")
    ap.add_argument("--_plan", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._plan:
        _plan(
            Path(a._plan), a.cases, a.ingest_share, a.seed, a.cli_every, a.timeout, a.mem_limit_gb
        )
        return
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="prism-fuzz3-"))
    (root / "results").mkdir()
    try:
        print(f"setting up in {root} ...", file=sys.stderr, flush=True)
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--_plan",
                str(root),
                "--cases",
                str(a.cases),
                "--ingest-share",
                str(a.ingest_share),
                "--seed",
                str(a.seed),
                "--cli-every",
                str(a.cli_every),
                "--timeout",
                str(a.timeout),
                "--mem-limit-gb",
                str(a.mem_limit_gb),
            ],
            check=True,
        )
        plan = json.loads((root / "plan.json").read_text())
        cases: list[Any] = [fi.Case(**c) for c in plan["ingest"]]
        cases += [CmdCase(**c) for c in plan["command"]]
        random.Random(a.seed + 1).shuffle(cases)
        print(f"running {len(cases)} cases ...", file=sys.stderr, flush=True)
        done = campaign(cases, root, a.jobs, a.timeout, a.mem_limit_gb)
    finally:
        with contextlib.suppress(OSError):
            for p in root.rglob("*"):
                if p.is_dir() and not p.is_symlink():
                    p.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - t0
    body = summarize(done, wall, a.jobs)
    print(body)
    if not a.no_note:
        from _common import host_kind, write_note

        cmd = (
            f"python benchmarks/fuzz_round3.py --cases {a.cases} --ingest-share"
            f" {a.ingest_share} --jobs {a.jobs} --seed {a.seed}"
        )
        note = write_note(
            "fuzz_round3",
            host_kind(a.host),
            title="Fuzzing every format and command: issue 33's classes",
            command=cmd,
            body=body,
        )
        print(f"wrote {note}")
    sys.exit(0 if not any(d.outcome in FAILURES for d in done) else 1)


if __name__ == "__main__":
    main()

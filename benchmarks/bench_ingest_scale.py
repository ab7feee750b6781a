"""Ingest at scale: many small real-shaped ranks against HTA, workers, and one large file.

Two sets, every tool run in a fresh process (wall clock and peak memory of its process tree, as in
``bench_ingest.py``, whose measuring code this reuses):

1. ``dlrm-32rank``: the 8 real PARAM DLRM Kineto ranks replicated to 32 (``distributedInfo.rank``
   and ``world_size`` rewritten, file ``rank<r>.pt.trace.json.gz``). Runs ``prism ingest
   --workers 1``, ``prism ingest --workers 2``, ``prism ingest`` (the default plan, which must
   not be slower than ``--workers 1``) and HTA's ``TraceAnalysis(trace_dir=...)`` parse
   on the same folder; checks that both prism stores hold the same rows. Then the floor: the
   Kineto reader alone in one process (no store, no pool) on one of the files (the memory every
   reading process pays: interpreter, DuckDB, polars) and on all of them (the reader's time);
   and DuckDB's ``read_json`` alone on every file (``bench_ingest.py``'s floor), the least any
   reader built on it pays. Then the floors of any DuckDB store of the set: each file's events
   appended to one store table (``bench_ingest.py``'s floor+store: its peak is the least memory
   such an ingest holds) and every file's events read by one statement into a new database
   file (its time is the least such an ingest takes); and the stack's own floor, a process
   that imports DuckDB and polars and moves a frame between them.
2. ``big``: one ``--big-gb`` GB Kineto file from ``make_big_trace.py``; ``prism ingest`` (its
   default workers: one file is read in the prism process) throughput and peak memory; then
   two floors: the Kineto reader's load statement alone into a database file (every record
   stored with its fields' types checked, nothing modelled) and DuckDB's unchecked
   ``read_json`` appended to a store.

Targets (issue 22), all ratios taken within this one run: prism >= 5x faster than HTA at <= 1/4
of its peak memory on the 32 ranks (the project's goal is 10x); ``--workers 2`` >= 1.6x faster
than ``--workers 1`` with identical rows; the big file at >= 100 MB/s with bounded memory.

Usage::

    python benchmarks/bench_ingest_scale.py              # 32 DLRM ranks + a 1 GB file
    python benchmarks/bench_ingest_scale.py --big-gb 0   # the 32 ranks only
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ingest as bi
import make_big_trace
from _common import REPO, host_kind, write_note

RANKS = 32
_INFO = re.compile(rb'"distributedInfo":\s*\{[^{}]*\}')
TARGET_HTA = 5.0
GOAL_HTA = 10.0
TARGET_MEM = 0.25
TARGET_WORKERS = 1.6
TARGET_MBPS = 100.0


def make_dlrm(out: Path, ranks: int = RANKS) -> bi.TraceSet:
    """The 8 DLRM ranks replicated to ``ranks``, each stating its own rank and the world.

    The ``distributedInfo`` line is rewritten in the text, so the files keep Kineto's layout
    (HTA finds a trace's rank by matching ``"rank": N`` in it: a re-serialised, compact file
    would be read by HTA as rank 0, 32 times over)."""
    src = sorted(bi.REAL_SET.glob("*.json.gz"))
    if not src:
        raise SystemExit(f"{bi.REAL_SET}: DLRM traces not found (set PRISM_SHARED_DATASETS)")
    out.mkdir(parents=True, exist_ok=True)
    texts = [gzip.decompress(f.read_bytes()) for f in src]
    for r in range(ranks):
        info = f'"distributedInfo": {{"backend": "nccl", "rank": {r}, "world_size": {ranks}}}'
        text, n = _INFO.subn(info.encode(), texts[r % len(src)], count=1)
        if n != 1:
            raise SystemExit(f"{src[r % len(src)]}: no distributedInfo to rewrite")
        (out / f"rank{r}.pt.trace.json.gz").write_bytes(gzip.compress(text, compresslevel=1))
    return bi._trace_set(f"dlrm-{ranks}rank", out)


def run_hta(ts: bi.TraceSet, work: Path, timeout: float) -> bi.Measurement:
    """HTA's ``TraceAnalysis(trace_dir=...)`` parse, as ``bench_ingest.py`` runs it."""
    out = work / "hta.json"
    cmd = [sys.executable, bi.__file__, "--_hta-child", str(ts.path), str(out)]
    m = bi.measure("hta", cmd, log=work / "hta.log", timeout_s=timeout)
    if m.rc == 0 and out.exists():
        m.extra.update(json.loads(out.read_text()))
    return m


def run_prism(
    prism: str,
    ts: bi.TraceSet,
    db: Path,
    workers: int | None,
    timeout: float,
    *,
    memory_limit: str | None = None,
) -> bi.Measurement:
    """``prism ingest --workers N`` into a new store (None: no ``--workers``, the default plan);
    with ``memory_limit``, under ``PRISM_INGEST_MEMORY_LIMIT`` set to it."""
    for p in (db, db.with_suffix(".duckdb.wal")):
        p.unlink(missing_ok=True)
    cmd = [prism, "ingest", str(ts.path), "--db", str(db), "--run", "b", "--quiet"]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    label = "prism (default)" if workers is None else f"prism --workers {workers}"
    if memory_limit is not None:
        cmd = ["env", f"PRISM_INGEST_MEMORY_LIMIT={memory_limit}", *cmd]
        label += f", memory limit {memory_limit}"
    log = db.with_suffix(".log")
    return bi.measure(label, cmd, log=log, timeout_s=timeout)


def run_reader(
    files: list[Path], work: Path, timeout: float, *, batch: bool = False
) -> bi.Measurement:
    """The Kineto reader alone on ``files``, in one process, no store: its floor.

    On one file: the memory of one process that has read a trace (the interpreter, DuckDB, polars
    and the pages of their libraries it touched), which every ingest process pays. On every
    file: the reader's own time, without the store's writes or a worker pool."""
    kind = "batch" if batch else "reader"
    out = work / f"{kind}{len(files)}.json"
    cmd = [sys.executable, __file__, f"--_{kind}-child", str(out), *map(str, files)]
    label = (
        f"{'batch reader' if batch else 'reader'}, {len(files)} file{'s' if len(files) > 1 else ''}"
    )
    m = bi.measure(label, cmd, log=work / f"{kind}{len(files)}.log", timeout_s=timeout)
    if m.rc == 0 and out.exists():
        m.extra.update(json.loads(out.read_text()))
    return m


def _reader_child(out: str, files: list[str]) -> None:
    """Body of the reader subprocess: ``stage_kineto`` per file on one connection, as a worker
    does (a work database attached per file), the events fetched and dropped."""
    import duckdb

    from prism_trace.formats.kineto.reader import stage_kineto

    con = duckdb.connect()
    events = 0

    def sink(_rank: int, rel: duckdb.DuckDBPyRelation) -> None:
        nonlocal events
        events += len(rel.fetchall())

    for i, f in enumerate(files):
        cur = con.cursor()
        cur.execute(f"ATTACH ':memory:' AS work{i}")
        cur.execute(f"USE work{i}")
        stage_kineto(Path(f), con=cur, events_into=sink)
        cur.execute("USE memory")
        cur.execute(f"DETACH work{i}")
        cur.close()
    status = Path("/proc/self/status").read_text()
    rss = {k: int(v) // 1024 for k, v in re.findall(r"(RssAnon|RssFile):\s+(\d+)", status)}
    Path(out).write_text(json.dumps({"events": events, **rss}))


def _batch_child(out: str, files: list[str]) -> None:
    """Body of the batch-reader subprocess: ``kineto_batch`` on batches of up to
    ``BATCH_FILES`` files, a work database attached per batch, as a worker does; the events
    (frames) counted and dropped. Refuses to count a batch that fell back to the per-file
    reader (it would be measuring that one)."""
    import duckdb

    from prism_trace.formats.kineto.batch import BATCH_FILES, try_read_kineto_batch

    con = duckdb.connect()
    events = 0
    paths = [Path(f) for f in files]
    for i in range(0, len(paths), BATCH_FILES):
        part = paths[i : i + BATCH_FILES]
        cur = con.cursor()
        cur.execute(f"ATTACH ':memory:' AS work{i}")
        cur.execute(f"USE work{i}")
        got = try_read_kineto_batch(part, ranks=[None] * len(part), con=cur)
        if got is None:
            raise SystemExit(f"{part[0]}: the batch fell back to the per-file reader")
        events += sum(t.events.height for t in got)
        cur.execute("USE memory")
        cur.execute(f"DETACH work{i}")
        cur.close()
    status = Path("/proc/self/status").read_text()
    rss = {k: int(v) // 1024 for k, v in re.findall(r"(RssAnon|RssFile):\s+(\d+)", status)}
    Path(out).write_text(json.dumps({"events": events, **rss}))


def run_child(kind: str, label: str, args: list[str], work: Path, timeout: float) -> bi.Measurement:
    """One of this file's child bodies (``--_<kind>-child``) in a fresh process."""
    out = work / f"{kind}.json"
    cmd = [sys.executable, __file__, f"--_{kind}-child", str(out), *args]
    m = bi.measure(label, cmd, log=work / f"{kind}.log", timeout_s=timeout)
    if m.rc == 0 and out.exists():
        m.extra.update(json.loads(out.read_text()))
    return m


def _ingest_forced_child(where: str, argv: list[str]) -> None:
    """Body of an ingest with the work database forced to a file (``disk``) or to memory
    (``memory``) whatever the trace's size (``ingest_memory.works_on_disk``): the two sides of
    that rule, at the same memory limit. ``argv``: the ``prism`` arguments."""
    import prism_trace.cli
    import prism_trace.ingestion.memory as im

    on_disk = where == "disk"
    im.works_on_disk = lambda *_: on_disk  # type: ignore[assignment]
    prism_trace.cli.main(argv)


def _stack_child(out: str) -> None:
    """Body of the stack floor: import DuckDB and polars and move a small result from one to
    the other, as every prism process that reads a trace does; nothing else. Its peak is the
    least any process of an ingest built on these two libraries holds."""
    import duckdb
    import polars as pl

    with duckdb.connect() as con:
        df = pl.DataFrame(con.sql("SELECT range AS x FROM range(10)").pl())
    Path(out).write_text(json.dumps({"events": f"{df.height} rows"}))


def _load_child(out: str, path: str, db: str) -> None:
    """Body of the checked-load floor: the Kineto reader's load statement alone on one file
    (records read with their fields' JSON types checked, ``ts``/``dur`` made ns, the ids taken
    out of ``args``) into a new database file, checkpointed, under the ingest's memory limit;
    no tracks, events, nesting or run tables. What any ingest that refuses mistyped fields
    pays to check and store the records of the file before it models one event."""
    import duckdb

    from prism_trace.formats.kineto.header import _resolve_rank
    from prism_trace.formats.kineto.json_array import split_trace_events
    from prism_trace.formats.kineto.reader import _Reader
    from prism_trace.ingestion.memory import ingest_memory_limit

    Path(db).unlink(missing_ok=True)
    with duckdb.connect(db, config={"memory_limit": f"{ingest_memory_limit()}B"}) as con:
        with split_trace_events(Path(path)) as tef:
            _Reader(Path(path), _resolve_rank(Path(path), tef.meta, None), tef, con).load()
        con.execute("CHECKPOINT")
        (n,) = con.execute("SELECT count(*) FROM raw").fetchall()[0]
    Path(out).write_text(json.dumps({"events": f"{n} records"}))


def _check_pass_child(out: str, path: str) -> None:
    """Body of the other way to check the fields' types: a pass of its own over the file's
    records (``read_json_objects`` and ``json_type`` of the 8 fields the load checks), which
    would run beside an unchecked typed read. ``scan_s``: the pass alone, without the split."""
    import duckdb

    from prism_trace.formats.kineto.json_array import split_trace_events
    from prism_trace.ingestion.memory import ingest_memory_limit

    with (
        duckdb.connect(config={"memory_limit": f"{ingest_memory_limit()}B"}) as con,
        split_trace_events(Path(path)) as tef,
    ):
        t0 = time.perf_counter()
        (n,) = con.execute(
            "SELECT count(*) FROM read_json_objects(?, format = 'array') WHERE json_type(json,"
            " ['$.ph', '$.ts', '$.dur', '$.name', '$.pid', '$.tid', '$.cat', '$.args'])"
            " IS NOT NULL",
            [[str(p) for p in tef.parts]],
        ).fetchall()[0]
        scan = time.perf_counter() - t0
    Path(out).write_text(json.dumps({"events": f"{n} records", "scan_s": round(scan, 2)}))


def _stored_lean_child(out: str, db: str, files: list[str]) -> None:
    """Body of the leanest store floor: ``bench_ingest.py``'s floor+store (each file's events
    appended to one table of a new database file, one transaction, nothing checked or
    modelled) with DuckDB held to one thread and 64 MB, the least it reads a file's 32 MB
    buffer with (32 MB fails). Its peak is the least memory a DuckDB store of the set holds."""
    import duckdb

    from prism_trace.formats.kineto.json_array import split_trace_events

    Path(db).unlink(missing_ok=True)
    with duckdb.connect(db, config={"memory_limit": "64MB", "threads": 1}) as con:
        con.execute(f"CREATE TABLE t AS {bi._FLOOR_READ} LIMIT 0", [[files[0]]])
        con.execute("BEGIN")
        for f in files:
            with split_trace_events(Path(f)) as tef:
                con.execute(f"INSERT INTO t {bi._FLOOR_READ}", [[str(p) for p in tef.parts]])
        con.execute("COMMIT")
        (n,) = con.execute("SELECT count(*) FROM t").fetchall()[0]
    Path(out).write_text(json.dumps({"events": f"{n} records"}))


def _stored_batch_child(out: str, db: str, files: list[str]) -> None:
    """Body of the batched store floor: every file's events array (split as prism splits it)
    read by one ``read_json`` into one table of a new database file; nothing typed beyond
    DuckDB's own casts, checked or modelled. The least a DuckDB store of the set costs: one
    statement planned once, both cores parsing."""
    import contextlib

    import duckdb

    from prism_trace.formats.kineto.json_array import split_trace_events

    Path(db).unlink(missing_ok=True)
    with contextlib.ExitStack() as stack, duckdb.connect(db) as con:
        parts = [
            str(p) for f in files for p in stack.enter_context(split_trace_events(Path(f))).parts
        ]
        con.execute(f"CREATE TABLE t AS {bi._FLOOR_READ}", [parts])
        (n,) = con.execute("SELECT count(*) FROM t").fetchall()[0]
    Path(out).write_text(json.dumps({"events": f"{n} records"}))


def same_rows(a: Path, b: Path) -> tuple[bool, int]:
    """Whether two stores hold the same rows in every per-run table; and their event count."""
    import duckdb

    from prism_trace.store.write import RUN_TABLES

    with duckdb.connect(str(a), read_only=True) as x, duckdb.connect(str(b), read_only=True) as y:
        for tbl in RUN_TABLES:
            drop = "run_id, ingested_at" if tbl == "source_file" else "run_id"
            q = f"SELECT * EXCLUDE ({drop}) FROM {tbl} ORDER BY ALL"
            if x.execute(q).fetchall() != y.execute(q).fetchall():
                return False, -1
        (n,) = x.execute("SELECT count(*) FROM event").fetchone()  # type: ignore[misc]
    return True, int(n)


def _line(label: str, value: float, target: float, *, at_most: bool = False) -> str:
    ok = value <= target if at_most else value >= target
    sign = "<=" if at_most else ">="
    return f"{label} = {value:.2f} [{'ok' if ok else 'MISS'}: target {sign} {target:g}]"


def _goal(speed: float) -> str:
    return "met" if speed >= GOAL_HTA else f"{speed / GOAL_HTA:.0%} of it"


def main(argv: list[str] | None = None) -> int:
    """Run both sets and write the note."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_reader-child"]:
        _reader_child(argv[1], argv[2:])
        return 0
    if argv[:1] == ["--_batch-child"]:
        _batch_child(argv[1], argv[2:])
        return 0
    if argv[:1] == ["--_ingest-forced-child"]:
        _ingest_forced_child(argv[1], argv[2:])
        return 0
    if argv[:1] == ["--_stack-child"]:
        _stack_child(argv[1])
        return 0
    if argv[:1] == ["--_load-child"]:
        _load_child(argv[1], argv[2], argv[3])
        return 0
    if argv[:1] == ["--_check-pass-child"]:
        _check_pass_child(argv[1], argv[2])
        return 0
    if argv[:1] == ["--_stored-lean-child"]:
        _stored_lean_child(argv[1], argv[2], argv[3:])
        return 0
    if argv[:1] == ["--_stored-batch-child"]:
        _stored_batch_child(argv[1], argv[2], argv[3:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-gb", type=float, default=1.0, help="size of the large file (0: skip)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    ap.add_argument(
        "--memory-limits",
        default="",
        help="also ingest the big file under each of these PRISM_INGEST_MEMORY_LIMIT values"
        " (comma-separated, e.g. 512MiB,1GiB,2GiB)",
    )
    ap.add_argument(
        "--work-db-pairs",
        type=int,
        default=0,
        help="also ingest the big file this many times with its work database on disk, then in"
        " memory, alternating (the rule in ingest_memory.works_on_disk, both sides)",
    )
    ap.add_argument("--no-note", action="store_true", help="do not write benchmarks/results/")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    args = ap.parse_args(argv)
    prism = bi._prism_exe()
    if prism is None:
        raise SystemExit("`prism ingest` is not available in this environment")
    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="prism_scale_"))
    rows: list[tuple[str, bi.Measurement, bi.TraceSet]] = []
    lines: list[str] = []
    try:
        ts = make_dlrm(work / "dlrm32")
        runs = {}
        for tool in ("w1", "w2", "wd", "hta"):
            bi._warm(ts.files)
            if tool == "hta":
                m = run_hta(ts, work, args.timeout)
            else:
                n = None if tool == "wd" else int(tool[1])
                m = run_prism(prism, ts, work / f"{tool}.duckdb", n, args.timeout)
                if tool == "wd":  # the plan the default would take now (the load has moved)
                    from prism_trace.ingestion.discover import find
                    from prism_trace.ingestion.plan import reader_processes

                    m.extra["plan"] = reader_processes(find([ts.path]))
            print(
                f"  {ts.name} {m.tool:<18} {m.wall_s:7.2f} s {m.peak_tree_mb:6.0f} MB",
                file=sys.stderr,
            )
            runs[tool] = m
            rows.append((ts.name, m, ts))
        for files in (ts.files[:1], ts.files):
            rs = ts if len(files) > 1 else bi._trace_set(f"{ts.name}, one file", files[0])
            bi._warm(files)
            m = run_reader(files, work, args.timeout)
            print(
                f"  {rs.name} {m.tool:<18} {m.wall_s:7.2f} s {m.peak_tree_mb:6.0f} MB",
                file=sys.stderr,
            )
            runs[f"reader{len(files)}"] = m
            rows.append((rs.name, m, rs))
        bi._warm(ts.files)
        batched = run_reader(ts.files, work, args.timeout, batch=True)
        print(f"  {ts.name} {batched.tool:<18} {batched.wall_s:7.2f} s", file=sys.stderr)
        rows.append((ts.name, batched, ts))
        bi._warm(ts.files)
        floor = bi.run_floor(ts, work, args.timeout)
        print(f"  {ts.name} {floor.tool:<18} {floor.wall_s:7.2f} s", file=sys.stderr)
        rows.append((ts.name, floor, ts))
        bi._warm(ts.files)
        stored = bi.run_floor(ts, work, args.timeout, store=True)
        print(f"  {ts.name} {stored.tool:<18} {stored.wall_s:7.2f} s", file=sys.stderr)
        rows.append((ts.name, stored, ts))
        bi._warm(ts.files)
        batch_db = str(work / "stored-batch.duckdb")
        stored_batch = run_child(
            "stored-batch",
            "floor+store, one statement",
            [batch_db, *map(str, ts.files)],
            work,
            args.timeout,
        )
        print(f"  {ts.name} {stored_batch.tool:<18} {stored_batch.wall_s:7.2f} s", file=sys.stderr)
        rows.append((ts.name, stored_batch, ts))
        bi._warm(ts.files)
        lean = run_child(
            "stored-lean",
            "floor+store, 1 thread, 64 MB",
            [str(work / "stored-lean.duckdb"), *map(str, ts.files)],
            work,
            args.timeout,
        )
        print(f"  {ts.name} {lean.tool:<18} {lean.peak_tree_mb:6.0f} MB", file=sys.stderr)
        rows.append((ts.name, lean, ts))
        stack = run_child("stack", "stack: DuckDB + polars", [], work, args.timeout)
        print(f"  {stack.tool:<18} {stack.peak_tree_mb:6.0f} MB", file=sys.stderr)
        w1, w2, wd, hta = runs["w1"], runs["w2"], runs["wd"], runs["hta"]
        one, every = runs["reader1"], runs[f"reader{len(ts.files)}"]
        same, events = same_rows(work / "w1.duckdb", work / "w2.duckdb")
        w1.extra["events"] = w2.extra["events"] = events
        lines.append(
            _line(
                f"{ts.name}: --workers 2 speed-up over --workers 1",
                w1.wall_s / w2.wall_s,
                TARGET_WORKERS,
            )
            + f"; rows identical: {'yes' if same else 'NO'}"
        )
        same_d, _ = same_rows(work / "w1.duckdb", work / "wd.duckdb")
        wd.extra["events"] = events
        lines.append(
            _line(
                f"{ts.name}: the default (no --workers) over --workers 1, time",
                wd.wall_s / w1.wall_s,
                1.0,
                at_most=True,
            )
            + f" (just after it, at load {os.getloadavg()[0]:.2f}, the default plans"
            f" {wd.extra['plan'] or 'no'} worker processes); rows identical:"
            f" {'yes' if same_d else 'NO'}"
        )
        cores = os.cpu_count() or 1
        least_cpu = min(float(w1.extra["cpu_s"]), float(w2.extra["cpu_s"]))
        best = least_cpu / cores
        lines.append(
            f"{ts.name}: the most workers can gain on {cores} cores: --workers 1 used"
            f" {w1.extra['cpu_s']} CPU s in {w1.wall_s:.2f} s"
            f" ({float(w1.extra['cpu_s']) / w1.wall_s:.2f} cores busy: DuckDB's own threads),"
            f" --workers 2 {w2.extra['cpu_s']} CPU s; with the lesser split evenly over every"
            f" core, a run takes at least {best:.2f} s: a speed-up over --workers 1 of at most"
            f" {w1.wall_s / best:.2f}"
            + (
                f" [below the {TARGET_WORKERS:g} target: out of reach on this machine]"
                if w1.wall_s / best < TARGET_WORKERS
                else f" [the {TARGET_WORKERS:g} target is within it]"
            )
        )
        lines.append(
            f"{ts.name}: CPU seconds over all processes: --workers 1 {w1.extra['cpu_s']},"
            f" --workers 2 {w2.extra['cpu_s']}, default {wd.extra['cpu_s']},"
            f" HTA {hta.extra['cpu_s']}"
            " (on a busy machine wall time follows the CPU share; CPU time does not)"
        )
        if one.rc == 0 and every.rc == 0:
            lines.append(
                f"{ts.name}: floor of one process: the reader alone on one file peaks at"
                f" {one.peak_tree_mb:.0f} MB (at its end RssAnon {one.extra.get('RssAnon')} MB,"
                f" RssFile {one.extra.get('RssFile')} MB: library pages), against a target of"
                f" {TARGET_MEM * hta.peak_tree_mb:.0f} MB for the whole tree; on all"
                f" {len(ts.files)} files it takes {every.wall_s:.2f} s"
                f" ({every.wall_s / len(ts.files) * 1e3:.0f} ms a file, no store, one process)"
            )
        if batched.rc == 0 and every.rc == 0:
            lines.append(
                f"{ts.name}: the batch reader alone (``kineto_batch``, batches of up to"
                f" 32 files, one process, no store) on all {len(ts.files)} files takes"
                f" {batched.wall_s:.2f} s ({batched.wall_s / len(ts.files) * 1e3:.0f} ms a file;"
                f" the per-file reader {every.wall_s / batched.wall_s:.1f}x as long)"
            )
        if floor.rc == 0 and hta.rc == 0:
            lines.append(
                f"{ts.name}: floor of any DuckDB reader: `read_json` alone on each file's events"
                f" (split as prism does, nothing typed or checked, fresh process) takes"
                f" {floor.wall_s:.2f} s, against HTA / {TARGET_HTA:g} ="
                f" {hta.wall_s / TARGET_HTA:.2f} s"
                f" (HTA / floor = {hta.wall_s / floor.wall_s:.2f})"
            )
        if stored_batch.rc == 0 and hta.rc == 0:
            lines.append(
                f"{ts.name}: floor of any DuckDB store: every file's events read by one"
                f" `read_json` into a table of a new database file (nothing checked or modelled,"
                f" fresh process) takes {stored_batch.wall_s:.2f} s, against HTA /"
                f" {TARGET_HTA:g} = {hta.wall_s / TARGET_HTA:.2f} s (HTA / this floor ="
                f" {hta.wall_s / stored_batch.wall_s:.2f})"
            )
        if stored.rc == 0 and lean.rc == 0 and stack.rc == 0 and hta.rc == 0:
            target = TARGET_MEM * hta.peak_tree_mb
            least = min(stored.peak_tree_mb, lean.peak_tree_mb, stack.peak_tree_mb)
            lines.append(
                f"{ts.name}: memory floors: DuckDB's `read_json` of each file appended to one"
                f" store table (nothing checked or modelled, one process) peaks at"
                f" {stored.peak_tree_mb:.0f} MB in {stored.wall_s:.2f} s, and at"
                f" {lean.peak_tree_mb:.0f} MB held to one thread and 64 MB; a process that"
                f" imports DuckDB and polars and moves a frame between them peaks at"
                f" {stack.peak_tree_mb:.0f} MB; the target, 1/4 of HTA's {hta.peak_tree_mb:.0f}"
                f" MB, is {target:.0f} MB"
                + (
                    " [below every floor: no ingest on these libraries reaches it here]"
                    if target < least
                    else " [at or above a floor: not excluded by it]"
                )
            )
        for m in (w2, w1):
            if hta.rc == 0 and m.rc == 0:
                speed = hta.wall_s / m.wall_s
                lines.append(
                    _line(f"{ts.name}: HTA / {m.tool} time", speed, TARGET_HTA)
                    + f" (goal {GOAL_HTA:g}x: {_goal(speed)})"
                )
                lines.append(
                    _line(
                        f"{ts.name}: {m.tool} / HTA peak tree memory",
                        m.peak_tree_mb / hta.peak_tree_mb,
                        TARGET_MEM,
                        at_most=True,
                    )
                    + f"; largest process {m.maxrss_mb / hta.maxrss_mb:.2f}"
                )
        if args.big_gb > 0:
            t0 = time.perf_counter()
            big = make_big_trace.make_set(work / "big", ranks=1, mb_per_rank=args.big_gb * 1000)
            print(f"  big file made in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            bts = bi._trace_set("big", big[0])
            bi._warm(bts.files)
            m = run_prism(prism, bts, work / "big.duckdb", os.cpu_count() or 1, args.timeout)
            print(f"  big {m.wall_s:7.2f} s {m.peak_tree_mb:6.0f} MB", file=sys.stderr)
            rows.append(("big", m, bts))
            for limit in [x for x in args.memory_limits.split(",") if x]:
                bi._warm(bts.files)
                ml = run_prism(
                    prism, bts, work / "big.duckdb", None, args.timeout, memory_limit=limit
                )
                print(
                    f"  big {ml.tool} {ml.wall_s:7.2f} s {ml.peak_tree_mb:6.0f} MB", file=sys.stderr
                )
                rows.append(("big", ml, bts))
            for _pair in range(args.work_db_pairs):
                for where in ("disk", "memory"):
                    bi._warm(bts.files)
                    db = work / "big.duckdb"
                    for f in (db, db.with_suffix(".duckdb.wal")):
                        f.unlink(missing_ok=True)
                    cmd = [sys.executable, __file__, "--_ingest-forced-child", where, "ingest"]
                    cmd += [str(bts.path), "--db", str(db), "--run", "b", "--quiet"]
                    label = f"prism, work database {'on disk' if where == 'disk' else 'in memory'}"
                    mw = bi.measure(label, cmd, log=work / "forced.log", timeout_s=args.timeout)
                    print(f"  big {label} {mw.wall_s:7.2f} s", file=sys.stderr)
                    rows.append(("big", mw, bts))
            bi._warm(bts.files)
            load = run_child(
                "load",
                "checked load + store",
                [str(big[0]), str(work / "load.duckdb")],
                work,
                args.timeout,
            )
            print(f"  big load {load.wall_s:7.2f} s", file=sys.stderr)
            rows.append(("big", load, bts))
            bi._warm(bts.files)
            check = run_child(
                "check-pass", "type-check pass alone", [str(big[0])], work, args.timeout
            )
            rows.append(("big", check, bts))
            bi._warm(bts.files)
            bstored = bi.run_floor(bts, work, args.timeout, store=True)
            print(f"  big floor+store {bstored.wall_s:7.2f} s", file=sys.stderr)
            rows.append(("big", bstored, bts))
            (work / "big" / big[0].name).unlink()
            if load.rc == 0 and bstored.rc == 0 and check.rc == 0:
                budget = bts.json_mb / TARGET_MBPS
                lines.append(
                    f"big ({bts.json_mb:.0f} MB JSON): floors: the reader's load statement alone"
                    f" into a database file (fields type-checked, records stored, no events"
                    f" model) {load.wall_s:.2f} s ="
                    f" {bts.json_mb / load.wall_s:.0f} MB/s; DuckDB's `read_json` appended to a"
                    f" store (nothing checked) {bstored.wall_s:.2f} s ="
                    f" {bts.json_mb / bstored.wall_s:.0f} MB/s; {TARGET_MBPS:g} MB/s leaves"
                    f" {budget:.2f} s for the whole file; a checking pass of its own instead"
                    f" (`read_json_objects` and `json_type` of the 8 fields) alone takes"
                    f" {check.extra.get('scan_s')} s (its process, with the split,"
                    f" {check.wall_s:.2f} s)"
                )
            if m.rc == 0:
                lines.append(
                    _line(
                        f"big ({bts.json_mb:.0f} MB JSON): prism MB/s",
                        bts.json_mb / m.wall_s,
                        TARGET_MBPS,
                    )
                    + f"; peak {m.peak_tree_mb:.0f} MB"
                    + f" = {m.peak_tree_mb / bts.json_mb:.2f} of the file"
                )
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()
    head = (
        "| set | files | JSON MB | tool | seconds | CPU s (all processes) | peak tree MB"
        " | maxrss MB | JSON MB/s | events | note |"
    )
    table = [head, "|" + "---|" * 11]
    for name, m, t in rows:
        table.append(
            f"| {name} | {len(t.files)} | {t.json_mb:.1f} | {m.tool} | {m.wall_s:.2f}"
            f" | {m.extra.get('cpu_s', '')} | {m.peak_tree_mb:.0f} | {m.maxrss_mb:.0f}"
            f" | {t.json_mb / m.wall_s:.1f}"
            f" | {m.extra.get('events', '')} | {m.note} |"
        )
    body = "\n".join(
        [
            f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load0)};"
            f" after: {', '.join(f'{x:.2f}' for x in load1)} on {os.cpu_count()} cores"
            + (
                " **(busy machine: absolute times are inflated; ratios are within this run)**"
                if load0[0] > 1
                else ""
            ),
            "",
            "Every run is a fresh process; files pre-read into the page cache. HTA: "
            "`TraceAnalysis(trace_dir=...)` (default ParserConfig, forked pool). `peak tree MB`: "
            "largest sampled RSS sum over the process tree; `maxrss MB`: the largest single"
            " process.",
            "",
            *table,
            "",
            *[f"- {line}" for line in lines],
        ]
    )
    print(body)
    if not args.no_note:
        cmd = shlex.join(["python", "benchmarks/bench_ingest_scale.py", *(argv or sys.argv[1:])])
        note = write_note(
            "ingest-scale",
            host_kind(),
            title="Ingest at scale: 32 DLRM ranks vs HTA, workers, one large file",
            command=cmd,
            body=body,
        )
        print(f"wrote {note.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

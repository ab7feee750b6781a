"""Ingest benchmark: prism vs HolisticTraceAnalysis on the same multi-rank traces, plus streaming.

Three trace sets, each measured in a fresh subprocess per tool (wall clock, peak memory):

1. ``param-dlrm-8rank``: the real 8-rank PARAM DLRM Kineto traces from the shared datasets;
2. ``synthetic-<R>rank``: R ranks x ``--mb-per-rank`` MB written by ``make_big_trace.py``;
3. ``synthetic-big``: one ``--big-gb`` GB file, prism only (HTA would hold it all as Python
   objects), to show streaming throughput (MB/s) and that prism's peak memory stays far below
   the file size.

HTA runs its default path, ``TraceAnalysis(trace_dir=...)``: every rank parsed on construction with
the default ``ParserConfig`` (JSON backend, multiprocessing pool). prism runs
``prism ingest PATH --db DB --run b --quiet``.

With ``--floor``, a third "tool" runs on the synthetic sets: DuckDB's ``read_json`` alone, parsing
every file's events array (cut in parts the way prism does) into a table with prism's columns and
nothing else: no ids, nesting, flows or store. It is a lower bound for any ingest that parses JSON
with DuckDB on this machine, to set against HTA's time / 10. A fourth, ``floor+store``, appends
the same records to one table of a new database file in one transaction: the least an ingest that
keeps every event and its args in DuckDB can do.

Peak memory is measured two ways: ``peak tree MB`` is the largest sampled sum of RSS over the
process and all its descendants (HTA parses ranks in forked workers, so one process does not show
its footprint; the sum overcounts pages the workers share with their parent), and ``maxrss MB`` is
the kernel's high-water mark of the largest single process (``wait4`` rusage; a lower bound for a
multi-process tool). Ratios are printed for both.

Usage::

    python benchmarks/bench_ingest.py            # 8 x 100 MB + one 2 GB file
    python benchmarks/bench_ingest.py --quick    # 8 x 10 MB + one 0.2 GB file, smoke run
    python benchmarks/bench_ingest.py --big-gb 4 --mb-per-rank 200 --repeat 3
    python benchmarks/bench_ingest.py --mb-per-rank 100 --ranks 8 --big-gb 1 --floor
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import importlib.metadata as md
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_big_trace

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("PRISM_SHARED_DATASETS", HERE.parents[1] / "shared" / "datasets"))
REAL_SET = SHARED / "param-dlrm-8rank" / "kineto"
SAMPLE_S = 0.02
TARGET_SPEEDUP = 10.0
TARGET_MEM = 0.25


@dataclass
class Measurement:
    """One tool run on one trace set."""

    tool: str
    wall_s: float
    peak_tree_mb: float
    maxrss_mb: float
    rc: int
    note: str = ""
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class TraceSet:
    """Files to ingest and their sizes."""

    name: str
    path: Path  # a directory (multi-rank) or one file
    files: list[Path]
    disk_mb: float
    json_mb: float
    tools: tuple[str, ...] = ("prism", "hta")


def _json_mb(files: list[Path]) -> float:
    total = 0
    for f in files:
        if f.suffix == ".gz":
            with gzip.open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    total += len(chunk)
        else:
            total += f.stat().st_size
    return total / 1e6


def _trace_set(name: str, path: Path, tools: tuple[str, ...] = ("prism", "hta")) -> TraceSet:
    files = sorted(path.glob("*.json*")) if path.is_dir() else [path]
    return TraceSet(
        name, path, files, sum(f.stat().st_size for f in files) / 1e6, _json_mb(files), tools
    )


def _warm(files: list[Path]) -> None:
    """Read the files once so every tool starts with them in the page cache."""
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def measure(tool: str, cmd: list[str], *, log: Path, timeout_s: float) -> Measurement:
    """Run ``cmd`` in a fresh process; return wall clock, peak memory and CPU of its process tree.

    CPU (``extra["cpu_s"]``): each process's own user + system time (``/proc``, children
    excluded), the last value sampled before it ended, summed over every process seen. Not
    rusage: that counts a process's reaped children with it (HTA's pool) and misses workers
    nobody waits for (a fork server's); what a process does after its last sample is missed.
    """
    seen: dict[int, float] = {}
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        ps = psutil.Process(proc.pid)
        peak = 0
        status = None
        rusage = None
        while True:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout_s:
                proc.kill()
                _, status, rusage = os.wait4(proc.pid, 0)
                break
            try:
                procs = [ps, *ps.children(recursive=True)]
            except psutil.Error:
                procs = [ps]
            total = 0
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
                    c = p.cpu_times()
                    seen[p.pid] = c.user + c.system
            peak = max(peak, total)
            time.sleep(SAMPLE_S)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
    maxrss_mb = rusage.ru_maxrss / 1024  # KiB on Linux
    # A single-process tool can peak between samples; the kernel's high-water mark cannot miss.
    peak_mb = max(peak / 2**20, maxrss_mb)
    note = "" if proc.returncode == 0 else f"exit {proc.returncode}, see {log}"
    m = Measurement(tool, wall, peak_mb, maxrss_mb, proc.returncode, note)
    m.extra["cpu_s"] = round(sum(seen.values()), 2)
    return m


def _prism_exe() -> str | None:
    """The ``prism`` beside this Python, or ``$PRISM_BENCH_PRISM`` (another checkout's, to
    compare two commits on the same files)."""
    exe = Path(sys.executable).with_name("prism")
    cand = os.environ.get("PRISM_BENCH_PRISM") or (
        str(exe) if exe.exists() else shutil.which("prism")
    )
    if not cand:
        return None
    ok = subprocess.run([cand, "ingest", "--help"], capture_output=True, check=False)
    return cand if ok.returncode == 0 else None


def run_prism(prism: str, ts: TraceSet, work: Path, timeout_s: float) -> Measurement:
    """``prism ingest`` into a fresh DuckDB file; adds the stored event count."""
    db = work / "bench.duckdb"
    for p in (db, db.with_suffix(".duckdb.wal")):
        p.unlink(missing_ok=True)
    cmd = [prism, "ingest", str(ts.path), "--db", str(db), "--run", "b", "--quiet"]
    m = measure("prism", cmd, log=work / f"prism_{ts.name}.log", timeout_s=timeout_s)
    if m.rc == 0:
        try:
            import duckdb

            with duckdb.connect(str(db), read_only=True) as con:
                m.extra["events"] = con.execute("SELECT count(*) FROM event").fetchone()[0]
        except Exception as exc:  # count is informative only
            m.extra["events"] = f"? ({type(exc).__name__})"
    m.extra["db_mb"] = round(db.stat().st_size / 1e6, 1) if db.exists() else None
    return m


def run_hta(ts: TraceSet, work: Path, timeout_s: float) -> Measurement:
    """HTA's default ``TraceAnalysis(trace_dir=...)`` in a fresh interpreter."""
    out = work / f"hta_{ts.name}.json"
    cmd = [sys.executable, __file__, "--_hta-child", str(ts.path), str(out)]
    m = measure("hta", cmd, log=work / f"hta_{ts.name}.log", timeout_s=timeout_s)
    if m.rc == 0 and out.exists():
        m.extra.update(json.loads(out.read_text()))
    return m


def run_floor(ts: TraceSet, work: Path, timeout_s: float, *, store: bool = False) -> Measurement:
    """DuckDB ``read_json`` alone on the set's event arrays, in a fresh interpreter; with
    ``store``, appended to one table of a database file (parse + store, nothing else)."""
    tool = "floor+store" if store else "floor"
    out = work / f"{tool}_{ts.name}.json"
    cmd = [sys.executable, __file__, "--_floor-child", str(ts.path), str(out)]
    if store:
        cmd.append(str(work / "floor.duckdb"))
    m = measure(tool, cmd, log=work / f"{tool}_{ts.name}.log", timeout_s=timeout_s)
    if m.rc == 0 and out.exists():
        m.extra.update(json.loads(out.read_text()))
    return m


_FLOOR_READ = (
    "SELECT * FROM read_json(?, format = 'array',"
    " columns = {ph: 'VARCHAR', cat: 'VARCHAR', name: 'VARCHAR', pid: 'VARCHAR',"
    " tid: 'VARCHAR', ts: 'DOUBLE', dur: 'DOUBLE', id: 'VARCHAR', args: 'JSON'})"
)


def _floor_child(trace_path: str, out: str, db: str | None = None) -> None:
    """Body of the floor subprocess: split each file as prism does, parse it, nothing more.

    With ``db``, every file's records are appended to one table of that (new) database file in
    one transaction: the least any ingest that stores each event with its args in DuckDB does.
    """
    import duckdb

    from prism_trace.formats.kineto.json_array import split_trace_events

    path = Path(trace_path)
    files = sorted(path.glob("*.json*")) if path.is_dir() else [path]
    if db is not None:
        Path(db).unlink(missing_ok=True)
    con = duckdb.connect(db or ":memory:")
    events = 0
    if db is not None:
        con.execute(f"CREATE TABLE t AS {_FLOOR_READ} LIMIT 0", [[str(files[0])]])
        con.execute("BEGIN")
    for f in files:
        with split_trace_events(f) as tef:
            parts = [[str(p) for p in tef.parts]]
            if db is not None:
                con.execute(f"INSERT INTO t {_FLOOR_READ}", parts)
            else:
                con.execute(f"CREATE OR REPLACE TABLE t AS {_FLOOR_READ}", parts)
                events += con.execute("SELECT count(*) FROM t").fetchall()[0][0]
    if db is not None:
        con.execute("COMMIT")
        events = con.execute("SELECT count(*) FROM t").fetchall()[0][0]
    con.close()
    Path(out).write_text(json.dumps({"events": f"{events} records"}))


def _hta_child(trace_dir: str, out: str) -> None:
    """Body of the HTA subprocess: parse every rank the default way, report what it holds."""
    t0 = time.perf_counter()
    from hta.trace_analysis import TraceAnalysis

    t1 = time.perf_counter()
    analyzer = TraceAnalysis(trace_dir=trace_dir)
    t2 = time.perf_counter()
    traces = analyzer.t.get_all_traces()
    Path(out).write_text(
        json.dumps(
            {
                "events": int(sum(len(df) for df in traces.values())),
                "ranks": len(traces),
                "import_s": round(t1 - t0, 2),
                "parse_s": round(t2 - t1, 2),
            }
        )
    )


def _best(runs: list[Measurement]) -> Measurement:
    ok = [r for r in runs if r.rc == 0] or runs
    best = min(ok, key=lambda r: r.wall_s)
    best.peak_tree_mb = max(r.peak_tree_mb for r in ok)
    best.maxrss_mb = max(r.maxrss_mb for r in ok)
    return best


def _versions() -> dict[str, str]:
    def v(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "prism-trace": v("prism-trace"),
        "duckdb": v("duckdb"),
        "polars": v("polars"),
        "HolisticTraceAnalysis": v("HolisticTraceAnalysis"),
        "pandas": v("pandas"),
        "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu,
        "cpu_count": str(os.cpu_count()),
        "ram_gb": f"{psutil.virtual_memory().total / 2**30:.1f}",
    }


def _fmt(x: object, spec: str = ".2f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "n/a"


def report(results: list[tuple[TraceSet, dict[str, Measurement]]]) -> tuple[str, list[str]]:
    """Render the table (markdown, readable as plain text) and the ratio lines."""
    head = (
        "| set | files | disk MB | JSON MB | tool | seconds | peak tree MB | maxrss MB "
        "| JSON MB/s | events | note |"
    )
    rows = [head, "|" + "---|" * 11]
    ratios = []
    for ts, by_tool in results:
        for tool, m in by_tool.items():
            ok = m.rc == 0
            mbps = ts.json_mb / m.wall_s
            rows.append(
                f"| {ts.name} | {len(ts.files)} | {ts.disk_mb:.1f} | {ts.json_mb:.1f} | {tool} "
                f"| {_fmt(m.wall_s) if ok else 'failed'} | {_fmt(m.peak_tree_mb, '.0f')} "
                f"| {_fmt(m.maxrss_mb, '.0f')} | {_fmt(mbps, '.1f') if ok else 'n/a'} "
                f"| {m.extra.get('events', '')} | {m.note} |"
            )
        p, h = by_tool.get("prism"), by_tool.get("hta")
        if p and h and p.rc == 0 and h.rc == 0:
            speed = h.wall_s / p.wall_s
            mem_tree = p.peak_tree_mb / h.peak_tree_mb
            mem_proc = p.maxrss_mb / h.maxrss_mb
            ratios.append(
                f"{ts.name}: HTA/prism time = {speed:.1f}x "
                f"[{'ok' if speed >= TARGET_SPEEDUP else 'MISS'}: "
                f"target >= {TARGET_SPEEDUP:.0f}x]; "
                f"prism/HTA peak = {mem_tree:.2f} (tree) / {mem_proc:.2f} (largest process) "
                f"[{'ok' if max(mem_tree, mem_proc) <= TARGET_MEM else 'MISS'}: "
                f"target <= {TARGET_MEM}]"
            )
        fl = by_tool.get("floor")
        if fl and fl.rc == 0:
            line = (
                f"{ts.name}: DuckDB read_json alone (split + parse into a table, nothing else)"
                f" {fl.wall_s:.2f} s = {fl.wall_s / p.wall_s:.0%} of prism's time"
                if p and p.rc == 0
                else f"{ts.name}: DuckDB read_json alone {fl.wall_s:.2f} s"
            )
            if h and h.rc == 0:
                line += (
                    f"; HTA / {TARGET_SPEEDUP:.0f} = {h.wall_s / TARGET_SPEEDUP:.2f} s"
                    f" (parsing alone reaches {h.wall_s / fl.wall_s:.1f}x)"
                )
            ratios.append(line)
        fs = by_tool.get("floor+store")
        if fs and fs.rc == 0:
            line = (
                f"{ts.name}: DuckDB read_json appended to one table of a database file (parse +"
                f" store every record with its args, nothing else) {fs.wall_s:.2f} s"
            )
            if h and h.rc == 0:
                reach = h.wall_s / fs.wall_s
                line += (
                    f"; HTA / {TARGET_SPEEDUP:.0f} = {h.wall_s / TARGET_SPEEDUP:.2f} s: parsing"
                    f" and storing alone reach {reach:.1f}x"
                    + (
                        " (the speed target is out of reach of any DuckDB store here)"
                        if reach < TARGET_SPEEDUP
                        else ""
                    )
                )
            ratios.append(line)
        if p and p.rc == 0 and "hta" not in ts.tools:
            ratios.append(
                f"{ts.name}: prism {ts.json_mb / p.wall_s:.1f} MB/s; peak {p.peak_tree_mb:.0f} MB "
                f"= {p.peak_tree_mb / ts.json_mb:.3f} of the {ts.json_mb:.0f} MB file"
            )
    return "\n".join(rows), ratios


def write_note(
    path: Path,
    *,
    kind: str,
    day: str,
    argv: list[str],
    args: argparse.Namespace,
    table: str,
    ratios: list[str],
    versions: dict[str, str],
    load: tuple[float, float],
) -> None:
    """Write the dated markdown result note."""
    mode = "quick (smoke run)" if args.quick else "full"
    lines = [
        f"# Ingest benchmark: prism vs HTA, {kind}, {day}",
        "",
        f"- Command: `{shlex.join(['python', 'benchmarks/bench_ingest.py', *argv])}`",
        f"- Mode: {mode}; synthetic set {args.ranks} ranks x {args.mb_per_rank:g} MB, "
        f"big file {args.big_gb:g} GB; gzip: {args.gzip or 'no'}; best of {args.repeat} "
        "(peaks: max over repeats)",
        f"- Load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f}"
        + (
            "  **(busy machine: timings are noisy)**"
            if max(load) > 0.5 * (os.cpu_count() or 1)
            else ""
        ),
        "- HTA: `TraceAnalysis(trace_dir=...)`, default ParserConfig (JSON backend, "
        "multiprocessing pool of min(cpu_count, ranks) forked workers).",
        "- prism: `prism ingest PATH --db DB --run b --quiet` into a new DuckDB file.",
        *(
            [
                "- floor: DuckDB `read_json` alone on each file's events array (split as prism"
                " does) into a table with prism's columns; no other processing, no store."
                " floor+store: the same, appended to one table of a new database file in one"
                " transaction."
            ]
            if args.floor
            else []
        ),
        "- Each run is a fresh process; files are pre-read into the page cache. `peak tree MB`: "
        "largest sampled RSS sum over the process tree (every 20 ms; never below maxrss); "
        "`maxrss MB`: kernel high-water mark of the largest single process.",
        "",
        "## Results",
        "",
        table,
        "",
        *[f"- {r}" for r in ratios],
        "",
        "## Versions",
        "",
        *[f"- {k}: {v}" for k, v in versions.items()],
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the result note."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_hta-child"]:
        _hta_child(argv[1], argv[2])
        return 0
    if argv[:1] == ["--_floor-child"]:
        _floor_child(argv[1], argv[2], *argv[3:4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (8 x 10 MB, 0.2 GB)")
    ap.add_argument("--ranks", type=int, default=8, help="ranks in the synthetic set")
    ap.add_argument("--mb-per-rank", type=float, default=None, help="default 100 (quick: 10)")
    ap.add_argument(
        "--big-gb",
        type=float,
        default=None,
        help="size of the streaming file, GB (default 2, quick 0.2; 0 skips it)",
    )
    ap.add_argument(
        "--gzip",
        type=int,
        nargs="?",
        const=1,
        default=None,
        metavar="LEVEL",
        help="gzip the synthetic files (default: plain .json)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per tool and set; best time kept")
    ap.add_argument("--skip-hta", action="store_true")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also time DuckDB read_json alone on the synthetic multi-rank set (a lower bound)",
    )
    ap.add_argument("--skip-real", action="store_true", help="skip param-dlrm-8rank")
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where traces and DBs go (default: a temp dir, removed afterwards)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument(
        "--host-kind",
        default=None,
        help="hardware label in the result name (default: <arch>-<N>cpu)",
    )
    ap.add_argument("--no-note", action="store_true", help="do not write benchmarks/results/")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    args = ap.parse_args(argv)
    if args.mb_per_rank is None:
        args.mb_per_rank = 10.0 if args.quick else 100.0
    if args.big_gb is None:
        args.big_gb = 0.2 if args.quick else 2.0

    load0 = os.getloadavg()[0]
    prism = _prism_exe()
    if prism is None:
        print("warning: `prism ingest` is not available; measuring HTA only", file=sys.stderr)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="prism_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    sets: list[TraceSet] = []
    try:
        if not args.skip_real and REAL_SET.is_dir():
            sets.append(_trace_set("param-dlrm-8rank", REAL_SET))
        print(f"generating traces in {work} ...", file=sys.stderr)
        syn_dir = work / f"synthetic-{args.ranks}rank"
        if args.mb_per_rank > 0:
            t = time.perf_counter()
            make_big_trace.make_set(
                syn_dir, ranks=args.ranks, mb_per_rank=args.mb_per_rank, gzip_level=args.gzip
            )
            print(f"  {syn_dir.name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
            tools = ("prism", "hta", "floor", "floor+store") if args.floor else ("prism", "hta")
            sets.append(_trace_set(syn_dir.name, syn_dir, tools=tools))
        if args.big_gb > 0:
            t = time.perf_counter()
            big = make_big_trace.make_set(
                work / "synthetic-big",
                ranks=1,
                mb_per_rank=args.big_gb * 1000,
                gzip_level=args.gzip,
            )
            print(f"  synthetic-big: {time.perf_counter() - t:.1f} s", file=sys.stderr)
            sets.append(_trace_set("synthetic-big", big[0], tools=("prism",)))

        results: list[tuple[TraceSet, dict[str, Measurement]]] = []
        for ts in sets:
            by_tool: dict[str, Measurement] = {}
            for tool in ts.tools:
                if tool == "hta" and args.skip_hta:
                    continue
                if tool == "prism" and prism is None:
                    by_tool["prism"] = Measurement(
                        "prism",
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        -1,
                        "prism ingest unavailable",
                    )
                    continue
                runs = []
                for _ in range(args.repeat):
                    _warm(ts.files)
                    if tool == "prism":
                        runs.append(run_prism(prism, ts, work, args.timeout))
                    elif tool.startswith("floor"):
                        runs.append(run_floor(ts, work, args.timeout, store=tool != "floor"))
                    else:
                        runs.append(run_hta(ts, work, args.timeout))
                    m = runs[-1]
                    print(
                        f"  {ts.name:<18} {tool:<6} {m.wall_s:8.2f} s  "
                        f"{m.peak_tree_mb:8.0f} MB tree  {m.maxrss_mb:8.0f} MB maxrss  {m.note}",
                        file=sys.stderr,
                    )
                by_tool[tool] = _best(runs)
            results.append((ts, by_tool))

        table, ratios = report(results)
        load1 = os.getloadavg()[0]
        print()
        print(table)
        print()
        for r in ratios:
            print(r)
        versions = _versions()
        print()
        print(", ".join(f"{k} {v}" for k, v in versions.items()))
        if not args.no_note:
            kind = args.host_kind or f"{platform.machine()}-{os.cpu_count()}cpu"
            kind = kind.replace("_", "-")  # `_` separates theme, host kind and date
            day = dt.date.today().isoformat()
            note = HERE / "results" / f"ingest_{kind}_{day}.md"
            write_note(
                note,
                kind=kind,
                day=day,
                argv=argv,
                args=args,
                table=table,
                ratios=ratios,
                versions=versions,
                load=(load0, load1),
            )
            print(f"\nwrote {note}")
    finally:
        if args.keep or args.workdir:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

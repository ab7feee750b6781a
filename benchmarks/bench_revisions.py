"""Revisions benchmark: the scorecard and the cheaper benchmarks at two git revisions, side by side.

A refactor should change no figure: this runs the same fixed list of benchmarks (each with its
own revision's script, so each measures its own code) and ``shared/tools/scorecard`` in a
temporary ``git worktree`` of each revision, parses every number they print, and writes one table
``results/revisions_<host-kind>_<date>.md``: figure | before | after | change.

Each worktree gets a venv chained to this one's dependencies (a ``.pth`` to the site-packages this
interpreter reads beside its own) and ``pip install --no-deps -e`` of the worktree, so nothing is
downloaded. The benchmarks alternate between the revisions (before, after, next benchmark), so a
change of the machine's load falls on both; each timing is given with the 1-minute load average
taken as its benchmark started. A number is a timing when a time unit (s, ms, µs, min) or a rate
(``/s``) follows it, or its line speaks of RSS; every other number (errors in %, counts, bytes,
simulated times) is deterministic and must be the same at both revisions, or be explained in
``EXPLAINED``.

The default revisions are the parent of the house-plan refactor's first commit (the CLI package
and the store write API, 7a76e4e) and HEAD. Raw results are saved as JSON, and ``--render RAW``
rewrites the note from them without running anything again.

Usage::

    python benchmarks/bench_revisions.py                       # ~15 min on a busy 2-core machine
    python benchmarks/bench_revisions.py --only slice calibrate --no-scorecard --no-note
    python benchmarks/bench_revisions.py --render /tmp/prism-revisions.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import HERE, REPO, SHARED, host_kind, write_note

DEFAULT_BEFORE = "7a76e4e^"
"""The commit before the house-plan refactor began (its first commit: CLI package, store_write)."""

TOOLS = Path(os.environ.get("PRISM_SHARED_TOOLS", HERE.parents[1] / "shared" / "tools"))


@dataclass(frozen=True)
class Bench:
    """One benchmark: a name in the table and the script's arguments (no result note written)."""

    name: str
    args: tuple[str, ...]


_ASTRA_SIM = str(TOOLS / "astra-sim" / "astra-sim")
BENCHES = (
    Bench("slice", ("bench_slice.py", "--dp", "2048", "--repeat", "1", "--no-note")),
    Bench(
        "emulate",
        ("bench_emulate.py", "--source", "st", "--dp", "2048", "--repeat", "1", "--no-note"),
    ),
    Bench("export", ("bench_export.py", "--dp", "16")),
    Bench("validate", ("bench_validate.py", "--no-note")),
    Bench("calibrate", ("bench_calibrate.py", "--no-note")),
    Bench("et_memory", ("bench_et_memory.py", "--no-note")),
    Bench("draws", ("bench_draws.py", "--no-note")),
    Bench("analyses", ("bench_analyses.py", "--repeat", "1")),
    Bench("report", ("bench_report.py",)),
    Bench("astra_sim", ("bench_astra_sim.py", "--astra-sim", _ASTRA_SIM)),
)
"""The cheaper benchmarks (each well under two minutes on an idle 2-core machine)."""

EXPLAINED: tuple[tuple[str, frozenset[int] | None, str], ...] = (
    (
        r"^astra_sim: (all_reduce|reduce_scatter|all_to_all) ",
        frozenset({5, 6}),
        "prism's alpha_beta with ASTRA-sim's options: since the before revision the benchmark takes"
        " ASTRA-sim's settings from its system.json and charges the local reduction (4a53c62,"
        " 7ea1c23); ASTRA-sim's own figure is unchanged",
    ),
    (
        r"^astra_sim: all_gather ",
        frozenset({3, 4, 5, 6}),
        "an ALL_GATHER's comm_size is now each member's input, as the PyTorch converter and"
        " ASTRA-sim's ring read it (7704808), and the options as above (4a53c62, 7ea1c23);"
        " ASTRA-sim's own figure is unchanged",
    ),
    (
        r"^astra_sim: Largest diff",
        frozenset({2}),
        "the largest difference with ASTRA-sim's options, after 4a53c62/7ea1c23/7704808",
    ),
    (
        r"^astra_sim: # # # # % # # %",
        frozenset({5, 6}),
        "ST at 64 ranks, prism with ASTRA-sim's options (4a53c62, 7ea1c23); ASTRA-sim's own and"
        " prism's recorded-transfer figures are unchanged",
    ),
    (
        r"^astra_sim: Median over",
        frozenset({3}),
        "the median of the column above (4a53c62, 7ea1c23)",
    ),
    (
        r"^draws: ",
        None,
        "the draws changed between the revisions (9fe18ef: a step's common mode kept; cf03b5a:"
        " a row per set for the recorded run itself; both print other figures)",
    ),
    (
        r"^emulate: (rows written|rank_step rows)",
        None,
        "the emulator writes the rank_step table since 82b44a1 (schema 3) and the benchmark"
        " times it since 5af0499",
    ),
    (
        r"^report: report of run 'sample#_emu'",
        frozenset({3}),
        "the emulated run's report has one more figure, every rank's waits per step from the"
        " rank_step table (cb8ea6f, 82b44a1); the recorded runs' reports are the same size",
    ),
    (
        r"^report: sample#_emu # / #",
        frozenset({4}),
        "report MiB of the emulated run: the rank_step heatmap, as above (cb8ea6f)",
    ),
    (
        r"^report: sample#_emu / sample \(one run\)",
        None,
        "a line of the after revision only: bench_report gives the 8192-rank report's time as a"
        " ratio to the sample's, measured in one run (65f44c0), now that no test asserts a"
        " wall-clock time",
    ),
)
"""(figure regex, numbers allowed to differ (1-based; None: any), why) for deterministic figures
that differ between the default revisions because of features merged between them."""

_NUMBER = re.compile(r"(?<![\d.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])")
_UNIT_AFTER = re.compile(r"(?:\s*[,/]\s*[-+]?[\d.,]+)*\s?(?:s|ms|µs|us|min)(?![\w])")
_TIMING_LINE = re.compile(r"events/s|files/s|\bRSS\b")
_TIMING_HEADER = re.compile(r"(?:^|\s)(?:s|ms)$|\bseconds\b|\bwall\b")
"""A column of a printed table whose numbers are wall times: ``report s``, ``derive s``."""
_TMP = re.compile(r"\btmp[\w]{8}\b")
_SKIP = re.compile(r"^(note|wrote|written|Host|Command)\b|^\s*$|^```|^\|?\s*-{3,}")


# --------------------------------------------------------------------------------------------------
# running


def _dep_paths() -> list[str]:
    """The site-packages this interpreter reads beside its own venv's (the chained main venv)."""
    own = Path(sys.prefix).resolve()
    paths = [p for p in sys.path if p.endswith("site-packages") and own not in Path(p).parents]
    return paths or [sysconfig.get_paths()["purelib"]]


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def prepare(rev: str, root: Path) -> Path:
    """A detached worktree of ``rev`` under ``root``: a chained venv, the package installed."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    wt = root / f"rev-{sha[:10]}"
    _git("worktree", "add", "--detach", str(wt), sha)
    venv = wt / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "_deps_from_main.pth").write_text("\n".join(_dep_paths()) + "\n")
    # This interpreter's pip installs into the new venv (which has none); its build backend is
    # the chained setuptools, so nothing is downloaded.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "-q", "--no-deps", "--no-build-isolation", "-e", str(wt)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return wt


def _env(wt: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{wt / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PRISM_SHARED_DATASETS"] = str(SHARED)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    return env


def run_one(wt: Path, cmd: list[str], timeout: float) -> dict[str, object]:
    """Run ``cmd`` in ``wt``: its stdout, exit status, wall seconds and the load as it started."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=wt, env=_env(wt), capture_output=True, text=True, timeout=timeout
        )
        out, rc, err = proc.stdout, proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, err = "timeout", ""
    wall = time.perf_counter() - t0
    tail = err.strip().splitlines()[-1:] if rc != 0 else []
    return {"stdout": out, "rc": rc, "wall_s": wall, "load": load, "err": tail}


# --------------------------------------------------------------------------------------------------
# parsing and the table


def _cells(line: str) -> list[str]:
    if "|" in line:
        return [c.strip() for c in line.strip().strip("|").split("|")]
    return re.split(r"\s{2,}", line.strip())


def figures(stdout: str) -> dict[str, list[tuple[str, bool]]]:
    """Each printed line with numbers, keyed ``template #n`` -> its numbers (text, is a timing).

    A number is a timing when a time unit follows it, its line is a rate or an RSS, or it stands
    in a table column whose header ends in ``s`` or ``ms`` (the last header line of as many
    columns seen before it).
    """
    out: dict[str, list[tuple[str, bool]]] = {}
    seen: dict[str, int] = {}
    header: list[str] = []
    for raw in stdout.splitlines():
        line = _TMP.sub("tmp…", raw.rstrip())
        if _SKIP.search(line):
            continue
        cells = _cells(line)
        if len(cells) >= 3 and sum(bool(_NUMBER.search(c)) for c in cells) * 2 < len(cells):
            header = cells
        if not _NUMBER.search(line):
            continue
        whole_line_timing = bool(_TIMING_LINE.search(line))
        nums = [
            (m.group(), whole_line_timing or bool(_UNIT_AFTER.match(line, m.end())))
            for m in _NUMBER.finditer(line)
        ]
        if len(cells) == len(header) and cells != header:
            by_cell = [
                bool(_TIMING_HEADER.search(h)) for c, h in zip(cells, header, strict=True)
                for _ in _NUMBER.finditer(c)
            ]  # fmt: skip
            if len(by_cell) == len(nums):
                nums = [(x, t or c) for (x, t), c in zip(nums, by_cell, strict=True)]
        template = " ".join(_NUMBER.sub("#", line).replace("|", " ").split())
        seen[template] = seen.get(template, 0) + 1
        key = template if seen[template] == 1 else f"{template} ({seen[template]})"
        out[key] = nums
    return out


def _explained(fig: str, differing: set[int] | None) -> str | None:
    """Why ``fig`` differs, when ``EXPLAINED`` covers it and the numbers that differ."""
    for pattern, allowed, why in EXPLAINED:
        if re.search(pattern, fig) and (
            allowed is None or (differing is not None and differing <= allowed)
        ):
            return why
    return None


def _value(text: str) -> float:
    return float(text.replace(",", ""))


def _change(
    before: list[tuple[str, bool]], after: list[tuple[str, bool]]
) -> tuple[str, str, set[int] | None]:
    """The change column, the row's kind (same, timing or differs) and the deterministic numbers
    that differ (1-based; None when the lines do not have as many numbers)."""
    if [b for b, _ in before] == [a for a, _ in after]:
        return "same", "same", set()
    if len(before) != len(after):
        return "DIFFERS: other numbers", "differs", None
    parts, kind, differing = [], "timing", set()
    for i, ((b, timing), (a, _)) in enumerate(zip(before, after, strict=True), 1):
        if b == a:
            continue
        if timing:
            vb, va = _value(b), _value(a)
            rel = f"{(va / vb - 1) * 100:+.0f} %" if vb else "from 0"
            parts.append(f"#{i} {rel}")
        else:
            parts.append(f"#{i} DIFFERS {b} → {a}")
            kind = "differs"
            differing.add(i)
    return "; ".join(parts), kind, differing


def render(raw: dict[str, object]) -> tuple[str, str]:
    """The note's body and its one-line headline from the raw results."""
    revs: dict[str, dict[str, str]] = raw["revisions"]  # type: ignore[assignment]
    runs: dict[str, dict[str, dict[str, object]]] = raw["runs"]  # type: ignore[assignment]
    rows = ["| figure | before | after | change |", "|---|---|---|---|"]
    counts = {"same": 0, "timing": 0, "differs": 0, "explained": 0, "one side": 0}
    ratios: list[float] = []
    unexplained: list[str] = []
    for name, sides in runs.items():
        b_run, a_run = sides["before"], sides["after"]
        rows.append(
            f"| **{name}**: exit status, wall time of the benchmark (load) |"
            f" {b_run['rc']}, {b_run['wall_s']:.0f} s ({b_run['load']:.1f}) |"
            f" {a_run['rc']}, {a_run['wall_s']:.0f} s ({a_run['load']:.1f}) |"
            f" {float(a_run['wall_s']) / max(float(b_run['wall_s']), 1e-9) - 1:+.0%} |"  # type: ignore[arg-type]
        )
        for side, run in (("before", b_run), ("after", a_run)):
            if run["rc"] != 0:
                rows.append(f"| {name}: {side} failed | {run['err']} | | |")
        fb = figures(str(b_run["stdout"]))
        fa = figures(str(a_run["stdout"]))
        for key in list(fb) + [k for k in fa if k not in fb]:
            fig = f"{name}: {key}"
            b, a = fb.get(key), fa.get(key)
            bt = " / ".join(x for x, _ in b) if b else "—"
            at = " / ".join(x for x, _ in a) if a else "—"
            differing: set[int] | None = None
            if b is None or a is None:
                change, kind = "only one side prints it", "one side"
            else:
                change, kind, differing = _change(b, a)
                if kind in ("timing", "differs") and len(a) == len(b):
                    for (x, t), (y, _) in zip(b, a, strict=True):
                        if t and _value(x) > 0:
                            ratios.append(_value(y) / _value(x))
            why = _explained(fig, differing) if kind in ("differs", "one side") else None
            if why is not None:
                change += f" (explained: {why})"
                kind = "explained"
            elif kind in ("differs", "one side"):
                unexplained.append(fig)
            counts[kind] += 1
            rows.append(f"| {fig} | {bt} | {at} | {change} |")
    med = statistics.median(ratios) if ratios else float("nan")
    headline = (
        f"{sum(counts.values())} lines of figures: {counts['same']} identical,"
        f" {counts['timing']} differing only in timings (median after/before {med:.2f}),"
        f" {counts['differs']} with an unexplained deterministic difference,"
        f" {counts['one side']} printed by one side only (unexplained),"
        f" {counts['explained']} differing or printed by one side as explained"
    )
    head = "\n".join(
        f"- {side}: `{r['rev']}` = {r['sha'][:10]} {r['subject']}" for side, r in revs.items()
    )
    body = (
        f"Revisions:\n\n{head}\n\n**{headline}.**\n\n"
        "Each row is one printed line (numbers as `#`); `#k` in the change column is its k-th"
        " number. Timings are ratios after/before; the load is the 1-minute load average as each"
        " benchmark started (2 cores, shared).\n\n" + "\n".join(rows)
    )
    if unexplained:
        title = "Unexplained (a deterministic figure differs, or one side only prints the line)"
        body += f"\n\n{title}:\n\n" + "\n".join(f"- {f}" for f in unexplained)
    return body, headline


# --------------------------------------------------------------------------------------------------


def main() -> None:
    """Run the benchmarks at both revisions (or re-render saved results) and write the note."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=DEFAULT_BEFORE)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--only", nargs="+", default=None, help="benchmark names (see BENCHES)")
    ap.add_argument("--no-scorecard", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0, help="per benchmark run, seconds")
    ap.add_argument(
        "--raw", type=Path, default=Path(tempfile.gettempdir()) / "prism-revisions.json"
    )
    ap.add_argument("--render", type=Path, default=None, help="rewrite the note from saved JSON")
    ap.add_argument("--keep", action="store_true", help="keep the worktrees")
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()

    if args.render is not None:
        raw = json.loads(args.render.read_text())
    else:
        raw = collect(args)
        args.raw.write_text(json.dumps(raw, indent=1))
        print(f"raw results: {args.raw}")
    body, headline = render(raw)
    if args.render is not None:
        body = f"(Rendered again from that run's raw results, `--render {args.render}`.)\n\n{body}"
    print(body)
    if not args.no_note:
        note = write_note(
            "revisions",
            host_kind(args.host_kind),
            title="Scorecard and benchmarks before and after the house-plan refactor",
            command=str(raw["command"]),
            body=body,
        )
        print(f"note: {note}")
    print(headline)


def collect(args: argparse.Namespace) -> dict[str, object]:
    """Set up both worktrees, run every benchmark at each (alternating), and clean up."""
    benches = [b for b in BENCHES if args.only is None or b.name in args.only]
    scorecard = TOOLS / "scorecard"
    root = Path(tempfile.mkdtemp(prefix="prism-revisions-"))
    revs: dict[str, dict[str, str]] = {}
    trees: dict[str, Path] = {}
    runs: dict[str, dict[str, dict[str, object]]] = {}
    try:
        for side, rev in (("before", args.before), ("after", args.after)):
            trees[side] = prepare(rev, root)
            sha = _git("rev-parse", rev)
            revs[side] = {"rev": rev, "sha": sha, "subject": _git("log", "-1", "--format=%s", sha)}
        jobs: list[tuple[str, list[str]]] = [
            (b.name, [".venv/bin/python", f"benchmarks/{b.args[0]}", *b.args[1:]]) for b in benches
        ]
        if not args.no_scorecard and scorecard.is_file():
            jobs.append(("scorecard", ["bash", str(scorecard)]))
        for i, (name, cmd) in enumerate(jobs):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            runs[name] = {}
            for side in order:
                print(f"{name} at {side} ...", file=sys.stderr, flush=True)
                runs[name][side] = run_one(trees[side], cmd, args.timeout)
    finally:
        if not args.keep:
            for wt in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=REPO)
            shutil.rmtree(root, ignore_errors=True)
    given = " ".join(a for a in sys.argv[1:] if a != "--keep")
    command = f"python benchmarks/bench_revisions.py {given}".strip()
    return {"revisions": revs, "runs": runs, "command": command}


if __name__ == "__main__":
    main()

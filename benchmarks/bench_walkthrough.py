"""The README walkthrough on every kind of trace users bring: does any command crash or mislead?

Question (issue 32's first target): every command of the README's walkthrough runs on each
input without a traceback, and refuses only what it must, in one line that says what to do.

The inputs are real public traces (``../shared/datasets``) and the bundled sample, rewritten the
way other writers write them (``tests/prism_trace/brought_traces.py``):

- ``single-gpu``: ResNet-50 on one GPU (Kineto), with ProfilerStep spans added as
  ``torch.profiler.schedule`` writes them;
- ``single-gpu-no-steps``: the same trace as published, without ProfilerStep;
- ``et-kineto-pair``: a host ET + Kineto pair of one rank (the linear model);
- ``cpu-gloo-old``: the sample's 8 CPU ranks as an older PyTorch records gloo (worker-thread
  ``gloo:<op>`` spans only);
- ``amd`` / ``mtia``: HTA's NCCL rank with ROCm's and MTIA's categories and runtime calls;
- ``string-streams``: the same rank as older Kineto writes streams (``tid: "stream 7"``);
- ``group-ids``: two ranks of PyTorch 2.3 calls naming their group by id only;
- ``rank-pair``: DLRM rank 3 as control and rank 1 as test, ingested as two runs.

Each command is run in-process through the CLI (click's runner, so a crash is caught with its
traceback) and classed:

- ``ok``: exit 0;
- ``advised``: refused in one line naming ``--partial`` (a recording of some ranks of a
  larger job), and the same command with ``--partial`` then runs;
- ``refused``: exit 1 with exactly one ``error:`` line and no traceback;
- ``crash``: anything else (a traceback, several lines of error, a warning on stderr).

Usage::

    python benchmarks/bench_walkthrough.py            # writes benchmarks/results/walkthrough_*.md
    python benchmarks/bench_walkthrough.py --no-note
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "prism_trace"))

from _common import host_kind, write_note  # noqa: E402

SHARED = Path(os.environ.get("PRISM_SHARED_DATASETS", ROOT.parent / "shared" / "datasets"))


@dataclass
class Outcome:
    """One command on one input."""

    input: str
    command: str
    status: str  # ok | refused | crash
    detail: str
    seconds: float


def _inputs(work: Path) -> dict[str, list[Path]]:
    """Each input's files, written under ``work``."""
    import brought_traces as bt

    out: dict[str, list[Path]] = {}
    resnet = SHARED / "param-resnet-et"
    hta = bt.load(SHARED / "hta-nccl-rank0" / "nccl_data.json.gz")

    def folder(name: str) -> Path:
        p = work / name
        p.mkdir()
        return p

    # ResNet's trace has no ProfilerStep: the schedule's spans are added from its data-loader
    # marks, as torch.profiler.schedule writes them; the plain trace is the one without.
    plain = bt.load(resnet / "resnet_kineto.json.gz")
    out["single-gpu"] = [bt.save(bt.with_profiler_steps(plain), folder("steps") / "resnet.json.gz")]
    out["single-gpu-no-steps"] = [resnet / "resnet_kineto.json.gz"]
    out["et-kineto-pair"] = [resnet / "linear_et_1.0.1.json.gz", resnet / "linear_kineto.json.gz"]
    old = folder("old-gloo")
    out["cpu-gloo-old"] = [
        bt.save(bt.as_old_gloo(bt.load(p)), old / p.name)
        for p in sorted((ROOT / "datasets" / "sample").glob("rank*.kineto.json.gz"))
    ]
    out["amd"] = [bt.save(bt.as_amd(hta), folder("amd") / "rank0.json.gz")]
    out["mtia"] = [bt.save(bt.as_mtia(hta), folder("mtia") / "rank0.json.gz")]
    out["string-streams"] = [bt.save(bt.with_string_streams(hta), folder("streams") / "r0.json.gz")]
    ids = folder("group-ids")
    files = []
    for rank, address in ((0, 94_733_712_617_296), (1, 140_103_204_981_136)):
        t = bt.as_pt23_comms(hta, group_id=address)
        t["distributedInfo"]["rank"] = rank
        files.append(bt.save(t, ids / f"rank{rank}.json.gz"))
    out["group-ids"] = files
    return out


def _walkthrough(name: str, files: list[Path], work: Path) -> list[tuple[str, list[str]]]:
    """The README's walkthrough, adapted to ``name``'s run (one store per input)."""
    db = str(work / f"{name}.duckdb")
    run = "r"
    ingest = ["ingest", *map(str, files), "--db", db, "--run", run, "--quiet"]
    cmds: list[tuple[str, list[str]]] = [
        ("ingest", ingest),
        ("info", ["info", db]),
        ("info --run", ["info", db, "--run", run]),
        ("query", ["query", db, "SELECT rank, iteration, dur / 1e6 AS ms FROM iteration"]),
        ("analyze temporal", ["analyze", db, "--run", run, "temporal"]),
        ("analyze temporal hta", ["analyze", db, "--run", run, "temporal", "--window", "hta"]),
        ("analyze kernels", ["analyze", db, "--run", run, "kernels"]),
        ("analyze idle", ["analyze", db, "--run", run, "idle"]),
        ("analyze skew", ["analyze", db, "--run", run, "skew"]),
        ("graph", ["graph", db, "--run", run]),
        ("analyze critical-path-summary", ["analyze", db, "--run", run, "critical-path-summary"]),
        (
            "slice dp=2",
            ["slice", db, "--run", run, "--layout", "dp=2", "--world", "2", "--out-run", "big"],
        ),
        ("emulate", ["emulate", db, "--run", run, "--out-run", "e"]),
        ("emulate --partial", ["emulate", db, "--run", run, "--out-run", "ep", "--partial"]),
        (
            "emulate slow-ranks",
            ["emulate", db, "--run", run, "--out-run", "slow", "--what-if", "slow-ranks=0@1.2"],
        ),
        (
            "emulate no-stragglers",
            ["emulate", db, "--run", run, "--out-run", "ns", "--what-if", "no-stragglers"],
        ),
        ("analyze diff", ["analyze", db, "--run", "e", "diff", "--compare", "slow"]),
        ("validate", ["validate", db, "--run", run]),
        ("report", ["report", db, "--run", run, "-o", str(work / f"{name}.html")]),
        (
            "export perfetto",
            ["export", "perfetto", db, "--run", run, "-o", str(work / f"{name}.perfetto.json.gz")],
        ),
        ("export chakra", ["export", "chakra", db, "--run", run, "-o", str(work / f"{name}-et")]),
        (
            "export parquet",
            ["export", "parquet", db, "--run", run, "-o", str(work / f"{name}-pq")],
        ),
    ]
    return cmds


def _rank_pair(work: Path) -> list[tuple[str, list[str]]]:
    """DLRM rank 3 as control, rank 1 as test: two runs of one rank each, compared."""
    k = SHARED / "param-dlrm-8rank" / "kineto"
    control, test = sorted(k.glob("worker3_*")), sorted(k.glob("worker1_*"))
    db = str(work / "pair.duckdb")
    return [
        ("ingest control", ["ingest", str(control[0]), "--db", db, "--run", "control", "--quiet"]),
        ("ingest test", ["ingest", str(test[0]), "--db", db, "--run", "test", "--quiet"]),
        ("analyze diff", ["analyze", db, "--run", "control", "diff", "--compare", "test"]),
        (
            "analyze diff --map",
            ["analyze", db, "--run", "control", "diff", "--compare", "test", "--map", "3:1"],
        ),
        ("analyze temporal", ["analyze", db, "--run", "test", "temporal"]),
        (
            "report --compare",
            ["report", db, "--run", "test", "--compare", "control", "-o", str(work / "pair.html")],
        ),
    ]


def _classify(result: Any) -> tuple[str, str]:
    """``ok`` / ``refused`` / ``crash``, and the line that says why."""
    out = (result.stdout or "") + (getattr(result, "stderr", "") or "")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        tb = "".join(traceback.format_exception(result.exception)).strip().splitlines()
        return "crash", tb[-1][:200]
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    if "Traceback" in out or "Warning" in (getattr(result, "stderr", "") or ""):
        return "crash", next((ln for ln in out.splitlines() if "Warning" in ln), "traceback")
    if result.exit_code == 0:
        return "ok", ""
    if result.exit_code == 1 and len(errors) == 1:
        return "refused", errors[0]
    return "crash", f"exit {result.exit_code}: " + " | ".join(out.strip().splitlines()[-2:])[:200]


def sweep(work: Path, only: set[str] | None = None) -> list[Outcome]:
    """Run every input's walkthrough; one ``Outcome`` per command."""
    from click.testing import CliRunner

    from prism_trace.cli import main

    runner = CliRunner()
    plans: dict[str, Callable[[], list[tuple[str, list[str]]]]] = {}
    inputs = _inputs(work)
    for name, files in inputs.items():
        plans[name] = lambda n=name, f=files: _walkthrough(n, f, work)
    plans["rank-pair"] = lambda: _rank_pair(work)
    outcomes = []
    for name, plan in plans.items():
        if only and name not in only:
            continue
        for label, args in plan():
            t0 = time.perf_counter()
            res = runner.invoke(main, args, catch_exceptions=True)
            status, detail = _classify(res)
            if status == "refused" and "--partial" in detail and "--partial" not in args:
                # The refusal says what to do: do it, and see that it works.
                again, why = _classify(runner.invoke(main, [*args, "--partial"]))
                status = "advised" if again == "ok" else status
                detail = detail if again == "ok" else f"{detail}; with --partial: {why}"
            o = Outcome(name, label, status, detail, time.perf_counter() - t0)
            print(f"{name:20} {label:32} {status:8} {o.seconds:6.1f} s  {detail}", flush=True)
            outcomes.append(o)
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    """Counts per input, then every refusal and crash with its line."""
    names = list(dict.fromkeys(o.input for o in outcomes))
    kinds = ("ok", "advised", "refused", "crash")
    lines = ["| input | commands | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 2) + "|"]
    for n in [*names, None]:
        mine = [o for o in outcomes if n is None or o.input == n]
        c = [str(sum(o.status == k for o in mine)) for k in kinds]
        lines.append(f"| {n or '**all**'} | {len(mine)} | " + " | ".join(c) + " |")
    lines += ["", "Refusals and crashes, each in the line the user sees:", ""]
    lines += [
        f"- {o.input} / `{o.command}`: **{o.status}**: {o.detail}"
        for o in outcomes
        if o.status not in ("ok", "advised")
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", default="", help="comma-separated input names (default: all)")
    ap.add_argument("--no-note", action="store_true", help="do not write benchmarks/results")
    a = ap.parse_args()
    if not SHARED.is_dir():
        sys.exit(f"{SHARED}: the shared datasets are needed (set PRISM_SHARED_DATASETS)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prism-walk-") as tmp:
        outcomes = sweep(Path(tmp), set(filter(None, a.inputs.split(","))) or None)
    text = table(outcomes)
    print(text)
    if not a.no_note:
        body = (
            "The README walkthrough on each kind of trace users bring (module docstring);"
            " `refused` is exit 1 with one `error:` line, `crash` anything else.\n\n"
            f"{text}\n\n{time.perf_counter() - t0:.0f} s in all."
        )
        path = write_note(
            "walkthrough",
            host_kind(),
            title="The README walkthrough on traces users bring",
            command="python benchmarks/bench_walkthrough.py",
            body=body,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

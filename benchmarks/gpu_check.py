"""`scripts/gpu-check`: the replay's GPU paths, run end to end in one command (issue 35).

Three paths had never run on a GPU: ``prism replay --device cuda``, the CUDA side of the fake
process group under ``prism run``, and peak GPU memory. On a lent GPU machine (one H100, no
network; the wheels come from ``scripts/gpu-wheels``) this runs, in ≤ 8 minutes:

1. ``record``: the trace generator's job on DEVICE (Kineto + host ET): 1 rank with its gradient
   all-reduce over the one-member DP group (``--dp-sync-always``: the work of every rank of a DP
   job), the same once more (the noise floor; not with ``--quick``), and 2 ranks (dp=2; on one
   GPU through gloo, which stages CUDA tensors through the host: NCCL refuses two ranks on one
   device).
2. ``replay``: ingest; replay rank 0 of the 2-rank recording (rank 1 virtual; the 1-rank one if
   two ranks could not record) with ``prism replay --device DEVICE``, under the recording's
   instrumentation (``--instrument profiler``: iteration time, op-start error) and without it
   (``--instrument none``: peak memory, which on CUDA is ``max_memory_allocated``); validate.
3. ``run``: the generator's rank entry as rank 0 of a dp=8 job under ``prism run --world 8
   --ranks 0`` (peers virtual and instant, on the fake process group, tensors on DEVICE): the
   same work as the 1-rank recording, its all-reduce answered by the fake group instead of a
   real one-member group; its step times and peak memory next to the recording's (and the
   2-rank recording's rank 0, whose peer is real).
4. ``overhead``: replay overhead on kernels of about 10 µs and about 1 ms (``_gpu_kernels.py``).
5. one results file: ``gpu-check_<host>_<date>.json`` and ``.md`` in ``--out``.

Each step runs its work in subprocesses with time limits, logs under ``--out/logs``; a step that
fails is reported with its error and the others still run where they can. Exit status: 0 when
every step ran, 1 when one failed, 3 (``--device cuda`` only) when all ran but a target was
missed. ``--device cpu`` runs the same steps on CPU (CI): its figures are not held to the GPU
targets. ``--quick`` is the test's size (fewer steps and passes).

Usage::

    scripts/gpu-check --device cuda --out DIR
    scripts/gpu-check --device cpu --out /tmp/gpucheck [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _gpu_results import (  # noqa: E402
    Target,
    environment,
    op_start_errors,
    recorded_peak,
    targets,
    write_results,
)

__all__ = ["Check", "Sizes", "main", "tree_hash"]

STEPS = ("record", "replay", "run", "run_zero", "overhead")
SOURCE_DIRS = ("prism_trace", "replay", "analysis", "datasets")
"""What the prism-trace wheel is built from (``tree_hash``)."""

_NOT_SENT = (".pyc", ".duckdb", ".wal", ".html")
"""Suffixes .gitignore keeps out of the working tree the device tool sends: not hashed, so a
stray store or report in a package folder here does not make the machine refuse the wheel."""


def tree_hash(root: Path = REPO) -> str:
    """SHA-256 over the package's source files and ``pyproject.toml``: ``scripts/gpu-wheels``
    stores it beside the wheel it builds, and the check refuses a wheel built from another tree."""
    h = hashlib.sha256()
    files = [root / "pyproject.toml"]
    for d in SOURCE_DIRS:
        files += sorted(
            p
            for p in (root / d).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in _NOT_SENT
        )
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class Sizes:
    """How big each step is: the generator's model and steps, the replay's passes, the kernels."""

    hidden: int
    seq: int
    layers: int
    heads: int
    microbatches: int
    microbatch_size: int
    steps: int  # profiled steps of every recording (and of the job under prism run)
    iterations: int  # measured replay passes
    run_repeats: int  # prism run repeats
    noise_floor: bool  # record the 1-rank job twice
    kernel_ops: tuple[int, int]  # products per step of the ~10 µs and the ~1 ms kernel jobs
    passes: int  # overhead: measured passes
    pairs: int  # overhead: timed/bare pass pairs

    @classmethod
    def of(cls, device: str, *, quick: bool) -> Sizes:
        """The sizes of `device` (CUDA: a model whose products take tens of µs)."""
        model = (
            {"hidden": 512, "seq": 256, "layers": 4, "heads": 8, "microbatch_size": 4}
            if device == "cuda"
            else {"hidden": 64, "seq": 32, "layers": 2, "heads": 4, "microbatch_size": 2}
        )
        if quick:
            return cls(
                **model,
                microbatches=2,
                steps=2,
                iterations=2,
                run_repeats=1,
                noise_floor=False,
                kernel_ops=(50, 4),
                passes=3,
                pairs=6,
            )
        return cls(
            **model,
            microbatches=4,
            steps=4,
            iterations=5,
            run_repeats=3,
            noise_floor=True,
            kernel_ops=(400, 40) if device == "cuda" else (200, 10),
            passes=10,
            pairs=40,
        )


class StepError(Exception):
    """A step could not finish: one line saying why (the log has the rest)."""


class Check:
    """One run of the check: its options, work folder, logs, and what each step found."""

    def __init__(self, device: str, out: Path, *, quick: bool, python: str) -> None:
        """Lay out ``out`` (``work/`` for recordings and stores, ``logs/``)."""
        self.device, self.out, self.quick, self.py = device, out, quick, python
        # --debug: an unexpected error leaves its traceback in logs/ (the first GPU run left only
        # "unexpected ValueError: zip() ..." and the bug had to be found again on a lent GPU).
        self.cli = [python, "-m", "prism_trace.cli", "--debug"]
        self.sizes = Sizes.of(device, quick=quick)
        self.work = out / "work"
        self.logs = out / "logs"
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.db = self.work / "check.duckdb"
        self.steps: dict[str, dict[str, Any]] = {}
        self.recordings: dict[str, dict[str, Any]] = {}

    # -- subprocesses ------------------------------------------------------------------------

    def sh(self, step: str, cmd: list[str], *, timeout_s: float = 300.0) -> str:
        """Run `cmd` in the work folder (never the checkout: ``python -m prism_trace...`` from the
        repository root would import its ``prism_trace/`` folder over the installed package);
        log it; its stdout, or `StepError` with the end of its stderr."""
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                cmd, cwd=self.work, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            self._log(step, cmd, f"timed out after {timeout_s:g} s", str(exc.stdout), "")
            msg = f"{' '.join(cmd[:4])} ...: no result within {timeout_s:g} s"
            raise StepError(msg) from None
        self._log(
            step, cmd, f"exit {p.returncode}, {time.perf_counter() - t0:.1f} s", p.stdout, p.stderr
        )
        if p.returncode:
            tail = [ln for ln in (p.stderr or p.stdout).strip().splitlines() if ln.strip()][-3:]
            what = " ".join(Path(c).name if "/" in c else c for c in cmd[:5])
            msg = f"{what} ... exited {p.returncode}: {' | '.join(tail)}"
            raise StepError(msg)
        return p.stdout

    def _log(self, step: str, cmd: list[str], status: str, out: str, err: str) -> None:
        with (self.logs / f"{step}.log").open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n# {status}\n{out}\n{err}\n")

    def prism(self, step: str, *args: str, timeout_s: float = 300.0) -> str:
        """``prism ARGS`` (the CLI of the interpreter running the check)."""
        return self.sh(step, [*self.cli, *args], timeout_s=timeout_s)

    def json_of(self, step: str, cmd: list[str], *, timeout_s: float = 300.0) -> Any:
        """The last JSON object a command prints on stdout (libraries print lines before it)."""
        out = self.sh(step, cmd, timeout_s=timeout_s)
        start = out.rfind("\n{")
        return json.loads(out[start + 1 if start >= 0 else out.index("{") :])

    # -- steps -------------------------------------------------------------------------------

    def run_step(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        """Run one step; record its figures, status, seconds (and error)."""
        t0 = time.perf_counter()
        print(f"gpu-check: {name} ...", flush=True)
        try:
            figures = fn()
            status, error = "ok", None
        except StepError as exc:
            figures, status, error = {}, "failed", str(exc)
        except Exception as exc:
            figures, status, error = {}, "failed", f"{type(exc).__name__}: {exc}"
        secs = round(time.perf_counter() - t0, 1)
        self.steps[name] = {"status": status, "seconds": secs, "error": error, **figures}
        print(
            f"gpu-check: {name} {status} in {secs} s" + (f": {error}" if error else ""), flush=True
        )

    def _generate(
        self, name: str, dp: int, *, extra: tuple[str, ...] = (), step: str = "record"
    ) -> dict[str, Any]:
        s, d = self.sizes, self.work / name
        cmd = [self.py, "-m", "prism_trace.datasets.generate", "--dp", str(dp), "--tp", "1"]
        cmd += ["--pp", "1", "--device", self.device, "--out", str(d), *extra]
        if dp == 1:  # the gradient all-reduce too (one member): the work of a DP job's rank
            cmd.append("--dp-sync-always")
        for k in ("steps", "microbatches", "microbatch_size", "hidden", "seq", "layers", "heads"):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(s, k))]
        self.sh(step, cmd)
        run = json.loads((d / "run.json").read_text())
        r0 = run["ranks"][0]
        steps = [st["dur_ns"] for st in r0["steps"] if st["profiled"]]
        return {
            "dir": str(d),
            "ranks": run["world_size"],
            "backend": run["backend"],
            "wall_s": run["wall_s"],
            "rank0_steps_ns": steps,
            "rank0_mean_step_ms": sum(steps) / len(steps) / 1e6,
            "rank0_peak_allocated_bytes": r0.get("peak_allocated_bytes"),
            "rank0_cuda_max_allocated_bytes": r0.get("cuda_max_allocated_bytes"),
            "config": run["config"],
        }

    def record(self) -> dict[str, Any]:
        """Step 1: the 1-rank job (twice for the noise floor), and 2 ranks when they can run."""
        names = ["rec1", "rec1b"] if self.sizes.noise_floor else ["rec1"]
        if self.device == "cuda" and self.sizes.noise_floor:
            # A job first, unused: on the H200 the first recording on a fresh machine ran 242 ms
            # a step and the second 172 ms, so the noise floor measured the warm-up and not the
            # machine. Each recording is a process of its own: what carries over is the device's
            # and the host's state (clocks, driver, page cache), not the CUDA context.
            self._generate("warm-up", 1)
        for name in names:
            self.recordings[name] = self._generate(name, 1)
        notes = []
        try:
            self.recordings["rec2"] = self._generate("rec2", 2)
        except StepError as exc:
            if self.device == "cpu":
                raise
            notes.append(f"2 ranks on one GPU did not record: {exc}")
        figures = {
            k: {x: v for x, v in r.items() if x not in ("dir", "config", "rank0_steps_ns")}
            for k, r in self.recordings.items()
        }
        return {"recordings": figures, "notes": notes}

    def _ingest(self, name: str, db: Path | None = None) -> None:
        db = db or self.db
        d = self.work / name
        self.prism("replay", "ingest", str(d), "--db", str(db), "--run", name, "--quiet")
        self.prism("replay", "graph", str(db), "--run", name)

    def _replay(self, run: str, instrument: str, notes: list[str]) -> dict[str, Any]:
        s = self.sizes
        out_run = f"rep-{instrument}"
        args = ["replay", str(self.db), "--run", run, "--ranks", "0", "--out-run", out_run]
        args += ["--device", self.device, "--iterations", str(s.iterations), "--warmup", "1"]
        args += ["--threads", "1", "--instrument", instrument, "--replace", "--json"]
        try:
            rep = self.json_of("replay", [*self.cli, *args])
        except StepError as exc:  # an op this torch cannot rebuild: the rest still measured
            if "--substitute-recorded" not in str(exc):
                raise
            notes.append(f"{out_run}: {exc}; replayed again with --substitute-recorded")
            cmd = [*self.cli, *args, "--substitute-recorded"]
            rep = self.json_of("replay", cmd)
        val = self.json_of(
            "replay",
            [
                *self.cli,
                "validate",
                str(self.db),
                "--replayed",
                out_run,
                "--json",
            ],
        )
        return {"report": rep, "validation": val}

    def replay(self) -> dict[str, Any]:
        """Step 2: ingest, replay rank 0 (its peer virtual), validate time, op starts, memory."""
        if "rec1" not in self.recordings:
            raise StepError("no recording (step record failed)")
        for name in self.recordings:
            self._ingest(name)
        run = "rec2" if "rec2" in self.recordings else "rec1"
        notes: list[str] = []
        prof = self._replay(run, "profiler", notes)
        none = self._replay(run, "none", notes)
        r0 = prof["report"]["ranks"][0]
        starts = op_start_errors(self.db, "rep-profiler")
        pv, nv = prof["validation"], none["validation"]
        rank_none = none["report"]["ranks"][0]
        if self.device == "cuda":  # absolute on both sides: max_memory_allocated, the GPU's rows
            rec_peak = recorded_peak(self.db, run, 0, "cuda")
            rep_peak = rank_none["peak_memory"]
        else:  # the memory pass's allocator rows, their level aligned per iteration
            mem = (nv.get("memory") or [{}])[0]
            rec_peak, rep_peak = mem.get("recorded"), mem.get("emulated")
        mem_err = None
        if rec_peak and rep_peak is not None:
            mem_err = 100.0 * (rep_peak - rec_peak) / rec_peak
        return {
            "replayed_run": run,
            "virtual_peers": 1 if run == "rec2" else 0,
            "compute_ops": r0["support"]["compute_units"],
            "supported_ops": r0["support"]["supported"],
            "comm_units": r0["support"]["comm_units"],
            "profiler": _iteration_figures(pv),
            "none": _iteration_figures(nv),
            "op_start_error_p50_pct": starts[0],
            "op_start_error_p99_pct": starts[1],
            "op_start_ops": starts[2],
            "peak_memory_replayed": rep_peak,
            "peak_memory_recorded": rec_peak,
            "peak_memory_error_pct": mem_err,
            "notes": notes,
        }

    def run(self) -> dict[str, Any]:
        """Step 3: rank 0 of a dp=8 job under ``prism run`` against the 1-rank recording."""
        from bench_run_accuracy import _errors

        rec1 = self.recordings.get("rec1")
        if rec1 is None:
            raise StepError("no 1-rank recording (step record failed)")
        cfg = {**rec1["config"], "dp": 8}
        cfg_path = self.work / "dp8.json"
        cfg_path.write_text(json.dumps({"config": cfg}))
        repeats = []
        for i in range(self.sizes.run_repeats):
            out = self.work / f"run{i}"
            entry = [
                self.py,
                str(HERE / "bench_run_accuracy.py"),
                "rank",
                "--config",
                str(cfg_path),
            ]
            launch = ["run", "--world", "8", "--ranks", "0", "--json", "--timeout-s", "300", "--"]
            report = self.json_of("run", [*self.cli, *launch, *entry, "--out", str(out)])
            mine = json.loads((out / "rank0.steps.json").read_text())
            steps = [s["dur_ns"] for s in mine["steps"] if s["profiled"]]
            mean_abs, of_mean, _ = _errors(steps, rec1["rank0_steps_ns"])
            rank_rep = report["ranks"][0]["report"] or {}
            repeats.append(
                {
                    "mean_step_ms": sum(steps) / len(steps) / 1e6,
                    "steps_ms": [t / 1e6 for t in steps],
                    "step_error_of_mean_pct": of_mean,
                    "step_mean_abs_error_pct": mean_abs,
                    "peak_allocated_bytes": mine.get("peak_allocated_bytes"),
                    "cuda_max_allocated_bytes": mine.get("cuda_max_allocated_bytes"),
                    "waited_ms": rank_rep.get("waited_ms"),
                    "unscheduled_calls": sum((rank_rep.get("unscheduled_calls") or {}).values()),
                }
            )
        key = "cuda_max_allocated_bytes" if self.device == "cuda" else "peak_allocated_bytes"
        # The 1-rank recordings' peaks: on CPU the profiler counts from its own start, so the
        # level is an accident of that moment (a tensor of the warm-up step freed just after it
        # lowers it) and two recordings of one job can differ; on CUDA the totals are absolute.
        recorded = [r[f"rank0_{key}"] for n, r in self.recordings.items() if n.startswith("rec1")]
        mem_run = [r[key] for r in repeats]
        figures: dict[str, Any] = {
            "world": 8,
            "layout": "dp=8 (rank 0 real, 7 virtual, instant peers)",
            "repeats": repeats,
            "median_step_error_of_mean_pct": statistics.median(
                r["step_error_of_mean_pct"] for r in repeats
            ),
            "recorded_1rank_mean_step_ms": rec1["rank0_mean_step_ms"],
            "memory_key": key,
            "memory_run": mem_run,
            "memory_recorded_1rank": recorded,
            "memory_exact": all(m in recorded for m in mem_run),
        }
        if "rec2" in self.recordings:  # the same code path (dp sync) with a real peer
            r2 = self.recordings["rec2"]
            figures["recorded_2rank_rank0_mean_step_ms"] = r2["rank0_mean_step_ms"]
            figures["memory_recorded_2rank_rank0"] = r2[f"rank0_{key}"]
        if "rec1b" in self.recordings:
            floor = _errors(self.recordings["rec1b"]["rank0_steps_ns"], rec1["rank0_steps_ns"])
            figures["noise_floor_error_of_mean_pct"] = floor[1]
            figures["noise_floor_mean_abs_pct"] = floor[0]
        return figures

    def run_zero(self) -> dict[str, Any]:
        """Step 4: ZeRO-1 (Adam's state sharded over dp 2, 2 ranks on one device through gloo):
        rank 0 under ``prism run --world 2`` against rank 0 of the recording; its optimizer
        shards and reduce-scatter outputs are the target's, so the peaks should be equal."""
        zero = ("--zero", "1", "--optimizer", "adam")
        rec = self._generate("rec2z", 2, extra=zero, step="run-zero")
        cfg_path = self.work / "zero-dp2.json"
        cfg_path.write_text(json.dumps({"config": rec["config"]}))
        out = self.work / "run-zero"
        entry = [self.py, str(HERE / "bench_run_accuracy.py"), "rank", "--config", str(cfg_path)]
        launch = ["run", "--world", "2", "--ranks", "0", "--json", "--timeout-s", "300", "--"]
        self.json_of("run-zero", [*self.cli, *launch, *entry, "--out", str(out)])
        mine = json.loads((out / "rank0.steps.json").read_text())
        key = "cuda_max_allocated_bytes" if self.device == "cuda" else "peak_allocated_bytes"
        recorded, run_peak = rec[f"rank0_{key}"], mine.get(key)
        err = None
        if recorded and run_peak is not None:
            err = 100.0 * (run_peak - recorded) / recorded
        return {
            "memory_key": key,
            "recorded": recorded,
            "prism_run": run_peak,
            "error_pct": err,
        }

    def overhead(self) -> dict[str, Any]:
        """Step 5: replay overhead on kernels of about 10 µs and about 1 ms."""
        db = self.work / "kernels.duckdb"
        sets = []
        for target_us, ops in zip((10.0, 1000.0), self.sizes.kernel_ops, strict=True):
            name = f"k{int(target_us)}us"
            kern = [self.py, str(HERE / "_gpu_kernels.py")]
            rec_args = ["record", "--device", self.device, "--target-us", str(target_us)]
            rec_args += ["--ops", str(ops), "--steps", "3", "--out", str(self.work / name)]
            rec = self.json_of("overhead", [*kern, *rec_args])
            self._ingest(name, db)
            ov = [*kern, "overhead", "--device", self.device, "--db", str(db), "--run", name]
            ov += ["--passes", str(self.sizes.passes), "--pairs", str(self.sizes.pairs)]
            if not self.quick:
                ov.append("--recorded-gaps")
            m = self.json_of("overhead", ov)
            sets.append({"name": name, "record": rec, **m})
        return {"sets": sets}


def _iteration_figures(v: dict[str, Any]) -> dict[str, Any]:
    return {
        "iteration_time_error_pct": v.get("iteration_time_error_pct"),
        "mean_iteration_error_pct": v.get("mean_iteration_error_pct"),
        "iterations": v.get("iterations"),
    }


def _python() -> str:
    return sys.executable


def main(argv: list[str] | None = None) -> int:
    """Run every step and write the results; the exit status (module docstring)."""
    ap = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "gpu-check")
    ap.add_argument("--quick", action="store_true", help="fewer steps and passes (the test)")
    ap.add_argument("--host-kind", default=None, help="label of the results file")
    ap.add_argument("--tree-hash", action="store_true", help="print the source tree's hash, exit")
    ap.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"comma-separated steps to run, in this order: {','.join(STEPS)} (a lent GPU's"
        " minutes are few: rerun only what a fix touched; replay and run need record)",
    )
    a = ap.parse_args(argv)
    chosen = [x.strip() for x in a.steps.split(",") if x.strip()]
    if not chosen or not set(chosen) <= set(STEPS):
        ap.error(f"--steps: choose from {','.join(STEPS)}, not {a.steps!r}")
    if a.tree_hash:
        print(tree_hash())
        return 0
    t0 = time.perf_counter()
    check = Check(a.device, a.out.resolve(), quick=a.quick, python=_python())
    env = environment(a.device, check.py, REPO, a.host_kind)
    if a.device == "cuda" and not env.get("cuda_available"):
        print(
            "gpu-check: --device cuda: no CUDA device is available to this torch", file=sys.stderr
        )
        return 1
    for name in STEPS:
        if name in chosen:
            check.run_step(name, getattr(check, name))
    env["load_average_after"] = os.getloadavg()
    env["seconds"] = round(time.perf_counter() - t0, 1)
    env["sizes"] = asdict(check.sizes)
    if tuple(chosen) != STEPS:
        env["steps"] = [x for x in STEPS if x in chosen]
    goals: list[Target] = targets(check.steps, a.device)
    paths = write_results(check.out, env, check.steps, goals, quick=a.quick)
    print(f"gpu-check: wrote {', '.join(str(p) for p in paths)} in {env['seconds']} s")
    if any(s["status"] != "ok" for s in check.steps.values()):
        return 1
    if a.device == "cuda" and any(t.met is False for t in goals):
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

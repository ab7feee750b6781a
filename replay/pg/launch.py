"""`prism run`: start the selected ranks of a job as processes; the `prism` backend fakes the rest.

``launch(["python", "train.py", ...], world_size=N, ranks=[0])`` starts one process per selected
rank with the environment of a ``torchrun`` worker (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``) plus the ``PRISM_*`` switches of `replay.pg.base.ENV`.
A ``sitecustomize`` on ``PYTHONPATH`` (`install_shim`) patches
``torch.distributed.init_process_group`` the moment torch defines it, so the script's own
``init_process_group("gloo" | "nccl" | ..., init_method=...)`` joins the `prism` backend through
the launcher's store instead of waiting for N ranks. The script itself is not modified.

With ``db`` and ``run`` the launcher emulates the run once, gives every selected rank its
`replay.peers.PeerSchedule`, and the virtual peers complete each call when the recording says.

This module imports torch only inside functions: the shim runs at interpreter start-up.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prism_trace.replay.pg.base import BACKEND, ENV

from prism_trace.errors import ProcessFailedError, RunStateError, UsageError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import ModuleType

__all__ = ["LaunchResult", "RankResult", "install_shim", "launch"]

_SITECUSTOMIZE = '''"""Written by `prism run`: routes init_process_group to prism."""
import importlib.machinery as _m
import importlib.util as _u
import sys as _s

try:
    import prism_trace.replay.pg.launch as _prism_launch
except ImportError:
    # The child's interpreter lacks prism_trace: reach the launcher's copy from the *end* of the
    # path, so that it can never shadow a package of the script's own.
    _s.path.append({root!r})
    import prism_trace.replay.pg.launch as _prism_launch

_prism_launch.install_shim()
# Run the sitecustomize that this one shadows, if there is one.
_spec = _m.PathFinder.find_spec("sitecustomize", [p for p in _s.path if p != {here!r}])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(_u.module_from_spec(_spec))
'''


@dataclass(frozen=True)
class RankResult:
    """One selected rank's process: exit status and the backend's report (`PrismSession`)."""

    rank: int
    returncode: int
    report: dict[str, Any] | None


@dataclass
class LaunchResult:
    """What `launch` did: per-rank results, wall time and the run whose peers were emulated."""

    world_size: int
    ranks: list[RankResult]
    wall_s: float
    run: str | None = None
    schedule_calls: dict[int, int] = field(default_factory=dict)
    failed_rank: int | None = None  # the rank whose failure stopped the others

    @property
    def returncode(self) -> int:
        """0 when every rank exited 0, else the status of the rank that failed first."""
        codes = {r.rank: r.returncode for r in self.ranks}
        if self.failed_rank is not None and codes.get(self.failed_rank):
            return codes[self.failed_rank]
        return next((c for c in codes.values() if c), 0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "world_size": self.world_size,
            "run": self.run,
            "wall_s": round(self.wall_s, 3),
            "returncode": self.returncode,
            "failed_rank": self.failed_rank,
            "schedule_calls": {str(k): v for k, v in self.schedule_calls.items()},
            "ranks": [
                {"rank": r.rank, "returncode": r.returncode, "report": r.report} for r in self.ranks
            ],
        }

    def summary(self) -> str:
        """A few lines: per rank, exit status, matched calls, wait for peers and step times."""
        peers = f"peers from run {self.run!r}" if self.run else "instant peers (no run given)"
        lines = [
            f"prism run: {len(self.ranks)} of {self.world_size} ranks real, {peers}, "
            f"{self.wall_s:.1f} s"
        ]
        for r in self.ranks:
            rep = r.report or {}
            marked = rep.get("step_ms") or {}
            its = rep.get("iteration_ms") or []
            if marked:
                steps = ", ".join(f"#{k} {t:.1f}" for k, t in marked.items())
            else:
                steps = ", ".join(f"{t:.1f}" for t in its) if its else "n/a"
            unsched = sum((rep.get("unscheduled_calls") or {}).values())
            lines.append(
                f"  rank {r.rank}: exit {r.returncode}; {rep.get('scheduled_calls', 0)} calls on "
                f"schedule, {unsched} outside it; waited {rep.get('waited_ms', 0.0):.1f} ms for "
                f"virtual peers; step times (ms): {steps}"
            )
        return "\n".join(lines)


def _parse_ranks(ranks: Sequence[int], world_size: int) -> list[int]:
    out = sorted({int(r) for r in ranks})
    if world_size < 1:
        msg = f"`--world` must be at least 1, got {world_size}"
        raise UsageError(msg)
    bad = [r for r in out if not 0 <= r < world_size]
    if not out or bad:
        msg = f"`--ranks` {bad or '(none)'} must be ranks of a world of {world_size}"
        raise UsageError(msg)
    return out


class _ReadOnly(Exception):
    """Raised at the end of the schedules' transaction, which then rolls back."""


def _schedules(
    db: Path, run: str, ranks: list[int], world_size: int, config: Any
) -> tuple[dict[int, Any], dict[int, tuple[str, list[int]]]]:
    from prism_trace.replay.peers import schedules_from_store

    from prism_trace.store.connection import open_store

    # Worked out in a transaction that is rolled back: a graph built for the schedules is not
    # kept, so `prism run` writes to the store once (its --out-run, in one transaction of its
    # own after the script) or not at all.
    with open_store(db) as store:
        try:
            with store.transaction():
                scheds = schedules_from_store(store, run=run, ranks=ranks, config=config)
                rows = store.con.sql(
                    "SELECT c.group_id, c.name, c.ranks FROM comm_group c JOIN run r"
                    " USING (run_id) WHERE r.name = $1",
                    params=[run],
                ).fetchall()
                raise _ReadOnly
        except _ReadOnly:
            pass
    for r, s in scheds.items():
        if s.world_size != world_size:
            msg = f"{db}: run {run!r} has a world of {s.world_size} ranks, not {world_size}"
            raise UsageError(msg)
        if not s.calls:
            msg = f"{db}: rank {r} of run {run!r} has no communication calls to schedule"
            raise RunStateError(msg)
    groups = {int(g): (str(n), list(rk or ())) for g, n, rk in rows}
    return scheds, groups


def _pythonpath(shim: Path, env: Mapping[str, str]) -> str:
    # Only the shim's folder goes first, and it holds nothing but ``sitecustomize.py``: the
    # script imports its own packages (HF ``datasets`` included) exactly as it would without us.
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(shim), *old])


def _package_root() -> str:
    """The folder that holds the installed ``prism_trace`` package (the shim's fallback)."""
    spec = importlib.util.find_spec("prism_trace")  # found, not imported: no cycle through it
    if spec is None or spec.origin is None:  # pragma: no cover - this module runs inside it
        msg = "prism_trace is not importable from this interpreter"
        raise RuntimeError(msg)
    return str(Path(spec.origin).resolve().parents[1])


def _rank_env(
    base: Mapping[str, str], *, rank: int, local: int, ranks: list[int], world_size: int, port: int
) -> dict[str, str]:
    env = dict(base)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(len(ranks)),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCH_DIST_INIT_BARRIER": "0",  # a store barrier would wait for all N ranks
            ENV.SWITCH: "1",
            ENV.WORLD_SIZE: str(world_size),
            ENV.RANKS: ",".join(map(str, ranks)),
        }
    )
    return env


def launch(
    command: Sequence[str],
    *,
    world_size: int,
    ranks: Sequence[int] = (0,),
    db: Path | None = None,
    run: str | None = None,
    config: Any = None,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    capture: bool = False,
) -> LaunchResult:
    """Run ``command`` as the selected ``ranks`` of a world of ``world_size``.

    Args:
        command: The program and its arguments (``python train.py ...``), unmodified.
        world_size: Ranks of the emulated job.
        ranks: Global ranks to start as processes; every other rank is virtual.
        db: Store holding ``run``; with it, virtual peers follow the run's emulated timeline.
        run: A recorded or sliced run of ``world_size`` ranks.
        config: `replay.emulate.config.EmulationConfig` for the emulation (default: its defaults).
        timeout_s: Kill every rank and fail after this long (None: no limit).
        env: Environment of the ranks (default: this process's).
        capture: Capture each rank's output into ``rank<r>.log`` of a temporary directory
            instead of passing it through (tests).

    Returns:
        The per-rank results (the caller decides what a non-zero exit means).

    Raises:
        PrismError: bad ranks, only one of ``db``/``run``, a run of another world size, or the
            ranks did not finish within ``timeout_s``.
    """
    import torch.distributed as dist

    selected = _parse_ranks(ranks, world_size)
    if (db is None) != (run is None):
        msg = "`--db` and `--run` go together (the recorded run whose peers to emulate)"
        raise UsageError(msg)
    if not command:
        msg = "no command to run (give it after `--`)"
        raise UsageError(msg)
    work = Path(tempfile.mkdtemp(prefix="prism-run-"))
    try:
        schedule_calls: dict[int, int] = {}
        payload_paths: dict[int, Path] = {}
        if db is not None and run is not None:
            scheds, groups = _schedules(Path(db), run, selected, world_size, config)
            for r, s in scheds.items():
                p = work / f"schedule.rank{r}.pkl"
                p.write_bytes(pickle.dumps({"schedule": s, "groups": groups}))
                payload_paths[r] = p
                schedule_calls[r] = len(s.calls)
        shim = work / "shim"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(
            _SITECUSTOMIZE.format(here=str(shim), root=_package_root())
        )
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        base = dict(os.environ if env is None else env)
        base["PYTHONPATH"] = _pythonpath(shim, base)
        procs: dict[int, subprocess.Popen[bytes]] = {}
        logs = []
        t0 = time.perf_counter()
        for local, r in enumerate(selected):
            renv = _rank_env(
                base, rank=r, local=local, ranks=selected, world_size=world_size, port=store.port
            )
            renv[ENV.REPORT] = str(work / f"report.rank{r}.json")
            if r in payload_paths:
                renv[ENV.SCHEDULE] = str(payload_paths[r])
            out = None
            if capture:
                out = (work / f"rank{r}.log").open("wb")
                logs.append(out)
            procs[r] = subprocess.Popen(
                list(command), env=renv, stdout=out, stderr=subprocess.STDOUT if capture else None
            )
        try:
            codes, failed = _wait_all(procs, timeout_s, t0)
        finally:
            for f in logs:
                f.close()
        wall = time.perf_counter() - t0
        results = []
        for r in selected:
            rp = work / f"report.rank{r}.json"
            rep = json.loads(rp.read_text()) if rp.exists() else None
            if capture:
                rep = {**(rep or {}), "log": (work / f"rank{r}.log").read_text(errors="replace")}
            results.append(RankResult(r, codes[r], rep))
        del store
        return LaunchResult(world_size, results, wall, run, schedule_calls, failed)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _wait_all(
    procs: dict[int, subprocess.Popen[bytes]], timeout_s: float | None, t0: float
) -> tuple[dict[int, int], int | None]:
    """Exit codes and the rank that failed first; then the others are stopped (they could wait)."""
    codes: dict[int, int] = {}
    failed: int | None = None
    try:
        while len(codes) < len(procs):
            for r, p in procs.items():
                if r not in codes and (c := p.poll()) is not None:
                    codes[r] = c
                    if c and failed is None:
                        failed = r
            if failed is not None:
                break
            if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                msg = f"ranks {sorted(set(procs) - set(codes))} still running after {timeout_s:g} s"
                raise ProcessFailedError(msg)
            time.sleep(0.02)
    finally:
        for r, p in procs.items():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            codes.setdefault(r, p.returncode)
    return codes, failed


# --------------------------------------------------------------------------------------------
# The shim (runs in every rank process, from sitecustomize)
# --------------------------------------------------------------------------------------------

_C10D = "torch.distributed.distributed_c10d"


def install_shim() -> None:
    """Route ``init_process_group`` to `prism` in this process, when `prism run` started it.

    Patches ``torch.distributed.distributed_c10d.init_process_group`` right after torch defines
    it (before ``torch.distributed`` re-exports it), so no torch import happens at start-up.
    """
    if os.environ.get(ENV.SWITCH) != "1":
        return
    mod = sys.modules.get(_C10D)
    if mod is not None:
        _patch(mod)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of torch's c10d module to patch it once loaded."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch(c10d: ModuleType) -> None:
    original = c10d.init_process_group
    if getattr(original, "__prism__", False):
        return

    @functools.wraps(original)
    def init_process_group(
        backend: Any = None,
        init_method: str | None = None,
        timeout: Any = None,
        world_size: int = -1,
        rank: int = -1,
        store: Any = None,
        group_name: str = "",
        pg_options: Any = None,
        device_id: Any = None,
        **kwargs: Any,
    ) -> None:
        """`prism run`'s stand-in: any backend becomes `prism`, the store is the launcher's."""
        import torch.distributed as dist
        from prism_trace.replay.pg import backend as ppg

        env_rank, env_world = int(os.environ["RANK"]), int(os.environ[ENV.WORLD_SIZE])
        if rank not in (-1, env_rank):
            msg = f"the script asks for rank {rank}, but `prism run` started it as rank {env_rank}"
            raise UsageError(msg)
        if world_size not in (-1, env_world):
            msg = f"the script asks for a world of {world_size}, but `prism run` has {env_world}"
            raise UsageError(msg)
        if store is None:
            kw = {} if timeout is None else {"timeout": timeout}
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                wait_for_workers=False,
                **kw,
            )
            store = dist.PrefixStore("prism", store)
        # init_method is dropped (its rendezvous waits for all N ranks); the backend's options
        # and device binding belong to the real backend and mean nothing to `prism`.
        del init_method, backend, pg_options, device_id
        ppg.register()
        original(
            BACKEND,
            timeout=timeout,
            world_size=env_world,
            rank=env_rank,
            store=store,
            group_name=group_name,
            **kwargs,
        )

    init_process_group.__prism__ = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group  # type: ignore[attr-defined]

"""The trace generator and the bundled sample, checked from the raw JSON (no prism reader)."""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

# Slow: records jobs with torch processes; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"

ANNOTATION = re.compile(
    r"prism_comm:pg=(?P<pg>[^;]+);desc=(?P<desc>[a-z_]+);seq=(?P<seq>\d+);"
    r"op=(?P<op>all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|barrier|send|recv);"
    r"in_bytes=(?P<in_bytes>\d+);out_bytes=(?P<out_bytes>\d+);dtype=(?P<dtype>[a-z0-9_]+);"
    r"peer=(?P<peer>-1|\d+);tag=(?P<tag>-?\d+)"
)


def _load(path: Path) -> Any:
    """A gzipped JSON file, parsed by orjson (a dependency of the package): the stdlib parser
    took 3.4 s of the 3.9 s that checking the sample's 16 files costs."""
    return orjson.loads(gzip.decompress(path.read_bytes()))


def _parse(name: str) -> dict[str, Any]:
    m = ANNOTATION.fullmatch(name)
    assert m is not None, f"unparseable annotation {name!r}"
    d: dict[str, Any] = m.groupdict()
    for k in ("seq", "in_bytes", "out_bytes", "peer", "tag"):
        d[k] = int(d[k])
    return d


def check_dataset(out: Path) -> None:
    """Assert the invariants of a generated dataset in `out`."""
    run = json.loads((out / "run.json").read_text())
    cfg, world = run["config"], run["world_size"]
    assert world == cfg["dp"] * cfg["tp"] * cfg["pp"]
    assert [r["rank"] for r in run["ranks"]] == list(range(world))
    for r in run["ranks"]:
        assert len(r["steps"]) == 1 + cfg["steps"]
        assert all(s["dur_ns"] > 0 for s in r["steps"])

    comms: dict[int, list[dict[str, Any]]] = {}
    groups_seen = None
    for rank in range(world):
        trace = _load(out / f"rank{rank}.kineto.json.gz")
        info = trace["distributedInfo"]
        assert (info["backend"], info["rank"], info["world_size"]) == ("gloo", rank, world)
        groups = trace["prism_groups"]
        assert isinstance(groups, list)
        assert groups_seen in (None, groups), "ranks disagree on `prism_groups`"
        groups_seen = groups
        events = trace["traceEvents"]
        steps = sorted(e["name"] for e in events if e["name"].startswith("ProfilerStep#"))
        assert steps == [f"ProfilerStep#{i}" for i in range(1, cfg["steps"] + 1)]
        names = [e["name"] for e in events if e["name"].startswith("prism_comm")]
        comms[rank] = [_parse(n) for n in names]
        assert comms[rank], f"rank {rank}: no prism_comm annotations"

        et = _load(out / f"rank{rank}.et.json.gz")
        assert len(et["nodes"]) > 100
        et_names = [n["name"] for n in et["nodes"]]
        assert "## process_group:init ##" in et_names
        assert sorted(n for n in et_names if n.startswith("prism_comm")) == sorted(names)

    assert groups_seen is not None
    by_name = {g["name"]: g for g in groups_seen}
    assert len(by_name) == len(groups_seen), "group names repeat"
    descs = {g["desc"] for g in groups_seen}
    assert descs <= {"tp", "dp", "pp", "world"}

    # Collectives: every member recorded (pg, seq) with the same op, bytes and dtype.
    coll: dict[tuple[str, int], dict[int, tuple[object, ...]]] = collections.defaultdict(dict)
    p2p: dict[tuple[str, int, int, int], list[tuple[object, ...]]] = collections.defaultdict(list)
    for rank, calls in comms.items():
        for c in calls:
            group = by_name[c["pg"]]
            assert rank in group["ranks"]
            assert c["desc"] == group["desc"]
            if c["op"] in ("send", "recv"):
                assert c["peer"] in group["ranks"]
                assert c["peer"] != rank
                assert c["in_bytes"] == c["out_bytes"] > 0
                src, dst = (rank, c["peer"]) if c["op"] == "send" else (c["peer"], rank)
                p2p[c["pg"], c["seq"], src, dst].append((c["op"], c["in_bytes"], c["dtype"]))
            else:
                assert c["peer"] == -1
                key = (c["pg"], c["seq"])
                assert rank not in coll[key], f"rank {rank} repeats {key}"
                coll[key][rank] = (c["op"], c["in_bytes"], c["out_bytes"], c["dtype"])
    for (pg, seq), per_rank in coll.items():
        assert set(per_rank) == set(by_name[pg]["ranks"]), f"({pg}, {seq}) missing ranks"
        assert len(set(per_rank.values())) == 1, f"({pg}, {seq}) differs: {per_rank}"
    for p2p_key, pair in p2p.items():
        assert sorted(str(op) for op, *_ in pair) == ["recv", "send"], f"{p2p_key}: {pair}"
        assert pair[0][1:] == pair[1][1:], f"{p2p_key} sizes differ: {pair}"

    # Every axis with more than one rank talks.
    seen_descs = {c["desc"] for calls in comms.values() for c in calls}
    for axis in ("tp", "dp", "pp"):
        assert (axis in seen_descs) == (cfg[axis] > 1), axis


def test_sample() -> None:
    assert (SAMPLE / "run.json").is_file(), f"{SAMPLE}: bundled sample missing"
    check_dataset(SAMPLE)
    total = sum(f.stat().st_size for f in SAMPLE.iterdir())
    assert total < 5_000_000


@pytest.mark.torch
@pytest.mark.slow
def test_generate(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets.generate import generate

    cfg = JobConfig(dp=2, tp=1, pp=2, microbatches=2, steps=2)
    generate(tmp_path, cfg, join_timeout_s=120)
    assert not list(tmp_path.glob("*.steps.json"))
    check_dataset(tmp_path)


@pytest.mark.torch
@pytest.mark.slow
def test_generate_tp_and_all_gather(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets.generate import generate

    generate(tmp_path, JobConfig(dp=1, tp=2, pp=1, microbatches=2, steps=1), join_timeout_s=120)
    check_dataset(tmp_path)
    ops = {
        _parse(e["name"])["op"]
        for e in _load(tmp_path / "rank0.kineto.json.gz")["traceEvents"]
        if e["name"].startswith("prism_comm")
    }
    assert ops == {"all_reduce", "all_gather"}


@pytest.mark.torch
def test_generate_refuses_a_bad_layout_before_starting_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """heads % tp != 0 is refused up front, naming the output folder: no rank is started."""
    pytest.importorskip("torch")
    from prism_trace.datasets import generate as gen
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._model import ModelConfig
    from prism_trace.datasets.generate import generate

    def no_ranks(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(gen.mp, "start_processes", no_ranks)
    for cfg, needle in (
        (JobConfig(dp=1, tp=3, pp=1, model=ModelConfig(heads=4)), "multiples of tp=3"),
        (JobConfig(dp=1, tp=1, pp=3, model=ModelConfig(layers=2)), "at least pp=3"),
    ):
        with pytest.raises(ValueError, match=needle) as exc:
            generate(tmp_path / "out", cfg)
        assert str(exc.value).startswith(f"{tmp_path / 'out'}: ")
    with pytest.raises(SystemExit):
        gen._parse(["--out", "x", "--dp", "1", "--tp", "3", "--pp", "1", "--heads", "4"])


@pytest.mark.torch
def test_generate_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that raises is reported as that rank's failure, naming the output folder.

    The up-front check is switched off in this process so that the ranks meet the bad layout
    themselves (each rank checks again when it builds its stage); tp=2 with 3 heads makes that a
    job of two processes, not three: the same failure, one torch start fewer.
    """
    pytest.importorskip("torch")
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._model import ModelConfig
    from prism_trace.datasets.generate import generate

    monkeypatch.setattr(ModelConfig, "check", lambda self, *, tp, pp: None)
    cfg = JobConfig(dp=1, tp=2, pp=1, model=ModelConfig(heads=3))
    with pytest.raises(RuntimeError, match=r"rank \d failed") as exc:
        # The ranks fail as soon as they build the model; the limit only has to outlast the start
        # of two torch processes on a busy machine.
        generate(tmp_path, cfg, join_timeout_s=300)
    assert "multiples of tp=2" in str(exc.value)
    assert str(tmp_path) in str(exc.value)


@pytest.mark.torch
def test_straggler_option() -> None:
    pytest.importorskip("torch")
    from prism_trace.datasets._config import ALL_RANKS
    from prism_trace.datasets.generate import _parse

    _, cfg = _parse(["--out", "x", "--dp", "2", "--tp", "1", "--pp", "1", "--straggler", "1@0.5"])
    assert (cfg.straggler_rank, cfg.straggler_s, cfg.straggler_spin) == (1, 0.5, False)
    _, cfg = _parse(["--out", "x", "--straggler", "all@0.1", "--straggler-spin"])
    assert (cfg.straggler_rank, cfg.straggler_s, cfg.straggler_spin) == (ALL_RANKS, 0.1, True)
    _, cfg = _parse(["--out", "x"])
    assert cfg.straggler_rank == -1
    for bad in ("1", "x@1", "1@-2", "9@1", "-2@1", "all@-1"):
        with pytest.raises(SystemExit):
            _parse(["--out", "x", "--dp", "2", "--tp", "1", "--pp", "1", f"--straggler={bad}"])


def test_a_finished_rank_yields_every_thread_of_its_process() -> None:
    """After its last profiled step a rank stops its profiler only on CPU time no other process
    wants: every thread of the process (the profiler works on several) at SCHED_IDLE, or nice
    19 where that policy is refused. Run in a child, as the policy cannot be undone."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import os, threading, time
        from prism_trace.datasets._train import _yield_cpu
        t = threading.Thread(target=time.sleep, args=(1,))
        t.start()
        _yield_cpu()
        tids = [int(x) for x in os.listdir("/proc/self/task")]
        idle = [os.sched_getscheduler(tid) == os.SCHED_IDLE for tid in tids]
        nice = [os.getpriority(os.PRIO_PROCESS, tid) == 19 for tid in tids]
        print(len(tids), all(i or n for i, n in zip(idle, nice)))
        t.join()
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    n, ok = res.stdout.split()
    assert int(n) >= 2
    assert ok == "True"

"""`prism run`: unmodified scripts as some ranks of a bigger world, end to end (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from prism_trace.replay.pg.launch import launch

from prism_trace.errors import DuplicateRunError, UsageError

# Slow: launches training scripts in torch processes; `scripts/test -m "not slow"` leaves it out.
pytestmark = [pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "datasets" / "sample"

# A plain gloo script: it knows nothing of prism.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    r = dist.get_rank()
    out = {"backend": dist.get_backend(), "world": dist.get_world_size()}
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t)
    out["sum"] = t.tolist()
    parts = [torch.empty(1) for _ in range(4)]
    dist.all_gather(parts, torch.tensor([float(r)]))
    out["gather"] = [p.item() for p in parts]
    peer = 2 - r
    got = torch.empty(3)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(r)), peer),
           dist.P2POp(dist.irecv, got, peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["p2p"] = got.tolist()
    virt = torch.full((3,), 9.0)
    dist.recv(virt, src=1)
    out["from_virtual"] = virt.tolist()
    g = dist.new_group([1, 2, 3])
    if r == 2:
        x = torch.ones(1)
        dist.all_reduce(x, group=g)
        out["subgroup"] = x.item()
    dist.barrier()
    dist.destroy_process_group()
    open(sys.argv[1] + f"/rank{r}.json", "w").write(json.dumps(out))
    """
)


def test_prism_run_gives_a_gloo_script_the_world_it_asks_for(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "prism_trace.cli", "run", "--world", "4", "--ranks", "0,2"]
    cmd += ["--json", "--timeout-s", "120", "--", sys.executable, str(script), str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO, timeout=180)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["world_size"] == 4
    assert [r["returncode"] for r in report["ranks"]] == [0, 0]
    out = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 2)}
    for r, o in out.items():
        assert (o["backend"], o["world"]) == ("prism", 4)
        # Virtual rank 1 mirrors rank 0, virtual rank 3 mirrors rank 2: 1 + 1 + 3 + 3.
        assert o["sum"] == [8.0, 8.0]
        assert o["gather"] == [0.0, 0.0, 2.0, 2.0]
        assert o["p2p"] == [float(2 - r)] * 3  # real data between the real ranks
        assert o["from_virtual"] == [0.0] * 3
    assert out[2]["subgroup"] == 3.0  # one real member of three
    # Instant peers: nothing was scheduled, every call ran at once.
    rep0 = report["ranks"][0]["report"]
    assert rep0["scheduled_calls"] == 0
    assert rep0["unscheduled_calls"]["recv"] == 1


def test_a_failing_rank_stops_the_others_instead_of_hanging(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            import torch.distributed as dist
            dist.init_process_group("nccl")
            if dist.get_rank() == 2:
                raise SystemExit(3)
            time.sleep(600)  # rank 0 would wait for ever (e.g. for a message from rank 2)
            """
        )
    )
    res = launch([sys.executable, str(script)], world_size=4, ranks=[0, 2], capture=True,
                 timeout_s=120)  # fmt: skip
    codes = {r.rank: r.returncode for r in res.ranks}
    assert codes[2] == 3
    assert codes[0] < 0  # stopped by the launcher (a signal)
    assert res.failed_rank == 2  # because rank 2 failed: not at the timeout (that raises)
    assert res.returncode == 3


def test_the_shim_refuses_a_rank_the_launcher_did_not_start(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(
        "import torch.distributed as d\n"
        "d.init_process_group('gloo', init_method='tcp://127.0.0.1:1', rank=3, world_size=4)\n"
    )
    res = launch([sys.executable, str(script)], world_size=4, ranks=[0], capture=True)
    assert res.returncode != 0
    log = (res.ranks[0].report or {})["log"]
    assert "the script asks for rank 3, but `prism run` started it as rank 0" in log


def test_the_script_imports_its_own_packages_not_ours(tmp_path: Path) -> None:
    """A training script that imports HF ``datasets`` gets HF's, not prism's bundled one."""
    site = tmp_path / "site" / "datasets"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("MARK = 'user'\n")
    script = tmp_path / "imp.py"
    script.write_text(
        "import sys, datasets, torch.distributed as d\n"
        "d.init_process_group('gloo')\n"
        "open(sys.argv[1], 'w').write(datasets.MARK + ' ' + d.get_backend())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site.parent)}
    out = tmp_path / "mark.txt"
    res = launch([sys.executable, str(script), str(out)], world_size=2, ranks=[0], capture=True,
                 env=env, timeout_s=120)  # fmt: skip
    assert res.returncode == 0, (res.ranks[0].report or {}).get("log")
    assert out.read_text() == "user prism"


def test_bad_launches_fail_before_starting_anything(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"`--ranks` \[4\] must be ranks of a world of 4"):
        launch(["python"], world_size=4, ranks=[4])
    with pytest.raises(UsageError, match="`--db` and `--run` go together"):
        launch(["python"], world_size=4, ranks=[0], db=tmp_path / "x.duckdb")


@pytest.mark.slow
def test_datasets_rank_under_recorded_peers(tmp_path: Path, sample_template: Path) -> None:
    """Rank 0 of the bundled tp2 x dp2 x pp2 job, the other 7 ranks virtual, timed by the run."""
    from prism_trace.store.connection import open_store
    from tests.conftest import db_contents, sample_copy

    db = tmp_path / "s.duckdb"
    sample_copy(sample_template, db).close()
    before = db_contents(db)
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_run_accuracy.py"), "rank"]
    cmd += ["--config", str(SAMPLE / "run.json"), "--out", str(out)]
    res = launch(cmd, world_size=8, ranks=[0], db=db, run="sample", capture=True, timeout_s=240)
    # The schedules' emulation wrote nothing (not even a graph): only --out-run writes, once.
    assert db_contents(db) == before
    rep = res.ranks[0].report or {}
    assert res.returncode == 0, rep.get("log", "")[-2000:]
    # Every recorded call of rank 0 (2 steps) was matched; the warm-up step and the final
    # barrier are outside the recording.
    assert rep["scheduled_calls"] == res.schedule_calls[0] == 50
    assert rep["anchored_by"] == "step mark"
    assert rep["waited_ms"] > 0
    steps = json.loads((out / "rank0.steps.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["dur_ns"] > 0 for s in steps)
    # The backend's own steps (from a profiler step opening to the next one being entered) are
    # the script's: each holds the script's `train_step` of that number, and not two of them.
    assert set(rep["step_ns"]) == {"0", "1", "2"}
    shortest = min(s["dur_ns"] for s in steps)
    for s in steps:
        start, end = rep["step_ns"][str(s["step"])]
        assert s["dur_ns"] <= end - start < s["dur_ns"] + shortest
    assert (out / "rank0.kineto.json.gz").exists()

    # Stored as a replayed run, `prism validate --replayed` compares it with the recording.
    from prism_trace.replay.pg.launched_run import write_launched_run
    from prism_trace.replay.validate.replayed import validate_replayed

    with open_store(db) as store:
        write_launched_run(store, run="sample", out_run="launched", result=res, command=cmd)
        v = validate_replayed(store, replayed="launched")
        rows = store.con.sql(
            "SELECT i.iteration, i.dur, r.ts AS rec_ts, i.ts FROM iteration i"
            " JOIN iteration r ON r.rank = i.rank AND r.iteration = i.iteration"
            " AND r.run_id = (SELECT run_id FROM run WHERE name = 'sample')"
            " WHERE i.run_id = (SELECT run_id FROM run WHERE name = 'launched') ORDER BY 1"
        ).fetchall()
        with pytest.raises(DuplicateRunError, match="already exists"):
            write_launched_run(store, run="sample", out_run="launched", result=res, command=cmd)
    assert v.ranks == [0]
    # Recorded steps 1 and 2 (step 0 is the generator's unprofiled warm-up, not in the trace).
    assert [e.iteration for e in v.iterations] == [1, 2]
    for e in v.iterations:
        assert e.emulated_ns == pytest.approx(rep["step_ms"][str(e.iteration)] * 1e6, rel=1e-6)
    assert [r[0] for r in rows] == [1, 2]
    assert rows[0][3] == rows[0][2]  # step 1 laid on its recorded start
    # the steps as the backend measured them, on the recording's clock: step 2 starts as step 1
    # ends (after the profiler's own step between them)
    (start1, end1), (start2, _) = rep["step_ns"]["1"], rep["step_ns"]["2"]
    assert rows[0][1] == end1 - start1
    assert rows[1][3] - rows[0][3] == start2 - start1
    assert rows[0][3] + rows[0][1] <= rows[1][3]


def test_out_run_needs_the_run_it_replays() -> None:
    from click.testing import CliRunner

    from prism_trace.cli import main

    out = CliRunner().invoke(
        main, ["run", "--world", "2", "--out-run", "x", "--", sys.executable, "-c", "pass"]
    )
    assert out.exit_code == 1
    assert "--out-run needs --db and --run" in out.output

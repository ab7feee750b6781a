"""scripts/gpu-check (issue 35): every step of the GPU check runs on CPU, as CI runs it; the
generator's device option keeps a CPU job's config as it was and refuses CUDA without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "scripts" / "gpu-check"
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_check import tree_hash  # noqa: E402
from prism_trace.datasets._config import LATER_FIELDS, JobConfig  # noqa: E402

STEPS = ("record", "replay", "run", "run_zero", "overhead")


@pytest.mark.slow
def test_every_step_runs_on_cpu(tmp_path: Path) -> None:
    """``scripts/gpu-check --device cpu --quick`` exits 0, every step ``ok`` with its figures."""
    p = subprocess.run(
        [str(CHECK), "--device", "cpu", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    (result,) = tmp_path.glob("gpu-check_*.json")
    doc = json.loads(result.read_text())
    status = {k: (s["status"], s["error"]) for k, s in doc["steps"].items()}
    assert status == {k: ("ok", None) for k in STEPS}
    assert "| figure | value | goal | met | detail |" in result.with_suffix(".md").read_text()
    assert all(t["figure"] is not None for t in doc["targets"]), doc["targets"]
    rp = doc["steps"]["replay"]
    # rank 0 of the 2-rank recording, its peer virtual, every op rebuilt
    assert (rp["replayed_run"], rp["virtual_peers"]) == ("rec2", 1)
    assert rp["supported_ops"] == rp["compute_ops"] > 0
    assert rp["op_start_ops"] > 0
    # The figures' values are the results file's to report (a shared host's timings move, and
    # the CPU replay's peak moved by 8 to 504 B between runs here); that each is measured is the
    # test's.
    assert rp["peak_memory_recorded"] > 0
    run = doc["steps"]["run"]
    assert run["repeats"][0]["unscheduled_calls"] > 0  # the dp all-reduces met the fake group
    assert run["memory_run"][0] > 0
    assert [s["record"]["ops"] for s in doc["steps"]["overhead"]["sets"]] == [50, 4]
    zero = doc["steps"]["run_zero"]
    assert zero["recorded"] > 0
    assert zero["prism_run"] > 0


def test_a_subset_of_steps_runs_into_a_file_of_its_own(tmp_path: Path) -> None:
    """``--steps`` reruns only what a fix touched (a lent GPU's minutes are few); a step name
    it does not know is a usage error."""
    p = subprocess.run(
        [str(CHECK), "--device", "cpu", "--quick", "--steps", "nope", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 2
    assert "--steps: choose from record,replay,run,run_zero,overhead" in p.stderr
    assert not list(tmp_path.glob("gpu-check_*"))


def test_no_cuda_is_one_line_and_a_failure(tmp_path: Path) -> None:
    """``--device cuda`` where torch has no GPU: exit 1, one line, nothing measured."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = subprocess.run(
        [str(CHECK), "--device", "cuda", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 1
    assert p.stderr.strip() == "gpu-check: --device cuda: no CUDA device is available to this torch"
    assert not list(tmp_path.glob("gpu-check_*"))


def test_the_generator_refuses_cuda_without_a_gpu(tmp_path: Path) -> None:
    """The generator's ``--device cuda`` is refused before any rank starts, in one line."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    job = ["--dp", "1", "--tp", "1", "--pp", "1", "--out", str(tmp_path / "g")]
    p = subprocess.run(
        [sys.executable, "-m", "prism_trace.datasets.generate", "--device", "cuda", *job],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert p.returncode != 0
    assert "--device cuda: no CUDA device is available to this torch" in p.stderr
    assert not (tmp_path / "g").exists()


def test_a_cpu_job_config_is_what_it_was() -> None:
    """``LATER_FIELDS`` (``device``, ``dp_sync_always``, ``chunks``) appear in ``run.json``
    only when set, so a CPU job's config (and the ladder's cache key) is unchanged; every config
    reads back."""
    later = set(LATER_FIELDS)
    assert set(JobConfig().to_json()) == {f.name for f in fields(JobConfig)} - later
    cuda = JobConfig(device="cuda", dp=1, dp_sync_always=True)
    assert (cuda.to_json()["device"], cuda.to_json()["dp_sync_always"]) == ("cuda", True)
    assert JobConfig.from_json(cuda.to_json()) == cuda
    with pytest.raises(ValueError, match="--compute wait sleeps on the host"):
        JobConfig(device="cuda", compute="wait").check()


def test_the_tree_hash_follows_the_sources(tmp_path: Path) -> None:
    """The wheel's tree hash changes with any package source file, not with a cache file."""
    (tmp_path / "pyproject.toml").write_text("x")
    for d in ("prism_trace", "replay", "analysis", "datasets"):
        (tmp_path / d / "__pycache__").mkdir(parents=True)
        (tmp_path / d / "m.py").write_text("a = 1\n")
    before = tree_hash(tmp_path)
    (tmp_path / "replay" / "__pycache__" / "m.cpython-312.pyc").write_bytes(b"\0")
    assert tree_hash(tmp_path) == before
    (tmp_path / "replay" / "m.py").write_text("a = 2\n")
    assert tree_hash(tmp_path) != before

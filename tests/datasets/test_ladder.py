"""Recordings at several scales: 1F1B, ZeRO-1, wait mode, the ladder driver, and their ingest."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.datasets.test_generate import _load, _parse, check_dataset

pytestmark = [pytest.mark.slow, pytest.mark.torch]

PRISM = Path(sys.executable).with_name("prism")


def _compute_order(kineto: Path) -> str:
    """``fwd0 bwd0 ...``: the micro-batches of a wait-mode rank's forward and backward ops in
    time order (each ``prism::*_fwd``/``*_bwd`` call carries its micro-batch as an input)."""
    events = [
        e
        for e in _load(kineto)["traceEvents"]
        if e.get("ph") == "X" and str(e["name"]).startswith("prism::") and "_" in e["name"]
    ]
    events.sort(key=lambda e: e["ts"])
    steps = sorted(
        (e for e in _load(kineto)["traceEvents"] if str(e["name"]).startswith("ProfilerStep#")),
        key=lambda e: e["ts"],
    )
    first = steps[0]
    out: list[str] = []
    for e in events:
        if not first["ts"] <= e["ts"] <= first["ts"] + first["dur"]:
            continue
        kind = "fwd" if e["name"].endswith("_fwd") else "bwd" if e["name"].endswith("_bwd") else ""
        if not kind:
            continue
        item = f"{kind}{int(e['args']['Concrete Inputs'][3])}"
        if not out or out[-1] != item:
            out.append(item)
    return " ".join(out)


def _expected(kind: str, stage: int, stages: int, mbs: int) -> str:
    from prism_trace.datasets._schedule import schedule

    plan = schedule(kind, stage=stage, stages=stages, microbatches=mbs)  # type: ignore[arg-type]
    return " ".join(str(a) for a in plan if a.kind in ("fwd", "bwd"))


def _comms(kineto: Path) -> list[dict[str, Any]]:
    events = sorted(
        (e for e in _load(kineto)["traceEvents"] if str(e["name"]).startswith("prism_comm")),
        key=lambda e: e["ts"],
    )
    return [_parse(e["name"]) for e in events]


def _prism(*args: str | Path) -> str:
    res = subprocess.run(
        [str(PRISM), *map(str, args)], capture_output=True, text=True, check=False, timeout=300
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_wait_ladder_records_caches_repeats_and_ingests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dp 2 and 4 at pp 2 in wait mode with 1F1B: every recording is a valid dataset with the
    schedule's order on each stage and a peak memory per rank; a second call finds them cached
    and adds a repeat (same draws); ``prism ingest`` and ``prism info`` read each one."""
    from prism_trace.datasets import ladder
    from prism_trace.datasets.generate import RECORDER_VERSION

    args = ["--out", str(tmp_path), "--pp", "2", "--compute", "wait", "--schedule", "1f1b"]
    args += ["--steps", "2", "--layers", "4", "--wait-ms-per-layer", "2", "--global-batch", "16"]
    ladder.main([*args, "--dp", "2,4"])
    lines = capsys.readouterr().out.strip().splitlines()
    names = ["tp1-dp2-pp2-1f1b-wait-gb16-s2", "tp1-dp4-pp2-1f1b-wait-gb16-s2"]
    assert [line.split()[0] for line in lines] == names
    assert all("recorded in" in line for line in lines)
    for name, dp in zip(names, (2, 4), strict=True):
        out = tmp_path / name
        check_dataset(out)
        run = json.loads((out / "run.json").read_text())
        assert (run["schedule"], run["compute"], run["global_batch"]) == ("1f1b", "wait", 16)
        mbs = 16 // (dp * 2)
        assert run["config"]["microbatches"] == mbs
        assert set(run["wait"]["base_ms"]) >= {"attn_fwd", "mlp_bwd", "optimizer_step"}
        for r in run["ranks"]:
            assert r["peak_allocated_bytes"] > 0
            assert r["max_rss_kb"] > 0
            stage = r["pp_rank"]
            order = _compute_order(out / f"rank{r['rank']}.kineto.json.gz")
            assert order == _expected("1f1b", stage, 2, mbs), (name, r["rank"])
    ladder.main([*args, "--dp", "2", "--repeat", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[0] == names[0]
    assert lines[0].endswith("(cached)")
    assert lines[1].split()[0] == names[0] + "-r1"
    assert "recorded in" in lines[1]
    # a recording an older recorder made is recorded again, not reused
    first = tmp_path / names[0] / "run.json"
    run = json.loads(first.read_text())
    assert run["recorder"] == RECORDER_VERSION
    first.write_text(json.dumps({**run, "recorder": RECORDER_VERSION - 1}))
    ladder.main([*args, "--dp", "2"])
    assert "recorded in" in capsys.readouterr().out
    assert json.loads(first.read_text())["recorder"] == RECORDER_VERSION
    # the world barrier that holds the writing of the traces until every rank has left its
    # profiled steps comes after the profiler's window: nothing of it is in them
    for r in range(4):
        names_in = {
            str(e.get("name"))
            for e in _load(tmp_path / names[0] / f"rank{r}.kineto.json.gz")["traceEvents"]
        }
        assert not any("barrier" in n for n in names_in), r

    def sleeps(folder: Path) -> list[str]:
        return [
            e["args"]["Concrete Inputs"][2]
            for e in _load(folder / "rank0.kineto.json.gz")["traceEvents"]
            if e.get("ph") == "X" and str(e["name"]).startswith("prism::")
        ]

    assert sleeps(tmp_path / names[0]) == sleeps(tmp_path / (names[0] + "-r1"))
    db = tmp_path / "x.duckdb"
    for name in [*names, names[0] + "-r1"]:
        _prism("ingest", tmp_path / name, "--db", db, "--run", name, "-q")
        info = _prism("info", db, "--run", name)
        world = 4 if "dp2" in name else 8
        assert f"{world} of {world} ranks" in info


def test_1f1b_pp4_order_and_memory(tmp_path: Path) -> None:
    """pp=4, 6 micro-batches, wait mode: each stage follows its schedule; 1F1B keeps fewer
    micro-batches' activations alive on the first stage than GPipe."""
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._model import ModelConfig
    from prism_trace.datasets.generate import generate

    peaks = {}
    for kind in ("gpipe", "1f1b"):
        cfg = JobConfig(
            dp=1,
            tp=1,
            pp=4,
            microbatches=6,
            steps=1,
            model=ModelConfig(layers=4),
            schedule=kind,  # type: ignore[arg-type]
            compute="wait",
            wait_ms_per_layer=2.0,
            et=False,
        )
        out = tmp_path / kind
        generate(out, cfg, join_timeout_s=300)
        run = json.loads((out / "run.json").read_text())
        for r in range(4):
            order = _compute_order(out / f"rank{r}.kineto.json.gz")
            assert order == _expected(kind, r, 4, 6), (kind, r)
        assert not list(out.glob("*.et.json.gz"))  # et=False
        peaks[kind] = run["ranks"][0]["peak_allocated_bytes"]
    assert peaks["1f1b"] < peaks["gpipe"]


def test_real_1f1b_with_tp_matches_gpipe(tmp_path: Path) -> None:
    """Real compute, tp=2 x pp=2 with 1F1B runs (no deadlock with TP calls in between), sends and
    receives in the schedule's order, and trains the same model as GPipe (same first loss)."""
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._schedule import schedule
    from prism_trace.datasets.generate import generate

    losses = {}
    for kind in ("gpipe", "1f1b"):
        cfg = JobConfig(dp=1, tp=2, pp=2, microbatches=3, steps=1, schedule=kind)  # type: ignore[arg-type]
        out = tmp_path / kind
        generate(out, cfg, join_timeout_s=300)
        check_dataset(out)
        run = json.loads((out / "run.json").read_text())
        losses[kind] = [s["loss"] for s in run["ranks"][2]["steps"]]
        for rank, stage in ((0, 0), (2, 1)):
            p2p = [f"{c['op']}" for c in _comms(out / f"rank{rank}.kineto.json.gz")]
            p2p = [op for op in p2p if op in ("send", "recv")]
            plan = schedule(kind, stage=stage, stages=2, microbatches=3)  # type: ignore[arg-type]
            calls = [a.kind for a in plan if a.kind not in ("fwd", "bwd")]
            assert p2p == [k.split("_")[0] for k in calls], (kind, rank)
    assert losses["1f1b"][0] == pytest.approx(losses["gpipe"][0], rel=1e-6)
    assert losses["1f1b"][1] == pytest.approx(losses["gpipe"][1], rel=1e-4)


def test_real_interleaved_trains_the_model_1f1b_trains(tmp_path: Path) -> None:
    """Real compute, interleaved 1F1B (pp 2, 2 chunks a stage: virtual stages 0 and 2 on stage 0,
    1 and 3 on stage 1, one layer each) computes the same layers in the same order as 1F1B with 2
    layers a stage: the same losses, step for step, to the bit; and each stage's send/recv are the
    interleaved schedule's."""
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._interleaved import stage_plan
    from prism_trace.datasets._model import ModelConfig
    from prism_trace.datasets.generate import generate

    losses = {}
    for kind, chunks in (("1f1b", 1), ("interleaved", 2)):
        cfg = JobConfig(
            dp=1, tp=1, pp=2, microbatches=4, steps=2, schedule=kind, chunks=chunks,  # type: ignore[arg-type]
            model=ModelConfig(layers=4),
        )  # fmt: skip
        out = tmp_path / kind
        generate(out, cfg, join_timeout_s=300)
        check_dataset(out)
        run = json.loads((out / "run.json").read_text())
        losses[kind] = [s["loss"] for s in run["ranks"][1]["steps"]]
        for stage in (0, 1):
            p2p = [c["op"] for c in _comms(out / f"rank{stage}.kineto.json.gz")]
            p2p = [op for op in p2p if op in ("send", "recv")]
            plan = stage_plan(kind, stage=stage, stages=2, microbatches=4, chunks=chunks)  # type: ignore[arg-type]
            calls = [a.kind.split("_")[0] for a in plan if a.kind not in ("fwd", "bwd")]
            assert p2p == calls * cfg.steps, (kind, stage)  # the profiled steps
    assert losses["interleaved"] == losses["1f1b"]
    assert len(set(losses["1f1b"])) == 3  # it trains: every step's loss differs


def test_zero1_trains_like_adam_and_shards_scale_as_one_over_dp(tmp_path: Path) -> None:
    """Real ZeRO-1 at dp=2 gives the losses of plain DP Adam, through annotated reduce_scatter
    and all_gather calls whose shard is half the bucket; wait-mode ZeRO-1 at dp=4 sends the same
    buckets with shards and optimizer state a quarter."""
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets.generate import generate

    base = JobConfig(dp=2, tp=1, pp=1, microbatches=2, steps=2)
    runs: dict[str, dict[str, Any]] = {}
    for name, cfg in (
        ("plain", base),
        ("zero", replace(base, zero=1)),
        ("wait4", replace(base, zero=1, dp=4, compute="wait")),
    ):
        generate(tmp_path / name, cfg, join_timeout_s=300)
        check_dataset(tmp_path / name)
        runs[name] = json.loads((tmp_path / name / "run.json").read_text())
    plain = [s["loss"] for s in runs["plain"]["ranks"][0]["steps"]]
    zero = [s["loss"] for s in runs["zero"]["ranks"][0]["steps"]]
    assert zero == pytest.approx(plain, rel=1e-5)

    def dp_calls(name: str) -> dict[str, list[tuple[int, int]]]:
        calls: dict[str, list[tuple[int, int]]] = {}
        for c in _comms(tmp_path / name / "rank0.kineto.json.gz"):
            if c["desc"] == "dp":
                calls.setdefault(c["op"], []).append((c["in_bytes"], c["out_bytes"]))
        return calls

    assert set(dp_calls("plain")) == {"all_reduce"}
    z2, z4 = dp_calls("zero"), dp_calls("wait4")
    assert set(z2) == set(z4) == {"reduce_scatter", "all_gather"}
    # One per bucket and step, as plain DP's all-reduces.
    assert (
        len(z2["reduce_scatter"])
        == len(z4["reduce_scatter"])
        == len(dp_calls("plain")["all_reduce"])
    )
    for (in2, out2), (in4, out4) in zip(z2["reduce_scatter"], z4["reduce_scatter"], strict=True):
        assert in2 == 2 * out2
        assert in4 == 4 * out4
        assert abs(in2 - in4) < 4 * 4  # the same bucket, padded to dp elements
    for (in2, out2), (in4, out4) in zip(z2["all_gather"], z4["all_gather"], strict=True):
        assert out2 == 2 * in2
        assert out4 == 4 * in4
    state2 = runs["zero"]["ranks"][0]["state_bytes"]["optimizer_state"]
    state4 = runs["wait4"]["ranks"][0]["state_bytes"]["optimizer_state"]
    assert state4 == pytest.approx(state2 / 2, rel=0.01)


def test_the_summary_says_how_long_the_last_step_ran() -> None:
    """The last profiled step against the median of the steps between the first and the last:
    a finished rank working while the others are still in their last step shows here."""
    from prism_trace.datasets.ladder import _last_step_pct

    def rank(durs: list[int]) -> dict[str, object]:
        return {"steps": [{"dur_ns": 0, "profiled": False}] + [{"dur_ns": d} for d in durs]}

    ranks = [rank([500, 100, 100, 102, 118]), rank([500, 100, 100, 98, 118])]
    assert _last_step_pct(ranks) == pytest.approx(18.0)
    assert _last_step_pct([rank([100, 100])]) != _last_step_pct([rank([100, 100])])  # nan

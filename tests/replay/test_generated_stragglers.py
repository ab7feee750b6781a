"""Waiting is produced, not stored: no-stragglers / no-launch-delay what-ifs and the slowdown,
on hand-written op timelines whose every time is worked out in the comments, and on ST."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.driver import emulate_in_memory
from prism_trace.replay.emulate.slowdown import slowdown
from prism_trace.replay.whatif.config import WhatIfConfig, parse_what_if

from prism_trace.errors import PrismError
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store

# Slow: records straggler jobs with torch processes; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

MS = 1_000_000  # ns

Row = tuple[int, int, int, str, float, float]  # dp_rank, stage, step, optype, start ms, dur ms


def _store(tmp_path: Path, rows: list[Row], *, dp: int, pp: int) -> Store:
    """Write ``rows`` as an op-timeline parquet (rank = stage * dp + dp_rank) and ingest it."""
    folder = tmp_path / "tl"
    folder.mkdir()
    df = pl.DataFrame(
        [
            {
                "dp_rank": d,
                "stage": s,
                "rank": s * dp + d,
                "step": step,
                "optype": op,
                "start_ts": start / 1000,
                "duration": dur / 1000,
                "seq_id": 0,
                "mc": 0 if op.endswith(("compute", "gather", "scatter")) else -1,
                "mb_id": 0,
                "gmc": -1,
            }
            for d, s, step, op, start, dur in rows
        ]
    )
    df.write_parquet(folder / "trace-T.parquet")
    (folder / "meta-T.yaml").write_text(
        f"dp_size: {dp}\npp_size: {pp}\ntp_size: 1\nworld_size: {dp * pp}\n"
    )
    store = open_store(tmp_path / "t.duckdb")
    ingest(store, [folder], run="t", progress=False)
    return store


def _steps(store: Store, **what_if: bool) -> list[float]:
    """Emulated step times (ms) per step, ``what_if`` flags of ``WhatIfConfig``."""
    cfg = EmulationConfig(what_if=WhatIfConfig(**what_if))
    _, iters = emulate_in_memory(store, run="t", config=cfg)
    per = iters.group_by("iteration").agg(pl.col("dur").max()).sort("iteration")
    return [round(d / MS, 3) for d in per["dur"].to_list()]


def _pipeline(slow: float) -> list[Row]:
    """pp = 2, one microbatch, two steps; stage 1 computes ``slow`` x in step 2.

    Step 1 (ms): rank 0 F [0,10], f-send [10,11]; rank 1 f-recv [0,11], F [11,21], B [21,41],
    b-send [41,42]; rank 0 b-recv [11,42], then 5 ms of CPU time (an own delay), B [47,67];
    clip (world all-reduce, transfer 1): rank 1 [42,68], rank 0 [67,68]; optimizer [68,78].
    Step 2 the same with rank 1's F = 10 slow, B = 20 slow and no CPU gap.
    """
    rows: list[Row] = []
    for step, k, gap in ((1, 1.0, 5.0), (2, slow, 0.0)):
        f1, b1 = 10 * k, 20 * k
        b_send = 11 + f1 + b1  # rank 1's backward-send starts here
        b0 = b_send + 1 + gap
        clip = b0 + 20
        rows += [
            (0, 0, step, "forward-compute", 0, 10),
            (0, 0, step, "forward-send", 10, 1),
            (0, 1, step, "forward-recv", 0, 11),
            (0, 1, step, "forward-compute", 11, f1),
            (0, 1, step, "backward-compute", 11 + f1, b1),
            (0, 1, step, "backward-send", b_send, 1),
            (0, 0, step, "backward-recv", 11, b_send + 1 - 11),
            (0, 0, step, "backward-compute", b0, 20),
            (0, 1, step, "optimizer-clip-main-grad", b_send + 1, clip + 1 - (b_send + 1)),
            (0, 0, step, "optimizer-clip-main-grad", clip, 1),
            (0, 0, step, "optimizer", clip + 1, 10),
            (0, 1, step, "optimizer", clip + 1, 10),
        ]
    return rows


def test_two_stage_pipeline_with_a_slow_stage(tmp_path: Path) -> None:
    store = _store(tmp_path, _pipeline(3.0), dp=1, pp=2)
    # Replay: exact. Step 1 = 78 ms; step 2: F1 = 30, B1 = 60 -> b-send at 101, B0 [102,122],
    # clip ends 123, optimizer 133.
    assert _steps(store) == [78.0, 133.0]
    # No own delay: step 1 loses its 5 ms CPU gap; step 2 had none.
    assert _steps(store, no_launch_delay=True) == [73.0, 133.0]
    # No stragglers: F = mean(10, 10, 10, 30) = 15, B = mean(20, 20, 20, 60) = 30, transfers 1;
    # own time before a computation stays (step 1's 5 ms before B0), communication is posted at
    # once: F0 15 + 1 + F1 15 + B1 30 + 1 + 5 + B0 30 + clip 1 + optimizer 10 = 108, then 103.
    assert _steps(store, no_stragglers=True) == [108.0, 103.0]
    out = slowdown(store, "t", by="stage")
    s = dict(zip(out["group"].to_list(), out["slowdown"].to_list(), strict=True))
    # Slowdown: no-launch-delay over no-stragglers, mean(73, 133) / mean(108, 103). Stage 1 alone
    # recorded (stage 0 typical: F 15, B 30): 15 + 1 + 10 + 20 + 1 + 5 + 30 + 11 = 93 and, slow,
    # 15 + 1 + 30 + 60 + 1 + 30 + 11 = 148. Stage 0 alone recorded (F 10, B 20, stage 1
    # typical): 10 + 1 + 15 + 30 + 1 + 5 + 20 + 11 = 93, then 88: faster than typical.
    typical = (108 + 103) / 2
    assert s["all"] == pytest.approx((73 + 133) / 2 / typical, rel=1e-5)
    assert s["1"] == pytest.approx((93 + 148) / 2 / typical, rel=1e-5)
    assert s["0"] == pytest.approx((93 + 88) / 2 / typical, rel=1e-5)


def _dp_pair() -> list[Row]:
    """dp = 2, pp = 1, one step; replica 1 computes 3x slower.

    Both: params-all-gather [0,1] (transfer 1), F from 1, B after F; grads-reduce-scatter: rank 0
    arrives at 31, rank 1 at 91, transfer 2: both end 93 (rank 0 waited 60 ms); clip [93,94];
    optimizer [94,104].
    """
    rows: list[Row] = []
    for d, k in ((0, 1.0), (1, 3.0)):
        f, b = 10 * k, 20 * k
        rows += [
            (d, 0, 1, "params-all-gather", 0, 1),
            (d, 0, 1, "forward-compute", 1, f),
            (d, 0, 1, "backward-compute", 1 + f, b),
            (d, 0, 1, "grads-reduce-scatter", 1 + f + b, 93 - (1 + f + b)),
            (d, 0, 1, "optimizer-clip-main-grad", 93, 1),
            (d, 0, 1, "optimizer", 94, 10),
        ]
    return rows


def test_dp_pair_no_stragglers_removes_the_other_replicas_wait(tmp_path: Path) -> None:
    store = _store(tmp_path, _dp_pair(), dp=2, pp=1)
    assert _steps(store) == [104.0]
    # typical F = 20, B = 40; reduce-scatter's median transfer 2: 1 + 20 + 40 + 2 + 1 + 10 = 74
    assert _steps(store, no_stragglers=True) == [74.0]
    cfg = EmulationConfig(what_if=WhatIfConfig(no_stragglers=True))
    res, _ = emulate_in_memory(store, run="t", config=cfg)
    nodes = res.inputs.nodes.with_columns(
        pl.Series("s", res.timeline.start), pl.Series("e", res.timeline.end)
    )
    rs = nodes.filter(pl.col("name") == "grads-reduce-scatter").sort("rank")
    # recorded: rank 0 spent 62 ms in it (60 waiting); emulated without stragglers: 2 each
    assert [round(d / MS, 3) for d in rs["dur"].to_list()] == [62.0, 2.0]
    assert [round(d / MS, 3) for d in (rs["e"] - rs["s"]).to_list()] == [2.0, 2.0]
    out = slowdown(store, "t", by="dp_rank")
    s = dict(zip(out["group"].to_list(), out["slowdown"].to_list(), strict=True))
    # the slow replica alone recorded: the recording (104); the fast one alone: the typical
    # replica is the slower one, so the step stays 74
    assert s["1"] == pytest.approx(104 / 74, rel=1e-5)
    assert s["0"] == pytest.approx(1.0, rel=1e-5)


def test_what_if_words_and_bad_by(tmp_path: Path) -> None:
    w = parse_what_if(["no-stragglers", "no-launch-delay"])
    assert w.no_stragglers
    assert w.no_launch_delay
    assert w.active
    store = _store(tmp_path, _dp_pair(), dp=2, pp=1)
    with pytest.raises(PrismError, match="slowdown --by must be one of"):
        slowdown(store, "t", by="layer")


def test_kineto_what_ifs_and_blocked_host_ops(sample_store: Store) -> None:
    """On a Kineto graph (the gloo sample): both what-ifs run and shorten the step; a host op whose
    end a ``sync`` edge holds recorded its wait, so it is left out of its name's typical time."""
    from prism_trace.replay.whatif.typical import typical_durations

    def mean_step(**what_if: bool) -> float:
        cfg = EmulationConfig(what_if=WhatIfConfig(**what_if))
        _, iters = emulate_in_memory(sample_store, run="sample", config=cfg)
        return float(iters["dur"].mean())  # type: ignore[arg-type]

    replay = mean_step()
    assert mean_step(no_launch_delay=True) < replay
    assert mean_step(no_stragglers=True) < replay
    names = pl.Series(["a", "a", "a", "b", "b"])
    dur = np.array([10, 20, 90, 40, 60])
    held = np.array([False, False, True, True, True])
    # "a": the two free ones (15); "b": every one blocked, the shortest (40)
    out = typical_durations(names, dur, np.ones(5, dtype=bool), held)
    assert out.tolist() == [15, 15, 15, 40, 40]
    keep = np.array([True, False, True, False, True])
    assert typical_durations(names, dur, keep, held).tolist() == [15, 20, 15, 40, 40]


@pytest.mark.shared_data
def test_st_matches_straggler_analysis(shared_datasets: Path, tmp_path: Path) -> None:
    """The issue's targets on the shared ST trace: what-if steps within 2 %, slowdown within
    0.02 of StragglerAnalysis's own result-ST.json."""
    st = shared_datasets / "megatron-straggler-st-8rank"
    want = json.loads((st / "result-ST.json").read_text())
    store = open_store(tmp_path / "st.duckdb")
    ingest(store, [st], run="t", progress=False)
    for flag, key in (("no_stragglers", "step_t_noblk"), ("no_launch_delay", "step_t_nodelay")):
        cfg = EmulationConfig(what_if=WhatIfConfig(**{flag: True}))
        _, iters = emulate_in_memory(store, run="t", config=cfg)
        got = dict(iters.group_by("iteration").agg(pl.col("dur").max()).iter_rows())
        errs = [abs(got[int(s)] / 1e9 / v - 1) for s, v in want[key].items()]
        assert len(errs) == len(want[key])
        assert sum(errs) / len(errs) < 0.02, flag
    for by in ("optype", "stage", "dp_rank"):
        out = slowdown(store, "t", by=by).filter(pl.col("by") == by)
        got = dict(zip(out["group"].to_list(), out["slowdown"].to_list(), strict=True))
        ref = want[f"blocking_decompose_by_{by}"]
        assert set(got) == set(ref), by
        assert all(abs(got[g] - v) <= 0.02 for g, v in ref.items()), (by, got, ref)


@pytest.mark.torch
@pytest.mark.slow
def test_generated_straggler_pair(tmp_path: Path) -> None:
    """Record one small gloo job (dp 2) three times: clean, with rank 1 sleeping S = 0.4 s per
    step in its forward, and with every rank sleeping S / 2 (``all@0.2``). ``no-stragglers`` on
    the straggler recording takes the mean ``prism::straggle`` over the 2 ranks, so it predicts
    the uniform job, and it removes the half of the straggler's excess that the mean does not
    keep. The tolerances hold on a quiet 2-core host (2 ranks, one core each; it passed twice at
    load 4 and 10); with other load the recordings of one job lie 9-90 % apart, so a failed
    comparison is recorded once more before it counts (``benchmarks/bench_stragglers.py --source
    generated`` measures with repeats)."""
    pytest.importorskip("torch")
    from prism_trace.datasets._config import ALL_RANKS, JobConfig
    from prism_trace.datasets.generate import generate

    def measure(root: Path) -> Store:
        """Record the three jobs under ``root`` and check the prediction against them."""
        root.mkdir()
        store = open_store(root / "g.duckdb")
        cfg = JobConfig(dp=2, tp=1, pp=1, microbatches=2, steps=2)
        runs = {"clean": (1, 0.0), "slow": (1, 0.4), "uniform": (ALL_RANKS, 0.2)}
        for name, (who, secs) in runs.items():
            generate(root / name, replace(cfg, straggler_rank=who, straggler_s=secs))
            ingest(store, [root / name], run=name, progress=False)
        naps = dict(
            store.con.execute(
                "SELECT e.rank, avg(e.dur) FROM event e JOIN run r USING (run_id)"
                " WHERE r.name = 'slow' AND e.name = 'prism::straggle' GROUP BY e.rank"
            ).fetchall()
        )
        assert naps[1] >= 0.19e9  # 0.4 s over 2 micro-batches, inside the profiled op
        assert naps[0] < 5e6

        def recorded(run: str) -> float:
            ((t,),) = store.con.execute(
                "SELECT avg(dur) FROM iteration JOIN run USING (run_id) WHERE run.name = ?", [run]
            ).fetchall()
            return float(t) / 1e9

        clean, slow, uniform = recorded("clean"), recorded("slow"), recorded("uniform")
        assert slow > clean + 0.2
        cfg_ns = EmulationConfig(what_if=WhatIfConfig(no_stragglers=True))
        _, iters = emulate_in_memory(store, run="slow", config=cfg_ns)
        predicted = float(iters["dur"].mean()) / 1e9  # type: ignore[arg-type]
        # the mean keeps S / N = 0.2 s of the 0.4 s excess: half of it is removed (0.5 +- noise)
        removed = (slow - predicted) / (slow - clean)
        assert 0.3 <= removed <= 0.8, (clean, slow, predicted)
        assert predicted == pytest.approx(uniform, rel=0.25), (clean, slow, uniform, predicted)
        return store

    # Timing on a shared host: a failed comparison is measured once more (three new
    # recordings) before it counts; a wrong prediction fails both times.
    try:
        store = measure(tmp_path / "first")
    except AssertionError:
        store = measure(tmp_path / "again")
    # The analyses name the injected straggler: first in the skew ranking and on the critical
    # path (issue-20's check on a recording with a known straggler).
    from prism_trace.analysis.critical_path import critical_path_shares
    from prism_trace.analysis.stragglers import skew

    from prism_trace.graph.build import build_graph

    build_graph(store, "slow")
    assert skew(store, "slow")["rank"][0] == 1
    on_path = critical_path_shares(store, "slow", by="rank").sort("path_ns", descending=True)
    assert on_path["rank"][0] == 1

"""Pipeline schedules, batch arithmetic, ZeRO-1 shard sizes and wait-mode draws: no processes."""

from __future__ import annotations

import statistics

import pytest
from prism_trace.datasets._grads import plan_buckets
from prism_trace.datasets._schedule import (
    SCHEDULES,
    Action,
    check_deadlock_free,
    schedule,
)


def _plan(kind: str, stage: int, stages: int, mbs: int) -> str:
    return " ".join(str(a) for a in schedule(kind, stage=stage, stages=stages, microbatches=mbs))  # type: ignore[arg-type]


def _compute(kind: str, stage: int, stages: int, mbs: int) -> str:
    return " ".join(
        str(a)
        for a in schedule(kind, stage=stage, stages=stages, microbatches=mbs)  # type: ignore[arg-type]
        if a.kind in ("fwd", "bwd")
    )


def test_1f1b_order_per_stage() -> None:
    """Megatron's non-interleaved 1F1B: pp - stage - 1 warm-up forwards, 1F1B pairs, cool-down."""
    assert _compute("1f1b", 0, 2, 4) == "fwd0 fwd1 bwd0 fwd2 bwd1 fwd3 bwd2 bwd3"
    assert _compute("1f1b", 1, 2, 4) == "fwd0 bwd0 fwd1 bwd1 fwd2 bwd2 fwd3 bwd3"
    assert _compute("1f1b", 0, 4, 6) == (
        "fwd0 fwd1 fwd2 fwd3 bwd0 fwd4 bwd1 fwd5 bwd2 bwd3 bwd4 bwd5"
    )
    assert (
        _compute("1f1b", 2, 4, 6) == "fwd0 fwd1 bwd0 fwd2 bwd1 fwd3 bwd2 fwd4 bwd3 fwd5 bwd4 bwd5"
    )
    # Warm-up capped by the micro-batches: all forwards, then all backwards.
    assert _compute("1f1b", 0, 4, 2) == "fwd0 fwd1 bwd0 bwd1"
    assert _compute("gpipe", 1, 2, 3) == "fwd0 fwd1 fwd2 bwd2 bwd1 bwd0"


def test_1f1b_exchanges_ordered_by_stage_parity() -> None:
    """A send/recv pair with one neighbour: even stages send first, odd stages receive first."""
    even = _plan("1f1b", 0, 2, 3)
    odd = _plan("1f1b", 1, 2, 3)
    assert even == (
        "fwd0 send_fwd0 fwd1 send_fwd1 recv_bwd0 bwd0 fwd2 send_fwd2 recv_bwd1 bwd1 recv_bwd2 bwd2"
    )
    assert odd == (
        "recv_fwd0 fwd0 bwd0 recv_fwd1 send_bwd0 fwd1 bwd1 recv_fwd2 send_bwd1 fwd2 bwd2 send_bwd2"
    )


@pytest.mark.parametrize("kind", [k for k in SCHEDULES if k != "interleaved"])
def test_schedules_are_deadlock_free(kind: str) -> None:
    for stages in range(1, 9):
        for mbs in range(1, 13):
            plans = [
                schedule(kind, stage=s, stages=stages, microbatches=mbs)  # type: ignore[arg-type]
                for s in range(stages)
            ]
            check_deadlock_free(plans)
            for plan in plans:
                assert sorted(str(a) for a in plan if a.kind == "fwd") == sorted(
                    f"fwd{m}" for m in range(mbs)
                )


def test_naive_1f1b_deadlocks() -> None:
    """Both neighbours sending first (Megatron's pairs as two blocking calls, no parity)."""
    s0 = [Action("fwd", 0), Action("send_fwd", 0), Action("fwd", 1)]
    s0 += [Action("send_fwd", 1), Action("recv_bwd", 0)]
    s1 = [Action("recv_fwd", 0), Action("fwd", 0), Action("bwd", 0)]
    s1 += [Action("send_bwd", 0), Action("recv_fwd", 1)]
    with pytest.raises(ValueError, match="deadlocks"):
        check_deadlock_free([s0, s1])


def test_schedule_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule("zigzag", stage=0, stages=2, microbatches=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no schedule"):
        schedule("1f1b", stage=2, stages=2, microbatches=2)
    with pytest.raises(ValueError, match="one model chunk a stage"):
        schedule("1f1b", stage=0, stages=2, microbatches=2, chunks=2)
    # The interleaved plan of one stage is its row of the whole pipeline's.
    from prism_trace.datasets._interleaved import interleaved_plans, stage_plan

    with pytest.raises(ValueError, match="whole pipeline"):
        schedule("interleaved", stage=1, stages=2, microbatches=4, chunks=2)
    got = stage_plan("interleaved", stage=1, stages=2, microbatches=4, chunks=2)
    assert got == interleaved_plans(2, 4, 2)[1]
    assert stage_plan("1f1b", stage=1, stages=2, microbatches=4) == schedule(
        "1f1b", stage=1, stages=2, microbatches=4
    )


def test_zero_shards_scale_as_one_over_dp() -> None:
    numels = [4096, 64, 16384, 64, 64, 64] * 3
    base = plan_buckets(numels, element_size=4, bucket_bytes=64 * 1024, dp=1)
    for dp in (2, 4, 8, 16):
        buckets = plan_buckets(numels, element_size=4, bucket_bytes=64 * 1024, dp=dp)
        assert [b.params for b in buckets] == [b.params for b in base]  # same buckets
        for b in buckets:
            assert b.padded == b.chunk * dp
            assert b.numel <= b.padded < b.numel + dp
        assert sum(b.chunk for b in buckets) == pytest.approx(sum(numels) / dp, abs=len(buckets))
    # The real job's rule: a bucket closes once it holds bucket_bytes (and at the end).
    assert [i for b in base for i in b.params] == list(range(len(numels)))
    for b in base[:-1]:
        assert b.numel * 4 >= 64 * 1024 > (b.numel - numels[b.params[-1]]) * 4


def _parse(*args: str) -> object:
    pytest.importorskip("torch")
    from prism_trace.datasets.generate import _parse as parse

    return parse(["--out", "x", *args])[1]


@pytest.mark.torch
def test_global_batch_microbatches(capsys: pytest.CaptureFixture[str]) -> None:
    from prism_trace.datasets._config import JobConfig, microbatches_for

    assert microbatches_for(64, dp=4, microbatch_size=2) == 8
    assert microbatches_for(64, dp=16, microbatch_size=2) == 2
    cfg = _parse("--dp", "4", "--tp", "1", "--pp", "2", "--global-batch", "64")
    assert isinstance(cfg, JobConfig)
    assert (cfg.microbatches, cfg.global_batch) == (8, 64)
    cfg = _parse("--dp", "2", "--tp", "1", "--pp", "2", "--microbatches", "3")
    assert isinstance(cfg, JobConfig)
    assert (cfg.microbatches, cfg.global_batch) == (3, 0)  # per rank, as before
    for bad in ("10", "0", "2"):
        with pytest.raises(SystemExit):
            _parse("--dp", "4", "--tp", "1", "--pp", "1", "--global-batch", bad)
        err = capsys.readouterr().err.strip().splitlines()
        assert "global batch" in err[-1]
        assert "dp x microbatch-size = 4 x 2 = 8" in err[-1]
    with pytest.raises(ValueError, match="means 8 micro-batches per rank, not 4"):
        JobConfig(dp=4, tp=1, pp=1, global_batch=64).check()


@pytest.mark.torch
def test_wait_options_and_straggler_factor() -> None:
    from prism_trace.datasets._config import JobConfig

    cfg = _parse("--compute", "wait", "--straggler", "3@x2.5", "--zero", "1", "--no-et")
    assert isinstance(cfg, JobConfig)
    assert (cfg.straggler_rank, cfg.straggler_s, cfg.straggler_factor) == (3, 0.0, 2.5)
    assert (cfg.zero, cfg.et, cfg.compute) == (1, False, "wait")
    for bad in (["--straggler", "1@x2"], ["--compute", "wait", "--straggler", "1@x0"]):
        with pytest.raises(SystemExit):
            _parse(*bad)  # a factor needs wait mode; and must be positive
    assert JobConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.torch
def test_wait_draws_are_reproducible() -> None:
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._durations import Durations, base_ms

    cfg = JobConfig(compute="wait", wait_ms_per_layer=10.0, wait_cv=0.05, rank_jitter=0.02)
    a, b = Durations(cfg, 3), Durations(cfg, 3)
    calls = [(op, s, m, layer) for op in ("attn_fwd", "mlp_bwd") for s in range(3) for m in range(4)
             for layer in range(2)]  # fmt: skip
    first = [a.seconds(op, step=s, mb=m, layer=lay) for op, s, m, lay in calls]
    # Same draws whatever the order of the calls, and from a fresh object.
    assert [b.seconds(op, step=s, mb=m, layer=lay) for op, s, m, lay in reversed(calls)] == first[
        ::-1
    ]
    assert len(set(first)) == len(first)  # every call its own draw
    other_rank = Durations(cfg, 4)
    assert other_rank.rank_factor != a.rank_factor
    assert other_rank.seconds("attn_fwd", step=0, mb=0, layer=0) != first[0]
    other_seed = Durations(JobConfig(compute="wait", seed=1), 3)
    assert other_seed.seconds("attn_fwd", step=0, mb=0, layer=0) != first[0]
    # The distribution: mean 1 noise with the configured CV around the base.
    base = base_ms(cfg)["attn_fwd"] / 1e3 * a.rank_factor
    draws = [
        a.seconds("attn_fwd", step=s, mb=m, layer=0) / base for s in range(50) for m in range(40)
    ]
    assert statistics.fmean(draws) == pytest.approx(1.0, abs=0.01)
    assert statistics.stdev(draws) == pytest.approx(0.05, rel=0.15)
    slow = Durations(JobConfig(compute="wait", straggler_rank=3, straggler_factor=2.0), 3)
    assert slow.seconds("attn_fwd", step=0, mb=0, layer=0) == pytest.approx(
        2 * Durations(JobConfig(compute="wait"), 3).seconds("attn_fwd", step=0, mb=0, layer=0)
    )
    assert (
        base_ms(JobConfig(compute="wait", tp=2))["attn_fwd"]
        == base_ms(JobConfig(compute="wait", tp=1))["attn_fwd"] / 2
    )


@pytest.mark.torch
def test_wait_param_shapes_match_the_real_model() -> None:
    from prism_trace.datasets._comm import Comm
    from prism_trace.datasets._model import (
        ModelConfig,
        Stage,
        TensorParallel,
        stage_param_shapes,
    )

    cfg = ModelConfig(layers=3)
    for tp in (1, 2, 4):
        for stages in (1, 2, 3):
            for s in range(stages):
                info = TensorParallel(rank=0, size=tp, group=None, comm=Comm())  # type: ignore[arg-type]
                stage = Stage(cfg, stage=s, stages=stages, tp=info)
                real = [tuple(p.shape) for p in stage.parameters()]
                assert real == stage_param_shapes(cfg, stage=s, stages=stages, tp=tp)


def test_interleaved_order_is_megatrons() -> None:
    """Megatron's forward_backward_pipelining_with_interleaving, pp 2, 2 chunks, 4 micro-batches:
    stage 0 warms up with (2 - 0 - 1) * 2 + (2 - 1) * 2 = 4 forwards, stage 1 with 2; backwards
    take the chunks in reverse."""
    from prism_trace.datasets._interleaved import virtual_order

    def order(stage: int) -> str:
        return " ".join(f"{k}{mb}c{c}" for k, mb, c in virtual_order(stage, 2, 4, 2))

    assert order(0) == (
        "fwd0c0 fwd1c0 fwd0c1 fwd1c1 fwd2c0 bwd0c1 fwd3c0 bwd1c1"
        " fwd2c1 bwd0c0 fwd3c1 bwd1c0 bwd2c1 bwd3c1 bwd2c0 bwd3c0"
    )
    assert order(1) == (
        "fwd0c0 fwd1c0 fwd0c1 bwd0c1 fwd1c1 bwd1c1 fwd2c0 bwd0c0"
        " fwd3c0 bwd1c0 fwd2c1 bwd2c1 fwd3c1 bwd3c1 bwd2c0 bwd3c0"
    )
    # As many micro-batches as stages: every forward first.
    assert [k for k, _, _ in virtual_order(0, 2, 2, 2)] == ["fwd"] * 4 + ["bwd"] * 4


def test_interleaved_blocking_calls_cannot_deadlock() -> None:
    """Blocking send/recv in the order the pipeline's run found, round the wrapped pipeline
    (the last stage's chunk c feeds the first stage's chunk c + 1): every stage computes each
    (micro-batch, chunk) forward and backward once, each receive before the compute that needs
    it, and the plans replay without deadlock (`check_deadlock_free` with the wrap)."""
    from prism_trace.datasets._interleaved import interleaved_plans

    for stages in range(2, 7):
        for chunks in range(2, 4):
            for mbs in range(stages, 3 * stages + 1, stages):
                plans = interleaved_plans(stages, mbs, chunks)
                check_deadlock_free(plans, chunks=chunks)
                units = sorted((m, c) for m in range(mbs) for c in range(chunks))
                for s, plan in enumerate(plans):
                    for kind in ("fwd", "bwd"):
                        assert sorted((a.mb, a.chunk) for a in plan if a.kind == kind) == units
                    seen: set[tuple[str, int, int]] = set()
                    for a in plan:
                        seen.add((a.kind, a.mb, a.chunk))
                        first = s == 0 and a.chunk == 0
                        last = s == stages - 1 and a.chunk == chunks - 1
                        if a.kind == "fwd" and not first:
                            assert ("recv_fwd", a.mb, a.chunk) in seen
                        if a.kind == "bwd" and not last:
                            assert ("recv_bwd", a.mb, a.chunk) in seen
    # The same calls made one compute at a time (each send right after its compute, each
    # receive right before) deadlock at the wrap: the batching is what makes them safe.
    naive = [
        [
            Action("fwd", 0, 0), Action("send_fwd", 0, 0), Action("recv_fwd", 0, 1),
            Action("fwd", 0, 1), Action("send_fwd", 0, 1),
        ],
        [
            Action("recv_fwd", 0, 0), Action("fwd", 0, 0), Action("recv_fwd", 0, 1),
            Action("send_fwd", 0, 0),
        ],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="deadlocks"):
        check_deadlock_free(naive, chunks=2)


def test_interleaved_refuses_what_megatron_refuses() -> None:
    from prism_trace.datasets._interleaved import interleaved_plans

    with pytest.raises(ValueError, match="multiple of the 2 stages"):
        interleaved_plans(2, 3, 2)
    with pytest.raises(ValueError, match="no interleaved schedule"):
        interleaved_plans(2, 4, 1)


def test_interleaved_jobs_megatron_cannot_run_are_refused() -> None:
    from prism_trace.datasets._config import JobConfig
    from prism_trace.datasets._model import ModelConfig

    def check(**kw: object) -> None:
        base: dict[str, object] = {"schedule": "interleaved", "chunks": 2, "pp": 2, "tp": 1}
        base["model"] = ModelConfig(layers=4)
        JobConfig(**{**base, "compute": "wait", **kw}).check()  # type: ignore[arg-type]

    check()
    with pytest.raises(ValueError, match="2 layers cannot fill 4 virtual stages"):
        check(model=ModelConfig(layers=2))
    with pytest.raises(ValueError, match="multiple of pp 2"):
        check(microbatches=3)
    with pytest.raises(ValueError, match="--chunks >= 2"):
        check(chunks=1)
    check(compute="real")  # the real model splits into the same virtual stages
    with pytest.raises(ValueError, match="needs --schedule interleaved"):
        JobConfig(schedule="1f1b", chunks=2, tp=1).check()

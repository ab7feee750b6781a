"""Hybrid replay (``replay.hybrid``) of rank 0 of the bundled sample, its stored run, validation."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from prism_trace.replay.hybrid.options import KernelReplayOptions  # noqa: E402
from prism_trace.replay.hybrid.replay import replay_run  # noqa: E402
from prism_trace.replay.peers import PeerSchedule  # noqa: E402
from prism_trace.replay.validate.replayed import validate_replayed  # noqa: E402

from prism_trace.errors import RunStateError, UsageError  # noqa: E402

# Slow: replays real kernels; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

FAST = KernelReplayOptions(iterations=1, warmup=0, threads=1)


@pytest.fixture(scope="module")
def replayed(sample_store: object) -> object:
    """Rank 0 replayed once, every other rank virtual."""
    return replay_run(sample_store, run="sample", ranks=[0], out_run="rp", options=FAST)  # type: ignore[arg-type]


def _rank0(store: object, out_run: str, options: KernelReplayOptions) -> Any:
    """Rank 0 of the sample replayed alone into ``out_run``."""
    return replay_run(store, run="sample", ranks=[0], out_run=out_run, options=options)  # type: ignore[arg-type]


def _q(store: object, sql: str) -> pl.DataFrame:
    return store.con.sql(sql).pl()  # type: ignore[attr-defined]


def test_stored_as_a_replayed_run(sample_store: object, replayed: object) -> None:
    run = _q(
        sample_store,
        "SELECT r.kind, p.name AS parent, r.config_json FROM run r"
        " JOIN run p ON p.run_id = r.parent_run_id WHERE r.name = 'rp'",
    )
    assert run["kind"][0] == "replayed"
    assert run["parent"][0] == "sample"
    cfg = json.loads(run["config_json"][0])
    assert cfg["ranks"] == [0]
    assert cfg["config"]["kernel_replay"]["iterations"] == 1
    # The stored config is the resolved one, and `prism replay --config` reads it back.
    import tempfile
    from pathlib import Path

    from prism_trace.replay.config_file import load_replay_config, to_toml
    from prism_trace.replay.emulate.config import EmulationConfig

    toml = Path(tempfile.mkdtemp()) / "rp.toml"
    toml.write_text(to_toml(cfg["config"]))
    assert load_replay_config(toml) == (FAST, EmulationConfig())
    rid = "(SELECT run_id FROM run WHERE name = 'rp')"
    ranks = _q(sample_store, f"SELECT rank, represented_by FROM rank WHERE run_id = {rid}")
    assert ranks.rows() == [(0, 0)]
    it = _q(sample_store, f"SELECT iteration, dur FROM iteration WHERE run_id = {rid} ORDER BY 1")
    assert it["iteration"].to_list() == [1, 2]
    assert (it["dur"] > 0).all()
    ev = _q(
        sample_store, f"SELECT category, count(*) AS n FROM event WHERE run_id = {rid} GROUP BY 1"
    )
    n = dict(ev.rows())
    assert sum(n.values()) == 1160  # 1110 compute ops + 50 communication calls
    # Collectives and p2p keep the recorded (group, seq), with the replay's host times.
    coll = _q(sample_store, f"SELECT group_id, seq, host_dur FROM collective WHERE run_id = {rid}")
    p2p = _q(sample_store, f"SELECT direction, peer FROM p2p WHERE run_id = {rid}")
    assert coll.height == 34
    assert p2p.height == 16
    assert (coll["host_dur"] >= 0).all()
    assert set(p2p["peer"].to_list()) == {4}
    mem = _q(sample_store, f"SELECT total_allocated, iteration FROM memory WHERE run_id = {rid}")
    assert mem.height > 100
    assert mem["total_allocated"].max() > 0
    assert set(mem["iteration"].to_list()) == {1, 2}  # each row in its replayed iteration
    assert replayed.ranks[0].support["supported_fraction"] == 1.0  # type: ignore[attr-defined]


def test_calls_wait_for_the_virtual_peers(sample_store: object, replayed: object) -> None:
    """Every communication call ends no earlier than the virtual peers allow: the peers' last
    arrival plus the transfer, counted from the replayed iteration's start."""
    sched = PeerSchedule.from_store(sample_store, run="sample", rank=0)  # type: ignore[arg-type]
    rid = "(SELECT run_id FROM run WHERE name = 'rp')"
    its = dict(_q(sample_store, f"SELECT iteration, ts FROM iteration WHERE run_id = {rid}").rows())
    comm = _q(
        sample_store,
        f"SELECT c.event_id, c.host_ts, c.host_dur, c.iteration, o.event_id AS src"
        f" FROM collective c JOIN et_op o ON o.node_id = c.event_id AND o.rank = 0"
        f" AND o.run_id = (SELECT run_id FROM run WHERE name = 'sample')"
        f" WHERE c.run_id = {rid}",
    )
    assert comm.height == 34
    for _, ts, dur, it, src in comm.rows():
        call = sched.by_event(src)
        assert call is not None
        end = ts + dur - its[it]
        assert end >= call.peers_arrival_ns + call.transfer_ns - 1000  # 1 us clock slack


def test_validate_replayed_and_gaps(sample_store: object, replayed: object) -> None:
    v = validate_replayed(sample_store, replayed="rp")  # type: ignore[arg-type]
    assert v.recorded == "sample"
    assert v.ranks == [0]
    assert [e.iteration for e in v.iterations] == [1, 2]
    assert v.memory is not None
    assert v.memory[0].recorded == 820928
    assert v.iteration_time_error_pct is not None
    assert v.peak_memory_error_pct is not None
    r = replayed.ranks[0]  # type: ignore[attr-defined]
    # The recorded host gaps were spent: the replayed iteration holds at least them, less the
    # hook's return that each gap wait ends early (``_Driver._lead_ns``: a fraction of a µs),
    # which in all is a small part of the gaps (else the bound below would say little).
    assert r.gap_ns > 0
    units = r.support["compute_units"] + 50
    assert 0 < units * r.wait_lead_ns < r.gap_ns // 10
    assert sum(r.replayed_ns.values()) >= r.op_ns + r.comm_ns + r.gap_ns - units * r.wait_lead_ns
    with pytest.raises(RunStateError, match="is recorded"):
        validate_replayed(sample_store, replayed="sample")  # type: ignore[arg-type]


def test_peak_memory_matches_the_recording(sample_store: object, replayed: object) -> None:
    """Rank 4 holds the loss: its peak comes from storages made inside ops (``log_softmax`` in
    ``cross_entropy_loss``, layer-norm statistics) that backward reads, which the replay allocates
    when the recording did (``Program.nested_outputs``). Rank 0's training loop keeps each
    micro-batch's output in a Python list after the ``send`` that is its last use in the ET: the
    replay holds it until the recording's allocator freed it (``replay.lifetimes``), and without
    that its peak is lower by those outputs."""
    replay_run(sample_store, run="sample", ranks=[4], out_run="rp4", options=FAST)  # type: ignore[arg-type]
    v = validate_replayed(sample_store, replayed="rp4")  # type: ignore[arg-type]
    assert v.memory is not None
    assert v.memory[0].recorded == 1189960
    assert v.peak_memory_error_pct is not None
    assert abs(v.peak_memory_error_pct) < 0.01
    v0 = validate_replayed(sample_store, replayed="rp")  # type: ignore[arg-type]
    assert v0.peak_memory_error_pct is not None
    assert abs(v0.peak_memory_error_pct) < 0.01
    assert replayed.ranks[0].support["held_by_recording"] > 0  # type: ignore[attr-defined]
    by_use = replace(FAST, recorded_lifetimes=False)
    replay_run(sample_store, run="sample", ranks=[0], out_run="rp0u", options=by_use)  # type: ignore[arg-type]
    vu = validate_replayed(sample_store, replayed="rp0u")  # type: ignore[arg-type]
    assert vu.memory is not None
    assert vu.memory[0].error_pct < -5  # the micro-batch outputs


def test_cpu_levels_are_aligned_per_iteration() -> None:
    """Each replayed iteration's CPU level moves to the recorded level at that iteration's start
    (the CPU allocator counts from when profiling began); deltas within it are kept."""
    from prism_trace.replay.hybrid.frames import _align_cpu_levels

    mem = pl.DataFrame(
        {
            "iteration": [1, 1, 2, 2, None],
            "ts": [10, 20, 30, 40, 50],
            "bytes": [100, -100, 50, 25, 8],
            "total_allocated": [100, 0, 60, 85, 93],
        },
        schema_overrides={"iteration": pl.Int32},
    )
    out = _align_cpu_levels(mem, {1: 0, 2: 1000, 3: 7})
    # iteration 1 starts at 0 in both; iteration 2 at 10 replayed, 1000 recorded
    assert out["total_allocated"].to_list() == [100, 0, 1050, 1075, 93]
    assert _align_cpu_levels(mem, {}).equals(mem)


def test_unsupported_ops_fail_or_take_recorded_time(sample_store: object) -> None:
    con = sample_store.con  # type: ignore[attr-defined]
    ((node, ev),) = con.execute(
        "SELECT node_id, event_id FROM et_op WHERE rank = 0 AND name = 'aten::gelu'"
        " ORDER BY node_id LIMIT 1"
    ).fetchall()
    ((schema,),) = con.execute(
        "SELECT op_schema FROM et_op WHERE rank = 0 AND node_id = ?", [node]
    ).fetchall()
    con.execute(
        "UPDATE et_op SET op_schema = 'aten::no_such_op_here(Tensor self) -> Tensor'"
        " WHERE rank = 0 AND node_id = ?",
        [node],
    )
    try:
        with pytest.raises(RunStateError, match=r"aten::gelu x1 \(no op aten::no_such_op_here"):
            replay_run(sample_store, run="sample", ranks=[0], out_run="rp_bad", options=FAST)  # type: ignore[arg-type]
        opts = KernelReplayOptions(
            iterations=1, warmup=0, threads=1, substitute_recorded=True, memory=False
        )
        rep = replay_run(sample_store, run="sample", ranks=[0], out_run="rp_sub", options=opts)  # type: ignore[arg-type]
        assert rep.ranks[0].support["unsupported"] == 1
        ((dur, args),) = con.execute(
            "SELECT dur, args FROM event WHERE run_id = ? AND event_id = ?", [rep.run_id, node]
        ).fetchall()
        ((rec_dur,),) = con.execute(
            "SELECT dur FROM event WHERE rank = 0 AND event_id = ?"
            " AND run_id = (SELECT run_id FROM run WHERE name = 'sample')",
            [ev],
        ).fetchall()
        assert json.loads(args) == {"substituted": True}
        assert dur >= rec_dur
    finally:
        con.execute("UPDATE et_op SET op_schema = ? WHERE rank = 0 AND node_id = ?", [schema, node])


def test_cuda_path_is_guarded(sample_store: object) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; the guard is for machines without one")
    with pytest.raises(UsageError, match="no CUDA device"):
        _rank0(sample_store, "rp_cuda", KernelReplayOptions(device="cuda", iterations=1, warmup=0))


def test_bare_passes_measure_the_instrumentation(sample_store: object) -> None:
    """``bare_passes`` pairs timed passes that do not wait for the virtual peers with bare passes
    (same ops, no clock or hooks): the figures the overhead benchmark reports. The measured
    passes still wait: each call for at least its transfer after the peers' arrival (the
    schedule's ``completion_ns``), so their communication time is at least the sum of the
    transfers (what the instrumentation costs is the benchmark's figure, not checked here)."""
    opts = replace(FAST, gaps="none", memory=False, bare_passes=3)
    rep = _rank0(sample_store, "rp_bare", opts)
    r = rep.ranks[0]
    assert len(r.bare_ns) == len(r.paired_op_ns) == len(r.instrumentation_pct_passes) == 3
    assert all(b > 0 for b in r.bare_ns)
    assert all(o > 0 for o in r.paired_op_ns)
    # > -100 %: the timed pass's own time (without its communication) is positive
    assert all(math.isfinite(x) and x > -100.0 for x in r.instrumentation_pct_passes)
    sched = PeerSchedule.from_store(sample_store, run="sample", rank=0)  # type: ignore[arg-type]
    assert len(sched.calls) == 50
    assert r.comm_ns >= sum(c.transfer_ns for c in sched.calls) > 0
    assert rep.as_dict()["ranks"][0]["bare_ns"] == r.bare_ns
    for bad in (replace(opts, gaps="recorded"), replace(opts, instrument="profiler")):
        with pytest.raises(UsageError, match="bare passes"):
            _rank0(sample_store, "rp_bare2", bad)


def test_cli_replay_and_validate(tmp_path: object, sample_store: object) -> None:
    from prism_trace.cli import main

    db = str(sample_store.path)  # type: ignore[attr-defined]
    sample_store.close()  # type: ignore[attr-defined]
    runner = CliRunner()
    out = runner.invoke(
        main,
        [
            "replay",
            db,
            "--run",
            "sample",
            "--ranks",
            "0",
            "--out-run",
            "rp_cli",
            "--iterations",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    rep = json.loads(out.output[out.output.index("{") :])
    assert rep["ranks"][0]["support"]["compute_units"] == 1110
    again = runner.invoke(
        main, ["replay", db, "--run", "sample", "--ranks", "0", "--out-run", "rp_cli"]
    )
    assert again.exit_code == 1
    assert "already exists" in again.output
    v = runner.invoke(main, ["validate", db, "--replayed", "rp_cli", "--json"])
    assert v.exit_code == 0, v.output
    assert json.loads(v.output)["recorded"] == "sample"


def test_waits_spin_when_each_process_has_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """``wait="auto"`` spins (a sleeping core comes back cold and slows the ops after it) unless
    the replaying processes' threads outnumber the CPUs, where a spin would steal a real rank's
    core; either way a wait never ends before its target (on a clock that moves 1 µs per read
    and by each sleep: a sleeping wait sleeps once, leaving its last 2 ms to the spin)."""
    import os

    from prism_trace.replay.hybrid import passes
    from prism_trace.replay.hybrid.options import _SPIN_SLEEP_NS
    from prism_trace.replay.hybrid.passes import _sleeps, _wait_until

    cpus = os.cpu_count() or 1
    assert not _sleeps(KernelReplayOptions(threads=1), cpus)
    assert _sleeps(KernelReplayOptions(threads=1), cpus + 1)
    assert _sleeps(KernelReplayOptions(threads=2, wait="auto"), cpus)
    assert not _sleeps(KernelReplayOptions(threads=8, wait="spin"), cpus)
    assert _sleeps(KernelReplayOptions(threads=1, wait="sleep"), 1)
    now = [0]
    naps: list[float] = []

    def pc() -> int:
        now[0] += 1_000
        return now[0]

    def nap(seconds: float) -> None:
        naps.append(seconds)
        now[0] += round(seconds * 1e9)

    monkeypatch.setattr(passes, "time", SimpleNamespace(sleep=nap))
    for sleep in (True, False):
        now[0], naps[:] = 0, []
        target = 3_000_000  # past the 2 ms that a sleeping wait spins at its end
        _wait_until(target, pc, sleep)
        assert target <= now[0] < target + 1_000  # it ends at the first read past its target
        if sleep:
            assert naps == [pytest.approx((target - 1_000 - _SPIN_SLEEP_NS) / 1e9)]
        else:
            assert naps == []

"""What-ifs and the variance mode on the real ST op timeline and the generated gloo sample.

The invariants that would break if expansion or the duration changes were wrong: expanding a
replica without changing it reproduces the symmetric emulation exactly; a slow rank slows its
own compute by exactly the factor; the slowest-of-N effect grows with N; draws are seeded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.driver import emulate_in_memory, emulate_run
from prism_trace.replay.whatif.config import SlowDown, WhatIfConfig, WhatIfError, parse_what_if

from prism_trace.cli import main
from prism_trace.ingestion.pipeline import ingest
from prism_trace.layout.mesh import ParallelLayout
from prism_trace.slicing.slicer import slice_run
from prism_trace.store.connection import Store


@pytest.fixture(scope="module")
def store(sample_store: Store, shared_datasets: Path) -> Store:
    """The sample (the module's copy of the conftest template) and the ST op timeline as `st`,
    both with their graph and axes, and `st64`: ST sliced to dp=16,pp=4."""
    s = sample_store
    ingest(s, [shared_datasets / "megatron-straggler-st-8rank"], run="st", progress=False)
    for run in ("st", "sample"):
        from prism_trace.graph.build import build_graph
        from prism_trace.layout.assign import assign_axes
        from prism_trace.layout.choice import infer_layout

        build_graph(s, run)
        assign_axes(s, run, infer_layout(s, run))
    slice_run(s, run="st", layout=ParallelLayout.parse("dp=16,pp=4"), world=64, out_run="st64")
    return s


def mean_iteration(iters: pl.DataFrame) -> float:
    return float(iters.group_by("iteration").agg(pl.col("dur").mean())["dur"].mean())


def emulate(store: Store, run: str, *words: str, seed: int = 0) -> tuple[object, pl.DataFrame]:
    cfg = EmulationConfig(what_if=parse_what_if(list(words)), seed=seed)
    return emulate_in_memory(store, run=run, config=cfg)


def test_parse_what_if_words() -> None:
    w = parse_what_if(
        [
            *("slow-ranks=3,5..7@1.2", "slow-ops=forward-*@1.5", "slow-kind=kernel,memcpy@1.1"),
            *("remove-gpu=17", "dp=64", "bandwidth=0.5", "variance=op"),
        ]
    )
    assert w.slow[0] == SlowDown(factor=1.2, ranks=(3, 5, 6, 7))
    assert w.slow[1].ops == "forward-*"
    assert w.slow[2].kinds == ("kernel", "memcpy")
    assert (w.remove_gpu, w.dp, w.bandwidth_scale) == (17, 64, 0.5)
    assert w.variance
    assert w.variance_mode == "op"
    assert w.rank_targets() == {3, 5, 6, 7, 17}
    for bad in ("slow-ranks=3", "fast=2", "dp=x", "slow-ranks=1@0", "variance=sometimes"):
        with pytest.raises(WhatIfError):
            parse_what_if([bad])
    # A config round-trips through the dict form stored in run.config_json.
    cfg = EmulationConfig(what_if=w)
    assert EmulationConfig.from_dict(cfg.as_dict()).what_if == w


def test_a_dp_what_if_can_keep_the_global_batch() -> None:
    w = parse_what_if(["dp=8", "global-batch=fixed"])
    assert (w.dp, w.global_batch) == (8, "fixed")
    assert parse_what_if(["dp=8"]).global_batch is None  # a sliced run's own, else per-rank
    assert EmulationConfig.from_dict(EmulationConfig(what_if=w).as_dict()).what_if == w
    with pytest.raises(WhatIfError, match="give it with dp=N"):
        parse_what_if(["global-batch=fixed"])
    with pytest.raises(WhatIfError, match="cannot read what-if"):
        parse_what_if(["dp=8", "global-batch=sometimes"])
    with pytest.raises(WhatIfError, match="contradicts"):
        parse_what_if(["dp=8", "global-batch=fixed", "global-batch=per-rank"])


def test_slow_rank_scales_exactly_its_compute(store: Store) -> None:
    _, base = emulate(store, "st")
    res, slow = emulate(store, "st", "slow-ranks=3@1.5")
    nodes = res.inputs.nodes  # type: ignore[attr-defined]
    comp = (nodes["rank"] == 3) & ~nodes["kind"].is_in(["collective", "send", "recv"])
    rec = nodes.filter(comp)["dur"].to_numpy()
    emu = nodes.filter(comp)["emu_dur"].to_numpy()
    assert np.array_equal(emu, np.rint(rec * 1.5).astype(np.int64))
    others = nodes.filter(nodes["rank"] != 3)
    assert others["emu_dur"].equals(others["dur"].fill_null(0), check_names=False)
    # Rank 3's pipeline and data-parallel peers wait for it: every step gets longer.
    j = slow.join(base, on=["rank", "iteration"], suffix="_base")
    assert (j["dur"] > j["dur_base"]).all()


def test_slow_op_type_and_comm_transfer(store: Store) -> None:
    _, base = emulate(store, "st")
    _, fwd = emulate(store, "st", "slow-ops=forward-compute@1.2")
    _, comm = emulate(store, "st", "slow-kind=collective,send,recv@3")
    assert mean_iteration(fwd) > mean_iteration(base) * 1.01
    assert mean_iteration(comm) > mean_iteration(base)


def test_expanding_without_change_reproduces_the_symmetric_emulation(store: Store) -> None:
    """Replica 5 gets a column of its own (rank 5 targeted) but factor 1: same times exactly."""
    res0, base = emulate(store, "st64")
    res1, same = emulate(store, "st64", "slow-ranks=5@1.0")
    assert res0.replicas is None  # type: ignore[attr-defined]
    assert res1.inputs.grid.replica.tolist() == [0, 5]  # type: ignore[attr-defined]
    assert same.sort("rank", "iteration").equals(base.sort("rank", "iteration"))


def test_slow_rank_in_a_slice_only_touches_its_replica_and_dp_peers(store: Store) -> None:
    _, base = emulate(store, "st64")
    res, slow = emulate(store, "st64", "slow-ranks=5@1.3")
    inputs = res.inputs  # type: ignore[attr-defined]
    # Replica 5 and the representative replica (0) are columns; 14 replicas follow replica 0.
    assert inputs.grid.replica.tolist() == [0, 5]
    assert (inputs.grid.column == np.where(np.arange(16) == 5, 1, 0)).all()
    j = slow.join(base, on=["rank", "iteration"], suffix="_base")
    assert (j["dur"] >= j["dur_base"]).all()
    assert mean_iteration(slow) > mean_iteration(base) * 1.02
    # Emulated events exist under every rank's class_id in the written run.
    cfg = EmulationConfig(what_if=parse_what_if(["slow-ranks=5@1.3"]))
    emulate_run(store, run="st64", out_run="st64_slow5", config=cfg)
    missing = store.con.execute(
        "SELECT count(*) FROM rank r WHERE r.run_id = (SELECT run_id FROM run WHERE name ="
        " 'st64_slow5') AND NOT EXISTS (SELECT 1 FROM event e WHERE e.run_id = r.run_id AND"
        " e.rank = coalesce(r.class_id, r.rank))"
    ).fetchall()[0][0]
    assert missing == 0


def test_variance_is_seeded_and_the_slowest_of_n_grows_with_n(store: Store) -> None:
    _, a = emulate(store, "st64", "variance", seed=7)
    _, b = emulate(store, "st64", "variance", seed=7)
    _, c = emulate(store, "st64", "variance", seed=8)
    assert a.equals(b)
    assert not a.equals(c)
    if store.run_id("st4") is None:
        slice_run(store, run="st", layout=ParallelLayout.parse("dp=1,pp=4"), world=4, out_run="st4")
    small = np.mean([mean_iteration(emulate(store, "st4", "variance", seed=s)[1]) for s in (1, 2)])
    big = np.mean([mean_iteration(emulate(store, "st64", "variance", seed=s)[1]) for s in (1, 2)])
    base = mean_iteration(emulate(store, "st4")[1])
    assert big > small  # more replicas, a slower slowest one at each data-parallel collective
    assert abs(small / base - 1) < 0.01  # dp = 1: the representatives keep recorded timing


def test_remove_gpu_runs_the_replica_at_lower_tp(store: Store) -> None:
    res, it = emulate(store, "sample", "remove-gpu=1")
    inputs = res.inputs  # type: ignore[attr-defined]
    assert inputs.left_out == {1: "removed", 5: "idle"}  # tp slot 1 of replica dp 0
    assert set(it["rank"].unique().to_list()) == {0, 2, 3, 4, 6, 7}
    assert set(inputs.size_override.values()) == {1}
    nodes = inputs.nodes.filter(~pl.col("kind").is_in(["collective", "send", "recv"]))
    replica = nodes.filter(pl.col("rank").is_in([0, 1, 4, 5]))
    assert np.array_equal(
        replica["emu_dur"].to_numpy(), np.rint(replica["dur"].fill_null(0) * 2.0).to_numpy()
    )
    _, base = emulate(store, "sample")
    assert mean_iteration(it) > mean_iteration(base) * 1.1  # compute x2, tp comm gone
    with pytest.raises(WhatIfError, match="tp = 1"):
        emulate(store, "st", "remove-gpu=2")


def test_dp_what_if_reslices_and_cleans_up(store: Store) -> None:
    before = {r for (r,) in store.con.execute("SELECT name FROM run").fetchall()}
    cfg = EmulationConfig(what_if=WhatIfConfig(dp=32))
    rep = emulate_run(store, run="st64", out_run="st64_dp32", config=cfg)
    assert rep.world_size == 128
    after = {r for (r,) in store.con.execute("SELECT name FROM run").fetchall()}
    assert after - before == {"st64_dp32"}
    ((parent, n_it),) = store.con.execute(
        "SELECT r.parent_run_id, (SELECT count(DISTINCT rank) FROM iteration i"
        " WHERE i.run_id = r.run_id) FROM run r WHERE name = 'st64_dp32'"
    ).fetchall()
    assert parent == store.run_id("st64")
    assert n_it == 128
    _, rec = emulate(store, "st", "dp=4")  # a recorded run: sliced to its own layout, dp 4
    assert rec["rank"].n_unique() == 16


def test_cli_what_if_and_bad_word(tmp_path: Path) -> None:
    from tests.replay.test_emulate import hand_store

    hand_store(tmp_path).close()
    path = str(tmp_path / "h.duckdb")
    runner = CliRunner()
    ok = runner.invoke(
        main, ["emulate", path, "--run", "h", "--out-run", "h2", "--what-if", "slow-ranks=1@2"]
    )
    assert ok.exit_code == 0, ok.output
    net = runner.invoke(
        main,
        [
            *("emulate", path, "--run", "h", "--out-run", "h4", "--topology", "h100"),
            *("--timing", "alpha_beta", "--calibrate"),
        ],
    )
    assert net.exit_code == 0, net.output
    import duckdb

    with duckdb.connect(path, read_only=True) as con:
        ((cfg,),) = con.execute("SELECT config_json FROM run WHERE name = 'h4'").fetchall()
    assert '"system": "h100"' in cfg
    assert '"model": "alpha_beta"' in cfg
    assert '"calibrate": true' in cfg
    bad = runner.invoke(
        main, ["emulate", path, "--run", "h", "--out-run", "h3", "--what-if", "x=1"]
    )
    assert bad.exit_code == 1
    assert "cannot read what-if 'x=1'" in bad.output
    assert len(bad.output.splitlines()) == 1


def test_bandwidth_and_scale_change_the_transfers(store: Store) -> None:
    _, base = emulate(store, "st")
    _, slow_net = emulate(store, "st", "bandwidth=0.25")
    _, same = emulate(store, "st", "bandwidth=1")
    assert same.equals(base)
    assert mean_iteration(slow_net) > mean_iteration(base)
    # More data-parallel replicas: the dp collectives' modelled ring cost grows with n.
    res16, _ = emulate(store, "st64")
    res_big, _ = emulate(store, "st64", "dp=512")

    def dp_transfer(res: object) -> float:
        s = res.sync  # type: ignore[attr-defined]
        return float(s.filter(pl.col("comm_kind") == "reduce_scatter")["transfer"].sum())

    assert dp_transfer(res_big) >= dp_transfer(res16)

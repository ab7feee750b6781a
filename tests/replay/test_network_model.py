"""The fitted network model: a fit recovers a known network, fit -> file -> predict round trip,
and the emulator prices collectives with it (``--network``, ``[network]``)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from prism_trace.replay import EmulationConfig, emulate_run
from prism_trace.replay.model.timing import TimingConfig, TransferQuery
from prism_trace.replay.model.topology import Topology
from prism_trace.replay.network.fit import fit_network, fit_rows, log_errors
from prism_trace.replay.network.io import read_network_file, write_network_file
from prism_trace.replay.network.model import NetworkModel, network_time_us
from prism_trace.replay.network.parse import read_nccl_log
from prism_trace.replay.network.predict import choice_by_size
from prism_trace.replay.network.transfer import NetworkTransfer

from prism_trace.errors import ConfigError
from prism_trace.store.connection import Store, open_store

DATA = Path(__file__).resolve().parents[1] / "data" / "nccl" / "nccl-tests-309"
SIZES = [1 << k for k in range(10, 31, 2)]  # 1 KiB .. 1 GiB
TRUTH = NetworkModel(  # the 2-node tree is NIC-bound (2 x 8 x 15 < 350), so the NIC shows
    intra_gbps=350.0,
    inter_gbps=15.0,
    nvls_gbps=0.0,
    base_latency_scale=1.3,
    intra_latency_scale=0.8,
    inter_latency_scale=1.5,
    all_gather_efficiency=0.9,
)


def prism(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prism_trace.cli", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def synthetic_log(path: Path, op: str, nodes: int, model: NetworkModel = TRUTH) -> Path:
    """An nccl-tests log (current layout) of ``op`` on ``nodes`` x 8 ranks, timed by ``model``."""
    n = 8 * nodes
    t, _ = network_time_us(
        model, op, np.array(SIZES), np.full(len(SIZES), n), np.full(len(SIZES), nodes)
    )
    stem = {"all_to_all": "alltoall"}.get(op, op)  # nccl-tests' binary names it so
    lines = [
        f"# Collective test starting: {stem}_perf",
        "# nThread 1 nGpus 1 minBytes 1024 maxBytes 1073741824 step: 4(factor)",
        "#",
        "# Using devices",
    ]
    lines += [
        f"#  Rank {r:2d} Group  0 Pid {1000 + r:6d} on node{r // 8:03d} device  {r % 8}"
        " [0x1b] NVIDIA H100 80GB HBM3"
        for r in range(n)
    ]
    lines += [
        "#       size         count      type   redop    root     time   algbw   busbw #wrong"
        "     time   algbw   busbw #wrong"
    ]
    lines += [
        f"{s:>12} {s // 4:>13}     float     sum      -1 {us:>8.2f} {s / us / 1e3:7.2f}"
        f" {s / us / 1e3:7.2f}      0 {us:>8.2f} {s / us / 1e3:7.2f} {s / us / 1e3:7.2f}      0"
        for s, us in zip(SIZES, t, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_fit_recovers_a_known_network_and_extrapolates(tmp_path: Path) -> None:
    logs = [
        synthetic_log(tmp_path / "ar1.log", "all_reduce", 1),
        synthetic_log(tmp_path / "ar2.log", "all_reduce", 2),
        synthetic_log(tmp_path / "ag2.log", "all_gather", 2),
    ]
    model = fit_network([lg for p in logs for lg in read_nccl_log(p)])
    assert model.fit_error is not None
    assert model.fit_error < 0.01
    assert model.intra_gbps == pytest.approx(350.0, rel=0.03)
    assert model.inter_gbps == pytest.approx(15.0, rel=0.03)
    assert model.all_gather_efficiency == pytest.approx(0.9, rel=0.03)
    assert {"intra_gbps", "inter_gbps", "all_gather_efficiency"} <= set(model.determined)
    for nodes in (4, 8, 16):  # scales the fit never saw
        n = np.full(len(SIZES), 8 * nodes)
        want, _ = network_time_us(
            TRUTH, "all_reduce", np.array(SIZES), n, np.full(len(SIZES), nodes)
        )
        got, _ = network_time_us(
            model, "all_reduce", np.array(SIZES), n, np.full(len(SIZES), nodes)
        )
        big = np.array(SIZES) >= 1 << 20
        assert np.median(np.abs(got[big] / want[big] - 1)) < 0.03, nodes


def test_fit_file_predict_round_trip(tmp_path: Path) -> None:
    log = DATA / "qoofyk_all_reduce_2n.log"
    out = tmp_path / "net.toml"
    fit = prism("network", "fit", str(log), "-o", str(out))
    assert fit.returncode == 0, fit.stderr
    assert "all_reduce@16r/2n" in fit.stdout
    assert "choice by size, all_reduce@16r/2n: tree/LL from 1 B, " in fit.stdout
    model = read_network_file(out)
    assert model == fit_network(read_nccl_log(log))  # the file holds the fit exactly
    (measured,) = read_nccl_log(log)
    args = ["network", "predict", str(out), "--op", "all_reduce", "--ranks", "16", "--json"]
    for r in measured.rows:
        args += ["--bytes", str(r.size)]
    pred = prism(*args)
    assert pred.returncode == 0, pred.stderr
    rows = json.loads(pred.stdout)
    assert [p["bytes"] for p in rows] == [r.size for r in measured.rows]
    assert {p["nodes"] for p in rows} == {2}
    err = [abs(p["time_us"] / r.time_us - 1) for p, r in zip(rows, measured.rows, strict=True)]
    assert float(np.median(err)) == pytest.approx(model.fit_error, abs=0.002)
    last = rows[-1]  # busbw in nccl-tests' terms: algbw * 2(n-1)/n
    assert last["busbw_gbps"] == pytest.approx(last["algbw_gbps"] * 2 * 15 / 16, rel=1e-3)
    text = prism("network", "predict", str(out), "--op", "alltoall", "--ranks", "64")
    text_args = [*text.args[3:], "--bytes", "1M", "--ranks-per-node", "4"]
    shown = prism(*text_args)
    assert shown.returncode == 0
    assert "all_to_all, 64 ranks on 16 node(s)" in shown.stdout


def test_the_choice_by_size_is_the_cheapest_candidate_at_each_size() -> None:
    model = NetworkModel(intra_gbps=400.0, inter_gbps=50.0, nvls_gbps=450.0)
    pairs = choice_by_size(model, "all_reduce", 64, 8)
    assert pairs[0][0] == 1
    assert [b for b, _ in pairs] == sorted(b for b, _ in pairs)
    assert len({c for _, c in pairs}) == len(pairs) > 1  # small and large sizes differ
    for (b, c), nxt in zip(pairs, [*pairs[1:], (1 << 34, None)], strict=True):
        for size in (b, max(b, nxt[0] // 2)):  # both ends of the range the choice holds
            _, got = network_time_us(model, "all_reduce", [size], [64], [8])
            assert got[0] == c
    ring_only = choice_by_size(model, "all_gather", 64, 8)
    assert {c.split("/")[0] for _, c in ring_only} == {"ring"}


def test_a_file_without_a_fitted_network_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "net.toml"
    bad.write_text("[network]\ninter_gbps = 3.0\n")
    with pytest.raises(ConfigError, match="no fitted \\[network\\] table"):
        read_network_file(bad)
    bad.write_text("[network]\nintra_gbps = 300.0\nnvls_gbps = -1.0\n")
    with pytest.raises(ConfigError, match="network `nvls_gbps` must be"):
        read_network_file(bad)


def two_ranks(tmp_path: Path, msg_bytes: int) -> Store:
    """Two ranks on one node: rank 0 enters an all_reduce at 10, rank 1 (last) at 30."""
    s = open_store(tmp_path / "h.duckdb")
    nodes = [
        (0, 0, "host", "a", 0, 10, None, None, None),
        (0, 1, "collective", "all_reduce", 10, 30, 0, 0, "all_reduce"),
        (1, 0, "host", "b", 0, 30, None, None, None),
        (1, 1, "collective", "all_reduce", 30, 10, 0, 0, "all_reduce"),
    ]
    with s.transaction() as con:
        con.execute(
            "INSERT INTO run (run_id, name, kind, world_size, source_format)"
            " VALUES (1, 'h', 'recorded', 2, 'kineto')"
        )
        con.executemany("INSERT INTO rank (run_id, rank) VALUES (1, ?)", [[0], [1]])
        con.execute(
            "INSERT INTO comm_group (run_id, group_id, name, description, size, ranks)"
            " VALUES (1, 0, '0', 'default_pg', 2, [0, 1])"
        )
        con.executemany(
            "INSERT INTO graph_node (run_id, rank, node_id, kind, track_id, name, ts, dur,"
            " iteration, group_id, seq, comm_kind, msg_bytes)"
            f" VALUES (1, ?, ?, ?, 0, ?, ?, ?, 1, ?, ?, ?, {msg_bytes})",
            [list(n) for n in nodes],
        )
        con.execute(
            "INSERT INTO graph_edge SELECT 1, a.rank, a.node_id, b.node_id, 'program', 'end',"
            " b.ts - (a.ts + a.dur) FROM graph_node a JOIN graph_node b"
            " ON a.rank = b.rank AND b.node_id = a.node_id + 1"
        )
        con.executemany(
            "INSERT INTO iteration (run_id, rank, iteration, ts, dur, name)"
            " VALUES (1, ?, 1, 0, 200, 'ProfilerStep#1')",
            [[0], [1]],
        )
    return s


def _collective_end(store: Store, run_id: int) -> list[tuple[int, int]]:
    return store.con.execute(
        "SELECT rank, ts + dur FROM event WHERE run_id = ? AND name = 'all_reduce' ORDER BY rank",
        [run_id],
    ).fetchall()


def test_emulate_prices_collectives_as_the_model_says(tmp_path: Path) -> None:
    size = 64 << 20
    store = two_ranks(tmp_path, size)
    model = NetworkModel(intra_gbps=200.0, inter_gbps=20.0, base_latency_scale=2.0)
    t_us, choice = network_time_us(model, "all_reduce", np.array([size]), np.array([2]), [1])
    want = round(t_us[0] * 1e3)
    assert want > 100_000  # 64 MiB at 200 GB/s: far from the recorded 10 ns
    pure = EmulationConfig(timing=TimingConfig(model="alpha_beta"), network=model)
    report = emulate_run(store, run="h", out_run="pure", config=pure)
    assert _collective_end(store, report.run_id) == [(0, 30 + want), (1, 30 + want)]
    assert any("fitted network model" in n for n in report.notes)
    # scaled (the default): at the recorded shape the recording stays as it was
    same = emulate_run(store, run="h", out_run="same", config=EmulationConfig(network=model))
    assert _collective_end(store, same.run_id) == [(0, 40), (1, 40)]
    # without the model: the topology's alpha-beta cost, another figure
    plain = emulate_run(
        store,
        run="h",
        out_run="plain",
        config=EmulationConfig(timing=TimingConfig(model="alpha_beta")),
    )
    assert _collective_end(store, plain.run_id)[0][1] != 30 + want
    assert str(choice[0]).startswith("ring/")


def test_the_transfer_scales_recorded_times_by_the_models_ratio() -> None:
    model = NetworkModel(intra_gbps=300.0, inter_gbps=40.0)
    topo = Topology(ranks_per_node=8)
    q = TransferQuery(
        kind=np.array(["all_reduce", "all_gather", "barrier"], dtype=object),
        msg_bytes=np.array([1 << 26, 1 << 20, 4]),
        group_size=np.array([64, 64, 64]),
        spans_nodes=np.array([True, True, True]),
        recorded_ns=np.array([1_000_000, 50_000, 0]),
        n_nodes=np.array([8, 8, 8]),
        recorded_group_size=np.array([16, 16, 16]),
        recorded_n_nodes=np.array([2, 2, 2]),
    )
    got = NetworkTransfer(model, topo, "scaled").transfer(q)
    new, _ = network_time_us(model, q.kind[:2], q.msg_bytes[:2], [64, 64], [8, 8])
    old, _ = network_time_us(model, q.kind[:2], q.msg_bytes[:2], [16, 16], [2, 2])
    assert got[0] == round(1_000_000 * new[0] / old[0])
    assert got[1] == round(50_000 * new[1] / old[1])
    barrier, _ = network_time_us(model, "all_reduce", [4], [64], [8])
    assert got[2] == round(barrier[0] * 1e3)  # nothing recorded: the pure model


def test_emulate_cli_network_flag_and_info_config(tmp_path: Path) -> None:
    store = two_ranks(tmp_path, 1 << 20)
    db = store.path
    store.close()
    net = write_network_file(NetworkModel(intra_gbps=123.0, inter_gbps=12.0), tmp_path / "n.toml")
    em = prism("emulate", str(db), "--run", "h", "--out-run", "e", "--network", str(net))
    assert em.returncode == 0, em.stderr
    info = prism("info", str(db), "--run", "e", "--config")
    assert info.returncode == 0, info.stderr
    assert "[network]\nintra_gbps = 123.0\ninter_gbps = 12.0\n" in info.stdout
    cfg = tmp_path / "job.toml"
    cfg.write_text('[network]\nfile = "n.toml"\ninter_gbps = 6.0\n')
    em2 = prism("emulate", str(db), "--run", "h", "--out-run", "e2", "--config", str(cfg))
    assert em2.returncode == 0, em2.stderr
    info2 = prism("info", str(db), "--run", "e2", "--config")
    assert "intra_gbps = 123.0\ninter_gbps = 6.0\n" in info2.stdout
    plain = prism("info", str(db), "--run", "e", "--config")
    assert plain.stdout == info.stdout
    missing = prism("emulate", str(db), "--run", "h", "--out-run", "e3", "--network", "nope.toml")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        "error: nope.toml: cannot read the config: No such file or directory"
    ]


def test_a_cluster_shape_unlike_the_topologys_is_noted(tmp_path: Path) -> None:
    store = two_ranks(tmp_path, 1 << 20)
    net = NetworkModel(intra_gbps=300.0, inter_gbps=30.0, ranks_per_node=4)
    report = emulate_run(store, run="h", out_run="e", config=EmulationConfig(network=net))
    assert (
        "network: fitted on 4 ranks per node, but groups are placed 8 per node"
        " ([topology] ranks_per_node)"
    ) in report.notes
    same = EmulationConfig(network=net, topology=Topology(ranks_per_node=4))
    quiet = emulate_run(store, run="h", out_run="e4", config=same)
    assert not any("ranks per node" in n for n in quiet.notes)


def test_all_reduce_on_one_node_leaves_the_nic_to_the_kinds_that_crossed_nodes(
    tmp_path: Path,
) -> None:
    """all_reduce logged on one node only, all_to_all and sendrecv on one and two: the NIC is
    fitted on the two-node rows (their bus bandwidth is one GPU's, not a ring's node), so a
    larger all_reduce follows. Before, the NIC stayed at its start: 2-node rows 4-6x off."""
    logs = [
        synthetic_log(tmp_path / "ar1.log", "all_reduce", 1),
        synthetic_log(tmp_path / "a2a1.log", "all_to_all", 1),
        synthetic_log(tmp_path / "a2a2.log", "all_to_all", 2),
        synthetic_log(tmp_path / "sr2.log", "sendrecv", 2),
    ]
    parsed = [lg for p in logs for lg in read_nccl_log(p)]
    model = fit_network(parsed)
    assert model.inter_gbps == pytest.approx(TRUTH.inter_gbps, rel=0.05)
    assert max(e for _, e in log_errors(model, parsed) if e is not None) < 0.05
    n, nodes = np.full(len(SIZES), 32), np.full(len(SIZES), 4)
    want, _ = network_time_us(TRUTH, "all_to_all", np.array(SIZES), n, nodes)
    got, _ = network_time_us(model, "all_to_all", np.array(SIZES), n, nodes)
    big = np.array(SIZES) >= 1 << 20
    assert np.median(np.abs(got[big] / want[big] - 1)) < 0.05


def test_rows_whose_data_check_failed_are_not_fitted(tmp_path: Path) -> None:
    """A call that delivered wrong data measured no network: its column's time is left out."""
    path = synthetic_log(tmp_path / "ar2.log", "all_reduce", 2)
    lines = path.read_text().splitlines()
    row = len(lines) - 2  # one row near the end: 256 MiB
    cols = lines[row].split()
    fast = f"{float(cols[5]) / 10:.2f}"  # the failed column is the faster: only its exclusion
    oop_failed = [*cols[:5], fast, *cols[6:8], "1216", *cols[9:]]  # makes in-place the time
    lines[row] = " ".join(oop_failed)
    both = len(lines) - 1
    cols = lines[both].split()
    lines[both] = " ".join([*cols[:8], "3", *cols[9:12], "7"])
    path.write_text("\n".join(lines) + "\n")
    (log,) = read_nccl_log(path)
    rows = {r.line: r for r in log.rows}
    assert rows[row + 1].failed_check
    assert rows[row + 1].time_us == rows[row + 1].ip_us  # the in-place column passed
    assert rows[both + 1].time_us == 0.0  # both failed: no time to fit
    assert fit_rows([log]).size.size == len(SIZES) - 1
    old_layout = read_nccl_log(DATA.parent / "nccl-tests-78" / "all_reduce_perf_256gpu.log")[0]
    assert not any(r.failed_check for r in old_layout.rows)  # `error` is a deviation, not a count
    result = prism("network", "fit", str(path), "-o", str(tmp_path / "n.toml"))
    assert result.returncode == 0, result.stderr
    assert "data check failed (#wrong > 0) on 2 row(s)" in result.stdout
    assert "median |error| per log: ar2.log all_reduce@16r/2n" in result.stdout


def test_an_efficiency_near_two_does_not_stop_the_fit(tmp_path: Path) -> None:
    """The simplex may not step past the largest efficiency the model takes (2)."""
    truth = replace(TRUTH, all_gather_efficiency=1.9)
    logs = [
        synthetic_log(tmp_path / "ar1.log", "all_reduce", 1, truth),
        synthetic_log(tmp_path / "ag1.log", "all_gather", 1, truth),
        synthetic_log(tmp_path / "ag2.log", "all_gather", 2, truth),
    ]
    parsed = [lg for p in logs for lg in read_nccl_log(p)]
    model = fit_network(parsed)  # before: NetworkModelError, an efficiency of 2.48 tried
    assert 1.8 <= model.all_gather_efficiency <= 2.0
    assert max(e for _, e in log_errors(model, parsed) if e is not None) < 0.05


def test_a_nic_no_kind_pins_is_not_claimed(tmp_path: Path) -> None:
    """all_reduce on one node, all_to_all across nodes only: its efficiency and the NIC trade
    off freely, so the NIC is not among the parameters the logs determined."""
    logs = [
        synthetic_log(tmp_path / "ar1.log", "all_reduce", 1),
        synthetic_log(tmp_path / "a2a2.log", "all_to_all", 2),
    ]
    model = fit_network([lg for p in logs for lg in read_nccl_log(p)])
    assert "inter_gbps" not in model.determined
    assert "intra_gbps" in model.determined

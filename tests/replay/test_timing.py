"""The transfer model: nccl-tests formulas, ring vs tree, node spans, scaled and what-if modes."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import numpy as np
import pytest
from prism_trace.replay.model.cost import bus_factor, collective_cost, reduction_ns
from prism_trace.replay.model.timing import (
    AlphaBetaTransfer,
    RecordedTransfer,
    ScaledTransfer,
    TimingConfig,
    TransferQuery,
    transfer_model,
)
from prism_trace.replay.model.topology import PRESETS, Topology, TopologyError

from prism_trace.errors import ConfigError, PrismError

GIB = 1 << 30


def arr(*xs: object) -> np.ndarray:
    return np.array(xs, dtype=object if isinstance(xs[0], str) else None)


def one(kind: str, size: int, n: int, nodes: int, topo: Topology, **kw: object) -> float:
    cost = collective_cost(arr(kind), arr(size), arr(n), arr(nodes), topo, **kw)
    return float(cost.time_ns(topo)[0])


def test_bus_factors_are_nccl_tests() -> None:
    kinds = arr("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
    assert bus_factor(kinds, np.full(6, 8)).tolist() == pytest.approx(
        [2 * 7 / 8, 7 / 8, 7 / 8, 7 / 8, 1.0, 1.0]
    )


def test_single_node_formulas() -> None:
    # nccl-tests: busbw = algbw * factor, so at busbw B a size S takes factor * S / B (+ latency)
    b, a = 400.0, 1500.0
    topo = Topology(intra_node_gbps=b, intra_node_latency_ns=a)
    assert one("all_reduce", GIB, 8, 1, topo) == pytest.approx(14 * a + 2 * 7 / 8 * GIB / b)
    assert one("all_gather", GIB, 8, 1, topo) == pytest.approx(7 * a + 7 / 8 * GIB / b)
    assert one("reduce_scatter", GIB, 4, 1, topo) == pytest.approx(3 * a + 3 / 4 * GIB / b)
    assert one("all_to_all", GIB, 8, 1, topo) == pytest.approx(7 * a + 7 / 8 * GIB / b)
    assert one("broadcast", GIB, 8, 1, topo) == pytest.approx(7 * a + GIB / b)
    assert one("send", GIB, 2, 1, topo) == pytest.approx(a + GIB / b)
    assert one("all_reduce", GIB, 1, 1, topo) == 0.0  # a group of one moves nothing
    # the bandwidth term alone gives back the busbw nccl-tests would report
    cost = collective_cost(arr("all_reduce"), arr(GIB), arr(8), arr(1), topo)
    algbw = GIB / cost.bandwidth_ns(topo)[0]
    assert algbw * 2 * 7 / 8 == pytest.approx(b)


def test_groups_across_nodes_are_bound_by_the_nics() -> None:
    topo = Topology.preset("h100")  # 475 GB/s NVLink, 46 GB/s per GPU's NIC, 8 per node
    x = 2 * 15 / 16 * GIB
    # 16 GPUs on 2 nodes: 8 NICs per node carry the ring: min(475, 8 * 46) = 368 GB/s
    cost = collective_cost(arr("all_reduce"), arr(GIB), arr(16), arr(2), topo, algorithm="ring")
    assert cost.bandwidth_ns(topo)[0] == pytest.approx(x / 368.0)
    assert cost.intra_steps[0] == 2 * (16 - 2)
    assert cost.inter_steps[0] == 2 * (2 - 1)
    # the same 16 ranks one per node (a strided dp group): one NIC each
    cost = collective_cost(arr("all_reduce"), arr(GIB), arr(16), arr(16), topo, algorithm="ring")
    assert cost.bandwidth_ns(topo)[0] == pytest.approx(x / 46.0)
    # all_to_all: the off-node share through one NIC, the rest over NVLink, at the same time
    t = one("all_to_all", GIB, 16, 2, topo)
    lat = 7 * 1000.0 + 8 * 3200.0
    assert t == pytest.approx(lat + max(7 / 16 * GIB / 475.0, 8 / 16 * GIB / 46.0))
    # a send between nodes crosses one NIC
    assert one("send", GIB, 2, 2, topo) == pytest.approx(3200.0 + GIB / 46.0)


def test_ring_or_tree_like_nccls_tuner() -> None:
    topo = Topology.preset("h100")
    kinds, n, nodes = arr("all_reduce", "all_reduce"), arr(32, 32), arr(4, 4)
    sizes = arr(1024, GIB)
    auto = collective_cost(kinds, sizes, n, nodes, topo)
    ring = collective_cost(kinds, sizes, n, nodes, topo, algorithm="ring")
    tree = collective_cost(kinds, sizes, n, nodes, topo, algorithm="tree")
    assert auto.algorithm.tolist() == ["tree", "ring"]  # latency-bound small, bandwidth-bound big
    assert auto.time_ns(topo) == pytest.approx(np.minimum(ring.time_ns(topo), tree.time_ns(topo)))
    # tree latency: intra-node chain + inter-node binary tree, both ways
    assert tree.intra_steps[0] == 2 * (8 - 1)
    assert tree.inter_steps[0] == 2 * math.ceil(math.log2(4))
    assert tree.bandwidth_ns(topo)[1] == pytest.approx(2 * GIB / 0.9 / 368.0)
    # inside one node NCCL runs rings
    single = collective_cost(arr("all_reduce"), arr(1024), arr(8), arr(1), topo)
    assert single.algorithm.tolist() == ["ring"]
    # one GPU per node at scale: tree's log2 latency wins far into large sizes
    big = collective_cost(arr("all_reduce"), arr(64 << 20), arr(1024), arr(1024), topo)
    assert big.algorithm.tolist() == ["tree"]


def test_spans_nodes_and_group_shape() -> None:
    topo = Topology(ranks_per_node=8)
    lo, hi = np.array([0, 0, 8, 7, 0]), np.array([7, 8, 15, 8, 56])
    assert topo.spans_nodes(lo, hi).tolist() == [False, True, False, True, True]
    nodes, per = topo.group_nodes(lo, hi, np.array([8, 2, 8, 2, 8]))
    assert nodes.tolist() == [1, 2, 1, 2, 8]  # the last: a dp group of stride 8
    assert per.tolist() == [8, 1, 8, 1, 1]
    nodes, per = topo.group_nodes(np.array([0, 0]), np.array([15, 14]), np.array([16, 8]))
    assert nodes.tolist() == [2, 2]  # all 16 / even ranks 0..14: 4 per node
    assert per.tolist() == [8, 4]
    members = np.array([0, 1, 2, 3, 8, 9, 10, 0, 16, 24])
    group = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2])
    nodes, most = topo.group_shape(members, group, 4)
    assert nodes.tolist() == [1, 1, 3, 0]
    assert most.tolist() == [4, 3, 1, 0]


def test_presets_and_config_round_trip() -> None:
    h100 = Topology.preset("h100")
    assert h100 == Topology(system="h100")
    assert (h100.ranks_per_node, h100.intra_node_gbps, h100.inter_node_gbps) == (8, 475.0, 46.0)
    assert Topology.preset("h200").inter_node_gbps == 46.0
    assert Topology().system == "generic"
    assert Topology().intra_node_gbps == PRESETS["generic"]["intra_node_gbps"]
    over = Topology.preset("h200", inter_node_gbps=25.0, bandwidth_scale=2.0)
    assert over.inter_node_gbps == 25.0
    assert over.inter_bytes_per_ns == 50.0
    assert Topology(**json.loads(json.dumps(asdict(over)))) == over
    # A named error: one line at the CLI (PrismError), still a ValueError to callers.
    assert issubclass(TopologyError, PrismError)
    assert issubclass(TopologyError, ValueError)
    with pytest.raises(TopologyError, match="unknown topology `system`"):
        Topology(system="tpu")
    with pytest.raises(TopologyError, match="bandwidth_scale"):
        Topology(bandwidth_scale=0)
    t = TimingConfig(model="scaled", calibrate=True, algorithm="ring")
    assert TimingConfig(**json.loads(json.dumps(asdict(t)))) == t
    with pytest.raises(ConfigError, match="timing `model`"):
        TimingConfig(model="magic")  # type: ignore[arg-type]

    from prism_trace.replay.emulate.config import EmulationConfig

    cfg = EmulationConfig.from_dict(
        {
            "timing": {"model": "scaled", "calibrate": True},
            "topology": {"system": "h200", "bandwidth_scale": 2.0},
        }
    )
    assert cfg.topology.intra_node_gbps == 475.0
    assert EmulationConfig.from_dict(json.loads(json.dumps(cfg.as_dict()))) == cfg


def test_transfer_model_choice() -> None:
    topo = Topology.preset("h100")
    assert isinstance(transfer_model(TimingConfig(), topo), ScaledTransfer)  # the default
    assert isinstance(transfer_model(TimingConfig(model="recorded"), topo), RecordedTransfer)
    model = transfer_model(TimingConfig(model="alpha_beta", algorithm="tree"), topo)
    assert isinstance(model, AlphaBetaTransfer)
    assert model.algorithm == "tree"


def _query(**kw: object) -> TransferQuery:
    base = {
        "kind": arr("all_reduce", "all_gather", "all_to_all", "send"),
        "msg_bytes": arr(64 << 20, 8 << 20, 1 << 20, 4 << 20),
        "group_size": arr(8, 8, 8, 2),
        "spans_nodes": np.zeros(4, dtype=bool),
        "recorded_ns": arr(900_000, 150_000, 40_000, 30_000),
    }
    base.update(kw)
    return TransferQuery(**base)  # type: ignore[arg-type]


def _terms(q: TransferQuery, topo: Topology, *, recorded: bool = False) -> tuple:
    size, n, nodes, rsize, rn, rnodes = q.shapes(topo)
    if recorded:
        size, n, nodes = rsize, rn, rnodes
    cost = collective_cost(q.kind, size, n, nodes, topo)
    return cost.latency_ns(topo), cost.bandwidth_ns(topo)


def test_scaled_is_the_recording_at_the_recorded_scale() -> None:
    topo = Topology.preset("h100")
    q = _query()
    assert ScaledTransfer(topo).transfer(q).tolist() == q.recorded_ns.tolist()
    q2 = _query(recorded_group_size=arr(8, 8, 8, 2), recorded_msg_bytes=q.msg_bytes)
    assert ScaledTransfer(topo).transfer(q2).tolist() == q.recorded_ns.tolist()


def test_scaled_follows_the_model_ratio() -> None:
    topo = Topology.preset("h100")
    rec = _query()
    # twice the bytes: the bandwidth term doubles, the latency stays, the residual is kept
    q = _query(msg_bytes=rec.msg_bytes * 2, recorded_msg_bytes=rec.msg_bytes)
    lat, bw = _terms(rec, topo)
    want = rec.recorded_ns * (lat + 2 * bw) / (lat + bw)
    assert ScaledTransfer(topo).transfer(q) == pytest.approx(want, abs=1)
    # twice the group on the same node: the ring has more steps and a larger bus factor
    q = _query(
        group_size=arr(16, 16, 16, 2),
        spans_nodes=np.array([True, True, True, False]),
        n_nodes=arr(2, 2, 2, 1),
        recorded_group_size=arr(8, 8, 8, 2),
        recorded_n_nodes=arr(1, 1, 1, 1),
    )
    new_lat, new_bw = _terms(q, topo)
    want = rec.recorded_ns * (new_lat + new_bw) / (lat + bw)
    out = ScaledTransfer(topo).transfer(q)
    assert out == pytest.approx(want, abs=1)
    assert (out[:3] > rec.recorded_ns[:3]).all()  # crossing nodes is slower
    assert out[3] == rec.recorded_ns[3]  # the send did not change
    # nothing recorded: the pure model; size unknown: the recording
    q = _query(recorded_ns=arr(0, 150_000, 40_000, 30_000), msg_bytes=arr(64 << 20, -1, 1, 4))
    out = ScaledTransfer(topo).transfer(q)
    pure = AlphaBetaTransfer(topo).transfer(q)
    assert out[0] == pure[0] > 0
    assert out[1] == 150_000


def test_default_recorded_nodes_keep_ranks_per_node() -> None:
    topo = Topology.preset("h100")
    q = _query(
        group_size=arr(2048, 64, 8, 2),
        n_nodes=arr(2048, 8, 1, 1),
        recorded_group_size=arr(2, 16, 8, 2),
    )
    *_, rn, rnodes = q.shapes(topo)
    assert rnodes.tolist() == [2, 2, 1, 1]  # a dp group of one rank per node stays so
    assert rn.tolist() == [2, 16, 8, 2]
    # without n_nodes, a group that spans nodes fills them
    q = _query(group_size=arr(32, 8, 8, 2), spans_nodes=np.array([True, False, False, True]))
    _, _, nodes, *_ = q.shapes(topo)
    assert nodes.tolist() == [4, 1, 1, 2]


def test_bandwidth_what_if() -> None:
    topo = Topology.preset("h100")
    fast = Topology.preset("h100", bandwidth_scale=2.0)
    q = _query()
    lat, bw = _terms(q, topo)
    # the pure model: bandwidth term halved, latency unchanged
    assert AlphaBetaTransfer(fast).transfer(q) == pytest.approx(np.rint(lat + bw / 2), abs=1)
    # recorded: the recording, times the model's ratio at the recorded shape
    want = q.recorded_ns * (lat + bw / 2) / (lat + bw)
    assert RecordedTransfer(fast).transfer(q) == pytest.approx(want, abs=1)
    # recorded ignores changed sizes; without a what-if it is the recording, exactly
    bigger = _query(msg_bytes=q.msg_bytes * 4, recorded_msg_bytes=q.msg_bytes)
    assert RecordedTransfer(topo).transfer(bigger).tolist() == q.recorded_ns.tolist()
    assert RecordedTransfer(fast).transfer(bigger) == pytest.approx(want, abs=1)
    # scaled with the what-if at the recorded shape agrees with recorded
    assert ScaledTransfer(fast).transfer(q).tolist() == RecordedTransfer(fast).transfer(q).tolist()
    # an inter-node-only what-if leaves single-node groups alone
    ib = Topology.preset("h100", inter_bandwidth_scale=0.5)
    assert RecordedTransfer(ib).transfer(q).tolist() == q.recorded_ns.tolist()
    cross = _query(spans_nodes=np.ones(4, dtype=bool), n_nodes=arr(2, 2, 2, 2))
    assert (RecordedTransfer(ib).transfer(cross) > cross.recorded_ns).all()


def test_astra_sim_options_chunks_and_ring_all_to_all() -> None:
    # ASTRA-sim's ring (docs/network.md): 4 pieces in sequence, each paying the latency; its
    # all-to-all relays n(n-1)/2 steps of S/n. 8 NPUs, 1 MiB, 50 GB/s, 500 ns: ASTRA-sim
    # measures 64 440 ns for the all-reduce.
    mib, b, a = 1 << 20, 50.0, 500.0
    topo = Topology(ranks_per_node=8, intra_node_gbps=b, intra_node_latency_ns=a)
    ar = one("all_reduce", mib, 8, 1, topo, algorithm="ring", chunks=4)
    assert ar == pytest.approx(4 * 14 * a + 2 * 7 / 8 * mib / b)
    assert abs(ar / 64_440 - 1) < 0.01
    a2a = one("all_to_all", mib, 8, 1, topo, chunks=4, all_to_all="ring")
    assert a2a == pytest.approx(4 * 28 * a + 3.5 * mib / b)
    # p2p is not split; chunks=1 is the plain model.
    assert one("send", mib, 2, 1, topo, chunks=4) == one("send", mib, 2, 1, topo)
    assert one("all_reduce", mib, 8, 1, topo, chunks=1) == one("all_reduce", mib, 8, 1, topo)
    with pytest.raises(ConfigError, match="chunks"):
        TimingConfig(chunks=0)
    with pytest.raises(ConfigError, match="all_to_all"):
        TimingConfig(all_to_all="mesh")  # type: ignore[arg-type]
    model = transfer_model(TimingConfig(model="alpha_beta", chunks=4), topo)
    assert isinstance(model, AlphaBetaTransfer)
    assert model.chunks == 4


def test_reduction_option_matches_astra_sim_reduce_scatter() -> None:
    # ASTRA-sim (docs/network.md): 8 NPUs, 1 MiB, its "50 GB/s" is 50 GiB/s, 500 ns per hop plus
    # a 10 ns endpoint delay per message, 4 chunks, reductions at local-mem-bw 1600 GB/s:
    # 33 080 ns for the reduce-scatter, 19 080 ns at latency 0.
    mib, bw, hop = 1 << 20, 50 * GIB / 1e9, 510.0
    topo = Topology(ranks_per_node=8, intra_node_gbps=bw, intra_node_latency_ns=hop)
    q = TransferQuery(
        kind=arr("reduce_scatter", "all_reduce", "all_gather", "send"),
        msg_bytes=arr(mib, mib, 8 * mib, mib),
        group_size=arr(8, 8, 8, 2),
        spans_nodes=np.zeros(4, dtype=bool),
        recorded_ns=arr(1, 1, 1, 1),
    )
    red = reduction_ns(q.kind, q.msg_bytes, q.group_size, 1600.0)
    # three passes over the (n-1)/n S bytes a rank reduces; nothing for gathers and p2p
    assert red.tolist() == pytest.approx([3 * 7 / 8 * mib / 1600] * 2 + [0.0, 0.0])
    assert reduction_ns(q.kind, q.msg_bytes, q.group_size, None).tolist() == [0.0] * 4
    plain = AlphaBetaTransfer(topo, "ring", chunks=4).transfer(q)
    model = transfer_model(
        TimingConfig(model="alpha_beta", algorithm="ring", chunks=4, reduction_gbps=1600), topo
    ).transfer(q)
    assert (model - plain).tolist() == pytest.approx(np.rint(red).tolist(), abs=1)
    assert abs(model[0] / 33_080 - 1) < 0.005
    assert abs(plain[0] / 33_080 - 1) > 0.02  # without it, 2.6 % short
    assert abs(model[2] / 151_016 - 1) < 0.005  # the all-gather moves 7 x its 1 MiB input
    for bad in (0, -1.0, float("inf"), "fast", True):
        with pytest.raises(ConfigError, match="reduction_gbps"):
            TimingConfig(reduction_gbps=bad)  # type: ignore[arg-type]

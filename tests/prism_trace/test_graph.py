"""The per-rank execution graph: hand-built frames for each rule, and real traces checked against
counts taken independently from the raw files (a plain stack walk per thread)."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import polars as pl
import pytest

from prism_trace.errors import RunNotFoundError, RunStateError
from prism_trace.graph.build import build_graph
from prism_trace.graph.chakra import chakra_graph
from prism_trace.graph.kineto import kineto_graph
from prism_trace.graph.timeline import timeline_graph
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
STREAM_CATS = DEVICE_CATS | {"gpu_user_annotation", "cuda_sync"}


def q(store: Store, sql: str, *params: object) -> list[tuple]:
    return store.con.execute(sql, list(params)).fetchall()


# -- hand-built frames -------------------------------------------------------------------------

EV_COLS = [
    "rank", "event_id", "track_id", "category", "name", "ts", "dur", "correlation", "parent_id",
    "iteration",
]  # fmt: skip


def frame(rows: list[tuple], cols: list[str]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=cols, orient="row")


def empty_comm() -> tuple[pl.DataFrame, pl.DataFrame]:
    coll = pl.DataFrame(
        schema={
            "rank": pl.Int32,
            "event_id": pl.Int64,
            "group_id": pl.Int32,
            "seq": pl.Int64,
            "kind": pl.Utf8,
            "msg_bytes": pl.Int64,
            "kernel_event_id": pl.Int64,
        }
    )
    p2p = pl.DataFrame(
        schema={
            "rank": pl.Int32,
            "event_id": pl.Int64,
            "group_id": pl.Int32,
            "seq": pl.Int64,
            "direction": pl.Utf8,
            "peer": pl.Int32,
            "bytes": pl.Int64,
            "kernel_event_id": pl.Int64,
        }
    )
    return coll, p2p


def tiny_kineto() -> tuple[pl.DataFrame, ...]:
    """Thread 0: step annotation > [A > launch K1] [B > comm C > launch K2] [sync S];
    stream 1: K1, K2; stream 2: a wait on K1 (cuda_sync W), then K3 launched by A."""
    events = frame(
        [
            (0, 0, 0, "user_annotation", "ProfilerStep#1", 0, 1000, None, None, 1),
            (0, 1, 0, "cpu_op", "A", 10, 100, None, 0, 1),
            (0, 2, 0, "cuda_runtime", "cudaLaunchKernel", 20, 5, 7, 1, 1),
            (0, 3, 0, "cuda_runtime", "cudaLaunchKernel", 40, 5, 9, 1, 1),
            (0, 4, 0, "cpu_op", "B", 200, 300, None, 0, 1),
            (0, 5, 0, "cpu_op", "record_param_comms", 250, 100, None, 4, 1),
            (0, 6, 0, "cuda_runtime", "cudaLaunchKernel", 270, 5, 8, 5, 1),
            (0, 7, 0, "cuda_runtime", "cudaDeviceSynchronize", 600, 50, None, 0, 1),
            (0, 10, 1, "kernel", "K1", 30, 100, 7, None, 1),
            (0, 11, 1, "kernel", "ncclKernel_AllReduce", 300, 200, 8, None, 1),
            (0, 12, 2, "cuda_sync", "Wait Event", 35, 0, None, None, 1),
            (0, 13, 2, "kernel", "K3", 140, 10, 9, None, 1),
        ],
        EV_COLS,
    )
    tracks = frame(
        [(0, 0, "thread"), (0, 1, "stream"), (0, 2, "stream")], ["rank", "track_id", "kind"]
    )
    flows = frame(
        [(0, "launch", 2, 10), (0, "launch", 6, 11), (0, "sync", 10, 12)],
        ["rank", "kind", "src_event_id", "dst_event_id"],
    )
    coll, p2p = empty_comm()
    coll = pl.concat(
        [
            coll,
            pl.DataFrame(
                [
                    {
                        "rank": 0,
                        "event_id": 5,
                        "group_id": 0,
                        "seq": 0,
                        "kind": "all_reduce",
                        "msg_bytes": 64,
                        "kernel_event_id": 11,
                    }
                ],
                schema=coll.schema,
            ),
        ]
    )
    return events, tracks, flows, coll, p2p


def test_kineto_rules_on_a_tiny_rank() -> None:
    g = kineto_graph(*tiny_kineto())
    nodes = {r["event_id"]: r for r in g.nodes.iter_rows(named=True)}
    # B is dissolved (it encloses the collective); annotations are not nodes.
    assert {e: n["kind"] for e, n in nodes.items()} == {
        1: "host", 5: "collective", 7: "host", 10: "kernel", 11: "kernel", 13: "kernel",
    }  # fmt: skip
    assert nodes[5]["group_id"] == 0
    assert nodes[5]["msg_bytes"] == 64
    assert nodes[5]["comm_kind"] == "all_reduce"
    assert [nodes[e]["node_id"] for e in (1, 5, 7, 10, 11, 13)] == list(range(6))
    nid = {e: n["node_id"] for e, n in nodes.items()}
    got = {
        (r["kind"], r["src"], r["dst"]): (r["anchor"], r["delay"])
        for r in g.edges.iter_rows(named=True)
    }
    assert got == {
        ("program", nid[1], nid[5]): ("end", 250 - 110),
        ("program", nid[5], nid[7]): ("end", 600 - 350),
        ("launch", nid[1], nid[10]): ("start", 10),
        ("launch", nid[1], nid[13]): ("start", 30),  # by correlation (no launch flow)
        ("comm", nid[5], nid[11]): ("start", 20),  # replaces the launch edge
        ("stream", nid[10], nid[11]): ("end", 0),
        ("wait", nid[10], nid[13]): ("end", 0),
        ("sync", nid[11], nid[7]): ("end", 0),  # last launched on stream 1
        ("sync", nid[13], nid[7]): ("end", 0),  # and on stream 2
    }
    stats = g.stats.row(0, named=True)
    assert stats["dissolved_ops"] == 1
    assert stats["unlaunched_device"] == 0


def test_sync_edge_delay_is_the_tail_after_the_call() -> None:
    events, tracks, flows, coll, p2p = tiny_kineto()
    # Put the synchronize inside an op that runs 30 ns past it; the stream is guessed.
    events = events.with_columns(
        pl.when(pl.col("event_id") == 7)
        .then(pl.lit("cudaStreamSynchronize"))
        .otherwise(pl.col("name"))
        .alias("name"),
        pl.when(pl.col("event_id") == 7)
        .then(pl.lit(14))
        .otherwise(pl.col("parent_id"))
        .alias("parent_id"),
    )
    extra = frame([(0, 14, 0, "cpu_op", "aten::item", 590, 90, None, 0, 1)], EV_COLS)
    g = kineto_graph(pl.concat([events, extra]), tracks, flows, coll, p2p)
    syncs = g.edges.filter(pl.col("kind") == "sync")
    host = g.nodes.filter(pl.col("event_id") == 14)["node_id"][0]
    k2 = g.nodes.filter(pl.col("event_id") == 11)["node_id"][0]
    # The thread last launched K2 (stream 1) before the call: only that stream is synchronised.
    assert syncs.select("src", "dst", "delay").rows() == [(k2, host, 680 - 650)]
    assert g.stats["guessed_sync_streams"][0] == 1


def test_timeline_dependencies_cross_lanes() -> None:
    # recv (pp lane) -> compute (compute lane) -> send (pp lane) -> ... The grad-norm op becomes
    # a world collective; the optimizer waits for it.
    events = frame(
        [
            (0, 0, 1, "comm", "forward-recv", 0, 100, None, None, 1),
            (0, 1, 0, "compute", "forward-compute", 97, 50, None, None, 1),
            (0, 2, 1, "comm", "forward-send", 150, 10, None, None, 1),
            (0, 3, 3, "comm", "optimizer-clip-main-grad", 170, 30, None, None, 1),
            (0, 4, 0, "compute", "optimizer", 205, 40, None, None, 1),
            (0, 5, 3, "comm", "optimizer-clip-main-grad", 300, 30, None, None, 2),
        ],
        EV_COLS,
    )
    coll, p2p = empty_comm()
    g = timeline_graph(events, coll, p2p, world_group=9)
    by_event = dict(zip(g.nodes["event_id"].to_list(), g.nodes["node_id"].to_list(), strict=True))
    edges = {
        (int(a), int(b)): (anchor, d)
        for a, b, anchor, d in g.edges.select("src", "dst", "anchor", "delay").iter_rows()
    }
    n = by_event
    # Megatron's dependencies (prism_trace.graph.deps_op_timeline): the recv feeds the compute,
    # which starts 3 ns before the recv ends (clock jitter: own delay 0, an overlap); the send
    # follows the compute; the clip follows the last compute; step 2's clip follows step 1's
    # optimizer.
    assert edges == {
        (n[0], n[1]): ("end", 0),
        (n[1], n[2]): ("end", 3),
        (n[1], n[3]): ("end", 23),
        (n[3], n[4]): ("end", 5),
        (n[4], n[5]): ("end", 55),
    }
    assert g.stats["overlaps"][0] == 1
    clip = g.nodes.filter(pl.col("name") == "optimizer-clip-main-grad").sort("ts")
    assert clip["kind"].to_list() == ["collective", "collective"]
    assert clip["group_id"].to_list() == [9, 9]
    assert clip["seq"].to_list() == [0, 1]
    assert clip["comm_kind"].to_list() == ["all_reduce", "all_reduce"]
    # without a world group the op stays a plain node
    plain = timeline_graph(events, coll, p2p)
    assert plain.nodes.filter(pl.col("kind") == "collective").height == 0


def test_chakra_kinds_and_dependency_edges() -> None:
    events = frame(
        [
            (0, 5, 0, "comm", "c10d::allreduce_", None, None, None, None, None, True),
            (0, 6, 1, "comm", "ncclKernel", None, 1000, None, None, None, False),
            (0, 7, 1, "compute", "gemm", None, 2000, None, None, None, False),
            (0, 8, 0, "compute", "aten::add", None, 10, None, None, None, None),
            (0, 9, 0, "memcpy", "load", None, 10, None, None, None, None),
        ],
        [*EV_COLS, "is_cpu_op"],
    )
    flows = frame(
        [(0, "data", 5, 6), (0, "ctrl", 6, 7), (0, "data", 7, 7), (0, "data", 8, 9)],
        ["rank", "kind", "src_event_id", "dst_event_id"],
    )
    coll, p2p = empty_comm()
    coll = pl.concat(
        [
            coll,
            pl.DataFrame(
                [
                    {
                        "rank": 0,
                        "event_id": 5,
                        "group_id": 0,
                        "seq": 0,
                        "kind": "all_reduce",
                        "msg_bytes": 8,
                        "kernel_event_id": 6,
                    }
                ],
                schema=coll.schema,
            ),
        ]
    )
    g = chakra_graph(events, flows, coll, p2p)
    kinds = dict(zip(g.nodes["event_id"].to_list(), g.nodes["kind"].to_list(), strict=True))
    assert kinds == {5: "collective", 6: "kernel", 7: "kernel", 8: "host", 9: "memcpy"}
    nid = dict(zip(g.nodes["event_id"].to_list(), g.nodes["node_id"].to_list(), strict=True))
    assert sorted(g.edges.select("kind", "src", "dst", "anchor").rows()) == sorted(
        [
            ("data", nid[5], nid[6], "end"),
            ("ctrl", nid[6], nid[7], "end"),
            ("data", nid[8], nid[9], "end"),
            ("comm", nid[5], nid[6], "start"),
        ]
    )


# -- independent walk of raw Kineto JSON -------------------------------------------------------


class RawEvent:
    def __init__(self, e: dict, base: int) -> None:
        self.name: str = e.get("name", "")
        self.cat: str = (e.get("cat") or "").lower()
        self.ts = base + round(Decimal(e["ts"]) * 1000)
        self.end = self.ts + round(Decimal(e.get("dur", 0)) * 1000)
        self.args: dict = e.get("args") or {}
        self.children: list[RawEvent] = []


def raw_kineto(path: Path) -> tuple[dict[tuple, list[RawEvent]], list[dict]]:
    """Per thread (pid, tid): the top-level events with their children, from a stack walk."""
    doc = json.loads(gzip.decompress(path.read_bytes()), parse_float=Decimal)
    base = int(doc.get("baseTimeNanoseconds") or 0)
    by_thread: dict[tuple, list[RawEvent]] = defaultdict(list)
    for e in doc["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") == "Trace" or (e.get("cat") or "") in STREAM_CATS:
            continue
        if str(e.get("pid")) in ("Spans", "Traces"):
            continue
        by_thread[(str(e["pid"]), str(e["tid"]))].append(RawEvent(e, base))
    roots: dict[tuple, list[RawEvent]] = {}
    for key, evs in by_thread.items():
        evs.sort(key=lambda x: (x.ts, -(x.end - x.ts)))
        top: list[RawEvent] = []
        stack: list[RawEvent] = []
        for ev in evs:
            while stack and stack[-1].end <= ev.ts:
                stack.pop()
            (stack[-1].children if stack else top).append(ev)
            if stack:
                ev.end = min(ev.end, stack[-1].end)  # an overrunning child ends with its parent
            stack.append(ev)
        roots[key] = top
    return roots, doc["traceEvents"]


def host_nodes(
    roots: list[RawEvent], is_comm: Callable[[RawEvent], bool]
) -> list[tuple[str, RawEvent]]:
    """Outermost cpu_op/runtime/comm events; an op enclosing a comm gives way to its children."""

    def has_comm(ev: RawEvent) -> bool:
        return any(is_comm(c) or has_comm(c) for c in ev.children)

    out: list[tuple[str, RawEvent]] = []

    def visit(evs: list[RawEvent]) -> None:
        for ev in evs:
            if is_comm(ev):
                out.append(("comm", ev))
            elif ev.cat in ("cpu_op", "cuda_runtime", "cuda_driver") and not has_comm(ev):
                out.append(("host", ev))
            else:
                visit(ev.children)

    visit(roots)
    return out


def check_kineto_rank(
    store: Store, run: str, rank: int, path: Path, is_comm: Callable[[RawEvent], bool]
) -> dict[str, int]:
    """Compare one rank's graph with the raw file; return the measured counts."""
    roots, raw_events = raw_kineto(path)
    expected = Counter()
    names = Counter()
    for top in roots.values():
        for kind, ev in host_nodes(top, is_comm):
            expected[kind] += 1
            names[ev.name] += 1
    nodes = store.con.sql(
        "SELECT n.* FROM graph_node n JOIN run r USING (run_id) WHERE r.name = $1 AND n.rank = $2",
        params=[run, rank],
    ).pl()
    comm_kinds = ("collective", "send", "recv")
    host = nodes.filter(pl.col("kind").is_in(["host", *comm_kinds]))
    assert host.filter(pl.col("kind") == "host").height == expected["host"]
    assert host.filter(pl.col("kind").is_in(comm_kinds)).height == expected["comm"]
    n_comm = q(
        store,
        "SELECT (SELECT count(*) FROM collective c WHERE c.run_id = r.run_id AND c.rank = ?)"
        " + (SELECT count(*) FROM p2p p WHERE p.run_id = r.run_id AND p.rank = ?)"
        " FROM run r WHERE r.name = ?",
        rank,
        rank,
        run,
    )[0][0]
    assert expected["comm"] == n_comm
    assert Counter(host["name"].to_list()) == names
    # Device nodes: every kernel/memcpy/memset of the raw file.
    device = Counter(e.get("cat") for e in raw_events if e.get("cat") in DEVICE_CATS)
    assert nodes.filter(pl.col("kind") == "kernel").height == device["kernel"]
    assert nodes.filter(pl.col("kind") == "memcpy").height == device["gpu_memcpy"]
    assert nodes.filter(pl.col("kind") == "memset").height == device["gpu_memset"]

    edges = store.con.sql(
        "SELECT e.* FROM graph_edge e JOIN run r USING (run_id) WHERE r.name = $1 AND e.rank = $2",
        params=[run, rank],
    ).pl()
    assert edges["delay"].min() is None or edges["delay"].min() >= 0
    by_id = {r["node_id"]: r for r in nodes.iter_rows(named=True)}
    # program: per thread, host nodes - 1, delays = recorded gaps.
    prog = edges.filter(pl.col("kind") == "program")
    threads_with_nodes = host["track_id"].n_unique()
    assert prog.height == host.height - threads_with_nodes
    for e in prog.iter_rows(named=True):
        a, b = by_id[e["src"]], by_id[e["dst"]]
        assert a["track_id"] == b["track_id"]
        assert a["ts"] <= b["ts"]
        if e["anchor"] == "end":
            assert e["delay"] == b["ts"] - (a["ts"] + a["dur"])
        else:
            assert e["delay"] == b["ts"] - a["ts"]
    # stream: device nodes per stream - 1.
    dev = nodes.filter(pl.col("kind").is_in(["kernel", "memcpy", "memset"]))
    assert (
        edges.filter(pl.col("kind") == "stream").height == dev.height - dev["track_id"].n_unique()
    )
    # launch: each device op whose launch is in the raw file has exactly one incoming launch (or
    # comm, for a communication's own kernel) edge, from the host node enclosing the launch.
    launch_ts = {
        e["args"]["correlation"]: round(Decimal(e["ts"]) * 1000)
        for e in raw_events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "correlation" in (e.get("args") or {})
    }
    base = json.loads(gzip.decompress(path.read_bytes())).get("baseTimeNanoseconds") or 0
    corr = dict(
        q(
            store,
            "SELECT e.event_id, e.correlation FROM event e JOIN run r USING (run_id)"
            " WHERE r.name = ? AND e.rank = ? AND e.category IN ('kernel', 'memcpy', 'memset')",
            run,
            rank,
        )
    )
    incoming = (
        edges.filter(pl.col("kind").is_in(["launch", "comm"]))
        .group_by("dst")
        .agg(pl.col("src"), pl.col("kind"), pl.col("delay"))
    )
    inc = {r["dst"]: r for r in incoming.iter_rows(named=True)}
    launched = 0
    for n in dev.iter_rows(named=True):
        c = corr[n["event_id"]]
        if c not in launch_ts:
            assert n["node_id"] not in inc or inc[n["node_id"]]["kind"] == ["comm"]
            continue
        launched += 1
        row = inc[n["node_id"]]
        launchers = [s for s, k in zip(row["src"], row["kind"], strict=True) if k == "launch"]
        comm = [s for s, k in zip(row["src"], row["kind"], strict=True) if k == "comm"]
        assert len(launchers) + len(comm) >= 1
        src = by_id[(launchers or comm)[0]]
        t = launch_ts[c] + int(base)
        assert src["ts"] <= t <= src["ts"] + src["dur"]
        assert len(launchers) <= 1
    return {
        "host": expected["host"],
        "comm": expected["comm"],
        "device": dev.height,
        "launched": launched,
        "edges": edges.height,
    }


def is_prism_comm(ev: RawEvent) -> bool:
    return ev.name.startswith("prism_comm:")


# -- the bundled sample (always runs) ----------------------------------------------------------


@pytest.fixture(scope="module")
def sample(sample_store: Store) -> Store:
    """The module's own copy of the sample store (conftest: ingested once per test run)."""
    return sample_store


def test_sample_graph_matches_raw_json(sample: Store) -> None:
    report = build_graph(sample, "sample")
    assert sorted(report.ranks) == list(range(8))
    for rank in range(8):
        got = check_kineto_rank(sample, "sample", rank, SAMPLE / f"rank{rank}.kineto.json.gz",
                                is_prism_comm)  # fmt: skip
        assert got["device"] == 0
        assert got["comm"] > 0
        rg = report.ranks[rank]
        assert rg.rule == "kineto"
        assert rg.comm_without_kernel == got["comm"]  # gloo on CPU: no kernels
        assert rg.nodes.get("send", 0) + rg.nodes.get("recv", 0) > 0
    # comm nodes carry the collective's facts.
    bad = q(
        sample,
        "SELECT count(*) FROM graph_node n JOIN collective c"
        " ON c.run_id = n.run_id AND c.rank = n.rank AND c.event_id = n.event_id"
        " WHERE n.kind <> 'collective' OR n.group_id <> c.group_id OR n.seq <> c.seq"
        " OR n.msg_bytes IS DISTINCT FROM c.msg_bytes OR n.comm_kind <> c.kind",
    )
    assert bad == [(0,)]
    bad = q(
        sample,
        "SELECT count(*) FROM graph_node n JOIN p2p p"
        " ON p.run_id = n.run_id AND p.rank = n.rank AND p.event_id = n.event_id"
        " WHERE n.kind <> p.direction OR n.peer <> p.peer OR n.seq <> p.seq"
        " OR n.msg_bytes IS DISTINCT FROM p.bytes",
    )
    assert bad == [(0,)]


def test_rebuild_replaces_the_rows(sample: Store) -> None:
    first = build_graph(sample, "sample")
    second = build_graph(sample, "sample")
    assert first.nodes == second.nodes
    assert first.edges == second.edges
    assert q(sample, "SELECT count(*) FROM graph_node") == [(first.nodes,)]
    assert q(sample, "SELECT count(*) FROM graph_edge") == [(first.edges,)]
    # node ids are dense per rank and every edge joins two nodes of its rank
    assert q(
        sample,
        "SELECT count(*) FROM (SELECT rank, max(node_id) + 1 - count(*) AS d FROM graph_node"
        " GROUP BY rank) WHERE d <> 0",
    ) == [(0,)]
    assert q(
        sample,
        "SELECT count(*) FROM graph_edge e WHERE NOT EXISTS (SELECT 1 FROM graph_node n"
        " WHERE n.run_id = e.run_id AND n.rank = e.rank AND n.node_id = e.src)"
        " OR NOT EXISTS (SELECT 1 FROM graph_node n"
        " WHERE n.run_id = e.run_id AND n.rank = e.rank AND n.node_id = e.dst)",
    ) == [(0,)]


def test_unknown_run_is_refused(sample: Store) -> None:
    with pytest.raises(RunNotFoundError, match="no run named 'nope'"):
        build_graph(sample, "nope")


# -- real traces -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(
    shared_datasets: Path, tmp_path_factory: pytest.TempPathFactory, dlrm_hta_template: Path
) -> Store:
    """dlrm and hta (a copy of the conftest template), then the Chakra ring and ST ingested here."""
    from tests.conftest import copy_of_template

    s = open_store(copy_of_template(dlrm_hta_template, tmp_path_factory, "graph_real"))
    sets = {
        "ring": ["chakra-et/astrasim_et_examples/custom_ring_allreduce_8npus_1MB"],
        "st": ["megatron-straggler-st-8rank"],
    }
    for run, rel in sets.items():
        ingest(s, [shared_datasets / p for p in rel], run=run, progress=False)
    return s


def _old_nccl_comm(ev: RawEvent) -> bool:
    """record_param_comms enclosing an ``nccl:<op>`` annotation (PyTorch < 2.1)."""

    def marks(e: RawEvent) -> bool:
        return any(
            (c.cat == "user_annotation" and c.name.startswith("nccl:")) or marks(c)
            for c in e.children
        )

    return ev.name == "record_param_comms" and marks(ev)


def _new_comm(ev: RawEvent) -> bool:
    return ev.name == "record_param_comms" and ev.args.get("Collective name") not in (None, "wait")


@pytest.mark.shared_data
def test_dlrm_graph_matches_raw_json(real: Store, shared_datasets: Path) -> None:
    report = build_graph(real, "dlrm")
    files = sorted((shared_datasets / "param-dlrm-8rank" / "kineto").iterdir())
    for f in files:
        rank = int(re.match(r"worker(\d+)_", f.name).group(1))  # type: ignore[union-attr]
        got = check_kineto_rank(real, "dlrm", rank, f, _old_nccl_comm)
        rg = report.ranks[rank]
        assert got["comm"] == 8
        assert rg.nodes["collective"] == 8
        assert rg.edges["comm"] == 8
        assert rg.comm_without_kernel == 0
        assert rg.unlaunched_device == got["device"] - got["launched"]


@pytest.mark.shared_data
def test_hta_graph_matches_raw_json(real: Store, shared_datasets: Path) -> None:
    report = build_graph(real, "hta")
    got = check_kineto_rank(
        real, "hta", 0, shared_datasets / "hta-nccl-rank0" / "nccl_data.json.gz", _new_comm
    )
    rg = report.ranks[0]
    assert got["comm"] == 21
    assert rg.edges["comm"] == 21
    assert rg.unlaunched_device == got["device"] - got["launched"]
    # the one cudaDeviceSynchronize waits for every stream with launched work before it
    assert rg.edges["sync"] >= 1


@pytest.mark.shared_data
def test_chakra_ring_graph(real: Store) -> None:
    report = build_graph(real, "ring")
    assert q(
        real, "SELECT count(*) FROM graph_node n JOIN run r USING (run_id) WHERE r.name = 'ring'"
    ) == q(real, "SELECT count(*) FROM event e JOIN run r USING (run_id) WHERE r.name = 'ring'")
    for rank, rg in report.ranks.items():
        assert rg.rule == "chakra"
        assert rg.nodes["send"] == rg.nodes["recv"] == 14
        assert rg.edges == {"data": q(
            real,
            "SELECT count(*) FROM flow f JOIN run r USING (run_id)"
            " WHERE r.name = 'ring' AND f.rank = ? AND f.kind = 'data'",
            rank,
        )[0][0]}  # fmt: skip
    # data edges are the flows, node for node
    assert q(
        real,
        """SELECT count(*) FROM flow f JOIN run r USING (run_id)
           JOIN graph_node s ON s.run_id = f.run_id AND s.rank = f.rank
                            AND s.event_id = f.src_event_id
           JOIN graph_node d ON d.run_id = f.run_id AND d.rank = f.rank
                            AND d.event_id = f.dst_event_id
           JOIN graph_edge e ON e.run_id = f.run_id AND e.rank = f.rank AND e.src = s.node_id
                            AND e.dst = d.node_id AND e.kind = f.kind
           WHERE r.name = 'ring'""",
    ) == [(272,)]


@pytest.mark.shared_data
def test_megatron_timeline_graph(real: Store, shared_datasets: Path) -> None:
    report = build_graph(real, "st")
    raw = pl.read_parquet(shared_datasets / "megatron-straggler-st-8rank" / "trace-ST.parquet")
    per_rank = raw.group_by("rank").len()
    for rank, n in per_rank.iter_rows():
        rg = report.ranks[rank]
        assert rg.rule == "op_timeline"
        assert sum(rg.nodes.values()) == n
        assert rg.edges["program"] >= 1
        assert set(rg.edges) <= {"program", "stream", "data"}
    sends = raw.filter(pl.col("optype").cast(pl.Utf8).str.ends_with("-send")).height
    recvs = raw.filter(pl.col("optype").cast(pl.Utf8).str.ends_with("-recv")).height
    assert sum(r.nodes["send"] for r in report.ranks.values()) == sends
    assert sum(r.nodes["recv"] for r in report.ranks.values()) == recvs
    clips = raw.filter(pl.col("optype") == "optimizer-clip-main-grad").height
    assert q(
        real,
        "SELECT count(*) FROM graph_node n JOIN run r USING (run_id) JOIN comm_group g"
        " ON g.run_id = n.run_id AND g.group_id = n.group_id WHERE r.name = 'st'"
        " AND n.name = 'optimizer-clip-main-grad' AND n.kind = 'collective' AND g.size = 8",
    ) == [(clips,)]
    # delays: every edge from an op's end, equal per destination to the recorded start minus the
    # latest end of all its sources (the own delay; 0 where clock jitter makes it negative)
    assert q(
        real,
        """SELECT count(*) FROM (
               SELECT e.rank, e.dst, min(e.delay) AS lo, max(e.delay) AS hi,
                      greatest(0, min(b.ts) - max(a.ts + a.dur)) AS gap,
                      bool_and(e.anchor = 'end') AS from_end
               FROM graph_edge e JOIN run r USING (run_id)
               JOIN graph_node a ON a.run_id = e.run_id AND a.rank = e.rank AND a.node_id = e.src
               JOIN graph_node b ON b.run_id = e.run_id AND b.rank = e.rank AND b.node_id = e.dst
               WHERE r.name = 'st' GROUP BY e.rank, e.dst)
           WHERE lo <> hi OR lo <> gap OR NOT from_end""",
    ) == [(0,)]
    # Megatron's schedule: forward-compute of microbatch m on a stage > 0 depends on its
    # forward-recv
    args = q(
        real,
        """SELECT count(*) FROM graph_edge e JOIN run r USING (run_id)
           JOIN graph_node a ON a.run_id = e.run_id AND a.rank = e.rank AND a.node_id = e.src
           JOIN graph_node b ON b.run_id = e.run_id AND b.rank = e.rank AND b.node_id = e.dst
           JOIN event ea ON ea.run_id = a.run_id AND ea.rank = a.rank AND ea.event_id = a.event_id
           JOIN event eb ON eb.run_id = b.run_id AND eb.rank = b.rank AND eb.event_id = b.event_id
           WHERE r.name = 'st' AND a.name = 'forward-recv' AND b.name = 'forward-compute'
             AND json_extract(ea.args, '$.seq_id')::INT = json_extract(eb.args, '$.mb_id')::INT""",
    )[0][0]
    fwd_on_later_stages = raw.filter(
        (pl.col("optype") == "forward-compute") & (pl.col("stage") > 0)
    ).height
    assert args == fwd_on_later_stages


@pytest.mark.shared_data
def test_host_et_only_rank_is_refused(shared_datasets: Path, tmp_path: Path) -> None:
    s = open_store(tmp_path / "et.duckdb")
    ingest(s, [shared_datasets / "param-dlrm-8rank" / "et" / "dlrm_eg_0.json.gz"], run="et",
           progress=False)  # fmt: skip
    with pytest.raises(RunStateError, match=r"rank 0 has no timeline \(host ET only\)"):
        build_graph(s, "et")
    assert q(s, "SELECT count(*) FROM graph_node") == [(0,)]

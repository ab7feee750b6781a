"""Chakra ET export: files every Chakra reader accepts, and a lossless round trip through ingest."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd

from prism_trace.errors import OutputError, PrismError
from prism_trace.export.chakra.rules import CTRL_EDGE_KINDS, SYNC_EDGE_KINDS, ChakraExportError
from prism_trace.export.chakra.writer import ExportReport, export_chakra
from prism_trace.formats.chakra.tables import NODE_COUNT_ATTR
from prism_trace.formats.host_et.comms import PG_INIT_NAME
from prism_trace.graph.build import build_graph
from prism_trace.ingestion.pipeline import ingest
from prism_trace.layout.mesh import ParallelLayout
from prism_trace.slicing.slicer import slice_run
from prism_trace.store.connection import Store, open_store
from tests.conftest import sample_copy

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"

RING = "chakra-et/astrasim_et_examples/custom_ring_allreduce_8npus_1MB"
KIND_AFTER = {"memset": "memcpy"}
"""Node kinds that read back as another (MEM_STORE_NODE is a memcpy to the reader)."""


def q(store: Store, sql: str, *params: object) -> list[tuple[Any, ...]]:
    return store.con.execute(sql, list(params)).fetchall()


def run_id(store: Store, name: str) -> int:
    return int(q(store, "SELECT run_id FROM run WHERE name = ?", name)[0][0])


# -- what a Chakra consumer sees -------------------------------------------------------------


def attrs(msg: pb.Node | pb.GlobalMetadata) -> dict[str, tuple[str | None, Any]]:
    out = {}
    for a in msg.attr:
        which = a.WhichOneof("value")
        out[a.name] = (which, getattr(a, which) if which else None)
    return out


def scorecard(path: Path) -> Counter[str]:
    """Decode ``path`` with protolib and check what ASTRA-sim's feeder reads, with its types."""
    fh = openFileRd(str(path))
    gm = pb.GlobalMetadata()
    assert decodeMessage(fh, gm), path
    assert gm.version == "0.0.4"
    ga = attrs(gm)
    assert ga["schema"][0] == "string_val"
    assert ga["world_size"][0] == "int64_val"
    seen: Counter[str] = Counter()
    node = pb.Node()
    while decodeMessage(fh, node):
        a = attrs(node)
        seen[pb.NodeType.Name(node.type)] += 1
        if node.name == PG_INIT_NAME:
            assert node.type == pb.METADATA_NODE
            continue
        assert a["is_cpu_op"][0] == "bool_val"
        if node.type == pb.COMM_COLL_NODE:
            assert a["comm_type"][0] == "int64_val", (path, node.id)
            assert a["comm_size"][0] == "int64_val", (path, node.id)
            assert a["pg_name"][0] == "string_val", (path, node.id)
            assert a["is_cpu_op"][1] is False
        if node.type in (pb.COMM_SEND_NODE, pb.COMM_RECV_NODE):
            for name in ("comm_src", "comm_dst", "comm_tag"):
                assert a[name][0] == "int32_val", (path, node.id, name)
            assert a["comm_size"][0] == "int64_val"
    fh.close()
    assert seen[pb.NodeType.Name(pb.METADATA_NODE)] <= 1
    # the node count prism's reader checks (a cut at a record boundary is refused)
    assert ga[NODE_COUNT_ATTR] == ("int64_val", sum(seen.values())), path
    assert_acyclic(path)
    return seen


def assert_acyclic(path: Path) -> None:
    """No cycle over ``data_deps`` and ``ctrl_deps``: a feeder that follows both never stalls."""
    fh = openFileRd(str(path))
    decodeMessage(fh, pb.GlobalMetadata())
    deps: dict[int, list[int]] = {}
    node = pb.Node()
    while decodeMessage(fh, node):
        deps[node.id] = list(node.data_deps) + list(node.ctrl_deps)
        assert all(d in deps for d in deps[node.id]), (path, node.id)  # parents come first
        node = pb.Node()
    fh.close()


def scorecard_dir(folder: Path) -> int:
    files = sorted(folder.glob("*.et"))
    assert files
    for f in files:
        scorecard(f)
    return len(files)


# -- the round trip ----------------------------------------------------------------------------


def graph_nodes(store: Store, rid: int, rank: int) -> dict[int, dict[str, Any]]:
    cols = ["node_id", "kind", "name", "dur", "comm_kind", "msg_bytes", "group_id", "peer"]
    cols += ["event_id"]
    rows = q(
        store,
        f"SELECT {', '.join(cols)} FROM graph_node WHERE run_id = ? AND rank = ?",
        rid,
        rank,
    )
    return {r[0]: dict(zip(cols, r, strict=True)) for r in rows}


def graph_edges(store: Store, rid: int, rank: int) -> list[tuple[int, int, str, str, int]]:
    return [
        (int(s), int(d), k, a, int(w or 0))
        for s, d, k, a, w in q(
            store,
            "SELECT src, dst, kind, anchor, delay FROM graph_edge WHERE run_id = ? AND rank = ?",
            rid,
            rank,
        )
    ]


def groups(store: Store, rid: int) -> dict[int, tuple[str, str | None, list[int]]]:
    rows = q(store, "SELECT group_id, name, axis, ranks FROM comm_group WHERE run_id = ?", rid)
    return {g: (name, axis, sorted(ranks or [])) for g, name, axis, ranks in rows}


def micros_ns(dur: int | None) -> int | None:
    """The documented rounding: half up to whole µs, a positive duration at least 1 µs."""
    if not dur or dur <= 0:
        return None
    return max(1, (dur + 500) // 1000) * 1000


def roundtrip(
    store: Store,
    run: str,
    tmp: Path,
    *,
    member_group: Any = None,
    member_peer: Any = None,
) -> ExportReport:
    """Export ``run``, ingest the folder, rebuild the graph; assert the same graph per rank.

    ``member_group(rank, exemplar_group_id) -> (name, ranks)`` and ``member_peer(rank, peer)``
    give the expected concrete group and peer of a sliced run's member (identity otherwise).
    """
    out = tmp / f"{run}_et"
    report = export_chakra(store, run=run, out_dir=out)
    assert report.files == scorecard_dir(out)
    back = f"{run}_back"
    ingest(store, [out], run=back, progress=False)
    build_graph(store, back)
    src_id, back_id = run_id(store, run), run_id(store, back)
    src_groups, back_groups = groups(store, src_id), groups(store, back_id)
    ranks = q(store, "SELECT rank, class_id FROM rank WHERE run_id = ? ORDER BY rank", src_id)
    assert [r for r, _ in ranks] == [
        r for (r,) in q(store, "SELECT rank FROM rank WHERE run_id = ? ORDER BY rank", back_id)
    ]
    for rank, class_id in ranks:
        graph_rank = rank if class_id is None else class_id
        orig = graph_nodes(store, src_id, graph_rank)
        new = graph_nodes(store, back_id, rank)
        meta = [n for n in new.values() if n["name"] == PG_INIT_NAME]
        assert len(meta) <= 1
        by_src = {n["event_id"]: n for n in new.values() if n["name"] != PG_INIT_NAME}
        # Same nodes, kinds (modulo KIND_AFTER) and durations (µs rounding).
        assert set(by_src) == set(orig), rank
        assert Counter(KIND_AFTER.get(n["kind"], n["kind"]) for n in orig.values()) == Counter(
            n["kind"] for n in by_src.values()
        )
        for nid, o in orig.items():
            n = by_src[nid]
            assert n["kind"] == KIND_AFTER.get(o["kind"], o["kind"]), (rank, nid)
            assert n["name"] == o["name"]
            assert n["dur"] == micros_ns(o["dur"]), (rank, nid, o["dur"], n["dur"])
            if o["kind"] in ("collective", "send", "recv"):
                # A recorded size comes back; a missing one comes back as the size rule's.
                assert n["msg_bytes"] == o["msg_bytes"] if o["msg_bytes"] else n["msg_bytes"] > 0
            if o["kind"] == "collective":
                assert n["comm_kind"] == o["comm_kind"]
                if member_group is None:
                    want = src_groups[o["group_id"]]
                    want_name, want_ranks = want[0], want[2]
                else:
                    want_name, want_ranks = member_group(rank, o["group_id"])
                got_name, _, got_ranks = back_groups[n["group_id"]]
                assert (got_name, got_ranks) == (want_name, want_ranks), (rank, nid)
                assert rank in got_ranks
            if o["kind"] in ("send", "recv"):
                want_peer = o["peer"] if member_peer is None else member_peer(rank, o["peer"])
                assert n["peer"] == want_peer, (rank, nid)
        # Same edges, one to one: kind, anchor and delay (prism_deps), not only Chakra's deps.
        node_of = {n["node_id"]: n["event_id"] for n in new.values()}
        want_edges = Counter(
            (s, d, k, a or "end", w) for s, d, k, a, w in graph_edges(store, src_id, graph_rank)
        )
        got_edges = Counter(
            (node_of[s], node_of[d], k, a, w) for s, d, k, a, w in graph_edges(store, back_id, rank)
        )
        assert got_edges == want_edges, rank
    # In the files, each edge is one Chakra dependency by the mapping's table (plus order_deps).
    want_deps: Counter[str] = Counter()
    for rank, class_id in ranks:
        for _, _, k, _, _ in graph_edges(store, src_id, rank if class_id is None else class_id):
            kind = "data_deps"
            kind = "ctrl_deps" if k in CTRL_EDGE_KINDS else kind
            kind = "sync_deps" if k in SYNC_EDGE_KINDS else kind
            want_deps[kind] += 1
    want_deps["data_deps"] += report.order_deps
    assert +want_deps == Counter(report.deps)
    # Every p2p send finds its receive across the files.
    unpaired = q(store, "SELECT count(*) FROM p2p_pair WHERE run_id = ? AND NOT paired", back_id)
    assert unpaired == [(0,)]
    return report


# -- tests -------------------------------------------------------------------------------------


def test_sample_roundtrip(sample_store: Store, tmp_path: Path) -> None:
    report = roundtrip(sample_store, "sample", tmp_path)
    assert report.kind == "recorded"
    assert report.files == 8
    assert report.templates == 8
    assert report.prefix == "sample"
    assert report.node_types["COMM_COLL_NODE"] > 0
    assert report.as_dict()["files"] == 8
    assert "8 Chakra ET files" in report.summary()
    names = sorted(p.name for p in (tmp_path / "sample_et").iterdir())
    want = ["comm_groups.json", *(f"sample.{r}.et" for r in sorted(range(8), key=str))]
    assert names == want


def test_file_cut_at_a_record_boundary_is_refused(sample_store: Store, tmp_path: Path) -> None:
    """A cut that leaves whole records is a valid shorter graph but for the node count."""
    out = tmp_path / "et"
    export_chakra(sample_store, run="sample", out_dir=out, prefix="cut")
    victim = out / "cut.3.et"
    data = victim.read_bytes()
    ends, pos = [], 0
    while pos < len(data):  # record ends: varint length, then the message
        size, shift = 0, 0
        while True:
            b = data[pos]
            pos += 1
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        pos += size
        ends.append(pos)
    victim.write_bytes(data[: ends[len(ends) // 2]])
    (out / "comm_groups.json").unlink()
    with open_store(tmp_path / "s.duckdb") as store, pytest.raises(PrismError) as exc:
        ingest(store, [out], run="cut", progress=False)
    assert "cut.3.et" in str(exc.value)
    assert f"its metadata `{NODE_COUNT_ATTR}` says" in str(exc.value)
    assert "truncated" in str(exc.value)


def test_sliced_roundtrip_members_own_groups_and_peers(sample_store: Store, tmp_path: Path) -> None:
    layout = ParallelLayout.parse("tp=2,dp=4,pp=2")
    slice_run(sample_store, run="sample", layout=layout, world=16, out_run="sample_x16")
    sid = run_id(sample_store, "sample_x16")
    sliced_groups = groups(sample_store, sid)
    class_of = dict(q(sample_store, "SELECT rank, class_id FROM rank WHERE run_id = ?", sid))

    def member_group(rank: int, gid: int) -> tuple[str, list[int]]:
        axis = sliced_groups[gid][1]
        (hit,) = [(n, rs) for n, a, rs in sliced_groups.values() if a == axis and rank in rs]
        return hit

    def member_peer(rank: int, peer: int) -> int:
        ex = class_of[rank]
        c = layout.coords([rank, ex, peer])
        coords = {a: int(v[2]) for a, v in c.items()}
        coords["dp"] = (int(c["dp"][2]) + int(c["dp"][0]) - int(c["dp"][1])) % layout.dp
        return int(layout.rank_of(coords))

    report = roundtrip(
        sample_store,
        "sample_x16",
        tmp_path,
        member_group=member_group,
        member_peer=member_peer,
    )
    assert report.kind == "sliced"
    assert report.files == 16
    assert report.templates == 4
    # A member of a class names its own groups, not its exemplar's.
    member = next(r for r, c in class_of.items() if r != c)
    ex = class_of[member]
    fh = openFileRd(str(tmp_path / "sample_x16_et" / f"sample_x16.{member}.et"))
    gm = pb.GlobalMetadata()
    decodeMessage(fh, gm)
    assert attrs(gm)["rank"] == ("int64_val", member)
    assert attrs(gm)["class_id"] == ("int64_val", ex)
    names, node = set(), pb.Node()
    while decodeMessage(fh, node):
        a = attrs(node)
        if "pg_name" in a:
            names.add(a["pg_name"][1])
    fh.close()
    # pg_name is ASTRA-sim's decimal id: the n-th group by group_id, listed in comm_groups.json.
    table = json.loads((tmp_path / "sample_x16_et" / "comm_groups.json").read_text())
    astra_name = {str(i + 1): sliced_groups[g][0] for i, g in enumerate(sorted(sliced_groups))}
    own = {n for n, _, rs in sliced_groups.values() if member in rs}
    assert names
    assert all(member in table[n] for n in names)
    assert {astra_name[n] for n in names} <= own


def test_unknown_collective_kind_is_named(sample_store: Store, tmp_path: Path) -> None:
    rid = run_id(sample_store, "sample")
    ((nid, rank, kind),) = q(
        sample_store,
        "SELECT node_id, rank, comm_kind FROM graph_node WHERE run_id = ?"
        " AND kind = 'collective' ORDER BY rank, node_id LIMIT 1",
        rid,
    )
    sql = "UPDATE graph_node SET comm_kind = ? WHERE run_id = ? AND rank = ? AND node_id = ?"
    sample_store.con.execute(sql, ["all_to_allv", rid, rank, nid])
    try:
        with pytest.raises(ChakraExportError, match=rf"node {nid} .*'all_to_allv'") as exc:
            export_chakra(sample_store, run="sample", out_dir=tmp_path / "bad")
        assert isinstance(exc.value, PrismError)
        assert f"rank {rank}" in str(exc.value)
    finally:
        sample_store.con.execute(sql, [kind, rid, rank, nid])


def test_refuses_stray_rank_files(sample_store: Store, tmp_path: Path) -> None:
    (tmp_path / "sample.99.et").write_bytes(b"")
    with pytest.raises(OutputError, match=r"sample\.99\.et"):
        export_chakra(sample_store, run="sample", out_dir=tmp_path)
    with pytest.raises(ChakraExportError, match="prefix"):
        export_chakra(sample_store, run="sample", out_dir=tmp_path / "x", prefix="a/b")


@pytest.mark.slow
def test_builds_missing_graph_and_sanitises_prefix(tmp_path: Path, sample_template: Path) -> None:
    store = sample_copy(sample_template, tmp_path / "s.duckdb", run="my run/1")
    report = export_chakra(store, run="my run/1", out_dir=tmp_path / "out")
    assert report.built_graph
    assert report.prefix == "my_run_1"
    assert (tmp_path / "out" / "my_run_1.0.et").is_file()


@pytest.fixture(scope="module")
def shared_store(
    tmp_path_factory: pytest.TempPathFactory, shared_datasets: Path, dlrm_hta_template: Path
) -> Store:
    """dlrm (and hta) from a copy of the conftest template, and the Chakra ring as `ring`."""
    from tests.conftest import copy_of_template

    store = open_store(copy_of_template(dlrm_hta_template, tmp_path_factory, "export"))
    ingest(store, [shared_datasets / RING], run="ring", progress=False)
    return store


def comm_sequences(folder: Path) -> dict[str, dict[int, list[tuple[int, int]]]]:
    """Per group (pg_name), per rank: (comm_type, comm_size) of its collectives in file order."""
    out: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for path in sorted(folder.glob("*.et")):
        fh = openFileRd(str(path))
        gm = pb.GlobalMetadata()
        decodeMessage(fh, gm)
        rank = attrs(gm)["rank"][1]
        node = pb.Node()
        while decodeMessage(fh, node):
            a = attrs(node)
            if node.type == pb.COMM_COLL_NODE:
                seq = out.setdefault(a["pg_name"][1], {}).setdefault(rank, [])
                seq.append((a["comm_type"][1], a["comm_size"][1]))
            node = pb.Node()
        fh.close()
    return out


@pytest.mark.shared_data
def test_dlrm_roundtrip(shared_store: Store, tmp_path: Path) -> None:
    report = roundtrip(shared_store, "dlrm", tmp_path)
    # The file order is the order ASTRA-sim issues communication in (order_deps chain it):
    # every rank of a group issues the group's collectives in one order.
    seqs = comm_sequences(tmp_path / "dlrm_et")
    assert seqs
    for per_rank in seqs.values():
        first = next(iter(per_rank.values()))
        assert all(s == first for s in per_rank.values())
    assert report.order_deps > 0
    # GPU graph: kernels, memcpy/memset, launch/stream/sync edges all make it through.
    assert "MEM_LOAD_NODE" not in report.node_types  # copies are COMP_NODEs for ASTRA-sim
    assert report.deps["sync_deps"] > 0
    assert "ctrl_deps" not in report.deps


@pytest.mark.shared_data
def test_chakra_ring_roundtrip(shared_store: Store, tmp_path: Path) -> None:
    report = roundtrip(shared_store, "ring", tmp_path)
    assert report.node_types["COMM_SEND_NODE"] == report.node_types["COMM_RECV_NODE"] > 0


@pytest.mark.slow
def test_edge_kind_without_a_code_round_trips(tmp_path: Path, sample_template: Path) -> None:
    """A kind outside ``prism_deps``' code table is spelled out in ``prism_dep_kinds``."""
    store = sample_copy(sample_template, tmp_path / "k.duckdb", run="k")
    build_graph(store, "k")
    rid = run_id(store, "k")
    ((src, dst),) = q(
        store,
        "SELECT src, dst FROM graph_edge WHERE run_id = ? AND rank = 0 ORDER BY dst LIMIT 1",
        rid,
    )
    store.con.execute(
        "UPDATE graph_edge SET kind = 'overlap', anchor = 'start', delay = 7"
        " WHERE run_id = ? AND rank = 0 AND src = ? AND dst = ?",
        [rid, src, dst],
    )
    roundtrip(store, "k", tmp_path)
    back = run_id(store, "k_back")
    kinds = q(
        store,
        "SELECT kind, anchor, delay FROM graph_edge WHERE run_id = ? AND kind = 'overlap'",
        back,
    )
    assert kinds == [("overlap", "start", 7)]


@pytest.mark.slow
def test_cli_size_bandwidth_and_bad_value(tmp_path: Path, sample_template: Path) -> None:
    import json as _json

    from click.testing import CliRunner

    from prism_trace.cli import main

    store = sample_copy(sample_template, tmp_path / "c.duckdb", run="c")
    store.close()
    db = str(tmp_path / "c.duckdb")
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "export",
            "chakra",
            db,
            "--run",
            "c",
            "-o",
            str(tmp_path / "o"),
            "--json",
            "--size-bandwidth",
            "25",
        ],
    )
    assert res.exit_code == 0, res.output
    out = _json.loads(res.output)
    assert out["size_bandwidth_gbps"] == 25.0
    assert out["comm_groups"] == 13
    assert out["warnings"] == []
    bad = runner.invoke(
        main,
        ["export", "chakra", db, "--run", "c", "-o", str(tmp_path / "p"), "--size-bandwidth", "0"],
    )
    assert bad.exit_code != 0
    assert "size bandwidth" in bad.output


@pytest.mark.slow
def test_all_gather_comm_size_is_each_members_input(tmp_path: Path, sample_template: Path) -> None:
    """An ALL_GATHER's ``comm_size`` is a member's input (ASTRA-sim and the PyTorch converter):
    the recorded nccl-tests size over the group size, rounded up, with the exact size kept in
    ``prism_msg_bytes`` where it is not a multiple; both read back to the recorded size."""
    store = sample_copy(sample_template, tmp_path / "g.duckdb", run="g")
    build_graph(store, "g")
    rid = run_id(store, "g")
    # The sample's all-gathers run in groups of 2 at 64 KiB; make every other one odd.
    store.con.execute(
        "UPDATE graph_node SET msg_bytes = 65537 WHERE run_id = ? AND comm_kind = 'all_gather'"
        " AND seq % 2 = 1",
        [rid],
    )
    sizes = Counter(
        q(
            store,
            "SELECT msg_bytes FROM graph_node WHERE run_id = ? AND comm_kind = 'all_gather'",
            rid,
        )
    )
    assert sizes == {(65536,): 16, (65537,): 16}
    roundtrip(store, "g", tmp_path)  # asserts every msg_bytes comes back
    written: Counter[tuple[int, int | None]] = Counter()
    for path in sorted((tmp_path / "g_et").glob("*.et")):
        fh = openFileRd(str(path))
        decodeMessage(fh, pb.GlobalMetadata())
        node = pb.Node()
        while decodeMessage(fh, node):
            a = attrs(node)
            if node.type == pb.COMM_COLL_NODE and a["comm_type"][1] == pb.ALL_GATHER:
                exact = a.get("prism_msg_bytes", (None, None))[1]
                written[(a["comm_size"][1], exact)] += 1
        fh.close()
    assert written == {(32768, None): 16, (32769, 65537): 16}

"""Chakra ET reader: real ASTRA-sim and converter files, hand-built graphs and broken inputs."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import decodeMessage, encodeMessage, openFileRd

from prism_trace.errors import RankUnknownError, TraceFormatError, TruncatedTraceError
from prism_trace.formats.base import FRAME_SCHEMAS
from prism_trace.formats.chakra.reader import rank_from_name, read_chakra
from prism_trace.formats.chakra.records import sniff_chakra
from prism_trace.ingestion.derive import fill_sizes

ASTRA = Path("chakra-et") / "astrasim_et_examples"
TESTS = Path("chakra-et") / "chakra_tests"
V101 = TESTS / "chakra.0.et_schema1.0.1_HEAD.gz"
V110 = TESTS / "chakra.0.et_schema1.1.0_commit-e366cf2.gz"
RING = ASTRA / "custom_ring_allreduce_8npus_1MB"
RESNET = ASTRA / "resnet50_dp_64npus_text_converted"


def _decode(path: Path) -> list[pb.Node]:
    """Every node of a file, decoded with Chakra's own protolib loop (independent of the reader)."""
    fh = openFileRd(str(path))
    decodeMessage(fh, pb.GlobalMetadata())
    nodes = []
    while True:
        node = pb.Node()
        if not decodeMessage(fh, node):
            break
        nodes.append(node)
    fh.close()
    return nodes


def _write_et(path: Path, nodes: list[pb.Node], attrs: dict[str, object] | None = None) -> Path:
    gm = pb.GlobalMetadata(version="0.0.4")
    for k, v in (attrs or {}).items():
        a = gm.attr.add(name=k)
        if isinstance(v, int):
            a.int64_val = v
        else:
            a.string_val = str(v)
    with path.open("wb") as fh:
        encodeMessage(fh, gm)
        for n in nodes:
            encodeMessage(fh, n)
    return path


def _node(nid: int, ntype: int, name: str = "", **attrs: object) -> pb.Node:
    node = pb.Node(id=nid, name=name or f"n{nid}", type=ntype)
    for k, v in attrs.items():
        a = node.attr.add(name=k)
        if isinstance(v, bool):
            a.bool_val = v
        elif isinstance(v, int):
            a.int64_val = v
        else:
            a.string_val = str(v)
    return node


# --- file names --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("all_reduce.3.et", 3),
        ("Resnet50_DataParallel.63.et", 63),
        ("chakra.0.et_schema1.0.1_HEAD.gz", 0),
        ("foo.bar.12.et.gz", 12),
        ("trace.et", None),
        ("rank3.json", None),
    ],
)
def test_rank_from_name(name: str, rank: int | None) -> None:
    assert rank_from_name(Path(name)) == rank


# --- real files ---------------------------------------------------------------------------------


@pytest.mark.shared_data
@pytest.mark.parametrize(
    "rel",
    [
        V101,
        V110,
        RING / "custom_allreduce.0.et",
        RESNET / "Resnet50_DataParallel.0.et",
        ASTRA / "microbenchmarks" / "all_to_all" / "4npus_1MB" / "all_to_all.2.et",
    ],
    ids=lambda p: p.name,
)
def test_node_and_edge_counts_match_protolib(shared_datasets: Path, rel: Path) -> None:
    path = shared_datasets / rel
    nodes = _decode(path)
    tables = read_chakra(path)
    want = Counter(pb.NodeType.Name(n.type) for n in nodes)
    assert tables.events.height == len(nodes)
    assert sorted(tables.events["event_id"].to_list()) == sorted(n.id for n in nodes)
    cats = Counter(tables.events["category"].to_list())
    assert cats["compute"] == want["COMP_NODE"]
    comm = want["COMM_COLL_NODE"] + want["COMM_SEND_NODE"] + want["COMM_RECV_NODE"]
    assert cats["comm"] == comm
    ids = {n.id for n in nodes}
    data = sum(1 for n in nodes for d in n.data_deps if d in ids and d != n.id)
    ctrl = sum(1 for n in nodes for d in n.ctrl_deps if d in ids and d != n.id)
    kinds = Counter(tables.flows["kind"].to_list())
    assert (kinds["data"], kinds["ctrl"]) == (data, ctrl)
    durs = {n.id: n.duration_micros * 1000 or None for n in nodes}
    assert dict(tables.events.select("event_id", "dur").iter_rows()) == durs
    assert tables.events["ts"].null_count() == len(nodes)  # these files carry no start times
    assert tables.rank_ids == [rank_from_name(path)]
    for name, want_schema in FRAME_SCHEMAS.items():
        assert dict(getattr(tables, name).schema) == want_schema


@pytest.mark.shared_data
def test_ring_send_recv_peers_form_a_ring(shared_datasets: Path) -> None:
    files = sorted((shared_datasets / RING).glob("*.et"))
    assert len(files) == 8
    frames = [read_chakra(f).p2p for f in files]
    p2p = pl.concat(frames)
    world = 8
    for r in range(world):
        mine = p2p.filter(pl.col("rank") == r)
        assert set(mine.filter(pl.col("direction") == "send")["peer"]) == {(r + 1) % world}
        assert set(mine.filter(pl.col("direction") == "recv")["peer"]) == {(r - 1) % world}
        assert set(mine["bytes"]) == {131072}
        assert set(mine["tag"]) == {0}
    sends = p2p.filter(pl.col("direction") == "send").select(
        src="rank", dst="peer", seq="seq", sb="bytes"
    )
    recvs = p2p.filter(pl.col("direction") == "recv").select(
        src="peer", dst="rank", seq="seq", rb="bytes"
    )
    pairs = sends.join(recvs, on=["src", "dst", "seq"], how="full", coalesce=True)
    assert pairs.height == sends.height == recvs.height == 8 * 14
    assert pairs.null_count().sum_horizontal().item() == 0
    assert (pairs["sb"] == pairs["rb"]).all()


@pytest.mark.shared_data
@pytest.mark.parametrize("kind", ["all_gather", "all_reduce", "all_to_all", "reduce_scatter"])
@pytest.mark.parametrize("npus", [4, 8, 16])
def test_microbenchmark_one_collective_per_rank(
    shared_datasets: Path, kind: str, npus: int
) -> None:
    folder = shared_datasets / ASTRA / "microbenchmarks" / kind / f"{npus}npus_1MB"
    files = sorted(folder.glob("*.et"))
    assert len(files) == npus
    colls = pl.concat([read_chakra(f).collectives for f in files])
    assert sorted(colls["rank"].to_list()) == list(range(npus))
    assert set(colls["kind"]) == {kind}
    # comm_size is each rank's input (ASTRA-sim's and the PyTorch converter's meaning): an
    # all-gather's output, hence its nccl-tests size, needs the group size, which the files
    # leave to the number of ranks (ingest.fill_sizes).
    assert set(colls["in_bytes"]) == {1 << 20}
    if kind == "all_gather":
        assert set(colls["msg_bytes"]) == {None}
        calls = fill_sizes(colls, pl.DataFrame({"name": ["0"], "size": [npus]}))
        assert set(calls["out_bytes"]) == set(calls["msg_bytes"]) == {npus << 20}
        assert set(calls["group_size"]) == {npus}
    else:
        assert set(colls["msg_bytes"]) == {1 << 20}
    assert set(colls["group_name"]) == {"0"}
    assert set(colls["seq"]) == {0}


@pytest.mark.shared_data
def test_resnet_64_ranks_have_the_same_collectives(shared_datasets: Path) -> None:
    files = sorted((shared_datasets / RESNET).glob("*.et"), key=lambda p: rank_from_name(p) or 0)
    assert len(files) == 64
    tables = [read_chakra(f) for f in files]
    colls = pl.concat(
        [t.collectives.join(t.events.select("event_id", "name"), on="event_id") for t in tables]
    )
    per_rank = colls.group_by("rank").agg(pl.len(), pl.col("seq").sort())
    assert per_rank.height == 64
    assert set(per_rank["len"]) == {54}
    assert all(s == list(range(54)) for s in per_rank["seq"].to_list())
    assert set(colls["kind"]) == {"all_reduce"}
    # node ids differ across ranks, but the same layer's all-reduce gets the same seq everywhere
    assert colls.group_by("seq").agg(pl.col("name").n_unique())["name"].max() == 1


@pytest.mark.shared_data
def test_converter_1_0_1_links_host_ops_to_kernels(shared_datasets: Path) -> None:
    tables = read_chakra(shared_datasets / V101)
    colls = tables.collectives.sort("seq")
    assert colls.height == 7
    assert Counter(colls["kind"].to_list()) == {"broadcast": 2, "all_reduce": 5}
    names = dict(tables.events.select("event_id", "name").iter_rows())
    assert all(names[e].startswith("c10d::") for e in colls["event_id"])
    assert all(names[k].startswith("ncclKernel_") for k in colls["kernel_event_id"])
    assert colls["msg_bytes"].to_list()[:2] == [212480, 424]
    kinds = dict(tables.tracks.select("tid", "kind").iter_rows())
    assert kinds == {1: "thread", 2: "thread", 7: "stream", 14: "stream"}
    args = json.loads(tables.ranks["args"][0])
    assert args["schema"] == "1.0.1"
    assert tables.ranks["pid"][0] == 114598


@pytest.mark.shared_data
def test_converter_1_1_0_reads_process_groups(shared_datasets: Path) -> None:
    tables = read_chakra(shared_datasets / V110)
    assert tables.world_size == 8
    groups = tables.comm_groups
    default = groups.filter(pl.col("name") == "0").row(0, named=True)
    assert default["description"] == "default_pg"
    assert default["backend"] == "nccl"
    assert default["ranks"] == list(range(8))
    assert groups.filter(pl.col("name") == "5")["ranks"].to_list() == [[0]]
    colls = tables.collectives
    assert colls.height == 14
    assert Counter(colls["kind"].to_list()) == {"all_reduce": 12, "broadcast": 2}
    assert set(colls["group_size"]) == {8}
    assert colls.filter(pl.col("kind") == "all_reduce")["msg_bytes"].max() == 131072000


# --- hand-built graphs ----------------------------------------------------------------------


def test_synthetic_graph_maps_every_frame(tmp_path: Path) -> None:
    pg = [
        {"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "ranks": []},
        {"pg_name": "7", "pg_desc": "tp", "backend_config": "cuda:nccl", "ranks": [2, 3]},
    ]
    pg[0]["group_size"] = 4
    pg[1]["group_size"] = 2
    init = _node(1, pb.COMP_NODE, "## process_group:init ##", pg=json.dumps(pg))
    comp = _node(2, pb.COMP_NODE, "gemm", tid=7, is_cpu_op=False)
    comp.start_time_micros, comp.duration_micros = 10, 5
    comp.data_deps.append(1)
    # a later id that runs first: the seq follows the dependency order, not the id order
    ag = _node(9, pb.COMM_COLL_NODE, "ag", comm_type=pb.ALL_GATHER, comm_size=4096, pg_name="7")
    ar = _node(5, pb.COMM_COLL_NODE, "ar", comm_type=pb.ALL_REDUCE, comm_size=64, pg_name="7")
    ar.data_deps.append(9)
    ar.ctrl_deps.extend([5, 3])  # a self-loop and a dep on a missing earlier node are dropped
    send = _node(6, pb.COMM_SEND_NODE, "send", comm_dst=3, comm_size=8, comm_tag=11)
    recv = _node(7, pb.COMM_RECV_NODE, "recv", comm_src=3, comm_size=8, comm_tag=11)
    recv.ctrl_deps.append(6)
    load = _node(8, pb.MEM_LOAD_NODE, "load")
    path = _write_et(tmp_path / "job.2.et", [init, comp, ag, ar, send, recv, load])

    t = read_chakra(path, rank=5)  # the file name wins over the argument
    assert t.rank_ids == [2]
    assert t.world_size == 4
    ev = {r["event_id"]: r for r in t.events.iter_rows(named=True)}
    assert ev[2]["ts"] == 10_000
    assert ev[2]["dur"] == 5_000
    assert ev[1]["ts"] == 0  # the file is timed, so 0 is a time
    assert ev[8]["category"] == "memcpy"
    assert json.loads(ev[9]["args"]) == {"comm_type": 2, "comm_size": 4096, "pg_name": "7"}
    tracks = {r["track_id"]: r for r in t.tracks.iter_rows(named=True)}
    assert (tracks[ev[2]["track_id"]]["kind"], tracks[ev[2]["track_id"]]["tid"]) == ("stream", 7)
    assert tracks[ev[9]["track_id"]]["kind"] == "thread"

    colls = {r["event_id"]: r for r in t.collectives.iter_rows(named=True)}
    assert colls[9]["seq"] == 0
    assert colls[5]["seq"] == 1
    assert colls[9]["kind"] == "all_gather"
    # comm_size is the all-gather's input: the output is the group's 2 inputs
    assert (colls[9]["in_bytes"], colls[9]["out_bytes"], colls[9]["msg_bytes"]) == (
        4096,
        8192,
        8192,
    )
    assert colls[5]["group_size"] == 2
    groups = {r["name"]: r for r in t.comm_groups.iter_rows(named=True)}
    assert groups["0"]["ranks"] == [0, 1, 2, 3]
    assert groups["7"]["ranks"] == [2, 3]

    p2p = {r["direction"]: r for r in t.p2p.iter_rows(named=True)}
    assert (p2p["send"]["peer"], p2p["send"]["tag"], p2p["send"]["bytes"]) == (3, 11, 8)
    assert p2p["recv"]["peer"] == 3
    assert set(t.p2p["seq"]) == {0}

    flows = set(t.flows.select("kind", "src_event_id", "dst_event_id").iter_rows())
    assert flows == {("data", 1, 2), ("data", 9, 5), ("ctrl", 6, 7)}
    assert json.loads(t.ranks["args"][0])["dropped_deps"] == 2


def test_default_group_without_world_size(tmp_path: Path) -> None:
    node = _node(0, pb.COMM_COLL_NODE, comm_type=pb.BARRIER)
    t = read_chakra(_write_et(tmp_path / "b.1.et", [node]))
    assert t.world_size is None
    assert t.collectives["kind"].to_list() == ["barrier"]
    assert t.collectives["msg_bytes"].to_list() == [None]
    g = t.comm_groups.row(0, named=True)
    assert (g["name"], g["size"], g["ranks"]) == ("0", None, None)


def test_world_size_attr_gives_the_default_group(tmp_path: Path) -> None:
    node = _node(0, pb.COMM_COLL_NODE, comm_type=pb.REDUCE_SCATTER, comm_size=800)
    t = read_chakra(_write_et(tmp_path / "x.0.et", [node], {"world_size": 8}))
    assert t.world_size == 8
    c = t.collectives.row(0, named=True)
    assert (c["in_bytes"], c["out_bytes"], c["group_size"]) == (800, 100, 8)
    assert t.comm_groups["ranks"].to_list() == [list(range(8))]


def test_gzipped_file_and_rank_argument(tmp_path: Path) -> None:
    plain = _write_et(tmp_path / "plain.et", [_node(0, pb.COMP_NODE)])
    gz = tmp_path / "noname.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_chakra(gz, rank=4).rank_ids == [4]
    with pytest.raises(RankUnknownError, match=r"noname\.gz"):
        read_chakra(gz)


def test_large_graph_streams_across_chunks(tmp_path: Path) -> None:
    nodes = []
    for i in range(30_000):
        n = _node(i, pb.COMP_NODE, f"op{i}", tid=1, note="x" * 200)
        if i:
            n.data_deps.append(i - 1)
        nodes.append(n)
    t = read_chakra(_write_et(tmp_path / "big.0.et", nodes))
    assert t.events.height == 30_000
    assert t.flows.height == 29_999


@pytest.mark.shared_data
def test_sniff_real_files(shared_datasets: Path) -> None:
    for rel in (V101, V110, RING / "custom_allreduce.5.et", RESNET / "Resnet50_DataParallel.9.et"):
        assert sniff_chakra(shared_datasets / rel), rel
    others = [
        TESTS / "host_et_1.0.2-chakra.0.0.4_allgather_2rank_rank0.json.gz",
        TESTS / "json_trace_workload_graph.tar.gz",
        Path("megatron-straggler-st-8rank") / "trace-ST.parquet",
        Path("megatron-straggler-st-8rank") / "meta-ST.yaml",
    ]
    for rel in others:
        assert not sniff_chakra(shared_datasets / rel), rel


def test_sniff_synthetic(tmp_path: Path) -> None:
    assert sniff_chakra(_write_et(tmp_path / "a.0.et", [_node(0, pb.COMP_NODE)]))
    assert sniff_chakra(_write_et(tmp_path / "b.0.et", []))
    junk = tmp_path / "junk.0.et"
    junk.write_bytes(b"hello, not a trace\n")
    assert not sniff_chakra(junk)
    assert not sniff_chakra(tmp_path / "missing.et")


# --- broken inputs ------------------------------------------------------------------------------


def test_truncated_file(tmp_path: Path) -> None:
    nodes = [_node(i, pb.COMP_NODE, f"op{i}") for i in range(10)]
    good = _write_et(tmp_path / "good.0.et", nodes).read_bytes()
    cut = tmp_path / "cut.0.et"
    cut.write_bytes(good[:-3])
    with pytest.raises(TruncatedTraceError, match=r"cut\.0\.et: truncated protobuf record at byte"):
        read_chakra(cut)


def test_huge_declared_length_is_truncation_not_memory_error(tmp_path: Path) -> None:
    good = _write_et(tmp_path / "g.0.et", [_node(0, pb.COMP_NODE)]).read_bytes()
    bad = tmp_path / "huge.0.et"
    bad.write_bytes(good + b"\xff\xff\xff\xff\xff\xff\xff\x7f" + b"x" * 100)
    with pytest.raises(TruncatedTraceError, match=f"byte offset {len(good)}"):
        read_chakra(bad)


@pytest.mark.shared_data
def test_truncated_real_gzip(shared_datasets: Path, tmp_path: Path) -> None:
    raw = (shared_datasets / V110).read_bytes()
    cut = tmp_path / "chakra.0.et.gz"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TruncatedTraceError, match=r"chakra\.0\.et\.gz"):
        read_chakra(cut)


@pytest.mark.shared_data
def test_truncated_real_decompressed(shared_datasets: Path, tmp_path: Path) -> None:
    raw = gzip.decompress((shared_datasets / V101).read_bytes())
    cut = tmp_path / "chakra.0.et"
    cut.write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(TruncatedTraceError, match=r"truncated protobuf record at byte offset \d+"):
        read_chakra(cut)


@pytest.mark.parametrize(
    "payload",
    [
        b"this is not a protobuf file\n" * 20,
        b'{"schema": "1.0.1", "nodes": []}',
        bytes(range(256)) * 4,
        b"\xff" * 64,
    ],
    ids=["text", "json", "bytes", "bad-varint"],
)
def test_garbage_is_a_format_error(tmp_path: Path, payload: bytes) -> None:
    bad = tmp_path / "garbage.0.et"
    bad.write_bytes(payload)
    with pytest.raises(TraceFormatError, match=r"garbage\.0\.et") as exc:
        read_chakra(bad)
    assert "\n" not in str(exc.value)


def test_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.0.et"
    empty.write_bytes(b"")
    with pytest.raises(TraceFormatError, match="empty file"):
        read_chakra(empty)


def test_corrupt_node_after_valid_metadata(tmp_path: Path) -> None:
    good = _write_et(tmp_path / "g.0.et", [_node(0, pb.COMP_NODE)]).read_bytes()
    bad = tmp_path / "bad.0.et"
    bad.write_bytes(good + b"\x05\xff\xff\xff\xff\xff")
    with pytest.raises(TraceFormatError, match=r"bad\.0\.et: corrupt protobuf record"):
        read_chakra(bad)


def test_unknown_comm_type(tmp_path: Path) -> None:
    node = _node(3, pb.COMM_COLL_NODE, comm_type=42)
    with pytest.raises(TraceFormatError, match="unknown comm_type 42 at node 3"):
        read_chakra(_write_et(tmp_path / "u.0.et", [node]))

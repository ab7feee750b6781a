"""Host execution trace reader: counts checked against an independent read of the raw JSON."""

from __future__ import annotations

import gzip
import json
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from prism_trace.errors import (
    MissingFieldError,
    RankUnknownError,
    TraceFormatError,
    TruncatedTraceError,
)
from prism_trace.formats.base import FRAME_SCHEMAS
from prism_trace.formats.host_et.comms import _from_record_param_comms, normalize_comm_kind
from prism_trace.formats.host_et.reader import rank_from_file_name, read_host_et, sniff_host_et

RESNET = "param-resnet-et"
ALLGATHER = "chakra-et/chakra_tests/host_et_1.0.2-chakra.0.0.4_allgather_2rank_rank0.json.gz"
# (file under shared datasets, schema prefix, rank the trace or its name tells; None: must be given)
ET_FILES = [
    *[(f"param-dlrm-8rank/et/dlrm_eg_{r}.json.gz", "1.0.1", r) for r in range(8)],
    (f"{RESNET}/linear_et_1.0.1.json.gz", "1.0.1", None),
    (f"{RESNET}/resnet_1gpu_et_1.0.3.json.gz", "1.0.3", 0),
    (f"{RESNET}/resnet_et_1.1.0.json.gz", "1.1.0", 0),
    (f"{RESNET}/resnet_2gpu_rank1_et_1.1.0.json.gz", "1.1.0", 1),
    (f"{RESNET}/hf_GPT2_et.json.gz", "1.1.0", None),
    (ALLGATHER, "1.0.2", 0),
]
ITEMSIZE = {"Float": 4, "Long": 8, "Half": 2, "BFloat16": 2, "Int": 4, "Double": 8, "Byte": 1}


def raw(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def attrs_of(node: dict[str, Any]) -> dict[str, Any]:
    return {a["name"]: a["value"] for a in node.get("attrs", [])}


@pytest.fixture(scope="module")
def pt2_et(shared_datasets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The schema 1.1.1 ET inside the PT2/Triton tarball, extracted to a temporary folder."""
    out = tmp_path_factory.mktemp("pt2")
    with tarfile.open(shared_datasets / RESNET / "pt2_et_with_triton_resources.tar.gz") as tar:
        tar.extractall(out, filter="data")
    return out / "pt2_et.json"


# ---------------------------------------------------------------------------------- real traces


@pytest.mark.shared_data
@pytest.mark.parametrize(("name", "schema", "rank"), ET_FILES, ids=[f[0] for f in ET_FILES])
def test_nodes_match_raw(shared_datasets: Path, name: str, schema: str, rank: int | None) -> None:
    path = shared_datasets / name
    doc = raw(path)
    assert doc["schema"].startswith(schema)
    t = read_host_et(path, rank=None if rank is not None else 0)
    ops = t.et_ops
    assert t.format == "host_et"
    assert t.rank_ids == [rank if rank is not None else 0]
    assert ops.schema == pl.Schema(FRAME_SCHEMAS["et_ops"])
    nodes = doc["nodes"]
    assert ops.height == len(nodes)
    assert sorted(ops["node_id"].to_list()) == sorted(n["id"] for n in nodes)
    assert Counter(ops["name"].to_list()) == Counter(n["name"] for n in nodes)
    assert ops["event_id"].null_count() == ops.height

    new = "attrs" in nodes[0]
    by_id = {n["id"]: n for n in nodes}
    rows = ops.sample(min(300, ops.height), seed=1).iter_rows(named=True)
    for row in rows:
        n = by_id[row["node_id"]]
        a = attrs_of(n) if new else n
        assert row["rf_id"] == a["rf_id"]
        assert row["seq_id"] == a["seq_id"]
        assert row["tid"] == a["tid"]
        assert row["scope"] == a["scope"]
        assert (row["op_schema"] or "") == a["op_schema"]
        ins = n["inputs"]["values"] if new else n["inputs"]
        shapes = n["inputs"]["shapes"] if new else n["input_shapes"]
        outs = n["outputs"]["types"] if new else n["output_types"]
        assert json.loads(row["inputs"]) == ins
        assert json.loads(row["input_shapes"]) == shapes
        assert json.loads(row["output_types"]) == outs
        parent = n["ctrl_deps"] if new else n["parent"]
        assert row["parent_node_id"] == (parent if parent != n["id"] else None)
        extra = json.loads(row["attrs"])
        assert extra.get("fw_tid") == a["fw_tid"]


@pytest.mark.shared_data
def test_schema_1_1_1_from_tarball(pt2_et: Path) -> None:
    doc = raw(pt2_et)
    assert doc["schema"].startswith("1.1.1")
    with pytest.raises(RankUnknownError, match=r"pt2_et\.json") as err:
        read_host_et(pt2_et)
    assert "--rank" in str(err.value)
    t = read_host_et(pt2_et, rank=5)
    assert t.rank_ids == [5]
    assert t.et_ops.height == len(doc["nodes"])
    # 1.1.1 adds strides; they are kept in attrs
    mm = t.et_ops.filter(pl.col("name") == "aten::mm").row(0, named=True)
    node = next(n for n in doc["nodes"] if n["id"] == mm["node_id"])
    assert json.loads(mm["attrs"])["input_strides"] == node["inputs"]["strides"]


@pytest.mark.slow
@pytest.mark.shared_data
def test_comm_groups_from_process_group_init(shared_datasets: Path) -> None:
    for name, world in [
        (f"{RESNET}/resnet_2gpu_rank1_et_1.1.0.json.gz", 2),
        (f"{RESNET}/resnet_et_1.1.0.json.gz", 1),
        (ALLGATHER, 2),
    ]:
        path = shared_datasets / name
        init = [n for n in raw(path)["nodes"] if n["name"] == "## process_group:init ##"]
        assert len(init) == 1
        expected = json.loads(init[0]["inputs"]["values"][0])
        t = read_host_et(path)
        groups = t.comm_groups.sort("name").to_dicts()
        assert [g["name"] for g in groups] == sorted(c["pg_name"] for c in expected)
        for g, c in zip(groups, sorted(expected, key=lambda c: c["pg_name"]), strict=True):
            assert g["size"] == c["group_size"]
            assert g["ranks"] == (c["ranks"] or list(range(c["group_size"])))
            assert g["description"] == c.get("pg_desc")
            assert g["backend"] == c["backend_config"].split(":")[-1]
        assert t.world_size == world
        assert t.ranks["backend"].to_list() == ["nccl"]


@pytest.mark.shared_data
def test_collectives_resnet_2gpu_rank1(shared_datasets: Path) -> None:
    path = shared_datasets / RESNET / "resnet_2gpu_rank1_et_1.1.0.json.gz"
    comms = [
        attrs_of(n)
        for n in raw(path)["nodes"]
        if n["name"] == "record_param_comms" and attrs_of(n)["collective_name"] != "wait"
    ]
    comms.sort(key=lambda a: a["rf_id"])
    t = read_host_et(path)
    assert t.rank_ids == [1]
    assert t.world_size == 2
    c = t.collectives
    assert c.height == len(comms) == 21
    kinds = {"allreduce": "all_reduce", "broadcast": "broadcast"}
    assert c["kind"].to_list() == [kinds[a["collective_name"]] for a in comms]
    assert c["msg_bytes"].to_list() == [
        max(a["in_msg_nelems"], a["out_msg_nelems"]) * ITEMSIZE[a["dtype"]] for a in comms
    ]
    assert c["dtype"].to_list() == [a["dtype"].lower() for a in comms]
    assert c["group_name"].to_list() == [a["pg_name"] for a in comms]
    assert c["group_size"].to_list() == [a["pg_size"] for a in comms]
    assert c["seq"].to_list() == list(range(21))
    assert c["rank"].unique().to_list() == [1]
    assert c["host_ts"].null_count() == c.height
    assert t.p2p.is_empty()


@pytest.mark.shared_data
@pytest.mark.parametrize("rank", range(8))
def test_collectives_dlrm_1_0_1(shared_datasets: Path, rank: int) -> None:
    """Schema 1.0.1 has no comm attrs and names its process group only by a per-process pointer:
    the calls decode (kind, sizes) but cannot be matched across ranks, so no collective rows."""
    path = shared_datasets / f"param-dlrm-8rank/et/dlrm_eg_{rank}.json.gz"
    expected, decoded = [], []
    for n in sorted(raw(path)["nodes"], key=lambda n: n["rf_id"]):
        if n["name"] != "record_param_comms":
            continue
        name = next(v for v in n["inputs"] if isinstance(v, str))
        if name == "wait":
            continue
        first = n["inputs"][0]
        tensors = first if isinstance(first[0], list) else [first]  # Tensor or GenericList[Tensor]
        expected.append((name, sum(t[3] * t[4] for t in tensors)))
        call = _from_record_param_comms(n, {})
        assert call is not None
        assert call["self_rank"] == rank
        assert call["group_name"] is None
        decoded.append((call["kind"], call["in_bytes"]))
    norm = {"all_to_allv": "all_to_all", "all_to_all": "all_to_all", "allreduce": "all_reduce"}
    assert decoded == [(norm[n], b) for n, b in expected]
    assert len(decoded) == 8
    t = read_host_et(path)
    assert t.rank_ids == [rank]
    assert t.collectives.is_empty()
    assert t.comm_groups.is_empty()


@pytest.mark.shared_data
def test_collectives_allgather_1_0_2(shared_datasets: Path) -> None:
    t = read_host_et(shared_datasets / ALLGATHER)
    c = t.collectives
    assert c.height == 10
    assert set(c["kind"]) == {"all_gather"}
    assert set(c["group_name"]) == {"0"}  # mapped from backend_id through process_group:init
    assert c["in_bytes"].unique().to_list() == [4]
    assert c["out_bytes"].unique().to_list() == [8]
    assert c["group_size"].unique().to_list() == [2]


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.shared_data
def test_truncated_gzip(shared_datasets: Path, tmp_path: Path) -> None:
    data = (shared_datasets / "param-dlrm-8rank/et/dlrm_eg_2.json.gz").read_bytes()
    cut = tmp_path / "dlrm_eg_2.json.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TruncatedTraceError, match=cut.name) as err:
        read_host_et(cut)
    assert "\n" not in str(err.value)


@pytest.mark.shared_data
def test_truncated_json(shared_datasets: Path, tmp_path: Path) -> None:
    text = gzip.decompress((shared_datasets / "param-dlrm-8rank/et/dlrm_eg_2.json.gz").read_bytes())
    cut = tmp_path / "dlrm_eg_2.json"
    cut.write_bytes(text[: len(text) // 3])
    with pytest.raises(TruncatedTraceError, match=cut.name):
        read_host_et(cut)


@pytest.mark.shared_data
def test_corrupt_json(shared_datasets: Path, tmp_path: Path) -> None:
    text = gzip.decompress((shared_datasets / "param-dlrm-8rank/et/dlrm_eg_2.json.gz").read_bytes())
    bad = tmp_path / "dlrm_eg_2.json"
    mid = len(text) // 2
    bad.write_bytes(text[:mid] + b"}}]],,{{" + text[mid:])
    with pytest.raises(TraceFormatError, match=bad.name) as err:
        read_host_et(bad)
    assert not isinstance(err.value, TruncatedTraceError)
    assert "\n" not in str(err.value)


def test_missing_nodes_or_schema(tmp_path: Path) -> None:
    no_nodes = tmp_path / "et_rank0.json"
    no_nodes.write_text('{"schema": "1.0.1", "pid": 1}')
    with pytest.raises(MissingFieldError, match=r"et_rank0\.json.*`nodes`"):
        read_host_et(no_nodes)
    no_schema = tmp_path / "et_rank1.json"
    no_schema.write_text('{"nodes": []}')
    with pytest.raises(MissingFieldError, match=r"et_rank1\.json.*`schema`"):
        read_host_et(no_schema)
    not_object = tmp_path / "et_rank2.json"
    not_object.write_text("[1, 2]")
    with pytest.raises(TraceFormatError, match=r"et_rank2\.json"):
        read_host_et(not_object)


def test_malformed_node(tmp_path: Path) -> None:
    bad = tmp_path / "et_rank0.json"
    bad.write_text('{"schema": "1.0.1", "nodes": [{"name": "x"}]}')
    with pytest.raises(
        TraceFormatError, match=r"et_rank0\.json: node \(nodes\[0\]\): `id` is missing"
    ):
        read_host_et(bad)


# ---------------------------------------------------------------------------------- small pieces


def _tiny_et(path: Path, *, extra: str = "") -> Path:
    node = (
        '{"id": 2, "name": "aten::add", "ctrl_deps": 1, "inputs": {"values": [], "shapes": [],'
        ' "types": []}, "outputs": {"values": [], "shapes": [], "types": []}, "attrs":'
        ' [{"name": "rf_id", "type": "uint64", "value": 7}]}'
    )
    path.write_text(f'{{"schema": "1.1.1-chakra.0.0.4", {extra} "nodes": [{node}]}}')
    return path


def test_rank_sources(tmp_path: Path) -> None:
    info = '"distributedInfo": {"backend": "nccl", "rank": 6, "world_size": 16},'
    t = read_host_et(_tiny_et(tmp_path / "a_rank2.json", extra=info), rank=3)
    assert (t.rank_ids, t.world_size, t.ranks["backend"].to_list()) == ([6], 16, ["nccl"])
    assert read_host_et(_tiny_et(tmp_path / "a_rank2.json"), rank=3).rank_ids == [2]
    assert read_host_et(_tiny_et(tmp_path / "b.json"), rank=3).rank_ids == [3]
    with pytest.raises(RankUnknownError, match=r"b\.json.*--rank"):
        read_host_et(_tiny_et(tmp_path / "b.json"))


def test_rank_from_file_name() -> None:
    cases = {
        "dlrm_eg_3.json.gz": 3,
        "resnet_2gpu_rank1_et_1.1.0.json.gz": 1,
        "host_et_1.0.2-chakra.0.0.4_allgather_2rank_rank0.json.gz": 0,
        "trace.5.json": 5,
        "worker7_et.json": 7,
        "resnet_1gpu_et_1.0.3.json.gz": None,  # a schema version, not a rank
        "linear_et_1.0.1.json.gz": None,
        "hf_GPT2_et.json.gz": None,
    }
    assert {n: rank_from_file_name(Path(n)) for n in cases} == cases


def test_normalize_comm_kind() -> None:
    cases = {
        "allreduce": "all_reduce",
        "allreduce_coalesced": "all_reduce",
        "_allgather_base": "all_gather",
        "all_gather": "all_gather",
        "allgather_into_tensor_coalesced": "all_gather",
        "reduce_scatter_tensor_coalesced": "reduce_scatter",
        "_reduce_scatter_base": "reduce_scatter",
        "all_to_allv": "all_to_all",
        "c10d::alltoall_base_": "all_to_all",
        "c10d::broadcast_": "broadcast",
        "c10d::reduce_": "reduce",
        "gather": "gather",
        "scatter": "scatter",
        "barrier": "barrier",
        "send": "send",
        "c10d::recv_any_source_": "recv",
        "wait": None,
        "coalesced": None,
    }
    assert {n: normalize_comm_kind(n) for n in cases} == cases


@pytest.mark.shared_data
def test_sniff(shared_datasets: Path) -> None:
    for name, *_ in ET_FILES:
        with gzip.open(shared_datasets / name) as fh:
            assert sniff_host_et(fh.read(4096)), name
    kineto = next((shared_datasets / "param-dlrm-8rank/kineto").glob("worker0_*"))
    with gzip.open(kineto) as fh:
        assert not sniff_host_et(fh.read(4096))
    assert not sniff_host_et(b'{\n  "workload_graph": [\n    {"Id": 216, "Name": "x"}')

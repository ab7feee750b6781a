"""Bad input, case by case (the findings of issue 18), and a seeded subset of the fuzz campaign.

Every case here uses the bundled sample or inputs made in the test, so it runs without
../shared/datasets. The campaign itself is ``benchmarks/fuzz_ingest.py``.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import ModuleType

import polars as pl
import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.errors import PrismError, TruncatedTraceError
from prism_trace.ingestion.pipeline import ingest
from prism_trace.limits import MAX_RANKS
from prism_trace.store.connection import open_store

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "datasets" / "sample"


def _fuzz() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fuzz_ingest", REPO / "benchmarks" / "fuzz_ingest.py"
    )
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_ingest"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fuzz() -> ModuleType:
    return _fuzz()


@pytest.fixture(scope="module")
def kineto_doc() -> dict:
    """A small Kineto trace: the sample's rank 0 cut to its first 2000 records."""
    doc = json.loads(gzip.decompress((SAMPLE / "rank0.kineto.json.gz").read_bytes()))
    doc["traceEvents"] = doc["traceEvents"][:2000]
    return doc


@pytest.fixture(scope="module")
def et_doc() -> dict:
    doc = json.loads(gzip.decompress((SAMPLE / "rank1.et.json.gz").read_bytes()))
    doc["nodes"] = doc["nodes"][:1500]
    return doc


@functools.cache
def _empty_store() -> bytes:
    """The bytes of a new, empty store: made once, since creating the schema is most of the cost
    of a small refused ingest."""
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "empty.duckdb"
        open_store(db).close()
        return db.read_bytes()


def _refused(tmp_path: Path, files: list[Path], needle: str) -> str:
    """Ingest ``files`` in-process and through the CLI: one line naming the file, store as was."""
    db = tmp_path / "s.duckdb"
    db.write_bytes(_empty_store())
    with open_store(db) as store, pytest.raises(PrismError) as exc:
        ingest(store, files, run="x", progress=False)
    msg = str(exc.value)
    assert "\n" not in msg
    assert needle in msg, msg
    assert any(f.name in msg or str(f.parent) in msg for f in files), msg
    res = CliRunner().invoke(main, ["ingest", *map(str, files), "--db", str(db), "--run", "x"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 1, res.output
    assert len(lines) == 1, res.output
    assert lines[0].startswith("error: ")
    with open_store(db, read_only=True) as store:
        assert store.con.execute("SELECT count(*) FROM run").fetchall() == [(0,)]
        assert store.con.execute("SELECT count(*) FROM event").fetchall() == [(0,)]
    return msg


def _kineto(tmp_path: Path, doc: dict, name: str = "rank0.kineto.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc, allow_nan=True))
    return path


def _with_event(doc: dict, **fields: object) -> dict:
    out = dict(doc)
    events = [dict(e) for e in doc["traceEvents"]]
    i = next(k for k, e in enumerate(events) if e.get("ph") == "X")
    for key, value in fields.items():
        if value is ...:
            events[i].pop(key, None)
        else:
            events[i][key] = value
    out["traceEvents"] = events
    return out


# -- Kineto ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", ["1", 2**70, -1, 10**9, True])
def test_kineto_bad_rank(tmp_path: Path, kineto_doc: dict, rank: object) -> None:
    doc = {**kineto_doc, "distributedInfo": {**kineto_doc["distributedInfo"], "rank": rank}}
    _refused(tmp_path, [_kineto(tmp_path, doc)], "distributedInfo.rank")


@pytest.mark.parametrize("world", [10**11, 0, "8", 2.5])
def test_kineto_bad_world_size(tmp_path: Path, kineto_doc: dict, world: object) -> None:
    info = {**kineto_doc["distributedInfo"], "world_size": world}
    _refused(tmp_path, [_kineto(tmp_path, {**kineto_doc, "distributedInfo": info})], "world_size")


@pytest.mark.parametrize("base", [2**70, -1, "1", 1e300])
def test_kineto_bad_base_time(tmp_path: Path, kineto_doc: dict, base: object) -> None:
    doc = {**kineto_doc, "baseTimeNanoseconds": base}
    _refused(tmp_path, [_kineto(tmp_path, doc)], "baseTimeNanoseconds")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dur", -5),
        ("dur", True),
        ("dur", None),
        ("dur", "10"),
        ("dur", "ten"),
        ("dur", {"us": 1}),
        ("dur", ...),
        ("ts", "123"),
        ("ts", "abc"),
        ("ts", ""),
        ("ts", [1]),
        ("ts", {}),
        ("ts", False),
        ("ts", 1e300),
        ("ts", float("nan")),
        ("name", ...),
        ("name", {"a": 1}),
        ("tid", ...),
        ("pid", True),
        ("ph", ...),
        ("cat", 3),
        ("args", [1]),
    ],
)
def test_kineto_bad_event_field(
    tmp_path: Path, kineto_doc: dict, field: str, value: object
) -> None:
    path = _kineto(tmp_path, _with_event(kineto_doc, **{field: value}))
    msg = _refused(tmp_path, [path], f"`{field}`")
    assert "traceEvents[" in msg


def _with_info(doc: dict, **info: object) -> dict:
    return {**doc, "distributedInfo": {**doc["distributedInfo"], **info}}


def _with_pg(doc: dict, **fields: object) -> dict:
    """``doc`` with its second ``pg_config`` entry (the tp group) changed."""
    pgs = [dict(g) for g in doc["distributedInfo"]["pg_config"]]
    pgs[1].update(fields)
    return _with_info(doc, pg_config=pgs)


def _with_prism_group(doc: dict, **fields: object) -> dict:
    groups = [dict(g) for g in doc["prism_groups"]]
    groups[0].update(fields)
    if "ranks" not in fields:
        groups[0].pop("ranks")
    return {**doc, "prism_groups": groups}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: _with_info(d, backend=5), "distributedInfo.backend"),
        (lambda d: _with_pg(d, pg_desc=7), "pg_desc"),
        (lambda d: _with_pg(d, pg_size=10**11), "pg_size"),
        (lambda d: _with_pg(d, pg_size="2"), "pg_size"),
        (lambda d: _with_pg(d, ranks=[0, 10**11]), "ranks"),
        (lambda d: _with_pg(d, ranks=[0, -1]), "ranks"),
        (lambda d: _with_pg(d, pg_name=[1]), "pg_name"),
        (lambda d: _with_prism_group(d, size="abc"), "size"),
        (lambda d: _with_prism_group(d, ranks=[0, 2**40]), "ranks"),
        (lambda d: _with_prism_group(d, desc={"a": 1}), "desc"),
    ],
)
def test_kineto_bad_group_header(tmp_path: Path, kineto_doc: dict, change, needle: str) -> None:
    """What the header says of the process groups is checked like the events: one line naming
    the file and the member, never a crash building the groups' frame, never a wrapped value."""
    _refused(tmp_path, [_kineto(tmp_path, change(kineto_doc))], needle)


def test_kineto_step_number_beyond_int32(tmp_path: Path, kineto_doc: dict) -> None:
    events = [dict(e) for e in kineto_doc["traceEvents"]]
    step = next(e for e in events if e.get("name", "").startswith("ProfilerStep#"))
    step["name"] = "ProfilerStep#99999999999"
    doc = {**kineto_doc, "traceEvents": events}
    _refused(tmp_path, [_kineto(tmp_path, doc)], "ProfilerStep#99999999999")


def _with_comm_op(doc: dict, name: str, args: dict) -> dict:
    """``doc`` with one more host op, ``name`` with ``args``, beside its first CPU op."""
    first = next(e for e in doc["traceEvents"] if e.get("cat") == "cpu_op" and e.get("ph") == "X")
    op = {**first, "name": name, "dur": 1, "args": args}
    return {**doc, "traceEvents": [*doc["traceEvents"], op]}


_RPC = {"Collective name": "allreduce", "dtype": "Float", "Process Group Name": "0"}


@pytest.mark.parametrize(
    ("name", "args", "needle"),
    [
        ("record_param_comms", {**_RPC, "In msg nelems": -5}, "In msg nelems"),
        ("record_param_comms", {**_RPC, "In msg nelems": 9 * 10**18}, "In msg nelems"),
        ("record_param_comms", {**_RPC, "In msg nelems": 2**41}, "In msg nelems"),  # 8 TiB
        ("record_param_comms", {**_RPC, "Out msg nelems": -1}, "Out msg nelems"),
        ("c10d::allreduce_", {"Input Dims": [[10**11, 10**11]]}, "Input Dims"),
        ("c10d::allreduce_", {"Input Dims": [[4, -2]]}, "Input Dims"),
        (
            "prism_comm:pg=0;seq=99;op=all_gather;in_bytes=9999999999999999;dtype=float",
            {},
            "in_bytes",
        ),
    ],
)
def test_kineto_bad_call_sizes(
    tmp_path: Path, kineto_doc: dict, name: str, args: dict, needle: str
) -> None:
    """A call's byte count from its args is refused by record and field when it is negative or
    past what one call moves (``MAX_COMM_BYTES``): stored, it would be a negative size or wrap
    when an all-gather's output is its input times the group's size."""
    msg = _refused(tmp_path, [_kineto(tmp_path, _with_comm_op(kineto_doc, name, args))], needle)
    assert "traceEvents[" in msg


def test_kineto_seq_past_int64_is_no_seq(tmp_path: Path, kineto_doc: dict) -> None:
    """A ``Seq`` of -2^63 (one less would not fit) is a call without a sequence number, numbered
    by order like the others (a negative ``seq`` is none), not a failed subtraction."""
    doc = _with_comm_op(
        kineto_doc, "record_param_comms", {**_RPC, "In msg nelems": 4, "Seq": -(2**63)}
    )
    with open_store(tmp_path / "s.duckdb") as store:
        ingest(store, [_kineto(tmp_path, doc)], run="x", progress=False)
        rows = store.con.execute("SELECT kind FROM collective WHERE in_bytes = 16").fetchall()
    assert rows == [("all_reduce",)]


def test_kineto_null_optional_field_reads_as_absent(tmp_path: Path, kineto_doc: dict) -> None:
    """`cat` and `args` are optional: a JSON null there is read as the member being absent."""
    rows = []
    for i, value in enumerate((None, ...)):
        path = _kineto(tmp_path, _with_event(kineto_doc, cat=value, args=value), f"r{i}.json")
        with open_store(tmp_path / f"s{i}.duckdb") as store:
            ingest(store, [path], run="x", progress=False)
            rows.append(
                store.con.execute("SELECT * EXCLUDE (run_id) FROM event ORDER BY ALL").fetchall()
            )
    assert rows[0] == rows[1]


def test_kineto_events_without_ph_are_refused(tmp_path: Path, kineto_doc: dict) -> None:
    doc = {**kineto_doc, "traceEvents": [{k: v for k, v in e.items() if k != "ph"}
                                         for e in kineto_doc["traceEvents"]]}  # fmt: skip
    _refused(tmp_path, [_kineto(tmp_path, doc)], "`ph`")


def test_kineto_with_bom_is_read(tmp_path: Path, kineto_doc: dict) -> None:
    plain = _kineto(tmp_path, kineto_doc)
    bom = tmp_path / "bom" / "rank0.kineto.json"
    bom.parent.mkdir()
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    counts = []
    for i, path in enumerate((plain, bom)):
        with open_store(tmp_path / f"{i}.duckdb") as store:
            report = ingest(store, [path], run="x", progress=False)
            counts.append(report.rows)
    assert counts[0] == counts[1]
    assert counts[0]["event"] > 0


def test_kineto_whitespace_before_the_array_end_is_read(tmp_path: Path, kineto_doc: dict) -> None:
    """Valid JSON with more whitespace before `]` than the tail window holds (9 MB)."""
    text = json.dumps(kineto_doc).encode()
    cut = text.rindex(b"]")
    padded = _kineto(tmp_path, kineto_doc)
    padded.write_bytes(text[:cut] + b" " * (9 << 20) + text[cut:])
    with open_store(tmp_path / "s.duckdb") as store:
        assert ingest(store, [padded], run="x", progress=False).rows["event"] > 0


@pytest.mark.slow
def test_gzip_bomb_is_refused_early(tmp_path: Path, fuzz: ModuleType) -> None:
    """2.3 GiB of whitespace inside the events array, 2.3 MB gzipped: refused as a bomb."""
    payload = gzip.decompress((SAMPLE / "rank0.kineto.json.gz").read_bytes())
    at = payload.index(b"[", payload.index(b'"traceEvents"')) + 1
    bomb = tmp_path / "rank0.kineto.json.gz"
    fuzz._write_gzip_fill(bomb, payload[:at], b" ", 2_300 << 20, payload[at:])
    _refused(tmp_path, [bomb], "decompression bomb")


# -- host ET --------------------------------------------------------------------------------------


def _et(tmp_path: Path, doc: dict, name: str = "rank1.et.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc, allow_nan=True))
    return path


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("id", None, "`id`"),
        ("id", True, "`id`"),
        ("name", None, "`name`"),
        ("name", False, "`name`"),
        ("ctrl_deps", "3", "`ctrl_deps`"),
        ("inputs", [1], "`inputs`"),
        ("attrs", {"a": 1}, "`attrs`"),
    ],
)
def test_host_et_wrong_types(
    tmp_path: Path, et_doc: dict, field: str, value: object, needle: str
) -> None:
    nodes = [dict(n) for n in et_doc["nodes"]]
    nodes[7][field] = value
    _refused(tmp_path, [_et(tmp_path, {**et_doc, "nodes": nodes})], needle)


@pytest.mark.parametrize(
    ("attr", "value"),
    [("rf_id", float("nan")), ("tid", "1"), ("op_schema", 3), ("rf_id", True)],
)
def test_host_et_wrong_attr_types(tmp_path: Path, et_doc: dict, attr: str, value: object) -> None:
    nodes = [dict(n) for n in et_doc["nodes"]]
    nodes[9]["attrs"] = [*nodes[9]["attrs"], {"name": attr, "type": "x", "value": value}]
    _refused(tmp_path, [_et(tmp_path, {**et_doc, "nodes": nodes})], f"attrs.{attr}")


def test_host_et_duplicate_node_id(tmp_path: Path, et_doc: dict) -> None:
    nodes = [dict(n) for n in et_doc["nodes"]]
    nodes[5]["id"] = nodes[4]["id"]
    _refused(tmp_path, [_et(tmp_path, {**et_doc, "nodes": nodes})], "appears more than once")


def test_host_et_node_without_a_key_of_its_layout(tmp_path: Path, et_doc: dict) -> None:
    """Two nodes run together by a cut lack the keys between; the observer writes all."""
    nodes = [dict(n) for n in et_doc["nodes"]]
    del nodes[7]["ctrl_deps"]
    msg = _refused(tmp_path, [_et(tmp_path, {**et_doc, "nodes": nodes})], "missing field")
    assert f"node {nodes[7]['id']} (nodes[7])" in msg
    assert "`ctrl_deps`" in msg


@pytest.mark.parametrize("rank", [10**9, -1, "1"])
def test_host_et_bad_rank(tmp_path: Path, et_doc: dict, rank: object) -> None:
    doc = {**et_doc, "distributedInfo": {"rank": rank}}
    _refused(tmp_path, [_et(tmp_path, doc)], "distributedInfo.rank")


def test_host_et_larger_than_the_limit(
    tmp_path: Path, et_doc: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRISM_MAX_JSON_BYTES", str(1 << 20))
    _refused(tmp_path, [_et(tmp_path, et_doc)], "PRISM_MAX_JSON_BYTES")


# -- Chakra ---------------------------------------------------------------------------------------


def _chakra(tmp_path: Path, fuzz: ModuleType, nodes: int = 30) -> Path:
    path = tmp_path / "job.1.et"
    fuzz._synthetic_chakra(path, world=4, nodes=nodes)
    return path


def test_chakra_metadata_only(tmp_path: Path, fuzz: ModuleType) -> None:
    path = _chakra(tmp_path, fuzz)
    recs = fuzz._records(path.read_bytes())
    path.write_bytes(fuzz._frame(recs[:1]))
    _refused(tmp_path, [path], "no nodes")


def test_chakra_cut_at_a_record_boundary(tmp_path: Path, fuzz: ModuleType) -> None:
    path = _chakra(tmp_path, fuzz)
    recs = fuzz._records(path.read_bytes())
    path.write_bytes(fuzz._frame(recs[:-2]))  # node 28 depends on node 30, now gone
    _refused(tmp_path, [path], "truncated")


def test_chakra_zero_length_records(tmp_path: Path, fuzz: ModuleType) -> None:
    path = _chakra(tmp_path, fuzz)
    path.write_bytes(path.read_bytes() + b"\x00" * 1_000_000)
    _refused(tmp_path, [path], "is not a valid Chakra node type")  # refused at the first


def test_chakra_corrupt_node_is_refused(tmp_path: Path, fuzz: ModuleType) -> None:
    """A flipped bit that leaves a parseable record: `id` as an unknown fixed64 field."""
    path = _chakra(tmp_path, fuzz)
    recs = fuzz._records(path.read_bytes())
    assert recs[10][0] == 0x08  # field 1 (id), varint
    recs[10] = b"\x09" + recs[10][1:]  # field 1, fixed64: an unknown field to the schema
    path.write_bytes(fuzz._frame(recs))
    _refused(tmp_path, [path], "corrupt record")


def test_chakra_invalid_node_type_is_refused(tmp_path: Path, fuzz: ModuleType) -> None:
    from prism_trace.formats.chakra import chakra_pb2 as pb

    path = _chakra(tmp_path, fuzz)
    recs = fuzz._records(path.read_bytes())
    node = pb.Node.FromString(recs[5])
    node.type = 99  # proto3 keeps an unknown enum number
    recs[5] = node.SerializeToString()
    path.write_bytes(fuzz._frame(recs))
    _refused(tmp_path, [path], "`type` = 99 is not a valid Chakra node type")


def test_chakra_huge_record(tmp_path: Path, fuzz: ModuleType) -> None:
    path = _chakra(tmp_path, fuzz)
    path.write_bytes(path.read_bytes() + fuzz._varint(2_300 << 20) + b"\x08\x01")
    with open_store(tmp_path / "s.duckdb") as store, pytest.raises(TruncatedTraceError):
        ingest(store, [path], run="x", progress=False)


def _chakra_rank(path: Path, world: int, nodes: int) -> list[bytes]:
    """A rank's Chakra ET without forward dependencies: compute and all-reduce in turn."""
    from prism_trace.formats.chakra import chakra_pb2 as pb

    gm = pb.GlobalMetadata(version="0.0.4")
    gm.attr.add(name="world_size").int64_val = world
    recs = [gm.SerializeToString()]
    for i in range(1, nodes + 1):
        kind = pb.COMM_COLL_NODE if i % 2 == 0 else pb.COMP_NODE
        n = pb.Node(id=i, name=f"{path.name}:op{i}", type=kind, duration_micros=5)
        if kind == pb.COMM_COLL_NODE:
            n.attr.add(name="comm_type").int64_val = pb.ALL_REDUCE
            n.attr.add(name="comm_size").int64_val = 4096
        if i > 1:
            n.data_deps.append(i - 1)
        recs.append(n.SerializeToString())
    path.write_bytes(_fuzz()._frame(recs))
    return recs


def test_chakra_rank_cut_short_beside_its_peers(tmp_path: Path) -> None:
    """A cut at a record boundary leaves a valid shorter graph; beside a whole file of another
    member of its communicator, it issues fewer collectives and is refused by name."""
    folder = tmp_path / "job"
    folder.mkdir()
    _chakra_rank(folder / "j.0.et", 3, 12)
    _chakra_rank(folder / "j.2.et", 3, 12)
    recs = _chakra_rank(folder / "j.1.et", 3, 12)
    (folder / "j.1.et").write_bytes(_fuzz()._frame(recs[:8]))  # 7 nodes: 3 all-reduces of 6
    msg = _refused(tmp_path, [folder], "rank 1 issues 3 collectives of process group '0'")
    assert "j.1.et" in msg
    assert "truncated" in msg
    # whole files are read, and one file alone cannot be judged
    with open_store(tmp_path / "ok.duckdb") as store:
        ingest(store, [folder / "j.0.et", folder / "j.2.et"], run="x", progress=False)
        ingest(store, [folder / "j.1.et"], run="y", progress=False)


@pytest.mark.parametrize("world", [0, 10**11])
def test_chakra_bad_world(tmp_path: Path, world: int) -> None:
    from prism_trace.formats.chakra import chakra_pb2 as pb

    fz = _fuzz()
    gm = pb.GlobalMetadata(version="0.0.4")
    a = gm.attr.add(name="world_size")
    a.int64_val = world
    node = pb.Node(id=1, name="n", type=pb.COMP_NODE)
    path = tmp_path / "j.0.et"
    path.write_bytes(fz._frame([gm.SerializeToString(), node.SerializeToString()]))
    _refused(tmp_path, [path], "world_size")


# -- special files --------------------------------------------------------------------------------


def test_fifo_and_devices_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "rank0.kineto.json"
    os.mkfifo(fifo)
    _refused(tmp_path, [fifo], "FIFO")
    link = tmp_path / "x.0.et"
    link.symlink_to("/dev/zero")
    _refused(tmp_path, [link], "/dev/zero")


def test_fifo_inside_a_folder_is_skipped(tmp_path: Path, kineto_doc: dict) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    _kineto(folder, kineto_doc)
    os.mkfifo(folder / "rank1.kineto.json")
    with open_store(tmp_path / "s.duckdb") as store:
        report = ingest(store, [folder], run="x", progress=False)
    assert report.ranks == [0]
    assert any(s.endswith("rank1.kineto.json") for s in report.skipped)


# -- op timelines ---------------------------------------------------------------------------------


def _op(tmp_path: Path, fuzz: ModuleType) -> Path:
    """The fuzzer's dp2 x pp2 op timeline (``trace-F.parquet``, ``meta-F.yaml``) in a folder."""
    folder = tmp_path / "op"
    folder.mkdir()
    fuzz._synthetic_op_timeline(folder)
    return folder


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda df: pl.concat([df, df.head(2)]), "duplicated"),
        (lambda df: df.with_columns(pl.col("duration") * -1), "`duration`"),
        (lambda df: df.with_columns(pl.col("start_ts") * float("inf")), "`start_ts`"),
        (lambda df: df.with_columns(pl.lit(float("nan")).alias("duration")), "`duration`"),
        (lambda df: df.with_columns(pl.col("start_ts") + 1e300), "`start_ts`"),
        (lambda df: df.with_columns(pl.col("rank") % 2 == 1), "`rank` is Boolean"),
        (lambda df: df.with_columns(pl.struct("start_ts").alias("start_ts")), "`start_ts` is"),
        (lambda df: df.with_columns(pl.col("step").cast(pl.Utf8)), "`step` is String"),
    ],
)
def test_op_timeline_bad_values(tmp_path: Path, fuzz: ModuleType, change, needle: str) -> None:
    folder = _op(tmp_path, fuzz)
    pq = folder / "trace-F.parquet"
    change(pl.read_parquet(pq)).write_parquet(pq)
    _refused(tmp_path, [folder], needle)


@pytest.mark.parametrize(
    ("meta", "needle"),
    [
        (b"dp_size: 2\npp_size: 2\nworld_size: 100000000000\n", "world_size"),
        (b"dp_size: 3\npp_size: 2\nworld_size: 4\n", "contradict"),
        (b"dp_size: 2\npp_size: 2\nworld_size: 8\n", "contradict"),
        (bytes(range(256)), "meta"),
    ],
)
def test_op_timeline_bad_meta(tmp_path: Path, fuzz: ModuleType, meta: bytes, needle: str) -> None:
    folder = _op(tmp_path, fuzz)
    (folder / "meta-F.yaml").write_bytes(meta)
    _refused(tmp_path, [folder], needle)


# -- CLI ------------------------------------------------------------------------------------------


def test_unexpected_error_is_one_line_and_debug_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import prism_trace.ingestion.pipeline as ingest_mod

    def boom(*args: object, **kwargs: object) -> None:
        msg = "a bug"
        raise KeyError(msg)

    monkeypatch.setattr(ingest_mod, "ingesting", boom)
    args = ["ingest", str(SAMPLE / "rank0.kineto.json.gz"), "--db", str(tmp_path / "s.duckdb")]
    res = CliRunner().invoke(main, args)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2
    assert len(lines) == 1
    assert "unexpected KeyError" in lines[0]
    assert "Traceback" not in res.output
    res = CliRunner().invoke(main, ["--debug", *args])
    assert isinstance(res.exception, KeyError)


def test_rank_limit_is_stated() -> None:
    assert MAX_RANKS == 1 << 20


# -- the campaign's independent check -------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle() -> ModuleType:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import _fuzz_oracle

    return _fuzz_oracle


def test_oracle_kineto(tmp_path: Path, oracle: ModuleType, kineto_doc: dict) -> None:
    good = _kineto(tmp_path, kineto_doc)
    assert oracle.verdict("kineto", [good]) is None
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + good.read_bytes())
    assert oracle.verdict("kineto", [bom]) is None
    neg = _kineto(tmp_path, _with_event(kineto_doc, dur=-5), "neg.json")
    assert "dur" in oracle.verdict("kineto", [neg])
    nan = _kineto(tmp_path, _with_event(kineto_doc, ts=float("nan")), "nan.json")
    assert "JSON" in oracle.verdict("kineto", [nan])


def test_oracle_host_et(tmp_path: Path, oracle: ModuleType, et_doc: dict) -> None:
    assert oracle.verdict("host_et", [_et(tmp_path, et_doc)]) is None
    nodes = [dict(n) for n in et_doc["nodes"]]
    del nodes[3]["attrs"]
    bad = oracle.verdict("host_et", [_et(tmp_path, {**et_doc, "nodes": nodes})])
    assert "every key" in bad


def test_oracle_chakra_cut(tmp_path: Path, oracle: ModuleType, fuzz: ModuleType) -> None:
    """A foreign file cut at a record boundary is a valid graph; prism's export is not."""
    path = _chakra(tmp_path, fuzz)
    recs = fuzz._records(path.read_bytes())
    path.write_bytes(fuzz._frame(recs[:-6]))
    assert oracle.verdict("chakra", [path]) is None
    assert not oracle.chakra_states_count(path)
    exported = tmp_path / "exp"
    fuzz._prism_export(_op(tmp_path, fuzz), exported)
    one = exported / "opt.1.et"
    assert oracle.verdict("chakra", [one]) is None
    assert oracle.chakra_states_count(one)
    one.write_bytes(fuzz._frame(fuzz._records(one.read_bytes())[:-1]))
    assert "prism_nodes" in oracle.verdict("chakra", [one])


def test_oracle_op_timeline(tmp_path: Path, oracle: ModuleType, fuzz: ModuleType) -> None:
    folder = _op(tmp_path, fuzz)
    assert oracle.verdict("op_timeline", [folder]) is None
    pq = folder / "trace-F.parquet"
    df = pl.read_parquet(pq)
    pl.concat([df, df.head(1)]).write_parquet(pq)
    assert "unique" in oracle.verdict("op_timeline", [folder])


# -- the campaign's fast subset -------------------------------------------------------------------


@pytest.mark.slow
def test_fuzz_fast_subset(fuzz: ModuleType) -> None:
    """160 seeded cases over the four formats (bundled and synthetic seeds, gz and plain,
    in-process and a few through the CLI, one bomb per format): all refused cleanly or accepted
    as is."""
    cases, results, root = fuzz.campaign(160, 2, 18, 40, 30.0, 4.0, shared=False)
    try:
        by_id = {c.id: c for c in cases}
        assert len(results) == 160
        assert {c.format for c in cases} == {"kineto", "host_et", "chakra", "op_timeline"}
        assert Counter(c.via for c in cases)["cli"] >= 4
        bad = [(by_id[r.id], r.outcome, r.detail) for r in results if not r.ok]
        assert not bad, bad
    finally:
        shutil.rmtree(root, ignore_errors=True)

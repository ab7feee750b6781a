"""Kineto reader: counts against an independent json.load of real traces, exact ns, bad inputs."""

from __future__ import annotations

import gzip
import json
import os
import socket
import sys
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from prism_trace.errors import (
    MissingFieldError,
    RankUnknownError,
    TraceFormatError,
    TruncatedTraceError,
    UnknownFormatError,
)
from prism_trace.formats.base import FRAME_SCHEMAS
from prism_trace.formats.kineto.header import rank_from_file_name
from prism_trace.formats.kineto.json_array import sniff_kineto, split_trace_events
from prism_trace.formats.kineto.reader import read_kineto

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"
DLRM = "param-dlrm-8rank/kineto"
HTA = "hta-nccl-rank0/nccl_data.json.gz"
RESNET = "param-resnet-et/resnet_kineto.json.gz"
LINEAR = "param-resnet-et/linear_kineto.json.gz"
BOOKKEEPING_PIDS = {"Spans", "Traces", ""}
KIND = {"allreduce": "all_reduce", "broadcast": "broadcast", "all_reduce": "all_reduce"}


# ---------------------------------------------------------------------------------- helpers


def load_raw(path: Path) -> dict[str, Any]:
    """The trace as Python objects, with floats as Decimal (the independent reference)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        return json.load(fh, parse_float=Decimal)


def expected_events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Events the reader keeps: X and instants, minus bookkeeping spans and memory records."""
    out = []
    for e in doc["traceEvents"]:
        if e.get("ph") not in ("X", "i", "I") or e.get("cat") == "Trace":
            continue
        if str(e.get("pid")) in BOOKKEEPING_PIDS or e.get("name") == "[memory]":
            continue
        out.append(e)
    return out


def to_ns(doc: dict[str, Any], ts: Any) -> int:
    return int(doc.get("baseTimeNanoseconds", 0)) + int(Decimal(ts) * 1000)


def write_trace(path: Path, events: list[dict[str, Any]], **meta: Any) -> Path:
    doc = {"schemaVersion": 1, **meta, "traceEvents": events, "traceName": str(path)}
    text = json.dumps(doc, indent=1).encode()
    path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)
    return path


def real_files(root: Path) -> list[tuple[Path, int | None]]:
    files: list[tuple[Path, int | None]] = [(p, None) for p in sorted((root / DLRM).glob("*.gz"))]
    return [*files, (root / HTA, None), (root / RESNET, 0), (root / LINEAR, 0)]


# ------------------------------------------------------------------------------- real traces


@pytest.mark.slow
@pytest.mark.shared_data
def test_real_traces_match_independent_counts(shared_datasets: Path) -> None:
    for path, rank in real_files(shared_datasets):
        doc = load_raw(path)
        t = read_kineto(path, rank=rank)
        for name, want in FRAME_SCHEMAS.items():
            assert dict(getattr(t, name).schema) == want, (path.name, name)
        evs = expected_events(doc)
        assert t.events.height == len(evs), path.name
        got_cats = Counter(t.events["category"].to_list())
        raw_cats = Counter(e.get("cat") for e in evs if e["ph"] == "X")
        assert got_cats["kernel"] == raw_cats["kernel"], path.name
        assert got_cats["memcpy"] == raw_cats["gpu_memcpy"], path.name
        assert got_cats["memset"] == raw_cats["gpu_memset"], path.name
        assert got_cats["cpu_op"] == raw_cats["cpu_op"], path.name
        assert t.events["event_id"].to_list() == list(range(t.events.height))
        # Exact integer ns: the multiset of start times equals the Decimal-exact conversion.
        assert sorted(t.events["ts"].to_list()) == sorted(to_ns(doc, e["ts"]) for e in evs)
        durs = sorted(int(Decimal(e.get("dur", 0)) * 1000) for e in evs)
        assert sorted(t.events["dur"].to_list()) == durs, path.name
        steps = [e for e in evs if str(e.get("name", "")).startswith("ProfilerStep#")]
        assert t.iterations.height == len(steps), path.name
        assert sorted(t.iterations["iteration"].to_list()) == sorted(
            int(e["name"].split("#")[1]) for e in steps
        )
        n_mem = sum(1 for e in doc["traceEvents"] if e.get("name") == "[memory]")
        assert t.memory.height == n_mem
        launched = {
            e["args"]["correlation"]
            for e in evs
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e["args"]
        }
        n_launch = sum(
            1
            for e in evs
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and e.get("args", {}).get("correlation") in launched
        )
        assert t.flows.filter(pl.col("kind") == "launch").height == n_launch, path.name
        n_fwdbwd = sum(1 for e in doc["traceEvents"] if e.get("cat") == "fwdbwd" and e["ph"] == "s")
        assert t.flows.filter(pl.col("kind") == "fwdbwd").height == n_fwdbwd, path.name
        assert t.ranks.height == 1
        info = doc.get("distributedInfo", {})
        assert t.ranks["rank"][0] == info.get("rank", rank)
        assert t.world_size == info.get("world_size")
        assert t.tracks["track_id"].to_list() == list(range(t.tracks.height))


@pytest.mark.slow
@pytest.mark.shared_data
def test_dlrm_collectives_per_rank(shared_datasets: Path) -> None:
    """Old traces: one collective per `nccl:<op>` annotation, in group 0 of all 8 ranks."""
    files = sorted((shared_datasets / DLRM).glob("*.gz"))
    assert len(files) == 8
    for rank, path in enumerate(files):
        doc = load_raw(path)
        anns = Counter(
            e["name"].removeprefix("nccl:")
            for e in doc["traceEvents"]
            if e.get("cat") == "user_annotation" and e["name"].startswith("nccl:")
        )
        nccl_kernels = [
            e for e in doc["traceEvents"] if e.get("cat") == "kernel" and "nccl" in e["name"]
        ]
        t = read_kineto(path)
        c = t.collectives
        assert t.ranks["rank"].to_list() == [rank]
        assert Counter(c["kind"].to_list()) == anns
        assert c["group_name"].unique().to_list() == ["0"]
        assert c["group_size"].unique().to_list() == [8]
        assert c["kernel_event_id"].null_count() == 0
        assert c.height == len(nccl_kernels)
        kernels = t.events.filter(pl.col("event_id").is_in(c["kernel_event_id"].implode()))
        assert all("nccl" in n for n in kernels["name"].to_list())
        assert (c["kernel_ts"] >= c["host_ts"]).all()
        assert (c["msg_bytes"] > 0).all()
        assert c["iteration"].unique().to_list() == [10]
        g = t.comm_groups
        assert g["name"].to_list() == ["0"]
        assert g["ranks"].to_list() == [list(range(8))]


@pytest.mark.shared_data
def test_hta_collectives(shared_datasets: Path) -> None:
    """Modern traces: record_param_comms with Collective name; `wait` is not a collective."""
    path = shared_datasets / HTA
    doc = load_raw(path)
    rpc = [e for e in doc["traceEvents"] if e.get("name") == "record_param_comms"]
    want = Counter(
        KIND[e["args"]["Collective name"]] for e in rpc if e["args"].get("Collective name") in KIND
    )
    t = read_kineto(path)
    c = t.collectives
    assert Counter(c["kind"].to_list()) == want
    assert c["group_name"].unique().to_list() == ["0"]
    assert c["kernel_event_id"].null_count() == 0
    first = next(e for e in rpc if e["args"].get("Collective name") == "allreduce")
    row = c.filter(pl.col("host_ts") == to_ns(doc, first["ts"])).row(0, named=True)
    nbytes = int(first["args"]["In msg nelems"]) * 4
    assert (row["kind"], row["dtype"], row["in_bytes"], row["msg_bytes"]) == (
        "all_reduce",
        "float",
        nbytes,
        nbytes,
    )
    assert row["host_dur"] == int(Decimal(first["dur"]) * 1000)
    kernel = t.events.filter(pl.col("event_id") == row["kernel_event_id"]).row(0, named=True)
    assert kernel["name"].startswith("ncclKernel_AllReduce")
    assert t.comm_groups.row(0, named=True) == {
        "name": "0",
        "description": "default_pg",
        "backend": "nccl",
        "size": 2,
        "ranks": [0, 1],
    }
    # device events take the iteration of their launch
    ev = t.events
    launches = t.flows.filter(pl.col("kind") == "launch")
    pairs = launches.join(
        ev.select(pl.col("event_id").alias("src_event_id"), pl.col("iteration").alias("it_src")),
        on="src_event_id",
    ).join(
        ev.select(pl.col("event_id").alias("dst_event_id"), pl.col("iteration").alias("it_dst")),
        on="dst_event_id",
    )
    assert (pairs["it_src"].eq_missing(pairs["it_dst"])).all()
    assert set(t.iterations["iteration"].to_list()) == {4, 5, 6}


@pytest.mark.shared_data
def test_hta_fwdbwd_binding_matches_naive(shared_datasets: Path) -> None:
    """Each fwd-bwd point binds to the innermost event of its thread enclosing it (naive scan)."""
    path = shared_datasets / HTA
    doc = load_raw(path)
    spans: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    for e in expected_events(doc):
        if e["ph"] == "X":
            start = to_ns(doc, e["ts"])
            end = start + int(Decimal(e.get("dur", 0)) * 1000)
            spans.setdefault((str(e["pid"]), str(e["tid"])), []).append((start, end, e["name"]))

    def innermost(p: dict[str, Any]) -> tuple[int, int, str] | None:
        ts = to_ns(doc, p["ts"])
        inside = [s for s in spans.get((str(p["pid"]), str(p["tid"])), []) if s[0] <= ts <= s[1]]
        return max(inside, key=lambda s: (s[0], -s[1]), default=None)  # latest start, shortest

    points = [e for e in doc["traceEvents"] if e.get("cat") == "fwdbwd"]
    bound = {(p["id"], p["ph"]): innermost(p) for p in points}
    want = Counter(
        (bound[(i, "s")], bound[(i, "f")])
        for i, ph in bound
        if ph == "s" and bound[(i, "s")] and bound.get((i, "f"))
    )
    assert sum(want.values()) == 543

    t = read_kineto(path)
    ev = t.events.select("event_id", "ts", "dur", "name")
    key = {r[0]: (r[1], r[1] + r[2], r[3]) for r in ev.iter_rows()}
    fwdbwd = t.flows.filter(pl.col("kind") == "fwdbwd")
    got = Counter(
        (key[s], key[d])
        for s, d in zip(fwdbwd["src_event_id"], fwdbwd["dst_event_id"], strict=True)
    )
    assert got == want


def test_rank_args_and_unknown_peer(tmp_path: Path) -> None:
    """``prism_layout`` goes verbatim into the rank's args; a p2p peer nobody states is null."""
    layout = {"tp": 2, "dp": 1, "pp": 1, "rank": 1, "tp_rank": 1, "dp_rank": 0, "pp_rank": 0}
    host = {"pid": 100, "tid": 100}
    events = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "prism_comm:pg=0;op=send;seq=0;in_bytes=8",
            "ts": 10,
            "dur": 5,
            **host,
        },
    ]
    path = write_trace(
        tmp_path / "rank1.json", events, distributedInfo={"rank": 1}, prism_layout=layout
    )
    t = read_kineto(path)
    assert json.loads(t.ranks["args"][0])["prism_layout"] == layout
    assert t.p2p["peer"].to_list() == [None]


# ------------------------------------------------------------------------- synthetic traces


def synthetic_events() -> list[dict[str, Any]]:
    host = {"pid": 100, "tid": 100}
    return [
        {"ph": "M", "name": "thread_name", "pid": 100, "tid": 100, "args": {"name": "main"}},
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "ProfilerStep#3",
            **host,
            "ts": 1000,
            "dur": 100,
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::mm",
            **host,
            "ts": 1010,
            "dur": 20,
            "args": {"External id": 7, "Record function id": 9, "Sequence number": 4},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            **host,
            "ts": 1015,
            "dur": 5,
            "args": {"External id": 7, "correlation": 55},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "gemm",
            "pid": 0,
            "tid": 7,
            "ts": 1150,
            "dur": 30,
            "args": {"External id": 7, "correlation": 55, "stream": 7, "device": 0},
        },
        {
            "ph": "X",
            "cat": "cuda_sync",
            "name": "Wait Event",
            "pid": 0,
            "tid": 9,
            "ts": 1190,
            "dur": 0,
            "args": {"wait_on_stream": 7, "wait_on_cuda_event_record_corr_id": 60},
        },
        {
            "ph": "i",
            "cat": "cpu_instant_event",
            "name": "[memory]",
            **host,
            "ts": 1020,
            "s": "t",
            "args": {
                "Bytes": 512,
                "Total Allocated": 1024,
                "Total Reserved": 2048,
                "Device Type": 1,
                "Device Id": 0,
                "Addr": 1234,
            },
        },
        {"ph": "i", "cat": "cpu_instant_event", "name": "marker", **host, "ts": 1040, "s": "t"},
        {"ph": "s", "cat": "fwdbwd", "id": 3, "pid": 100, "tid": 100, "ts": 1010, "name": "fwdbwd"},
        {
            "ph": "f",
            "cat": "fwdbwd",
            "id": 3,
            "pid": 100,
            "tid": 100,
            "ts": 1060,
            "name": "fwdbwd",
            "bp": "e",
        },
        {"ph": "X", "cat": "cpu_op", "name": "MmBackward0", **host, "ts": 1060, "dur": 10},
        {
            "ph": "X",
            "cat": "Trace",
            "name": "PyTorch Profiler (0)",
            "pid": "Spans",
            "tid": "PyTorch Profiler",
            "ts": 900,
            "dur": 500,
        },
        {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": 1400},
    ]


def test_synthetic_trace_all_frames(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "rank5_trace.json.gz", synthetic_events(), baseTimeNanoseconds=10**18
    )
    t = read_kineto(path)
    assert t.ranks.row(0, named=True)["rank"] == 5
    assert t.ranks["device"][0] == "cpu" or t.ranks["device"][0].startswith("device")
    ev = t.events.sort("event_id")
    assert ev["category"].to_list() == [
        "user_annotation",
        "cpu_op",
        "cuda_runtime",
        "instant",
        "cpu_op",
        "kernel",
        "cuda_sync",
    ]
    assert ev["ts"][0] == 10**18 + 1_000_000
    mm = ev.filter(pl.col("name") == "aten::mm").row(0, named=True)
    assert (mm["external_id"], mm["rf_id"], json.loads(mm["args"])) == (
        7,
        9,
        {"Sequence number": 4},
    )
    assert (mm["depth"], mm["parent_id"]) == (1, 0)
    launch = ev.filter(pl.col("name") == "cudaLaunchKernel").row(0, named=True)
    assert (launch["correlation"], launch["depth"], launch["parent_id"]) == (55, 2, mm["event_id"])
    gemm = ev.filter(pl.col("name") == "gemm").row(0, named=True)
    assert gemm["iteration"] == 3  # by its launch, though it runs after the step ends
    assert ev.filter(pl.col("name") == "MmBackward0")["iteration"].to_list() == [3]
    assert t.tracks["kind"].to_list() == ["thread", "stream", "stream"]
    assert t.tracks["name"][0] == "main"
    flows = {r["kind"]: r for r in t.flows.iter_rows(named=True)}
    assert (flows["launch"]["src_event_id"], flows["launch"]["dst_event_id"]) == (
        launch["event_id"],
        gemm["event_id"],
    )
    back = ev.filter(pl.col("name") == "MmBackward0")["event_id"][0]
    assert (flows["fwdbwd"]["src_event_id"], flows["fwdbwd"]["dst_event_id"]) == (
        mm["event_id"],
        back,
    )
    sync = ev.filter(pl.col("category") == "cuda_sync")["event_id"][0]
    assert (flows["sync"]["src_event_id"], flows["sync"]["dst_event_id"]) == (
        gemm["event_id"],
        sync,
    )
    assert t.memory.row(0, named=True) == {
        "rank": 5,
        "ts": 10**18 + 1_020_000,
        "device_type": "cuda",
        "device_id": 0,
        "addr": 1234,
        "bytes": 512,
        "total_allocated": 1024,
        "total_reserved": 2048,
        "iteration": 3,
        "inferred": False,
    }


def test_epoch_microseconds_with_decimals_are_exact(tmp_path: Path) -> None:
    """ts of ~1.7e15 µs with 3 decimals do not fit a DOUBLE; the reader keeps every ns."""
    path = tmp_path / "rank0.json"
    body = ",".join(
        f'{{"ph": "X", "cat": "cpu_op", "name": "op{i}", "pid": 1, "tid": 1,'
        f' "ts": 1694128201436271.{i:03d}, "dur": 0.{i:03d}}}'
        for i in range(1, 200, 7)
    )
    path.write_text('{"schemaVersion": 1, "traceEvents": [' + body + "]}")
    t = read_kineto(path)
    got = sorted(t.events["ts"].to_list())
    assert got == [1694128201436271000 + i for i in range(1, 200, 7)]
    assert sorted(t.events["dur"].to_list()) == list(range(1, 200, 7))


@pytest.mark.parametrize(
    ("device_type", "stored"),
    [(1, "cuda"), (0, "cpu"), (-2, "-2"), (2**31 - 1, str(2**31 - 1)), (99, "99"), ("XPU", "xpu")],
)
def test_memory_device_type(tmp_path: Path, device_type: object, stored: str) -> None:
    """An allocator record's ``Device Type`` is c10's enum by value; one outside it is kept as
    written (a negative one is not counted from the end, a huge one does not overflow)."""
    mem = {
        "ph": "i",
        "name": "[memory]",
        "pid": 1,
        "tid": 1,
        "ts": 5,
        "s": "t",
        "args": {"Device Type": device_type, "Device Id": 0, "Addr": 1, "Bytes": 8},
    }
    op = {"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": 1, "dur": 9}
    t = read_kineto(write_trace(tmp_path / "rank0.json", [op, mem]))
    assert t.memory["device_type"].to_list() == [stored]


def test_exact_ts_is_the_records_own_not_one_in_its_args(tmp_path: Path) -> None:
    """On the exact path the ts/dur text comes from the record, wherever its keys stand: a
    generator that writes ``args`` first (with keys named ``ts`` and ``dur`` in it) must not
    lend them to the event; an untimed record's huge ``ts`` does not stop the file."""
    path = tmp_path / "rank0.json"
    body = ",".join(
        f'{{"args": {{"ts": 1.5, "dur": 1, "inner": {{"ts": 2}}}}, "ph": "X", "cat": "cpu_op",'
        f' "name": "op{i}", "pid": 1, "tid": 1, "ts": 1694128201436271.{i:03d},'
        f' "dur": 0.{i:03d}}}'
        for i in range(1, 50, 7)
    )
    meta = '{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "ts": 1e30, "args": {}}'
    path.write_text('{"schemaVersion": 1, "traceEvents": [' + meta + "," + body + "]}")
    t = read_kineto(path)
    assert sorted(t.events["ts"].to_list()) == [1694128201436271000 + i for i in range(1, 50, 7)]
    assert sorted(t.events["dur"].to_list()) == list(range(1, 50, 7))


def test_rank_rules(tmp_path: Path) -> None:
    evs = synthetic_events()[:3]
    info = {"rank": 2, "world_size": 4, "backend": "nccl"}
    p = write_trace(tmp_path / "rank7_trace.json", evs, distributedInfo=info)
    assert read_kineto(p).rank_ids == [2]  # distributedInfo wins over the name
    assert read_kineto(p, rank=2).world_size == 4
    with pytest.raises(TraceFormatError, match="disagrees"):
        read_kineto(p, rank=3)
    q = write_trace(tmp_path / "worker3_step_12.123.pt.trace.json.gz", evs)
    assert read_kineto(q).rank_ids == [3]
    assert read_kineto(q, rank=1).rank_ids == [1]  # an explicit rank beats a name's guess
    anon = write_trace(tmp_path / "trace.json", evs)
    with pytest.raises(RankUnknownError, match=r"trace\.json: cannot tell the rank .*pass --rank"):
        read_kineto(anon)


def test_rank_from_file_name() -> None:
    assert rank_from_file_name(Path("worker3_step_12.1694128201557.pt.trace.json.gz")) == 3
    assert rank_from_file_name(Path("rank12_trace.json")) == 12
    assert rank_from_file_name(Path("iteration_5/rank_4.json")) == 4
    assert rank_from_file_name(Path("trace.6.json")) == 6
    assert rank_from_file_name(Path("trace.json")) is None


def test_trailer_and_header_keys(tmp_path: Path) -> None:
    """Keys after the array (with `]` inside strings and lists) come back; the array is exact."""
    events = [
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "a]b",
            "pid": 1,
            "tid": 1,
            "ts": 5,
            "dur": 1,
            "args": {"x": [{"y": [1, 2]}], "s": "]}, ]"},
        }
    ]
    text = (
        '{"schemaVersion": 1, "prism_groups": "[{\\"name\\": \\"tp\\", \\"ranks\\": [0, 1]}]",'
        ' "traceEvents": ' + json.dumps(events) + ', "INFO": ["x]", "]"], "list": [{"a": 1}],'
        ' "traceName": "t"}'
    )
    path = tmp_path / "rank0.json"
    path.write_text(text)
    with split_trace_events(path, tmp_dir=tmp_path) as tef:
        assert json.loads(tef.events_path.read_text()) == events
        assert tef.meta["INFO"] == ["x]", "]"]
        assert tef.meta["list"] == [{"a": 1}]
        assert tef.meta["traceName"] == "t"
        tmp_dir = tef.events_path.parent
    assert not tmp_dir.exists()
    t = read_kineto(path)
    assert t.events["name"].to_list() == ["a]b"]


def test_empty_events(tmp_path: Path) -> None:
    t = read_kineto(write_trace(tmp_path / "rank0.json", []))
    assert t.events.height == 0
    assert t.ranks["device"].to_list() == ["cpu"]


def test_sniff() -> None:
    assert sniff_kineto(b'{\n  "schemaVersion": 1,\n  "deviceProperties": [')
    assert sniff_kineto(gzip.compress(b'{"traceEvents": [{"ph": "X"}]}'))
    assert not sniff_kineto(b'{"schema": "1.0.1", "pid": 1, "nodes": [')
    assert not sniff_kineto(b'[{"name": "x"}]')


# ------------------------------------------------------------------------------- bad inputs


@pytest.mark.shared_data
def test_truncated_gzip(shared_datasets: Path, tmp_path: Path) -> None:
    src = next((shared_datasets / DLRM).glob("worker0_*"))
    cut = tmp_path / "worker0_cut.pt.trace.json.gz"
    data = src.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TruncatedTraceError, match=cut.name):
        read_kineto(cut)


@pytest.mark.shared_data
def test_corrupt_gzip(shared_datasets: Path, tmp_path: Path) -> None:
    src = next((shared_datasets / DLRM).glob("worker0_*"))
    bad = tmp_path / "worker0_bad.pt.trace.json.gz"
    data = bytearray(src.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\x00" * 64
    bad.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match=bad.name):
        read_kineto(bad)


@pytest.mark.shared_data
def test_corrupt_json(shared_datasets: Path, tmp_path: Path) -> None:
    src = next((shared_datasets / DLRM).glob("worker0_*"))
    text = gzip.decompress(src.read_bytes())
    bad = tmp_path / "worker0_json.pt.trace.json"
    mid = len(text) // 2
    bad.write_bytes(text[:mid] + b"}}]],,{{" + text[mid:])
    with pytest.raises(TraceFormatError, match=bad.name):
        read_kineto(bad)


def test_truncated_plain_json(tmp_path: Path) -> None:
    full = write_trace(tmp_path / "rank0.json", synthetic_events()).read_bytes()
    cut = tmp_path / "rank0_cut.json"
    cut.write_bytes(full[: len(full) * 2 // 3])
    with pytest.raises(TruncatedTraceError, match=cut.name):
        read_kineto(cut)


def test_no_trace_events(tmp_path: Path) -> None:
    et = tmp_path / "rank0_et.json"
    et.write_text('{"schema": "1.0.1", "pid": 1, "nodes": []}')
    with pytest.raises(MissingFieldError, match=r"rank0_et\.json: no top-level `traceEvents`"):
        read_kineto(et)
    arr = tmp_path / "rank0_array.json"
    arr.write_text('[{"ph": "X"}]')
    with pytest.raises(UnknownFormatError, match=arr.name):
        read_kineto(arr)


# ----------------------------------------------------------------------------- gloo (torch)


def _gloo_worker(rank: int, world: int, port: int, out: str) -> None:  # pragma: no cover
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = json.dumps([{"name": "0", "desc": "default_pg", "ranks": list(range(world))}])

    def ann(seq: int, op: str, nin: int, nout: int, peer: int = -1, tag: int = 0) -> str:
        return (
            f"prism_comm:pg=0;desc=default_pg;seq={seq};op={op};in_bytes={nin};"
            f"out_bytes={nout};dtype=float;peer={peer};tag={tag}"
        )

    t = torch.ones(256)
    seq = 0
    sched = schedule(wait=0, warmup=1, active=2, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched, profile_memory=True) as prof:
        for step in range(3):
            prof.add_metadata_json("prism_groups", groups)
            with record_function(ann(seq, "all_reduce", 1024, 1024)):
                dist.all_reduce(t)
            seq += 1
            outs = [torch.empty(256) for _ in range(world)]
            with record_function(ann(seq, "all_gather", 1024, 1024 * world)):
                dist.all_gather(outs, t)
            seq += 1
            if rank == 0:
                with record_function(ann(-1, "send", 1024, 0, peer=1, tag=step)):
                    dist.send(t, 1, tag=step)
            else:
                with record_function(ann(-1, "recv", 0, 1024, peer=0, tag=step)):
                    dist.recv(t, 0, tag=step)
            prof.step()
    prof.export_chrome_trace(f"{out}/rank{rank}_trace.json")
    # Both ranks reach the teardown together: a rank that destroys the group while its peer
    # still finishes its last recv can abort the peer in gloo ("terminate called without an
    # active exception", seen once under a loaded CI run).
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.torch
@pytest.mark.slow
def test_gloo_trace_from_prism_annotations(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    mp = pytest.importorskip("torch.multiprocessing")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.stdout.flush()
    mp.spawn(_gloo_worker, args=(2, port, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        t = read_kineto(tmp_path / f"rank{rank}_trace.json")
        assert t.rank_ids == [rank]
        assert t.ranks["backend"].to_list() == ["gloo"]
        c = t.collectives.sort("host_ts")
        # steps 1 and 2 were recorded (warmup=1): seq 2..5 of group 0
        assert c["seq"].to_list() == [2, 3, 4, 5]
        assert c["kind"].to_list() == ["all_reduce", "all_gather"] * 2
        assert c["msg_bytes"].to_list() == [1024, 2048] * 2
        assert c["group_name"].unique().to_list() == ["0"]
        assert c["group_size"].unique().to_list() == [2]
        assert c["kernel_event_id"].null_count() == c.height
        assert c["iteration"].to_list() == [1, 1, 2, 2]
        p = t.p2p
        assert p["direction"].to_list() == ["send" if rank == 0 else "recv"] * 2
        assert p["peer"].to_list() == [1 - rank] * 2
        assert p["tag"].to_list() == [1, 2]
        assert p["bytes"].to_list() == [1024, 1024]
        assert p["seq"].to_list() == [0, 1]
        g = t.comm_groups.row(0, named=True)
        assert (g["name"], g["description"], g["backend"], g["ranks"]) == (
            "0",
            "default_pg",
            "gloo",
            [0, 1],
        )
        assert t.memory.height > 0
        assert set(t.memory["device_type"].to_list()) == {"cpu"}
        assert t.iterations["iteration"].to_list() == [1, 2]


@pytest.mark.shared_data
def test_freeing_work_tables_changes_no_row(
    shared_datasets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large trace frees its work tables as it goes (``_Reader.free``), a small one does not:
    both give the same frames (here the same file read both ways)."""
    import prism_trace.formats.kineto.reader as kineto

    path = shared_datasets / HTA
    small = read_kineto(path)
    monkeypatch.setattr(kineto, "_FREE_BYTES", 0)
    freed = read_kineto(path)
    for name in FRAME_SCHEMAS:
        a, b = getattr(small, name), getattr(freed, name)
        assert a.height > 0 or name in ("et_ops", "p2p", "memory"), name
        assert a.equals(b), name


def test_out_of_memory_fetching_the_events_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The events query (the sort of the whole trace's events) running out of memory is the
    same one line, whoever consumes it."""
    import duckdb

    from prism_trace.errors import OutOfMemoryError
    from prism_trace.formats.kineto import reader as kineto

    real = kineto._Reader.events_sql

    def starved(self: kineto._Reader) -> str:
        self.con.execute("SET memory_limit = '1MB'")
        return real(self)

    monkeypatch.setattr(kineto._Reader, "events_sql", starved)

    def fetch(_rank: int, rel: duckdb.DuckDBPyRelation) -> None:
        for _batch in rel.to_arrow_reader(1 << 16):
            pass

    with (
        duckdb.connect(config={"threads": 1}) as con,
        pytest.raises(OutOfMemoryError, match="ran out of memory reading the trace"),
    ):
        kineto.stage_kineto(SAMPLE / "rank0.kineto.json.gz", con=con, events_into=fetch)

"""Host ET ↔ Kineto linking: hand-built cases, then real pairs checked against the raw JSON."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from prism_trace.formats.base import FRAME_SCHEMAS
from prism_trace.formats.host_et.reader import read_host_et
from prism_trace.ingestion.link import link_et_to_kineto

try:  # the Kineto reader lands in parallel; the raw loader below stands in until it does
    from prism_trace.formats.kineto.reader import read_kineto
except ImportError:  # pragma: no cover
    read_kineto = None

DLRM = "param-dlrm-8rank"
RESNET = "param-resnet-et"
ROOT = "[pytorch|profiler|execution_trace|thread]"


# ---------------------------------------------------------------------------------- helpers


def et_frame(ops: list[tuple[int, str, int, int | None]]) -> pl.DataFrame:
    """``et_ops`` of rank 0 from (node_id, name, tid, rf_id)."""
    return pl.DataFrame(
        {
            "rank": [0] * len(ops),
            "node_id": [o[0] for o in ops],
            "name": [o[1] for o in ops],
            "tid": [o[2] for o in ops],
            "rf_id": [o[3] for o in ops],
        }
    ).select(
        [
            (pl.col(c) if c in ("rank", "node_id", "name", "tid", "rf_id") else pl.lit(None))
            .cast(t)
            .alias(c)
            for c, t in FRAME_SCHEMAS["et_ops"].items()
        ]
    )


def ev_frame(evs: list[tuple[int, str, int, int | None, int | None]]) -> pl.DataFrame:
    """``events`` from (event_id, name, track_id, external_id, rf_id); ts follows event order."""
    return pl.DataFrame(
        {
            "event_id": [e[0] for e in evs],
            "name": [e[1] for e in evs],
            "track_id": [e[2] for e in evs],
            "external_id": [e[3] for e in evs],
            "rf_id": [e[4] for e in evs],
            "category": ["cpu_op"] * len(evs),
            "ts": [1000 * i for i in range(len(evs))],
        },
        schema_overrides={"external_id": pl.Int64, "rf_id": pl.Int64, "track_id": pl.Int32},
    )


def load_kineto_raw(path: Path) -> tuple[pl.DataFrame, dict[int, list[Any]]]:
    """Kineto ``X`` events as an ``events``-like frame, read straight from the JSON (independent of
    the package's reader), and each event's ``Input Dims``."""
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as fh:
        trace = json.load(fh)
    rows, dims = [], {}
    tracks: dict[tuple[Any, Any], int] = {}
    for i, e in enumerate(ev for ev in trace["traceEvents"] if ev.get("ph") == "X"):
        args = e.get("args") or {}
        rows.append(
            {
                "event_id": i,
                "name": e["name"],
                "category": e.get("cat") or "other",
                "ts": round(float(e["ts"]) * 1000),
                "dur": round(float(e.get("dur", 0)) * 1000),
                "external_id": args.get("External id"),
                "rf_id": args.get("Record function id"),
                "track_id": tracks.setdefault((e.get("pid"), e.get("tid")), len(tracks)),
            }
        )
        if "Input Dims" in args:
            dims[i] = args["Input Dims"]
    schema = {c: FRAME_SCHEMAS["events"][c] for c in rows[0]}
    return pl.DataFrame(rows, schema=schema), dims


def check_links(
    ops: pl.DataFrame, events: pl.DataFrame, dims: dict[int, list[Any]]
) -> tuple[int, int]:
    """Assert linked pairs agree on name and tensor input shapes; return (linked, shapes seen)."""
    linked = ops.filter(pl.col("event_id").is_not_null())
    assert linked["event_id"].n_unique() == linked.height, "an event is linked twice"
    names = dict(zip(events["event_id"].to_list(), events["name"].to_list(), strict=True))
    checked = 0
    for row in linked.iter_rows(named=True):
        assert names[row["event_id"]] == row["name"], row
        if row["event_id"] not in dims or row["input_types"] is None:
            continue
        k_dims = dims[row["event_id"]]
        types = json.loads(row["input_types"])
        shapes = json.loads(row["input_shapes"])
        for i, (shape, typ) in enumerate(zip(shapes, types, strict=False)):
            if typ.startswith("Tensor(") and i < len(k_dims):
                assert shape == k_dims[i], (row["name"], shapes, k_dims)
                checked += 1
    return linked.height, checked


def linkable_in_raw(path: Path) -> int:
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as fh:
        nodes = json.load(fh)["nodes"]
    return sum(
        not n["name"].startswith("[pytorch|profiler|") and n["name"] != "## process_group:init ##"
        for n in nodes
    )


# ---------------------------------------------------------------------------------- hand-built


def test_link_by_rf_id() -> None:
    ops = et_frame(
        [(1, ROOT, 1, 0), (2, "aten::mm", 1, 5), (3, "aten::add", 1, 6), (4, "aten::relu", 1, 9)]
    )
    events = ev_frame(
        [(10, "aten::mm", 0, 1, 5), (11, "aten::sub", 0, 2, 6), (12, "aten::relu", 0, 3, 9)]
    )
    out, rep = link_et_to_kineto(ops, events)
    assert out.columns == ops.columns
    assert out["event_id"].to_list() == [None, 10, None, 12]  # rf 6 names differ: not linked
    assert (rep.total, rep.linkable, rep.linked, rep.by_rf_id, rep.by_sequence) == (4, 3, 2, 2, 0)
    assert rep.linked_fraction == pytest.approx(2 / 3)


def test_link_by_sequence_windows_and_threads() -> None:
    """Kineto has extra ops (a step annotation, an op the ET lacks), the ET runs past the Kineto
    window, and the two ET threads must pair with the right Kineto tracks."""
    main = ["fwd", "aten::linear", "aten::t", "aten::addmm", "aten::relu", "aten::linear"]
    main += ["aten::t", "aten::addmm", "aten::sum", "opt.step", "aten::add_", "aten::add_"]
    back = ["eval: SumBackward", "SumBackward", "aten::expand", "eval: AddmmBackward"]
    back += ["AddmmBackward", "aten::mm", "aten::mm", "aten::sum", "aten::view", "acc_grad"]
    ops, rf = [(1, ROOT, 1, 0), (2, ROOT, 2, 0)], 1
    for name in main[:9]:
        ops.append((len(ops) + 1, name, 1, rf))
        rf += 1
    for name in back:
        ops.append((len(ops) + 1, name, 2, rf))
        rf += 1
    for name in main[9:]:
        ops.append((len(ops) + 1, name, 1, rf))
        rf += 1
    k_main = ["ProfilerStep#3", *main[:4], "aten::empty", *main[4:9], "opt.step"]  # ends early
    k_back = [*back[:5], "aten::zeros", *back[5:]]
    evs: list[tuple[int, str, int, int | None, int | None]] = []
    for track, names in ((7, k_back), (3, k_main)):
        for name in names:
            evs.append((100 + len(evs), name, track, 500 + len(evs), None))
    out, rep = link_et_to_kineto(et_frame(ops), ev_frame(evs))
    linked = out.filter(pl.col("event_id").is_not_null())
    ev_name = dict(zip([e[0] for e in evs], [e[1] for e in evs], strict=True))
    ev_track = dict(zip([e[0] for e in evs], [e[2] for e in evs], strict=True))
    assert all(ev_name[e] == n for e, n in zip(linked["event_id"], linked["name"], strict=True))
    assert {ev_track[e] for e in linked.filter(pl.col("tid") == 1)["event_id"]} == {3}
    assert {ev_track[e] for e in linked.filter(pl.col("tid") == 2)["event_id"]} == {7}
    # all but the two add_ after the Kineto window end are linked
    assert (rep.linkable, rep.linked, rep.by_sequence) == (22, 20, 20)
    unlinked = out.filter(pl.col("event_id").is_null() & (pl.col("name") != ROOT))
    assert unlinked["name"].to_list() == ["aten::add_", "aten::add_"]


def test_link_prefers_the_iteration_that_matches_longest() -> None:
    """Kineto holds two iterations; only the second matches the ET all the way (grads exist)."""
    it1 = ["aten::linear", "aten::t", "aten::addmm", "aten::relu", "aten::sum"] * 2
    it1 += ["acc_grad", "aten::detach", "opt.step"]
    it2 = [*it1[:-2], "aten::add_", "opt.step"]
    ops = et_frame([(i + 1, n, 1, i + 1) for i, n in enumerate(it2)])
    events = ev_frame([(i, n, 0, i + 1, None) for i, n in enumerate(it1 + it2)])
    out, rep = link_et_to_kineto(ops, events)
    assert rep.linked == len(it2)
    assert out["event_id"].to_list() == list(range(len(it1), len(it1) + len(it2)))


def test_link_empty() -> None:
    out, rep = link_et_to_kineto(et_frame([]), ev_frame([]))
    assert out.is_empty()
    assert (rep.total, rep.linked, rep.linked_fraction) == (0, 0, 1.0)
    ops = et_frame([(1, "aten::mm", 1, 3)])
    out, rep = link_et_to_kineto(ops, ev_frame([]))
    assert out["event_id"].to_list() == [None]
    assert rep.linked_by == {"rf_id": 0, "sequence": 0}


# ---------------------------------------------------------------------------------- real pairs


@pytest.mark.shared_data
@pytest.mark.parametrize("rank", range(8))
def test_dlrm_pairs(shared_datasets: Path, rank: int) -> None:
    """No `Record function id` in these Kineto traces: every ET op links by sequence, and the
    pairs agree on name and on every tensor input shape Kineto recorded."""
    et_path = shared_datasets / DLRM / "et" / f"dlrm_eg_{rank}.json.gz"
    k_path = next((shared_datasets / DLRM / "kineto").glob(f"worker{rank}_*.json.gz"))
    events, dims = load_kineto_raw(k_path)
    assert events["rf_id"].null_count() == events.height
    ops, rep = link_et_to_kineto(read_host_et(et_path).et_ops, events)
    expected = linkable_in_raw(et_path)
    assert rep.linkable == expected == 1672
    assert rep.linked == rep.by_sequence == expected
    linked, checked = check_links(ops, events, dims)
    assert linked == expected
    assert checked > 1500


@pytest.mark.shared_data
def test_linear_pair(shared_datasets: Path) -> None:
    """Same process (pid 24248), but the ET holds a later iteration than Kineto's first."""
    et_path = shared_datasets / RESNET / "linear_et_1.0.1.json.gz"
    events, dims = load_kineto_raw(shared_datasets / RESNET / "linear_kineto.json.gz")
    ops, rep = link_et_to_kineto(read_host_et(et_path, rank=0).et_ops, events)
    assert rep.linkable == linkable_in_raw(et_path) == 928
    assert rep.linked_fraction >= 0.99
    linked, _ = check_links(ops, events, dims)
    assert linked == rep.linked


@pytest.mark.slow
@pytest.mark.shared_data
def test_resnet_pair(shared_datasets: Path) -> None:
    """Not the same job: the ET is a DDP run (reducer, copy_bucket_to_grad, comms), the Kineto
    trace a plain single-GPU one, so only the common structure can link."""
    et_path = shared_datasets / RESNET / "resnet_et_1.1.0.json.gz"
    events, dims = load_kineto_raw(shared_datasets / RESNET / "resnet_kineto.json.gz")
    ops, rep = link_et_to_kineto(read_host_et(et_path).et_ops, events)
    assert rep.linkable == linkable_in_raw(et_path)
    assert rep.linked_fraction >= 0.5
    linked, _ = check_links(ops, events, dims)
    assert linked == rep.linked
    # what stays unlinked is mostly ops the Kineto trace never has
    k_names = set(events["name"].to_list())
    missing = ops.filter(pl.col("event_id").is_null() & ~pl.col("name").is_in(list(k_names)))
    assert missing.height > 2000


@pytest.mark.shared_data
@pytest.mark.skipif(read_kineto is None, reason="prism_trace.formats.kineto.reader not there yet")
@pytest.mark.parametrize("rank", [0, 5])
def test_dlrm_pairs_with_kineto_reader(shared_datasets: Path, rank: int) -> None:
    et_path = shared_datasets / DLRM / "et" / f"dlrm_eg_{rank}.json.gz"
    k_path = next((shared_datasets / DLRM / "kineto").glob(f"worker{rank}_*.json.gz"))
    assert read_kineto is not None
    events = read_kineto(k_path).events
    ops, rep = link_et_to_kineto(read_host_et(et_path).et_ops, events)
    assert rep.linked == linkable_in_raw(et_path)
    linked, _ = check_links(ops, events, {})
    assert linked == rep.linked


_GEN = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile

    out = sys.argv[1]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    et = ExecutionTraceObserver().register_callback(out + "/et_rank0.json")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 execution_trace_observer=et) as prof:
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
            prof.step()
    prof.export_chrome_trace(out + "/kineto_rank0.json")
    dist.destroy_process_group()
    """
)


@pytest.mark.torch
@pytest.mark.slow
def test_generated_pair_links_by_rf_id(tmp_path: Path) -> None:
    """A trace pair from the installed torch (schema 1.1.1, `Record function id` in Kineto)."""
    pytest.importorskip("torch")
    subprocess.run([sys.executable, "-c", _GEN, str(tmp_path)], check=True, capture_output=True)
    t = read_host_et(tmp_path / "et_rank0.json")
    assert t.rank_ids == [0]
    assert t.comm_groups["name"].to_list() == ["0"]
    assert t.comm_groups["backend"].to_list() == ["gloo"]
    # gloo records no record_param_comms: the c10d ops stand in
    assert t.collectives["kind"].to_list() == ["all_reduce"] * 8
    assert t.collectives["group_name"].unique().to_list() == ["0"]
    events, dims = load_kineto_raw(tmp_path / "kineto_rank0.json")
    ops, rep = link_et_to_kineto(t.et_ops, events)
    assert rep.by_rf_id == rep.linked == rep.linkable == linkable_in_raw(tmp_path / "et_rank0.json")
    assert rep.by_sequence == 0
    linked, checked = check_links(ops, events, dims)
    assert linked == rep.linked
    assert checked > 100

"""Perfetto export: valid Chrome trace JSON holding every timed event, for every run kind."""

from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from prism_trace.errors import OutputError, RunNotFoundError, SelectionError
from prism_trace.export.perfetto import PERFETTO_SCHEMA, export_perfetto
from prism_trace.ingestion.pipeline import ingest
from prism_trace.layout.mesh import ParallelLayout
from prism_trace.slicing.slicer import slice_run
from prism_trace.store.connection import Store, open_store

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"
NASTY = '<script>alert(1)</script> "quotes" \\ \n tab\t é'


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, sample_template: Path) -> Store:
    """The sample (one op renamed to a hostile string), sliced to 8192 ranks and emulated."""
    from prism_trace.replay import (
        emulate_run,  # replay is above prism_trace: only the test builds with it
    )

    db = tmp_path_factory.mktemp("perfetto") / "s.duckdb"
    shutil.copyfile(sample_template, db)  # the sample, ingested once per test run
    with open_store(db) as s:
        s.con.execute(
            "UPDATE event SET name = $2 WHERE run_id = $1 AND rank = 0 AND event_id = 5",
            [s.require_run("sample"), NASTY],
        )
        slice_run(
            s,
            run="sample",
            layout=ParallelLayout.parse("tp=2,dp=2048,pp=2"),
            world=8192,
            out_run="big",
        )
        emulate_run(s, run="big", out_run="big_emu")
    return open_store(db, read_only=True)


def load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)  # type: ignore[no-any-return]


def check_chrome_format(doc: dict[str, Any]) -> None:
    """The Chrome trace event format's rules for the phases we write."""
    assert isinstance(doc["traceEvents"], list)
    assert doc["displayTimeUnit"] in ("ms", "ns")
    flows: Counter[tuple[str, int]] = Counter()
    for ev in doc["traceEvents"]:
        ph = ev["ph"]
        assert isinstance(ev["pid"], int), ev
        if ph == "M":
            assert ev["name"] in {
                "process_name",
                "process_sort_index",
                "thread_name",
                "thread_sort_index",
            }
            assert isinstance(ev["args"], dict)
            continue
        assert isinstance(ev["tid"], int), ev
        assert isinstance(ev["ts"], float | int), ev
        assert ev["ts"] >= 0, ev
        assert isinstance(ev["name"], str), ev
        if ph == "X":
            assert isinstance(ev["dur"], float | int), ev
            assert ev["dur"] >= 0, ev
            assert isinstance(ev["cat"], str), ev
            assert isinstance(ev["args"], dict), ev
        elif ph in ("s", "f"):
            assert isinstance(ev["id"], int)
            flows[(ph, ev["id"])] += 1
        elif ph == "C":
            assert all(isinstance(v, int | float) for v in ev["args"].values())
        else:
            pytest.fail(f"unexpected phase {ph!r}")
    starts = {i for p, i in flows if p == "s"}
    assert starts == {i for p, i in flows if p == "f"}
    assert all(n == 1 for n in flows.values())


def x_events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def test_recorded_run(store: Store, tmp_path: Path) -> None:
    out = tmp_path / "sample.json"
    rep = export_perfetto(store, run="sample", out=out)
    doc = load(out)
    check_chrome_format(doc)
    rid = store.require_run("sample")
    n, base = store.con.execute(
        "SELECT count(*), min(ts) FROM event WHERE run_id = $1 AND ts IS NOT NULL", [rid]
    ).fetchall()[0]
    xs = x_events(doc)
    assert rep["events"] == len(xs) == n
    assert rep["ranks"] == 8
    assert rep["source"] == "event"
    assert not rep["exemplars"]
    assert rep["bytes"] == out.stat().st_size
    assert doc["otherData"]["schema"] == PERFETTO_SCHEMA
    assert doc["otherData"]["run_kind"] == "recorded"
    assert doc["baseTimeNanoseconds"] <= base
    # Per (pid, tid) the events come in time order; names and counts survive per rank.
    by_lane: dict[tuple[int, int], list[float]] = {}
    for e in xs:
        by_lane.setdefault((e["pid"], e["tid"]), []).append(e["ts"])
    assert all(ts == sorted(ts) for ts in by_lane.values())
    per_rank = dict(
        store.con.execute(
            "SELECT rank, count(*) FROM event WHERE run_id = $1 GROUP BY rank", [rid]
        ).fetchall()
    )
    assert Counter(e["pid"] for e in xs) == per_rank
    assert NASTY in {e["name"] for e in xs}
    threads = [e for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert len(threads) == 40
    assert rep["flows"] > 0
    assert rep["counters"] > 0


def test_exact_nanoseconds(store: Store, tmp_path: Path) -> None:
    """ts/dur text is exact to the ns: base + ts·1000 gives back the stored integers."""
    out = tmp_path / "sample.json"
    export_perfetto(store, run="sample", out=out)
    text = out.read_text()
    doc = json.loads(text, parse_float=lambda s: s)  # keep the decimal text
    base = doc["baseTimeNanoseconds"]
    rid = store.require_run("sample")
    stored = {
        (r, e): (ts, dur)
        for r, e, ts, dur in store.con.execute(
            "SELECT rank, event_id, ts, dur FROM event WHERE run_id = $1", [rid]
        ).fetchall()
    }
    for e in x_events(doc)[:5000]:
        ts_us, dur_us = e["ts"], e["dur"]
        assert ts_us.count(".") == 1
        assert len(ts_us.split(".")[1]) == 3
        ts = base + int(ts_us.replace(".", ""))
        dur = int(dur_us.replace(".", ""))
        assert stored[(e["pid"], e["args"]["event_id"])] == (ts, dur)


def test_emulated_run_exemplars_gzip(store: Store, tmp_path: Path) -> None:
    out = tmp_path / "big.json.gz"
    rep = export_perfetto(store, run="big_emu", out=out)
    with out.open("rb") as fh:
        assert fh.read(2) == b"\x1f\x8b"
    doc = load(out)
    check_chrome_format(doc)
    rid = store.require_run("big_emu")
    n, ranks = store.con.execute(
        "SELECT count(*), list(DISTINCT rank ORDER BY rank) FROM event WHERE run_id = $1", [rid]
    ).fetchall()[0]
    assert rep["events"] == len(x_events(doc)) == n
    other = doc["otherData"]
    assert other["run_kind"] == "emulated"
    assert other["world_size"] == 8192
    assert other["exemplars"] is True
    assert other["exported_ranks"] == ranks
    assert sum(c["ranks"] for c in other["classes"]) == 8192
    assert "class exemplars" in other["note"]
    procs = [e for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    # one process per class exemplar, named with the ranks it stands for
    assert [p["args"]["name"] for p in procs] == [
        "class 0: ranks 0..4094 step 2 (2048), exemplar rank 0",
        "class 1: ranks 1..4095 step 2 (2048), exemplar rank 1",
        "class 4096: ranks 4096..8190 step 2 (2048), exemplar rank 4096",
        "class 4097: ranks 4097..8191 step 2 (2048), exemplar rank 4097",
    ]


def test_emulated_run_expanded_ranks(store: Store, tmp_path: Path) -> None:
    """--ranks: one process per listed rank, drawn from its class exemplar's events."""
    out = tmp_path / "some.json"
    rep = export_perfetto(store, run="big_emu", out=out, ranks=[0, 6, 8191])
    doc = load(out)
    check_chrome_format(doc)
    procs = {
        e["pid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert procs == {
        0: "rank 0 (class 0)",
        6: "rank 6 (class 0, from exemplar rank 0)",
        8191: "rank 8191 (class 4097, from exemplar rank 4097)",
    }
    by_pid: dict[int, int] = {}
    for e in x_events(doc):
        by_pid[e["pid"]] = by_pid.get(e["pid"], 0) + 1
    rid = store.require_run("big_emu")
    per_rank = dict(
        store.con.execute(
            "SELECT rank, count(*) FROM event WHERE run_id = $1 AND ts IS NOT NULL GROUP BY rank",
            [rid],
        ).fetchall()
    )
    assert by_pid == {0: per_rank[0], 6: per_rank[0], 8191: per_rank[4097]}
    assert rep["ranks"] == 3
    with pytest.raises(SelectionError, match="no rank 9000"):
        export_perfetto(store, run="big_emu", out=tmp_path / "x.json", ranks=[9000])


def test_sliced_run_graph_nodes(store: Store, tmp_path: Path) -> None:
    out = tmp_path / "sliced.json"
    rep = export_perfetto(store, run="big", out=out)
    doc = load(out)
    check_chrome_format(doc)
    rid = store.require_run("big")
    (n,) = store.con.execute(
        "SELECT count(*) FROM graph_node WHERE run_id = $1 AND ts IS NOT NULL", [rid]
    ).fetchall()[0]
    assert rep["source"] == "graph_node"
    assert rep["events"] == len(x_events(doc)) == n
    assert doc["otherData"]["source_table"] == "graph_node"


def test_unknown_run_and_unwritable(store: Store, tmp_path: Path) -> None:
    with pytest.raises(RunNotFoundError, match="nope"):
        export_perfetto(store, run="nope", out=tmp_path / "x.json")
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="cannot write"):
        export_perfetto(store, run="sample", out=tmp_path / "file" / "x.json")
    assert not list(tmp_path.glob("**/*.part"))


@pytest.mark.slow
@pytest.mark.shared_data
def test_dlrm_kernels_and_flows(shared_datasets: Path, tmp_path: Path) -> None:
    with open_store(tmp_path / "d.duckdb") as s:
        ingest(s, [shared_datasets / "param-dlrm-8rank"], run="dlrm", progress=False)
        rep = export_perfetto(s, run="dlrm", out=tmp_path / "dlrm.json.gz")
        (n,) = s.con.execute("SELECT count(*) FROM event").fetchall()[0]
        (flows,) = s.con.execute("SELECT count(*) FROM flow").fetchall()[0]
    doc = load(tmp_path / "dlrm.json.gz")
    check_chrome_format(doc)
    xs = x_events(doc)
    assert rep["events"] == len(xs) == n
    assert 0 < rep["flows"] <= flows
    cats = Counter(e["cat"] for e in xs)
    assert cats["kernel"] > 0
    assert cats["cuda_runtime"] > 0
    coll = [e for e in xs if "collective" in e["args"]]
    assert coll
    assert all(isinstance(e["args"]["seq"], int) for e in coll)

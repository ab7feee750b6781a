"""Export → ingest → graph → emulate reproduces the exported run; a deadlock names its cycle."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from prism_trace.replay import DeadlockError, emulate_run
from prism_trace.replay.des.core import CommInstances, EmulatorGraph, emulate

from prism_trace.export.chakra.writer import export_chakra
from prism_trace.graph.build import build_graph
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store

# Slow: exports, reads back and emulates whole runs; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow


SHIFT_SQL = """
WITH a AS (
    SELECT e.rank, e.event_id AS nid, e.ts, e.ts + e.dur AS te FROM event e
    WHERE e.run_id = (SELECT run_id FROM run WHERE name = $1)),
b AS (
    SELECT e.rank, g.event_id AS nid, e.ts, e.ts + e.dur AS te FROM event e
    JOIN graph_node g ON g.rank = e.rank AND g.node_id = e.event_id
        AND g.run_id = (SELECT run_id FROM run WHERE name = $2)
    WHERE e.run_id = (SELECT run_id FROM run WHERE name = $3))
SELECT count(*), max(abs(b.ts - a.ts)), max(abs(b.te - a.te)) FROM a JOIN b USING (rank, nid)
"""
"""Nodes of both emulations (the read-back one by its graph node's source id, the exported node
id), and the largest shift of a start and of an end, ns."""


def roundtrip_shift(store: Store, run: str, tmp: Path) -> tuple[int, int, int]:
    """Emulate ``run`` and the run read back from its Chakra export; compare node by node.

    Returns the nodes matched, and the largest |start| and |end| difference (ns).
    """
    emulate_run(store, run=run, out_run=f"{run}-emu")
    export_chakra(store, run=run, out_dir=tmp / run)
    ingest(store, [tmp / run], run=f"{run}-back", progress=False)
    build_graph(store, f"{run}-back")
    emulate_run(store, run=f"{run}-back", out_run=f"{run}-back-emu")
    row = store.con.execute(SHIFT_SQL, [f"{run}-emu", f"{run}-back", f"{run}-back-emu"])
    n, ds, de = row.fetchone()
    return int(n), int(ds), int(de)


def nodes(store: Store, run: str) -> int:
    sql = "SELECT count(*) FROM graph_node JOIN run USING (run_id) WHERE run.name = ?"
    return int(store.con.execute(sql, [run]).fetchone()[0])


TOLERANCE_NS = 20_000
"""The export rounds every time to whole µs; over a run these shift a node by at most 14 µs
(the sample) and 10 µs (ST, a 70 s run); DLRM records whole µs and comes back exact."""


def test_sample_roundtrip_emulates_the_same(tmp_path: Path, sample_template: Path) -> None:
    shutil.copyfile(sample_template, tmp_path / "s.duckdb")  # the sample, ingested once per run
    store = open_store(tmp_path / "s.duckdb")
    matched, d_start, d_end = roundtrip_shift(store, "sample", tmp_path)
    assert matched == nodes(store, "sample")
    assert d_start <= TOLERANCE_NS
    assert d_end <= TOLERANCE_NS


@pytest.mark.shared_data
def test_st_and_dlrm_roundtrip_emulate_the_same(tmp_path: Path, real_template: Path) -> None:
    shutil.copyfile(real_template, tmp_path / "r.duckdb")  # st and dlrm (and resnet), ingested once
    store = open_store(tmp_path / "r.duckdb")
    # DLRM: its sync edges (end waits for end) used to come back as "start after end" and close
    # cycles (a deadlock); the exact edges (kind, anchor, delay) now come back.
    for run, exact in (("st", False), ("dlrm", True)):
        matched, d_start, d_end = roundtrip_shift(store, run, tmp_path)
        assert matched == nodes(store, run), run
        assert (d_start, d_end) == (0, 0) if exact else max(d_start, d_end) <= TOLERANCE_NS


def test_deadlock_names_the_cycle() -> None:
    """Two ranks, two collectives issued in opposite orders: the error walks the cycle."""
    # rank 0: a (node 0) then b (node 1); rank 1: b (node 2) then a (node 3).
    graph = EmulatorGraph(
        unit=np.array([0, 0, 1, 1]),
        dur=np.array([10, 10, 10, 10]),
        release=np.zeros(4, dtype=np.int64),
        src=np.array([0, 2]),
        dst=np.array([1, 3]),
        delay=np.zeros(2, dtype=np.int64),
        from_end=np.array([True, True]),
        holds_end=np.array([False, False]),
    )
    comm = CommInstances(
        node=np.array([0, 3, 1, 2]), instance=np.array([0, 0, 1, 1]), transfer=np.zeros(4)
    )
    names = ["rank 0 node 0 'a'", "rank 0 node 1 'b'", "rank 1 node 2 'b'", "rank 1 node 3 'a'"]
    with pytest.raises(DeadlockError) as exc:
        emulate(graph, comm, label=lambda v: names[v])
    cycle = exc.value.cycle
    assert cycle
    text = str(exc.value)
    # Every node on the cycle is named with its rank, id and name, and what it waits for.
    assert "rank 1 node 3 'a'" in text
    assert "rank 0 node 1 'b'" in text
    assert all(" waits for " in line for line in cycle)
    # The waits close: each line waits for what the next one is.
    for line, nxt in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        assert line.split(" waits for ")[1] == nxt.split(" waits for ")[0]

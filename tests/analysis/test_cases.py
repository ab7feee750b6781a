"""Query cases as data: (dataset, SQL over the analysis views, expected/<name>.csv).

The expected files were checked against the raw-JSON and HTA comparisons of the other tests.
Regenerate after an intended change with ``PRISM_UPDATE_EXPECTED=1 pytest tests/analysis``.
"""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import pytest
from prism_trace.analysis import load_views

from prism_trace.store.connection import Store

EXPECTED = Path(__file__).resolve().parent / "expected"

# name: (store fixture, SQL); `{run}` is the run's id.
CASES: dict[str, tuple[str, str, str]] = {
    "sample_temporal": (
        "sample_store",
        "sample",
        "SELECT rank, mode, iterations, window_ns, compute_ns, comm_ns, memory_ns, other_ns,"
        " idle_ns FROM breakdown_temporal WHERE run_id = {run} ORDER BY rank",
    ),
    "sample_overlap": (
        "sample_store",
        "sample",
        "SELECT rank, mode, comm_ns, compute_ns, overlap_ns FROM breakdown_overlap"
        " WHERE run_id = {run} ORDER BY rank",
    ),
    "sample_straggler": (
        "sample_store",
        "sample",
        "SELECT rank, straggler_place, calls, times_last, caused_wait_ns, wait_ns, top_preceding_op"
        " FROM comm_straggler WHERE run_id = {run} ORDER BY rank",
    ),
    "dlrm_temporal": (
        "real_store",
        "dlrm",
        "SELECT rank, window_ns, compute_ns, comm_ns, memory_ns, other_ns, idle_ns"
        " FROM breakdown_temporal WHERE run_id = {run} ORDER BY rank",
    ),
    "dlrm_overlap": (
        "real_store",
        "dlrm",
        "SELECT rank, comm_ns, compute_ns, overlap_ns, round(overlap_pct, 2) AS overlap_pct"
        " FROM breakdown_overlap WHERE run_id = {run} ORDER BY rank",
    ),
    "dlrm_idle": (
        "real_store",
        "dlrm",
        "SELECT rank, stream, idle_category, gaps, idle_ns FROM breakdown_idle"
        " WHERE run_id = {run} ORDER BY rank, stream, idle_category",
    ),
    "dlrm_collective_skew": (
        "real_store",
        "dlrm",
        "SELECT group_id, seq, kind, participants, arrival_spread_ns, kernel_spread_ns,"
        " total_wait_ns, last_rank, last_preceding_op FROM comm_collective_skew"
        " WHERE run_id = {run} ORDER BY group_id, seq",
    ),
    "hta_kernel_top3": (
        "real_store",
        "hta",
        "SELECT kernel_type, type_rank, name, calls, total_ns, round(type_pct, 3) AS type_pct"
        " FROM breakdown_kernel WHERE run_id = {run} AND type_rank <= 3"
        " ORDER BY kernel_type, type_rank",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name: str, request: pytest.FixtureRequest) -> None:
    fixture, run, sql = CASES[name]
    if fixture == "real_store":
        request.applymarker(pytest.mark.shared_data)
    store: Store = request.getfixturevalue(fixture)
    run_id = store.require_run(run)
    load_views(store.con)  # also settles require_run's pending result on the connection
    text = store.con.sql(sql.format(run=run_id)).pl().write_csv()
    path = EXPECTED / f"{name}.csv"
    if os.environ.get("PRISM_UPDATE_EXPECTED"):
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with PRISM_UPDATE_EXPECTED=1"
    expected = pl.read_csv(path)
    got = pl.read_csv(text.encode())
    assert got.equals(expected), f"{name}: got\n{got}\nexpected\n{expected}"

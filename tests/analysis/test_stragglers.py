"""Collective skew and the straggler ranking: invariants on the sample, raw JSON on DLRM."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
import pytest
import rawtrace
from prism_trace.analysis import collective_skew, collective_waits, skew, straggler_ops

from prism_trace.store.connection import Store


def _check_invariants(store: Store, run: str) -> None:
    waits = collective_waits(store, run)
    inst = collective_skew(store, run)
    rank = skew(store, run)
    assert (waits["wait_ns"] >= 0).all()
    assert (waits["lateness_ns"] >= 0).all()
    # lateness + wait = spread for every participant
    joined = waits.join(inst, on=["group_id", "seq", "link"])
    assert (joined["lateness_ns"] + joined["wait_ns"] == joined["arrival_spread_ns"]).all()
    # exactly one last rank per instance with two or more participants, and it waited 0
    lasts = waits.filter(pl.col("is_last"))
    multi = inst.filter(pl.col("participants") > 1)
    assert lasts.height == multi.height
    assert (lasts["wait_ns"] == 0).all()
    # the time others waited, attributed to last ranks, adds up to the total waiting; the part
    # blamed on the last rank's own work is never more
    assert rank["last_wait_ns"].sum() == multi["total_wait_ns"].sum()
    assert rank["caused_wait_ns"].sum() == multi["blamed_wait_ns"].sum()
    assert (inst["blamed_wait_ns"] <= inst["total_wait_ns"]).all()
    assert (waits["free_ns"] >= 0).all()
    assert rank["wait_ns"].sum() == waits["wait_ns"].sum()
    # places 1..n go to the ranks that were last somewhere; the others have none
    placed = rank.filter(pl.col("times_last") > 0)
    assert sorted(placed["straggler_place"]) == list(range(1, placed.height + 1))
    assert rank.filter(pl.col("times_last") == 0)["straggler_place"].null_count() == (
        rank.height - placed.height
    )
    ops = straggler_ops(store, run)
    assert ops["times_last"].sum() == lasts.height
    assert ops["caused_wait_ns"].sum() == rank["caused_wait_ns"].sum()


def test_sample_skew_invariants(sample_store: Store) -> None:
    _check_invariants(sample_store, "sample")
    rank = skew(sample_store, "sample")
    assert rank["rank"].sort().to_list() == list(range(8))
    assert (rank["caused_wait_ns"] > 0).any()
    # every late arrival on the sample is attributed to a host op
    assert "(none)" not in straggler_ops(sample_store, "sample")["preceding_op"].to_list()


@pytest.mark.shared_data
def test_dlrm_skew_matches_raw(real_store: Store, shared_datasets: Path) -> None:
    """Arrivals are the NCCL kernels' device-side starts, not the async host calls."""
    _check_invariants(real_store, "dlrm")
    arrivals: dict[int, list[int]] = {}
    for f in sorted((shared_datasets / "param-dlrm-8rank" / "kineto").iterdir()):
        rank = int(re.match(r"worker(\d+)_", f.name).group(1))  # type: ignore[union-attr]
        raw = rawtrace.load(f)
        assert len(raw.comm_kernels) == len(raw.comm_calls)
        arrivals[rank] = raw.comm_kernels
    assert collective_waits(real_store, "dlrm")["on_device"].all()
    n = len(arrivals[0])
    assert all(len(a) == n for a in arrivals.values())
    inst = collective_skew(real_store, "dlrm").sort("seq")
    assert inst["seq"].to_list() == list(range(n))
    caused = dict.fromkeys(arrivals, 0)
    for seq in range(n):
        ts = {r: a[seq] for r, a in arrivals.items()}
        last = max(ts, key=lambda r: (ts[r], -r))
        row = inst.row(seq, named=True)
        assert row["arrival_spread_ns"] == max(ts.values()) - min(ts.values())
        assert row["total_wait_ns"] == sum(ts[last] - t for t in ts.values())
        assert row["last_rank"] == last
        caused[last] += row["total_wait_ns"]
    got = dict(skew(real_store, "dlrm").select("rank", "last_wait_ns").iter_rows())
    assert got == caused


@pytest.mark.shared_data
def test_single_rank_run_has_no_straggler(real_store: Store) -> None:
    rank = skew(real_store, "hta")
    assert rank["times_last"].to_list() == [0]
    assert rank["caused_wait_ns"].to_list() == [0]

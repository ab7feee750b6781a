"""Temporal, kernel, overlap and idle breakdowns: invariants on the sample, raw-JSON references."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import polars as pl
import pytest
import rawtrace
from prism_trace.analysis import ANALYSES, idle, kernels, overlap, temporal

from prism_trace.store.connection import Store

PARTS = ("compute", "comm", "memory", "other", "idle")


def _check_parts(df: pl.DataFrame) -> None:
    for row in df.iter_rows(named=True):
        assert sum(row[f"{p}_ns"] for p in PARTS) == row["window_ns"], row
        assert all(row[f"{p}_ns"] >= 0 for p in PARTS), row
        assert sum(row[f"{p}_pct"] for p in PARTS) == pytest.approx(100.0), row


# -- the bundled gloo CPU sample: host mode ----------------------------------------------------


def test_sample_temporal_is_host_mode_and_partitions_windows(sample_store: Store) -> None:
    df = temporal(sample_store, "sample")
    assert df["rank"].to_list() == list(range(8))
    assert set(df["mode"]) == {"host"}
    assert (df["memory_ns"] == 0).all()
    assert (df["other_ns"] == 0).all()
    assert (df["comm_ns"] > 0).all()
    assert (df["compute_ns"] > 0).all()
    _check_parts(df)
    _check_parts(temporal(sample_store, "sample", by="iteration"))


def test_sample_comm_is_the_union_of_comm_host_ops(sample_store: Store) -> None:
    """Host mode: comm_ns is exactly the union of the collective/p2p host ops in the windows."""
    con = sample_store.con
    ops = con.sql(
        """SELECT rank, host_ts, host_ts + host_dur FROM collective
           UNION ALL SELECT rank, host_ts, host_ts + host_dur FROM p2p"""
    ).fetchall()
    windows = con.sql("SELECT rank, ts, ts + dur FROM iteration").fetchall()
    expected: dict[int, int] = defaultdict(int)
    for rank, lo, hi in windows:
        expected[rank] += rawtrace.union(
            [(max(s, lo), min(e, hi)) for r, s, e in ops if r == rank and s < hi and e > lo]
        )
    got = dict(temporal(sample_store, "sample").select("rank", "comm_ns").iter_rows())
    assert got == dict(expected)


@pytest.mark.slow
def test_sample_other_analyses_are_sane(sample_store: Store) -> None:
    ov = overlap(sample_store, "sample")
    assert ((ov["overlap_ns"] >= 0) & (ov["overlap_ns"] <= ov["comm_ns"])).all()
    assert ((ov["overlap_pct"] >= 0) & (ov["overlap_pct"] <= 100)).all()
    assert kernels(sample_store, "sample").is_empty()
    assert idle(sample_store, "sample").is_empty()
    for name, fn in ANALYSES.items():
        df = fn(sample_store, "sample")
        assert "run_id" not in df.columns, name


# -- real traces: against an independent computation from the raw JSON --------------------------


def _raw(shared: Path, run: str) -> dict[int, rawtrace.RawRank]:
    if run == "hta":
        return {0: rawtrace.load(shared / "hta-nccl-rank0" / "nccl_data.json.gz")}
    out = {}
    for f in sorted((shared / "param-dlrm-8rank" / "kineto").iterdir()):
        out[int(re.match(r"worker(\d+)_", f.name).group(1))] = rawtrace.load(f)  # type: ignore[union-attr]
    return out


@pytest.fixture(scope="module")
def raw(shared_datasets: Path) -> dict[str, dict[int, rawtrace.RawRank]]:
    return {run: _raw(shared_datasets, run) for run in ("dlrm", "hta")}


@pytest.mark.shared_data
@pytest.mark.parametrize("run", ["dlrm", "hta"])
def test_temporal_matches_raw_interval_union(real_store: Store, raw: dict, run: str) -> None:
    df = temporal(real_store, run, by="iteration")
    _check_parts(df)
    assert set(df["mode"]) == {"device"}
    for row in df.iter_rows(named=True):
        r = raw[run][row["rank"]]
        lo, hi = r.steps[row["iteration"]]
        assert row["window_ns"] == hi - lo
        assert {f"{p}_ns": row[f"{p}_ns"] for p in PARTS} == rawtrace.temporal(r, lo, hi), row


@pytest.mark.shared_data
@pytest.mark.parametrize("run", ["dlrm", "hta"])
def test_overlap_matches_raw(real_store: Store, raw: dict, run: str) -> None:
    for row in overlap(real_store, run, by="iteration").iter_rows(named=True):
        r = raw[run][row["rank"]]
        comm, both = rawtrace.overlap(r, *r.steps[row["iteration"]])
        assert (row["comm_ns"], row["overlap_ns"]) == (comm, both)
        assert row["overlap_pct"] == pytest.approx(100 * both / comm)


@pytest.mark.shared_data
@pytest.mark.parametrize("run", ["dlrm", "hta"])
def test_kernel_totals_equal_raw_sums(real_store: Store, raw: dict, run: str) -> None:
    per_rank = kernels(real_store, run, per_rank=True)
    expected: dict[tuple[int, str, str], list[int]] = defaultdict(list)
    for rank, r in raw[run].items():
        for o in r.ops:
            expected[(rank, o.kernel_type, o.name)].append(o.end - o.ts)
    got = {
        (row["rank"], row["kernel_type"], row["name"]): (row["calls"], row["total_ns"])
        for row in per_rank.iter_rows(named=True)
    }
    assert got == {k: (len(v), sum(v)) for k, v in expected.items()}
    # The run-wide view: per-type totals equal the raw sums, and top-k + others keeps them.
    full = kernels(real_store, run, top_k=10_000)
    top = kernels(real_store, run, top_k=3)
    for kt in set(full["kernel_type"]):
        raw_total = sum(sum(v) for k, v in expected.items() if k[1] == kt)
        assert full.filter(pl.col("kernel_type") == kt)["total_ns"].sum() == raw_total
        assert top.filter(pl.col("kernel_type") == kt)["total_ns"].sum() == raw_total
        assert top.filter(pl.col("kernel_type") == kt)["type_pct"].sum() == pytest.approx(100)
    spread = full.filter(pl.col("ranks") > 1)
    assert (spread["rank_min_ns"] <= spread["rank_mean_ns"]).all()
    assert (spread["rank_mean_ns"] <= spread["rank_max_ns"]).all()


@pytest.mark.shared_data
@pytest.mark.parametrize("run", ["dlrm", "hta"])
@pytest.mark.parametrize("threshold", [30, 30_000])
def test_idle_matches_raw(real_store: Store, raw: dict, run: str, threshold: int) -> None:
    df = idle(real_store, run, consecutive_kernel_delay=threshold)
    for rank, r in raw[run].items():
        expected = rawtrace.idle(r, threshold)
        got = {
            (row["stream"], row["idle_category"]): row["idle_ns"]
            for row in df.filter(pl.col("rank") == rank).iter_rows(named=True)
        }
        assert got == expected
    sums = df.group_by("rank", "stream").agg(pl.col("idle_ratio").sum())
    assert sums["idle_ratio"].to_list() == pytest.approx([1.0] * len(sums))


@pytest.mark.shared_data
def test_hta_window_counts_syncs_on_a_stream(shared_datasets: Path, tmp_path: Path) -> None:
    """HTA-NCCL with Kineto's CUDA sync events, without HTA installed: the `hta` window runs to
    the end of the Stream Sync after the last kernel (HTA 0.5.0 gives 511386 µs, non-compute
    97435, idle 338782: test_hta_parity.py checks against HTA itself); the Event Sync and Context
    Sync events (stream -1) change nothing, and prism's own window ignores syncs."""
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store
    from tests.analysis.foreign_traces import with_cuda_sync

    src = shared_datasets / "hta-nccl-rank0" / "nccl_data.json.gz"
    trace = with_cuda_sync(src, tmp_path / "nccl_sync.json", stream=7, tail_us=75_800)
    with open_store(tmp_path / "s.duckdb") as s:
        ingest(s, [trace], run="sync", progress=False)
        ingest(s, [src], run="plain", progress=False)
        _check_parts(temporal(s, "sync", window="hta"))
        got = temporal(s, "sync", window="hta").row(0, named=True)
        plain = temporal(s, "plain", window="hta").row(0, named=True)
        syncs = s.con.execute("SELECT count(*) FROM event WHERE category = 'cuda_sync'")
        assert syncs.fetchall()[0][0] == 26  # 24 Event Sync, 1 Context Sync, the tail
        assert (
            temporal(s, "sync")["window_ns"].to_list()
            == temporal(s, "plain")["window_ns"].to_list()
        )
    assert (got["window_ns"], got["idle_ns"]) == (511_386_000, 338_782_000)
    assert got["comm_ns"] + got["memory_ns"] + got["other_ns"] == 97_435_000
    assert got["window_ns"] - plain["window_ns"] == 75_800_000  # was: the same as without syncs
    assert got["compute_ns"] == plain["compute_ns"]

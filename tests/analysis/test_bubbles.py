"""Pipeline bubbles against independent computations: the raw Megatron parquet (op timeline), the
raw DLRM Kineto JSON (device mode) and a plain-Python sweep over the gloo sample (host mode)."""

from __future__ import annotations

import bisect
import itertools
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
import rawtrace
from prism_trace.analysis import ANALYSES, bubble_summary, bubbles
from prism_trace.replay import emulate_run

from prism_trace.store.connection import Store, open_store

ST = "megatron-straggler-st-8rank"
COMPUTE = re.compile(r"-compute$|^optimizer$")


def _gaps(ops: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The maximal sub-intervals of [lo, hi) that no op covers (a plain loop)."""
    out, t = [], lo
    for s, e in sorted(ops):
        if s > t:
            out.append((t, s))
        t = max(t, e)
    if hi > t:
        out.append((t, hi))
    return out


def _coverage(cuts: list[int], ivs: list[tuple[int, int]]) -> list[int]:
    """How many intervals cover each segment [cuts[k], cuts[k+1]) (difference array)."""
    diff = [0] * len(cuts)
    for s, e in ivs:
        diff[bisect.bisect_left(cuts, s)] += 1
        diff[bisect.bisect_left(cuts, e)] -= 1
    return list(itertools.accumulate(diff))[:-1]


@pytest.fixture(scope="module")
def st_store(st_emulated_template: Path) -> Store:
    """The ST op timeline as `st` and its emulation `st_emu` (the conftest template), read-only."""
    return open_store(st_emulated_template, read_only=True)


def _raw_st_windows(shared: Path) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(rank, step) -> idle windows relative to the step start, from the parquet alone."""
    t = pq.read_table(shared / ST / "trace-ST.parquet").to_pydict()
    base = json.loads((shared / ST / "result-ST.json").read_text())["step_t_base"]
    ops: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, step, op, start, dur in zip(
        t["rank"], t["step"], t["optype"], t["start_ts"], t["duration"], strict=True
    ):
        if COMPUTE.search(op) and dur > 0:
            ops[(rank, step)].append((round(start * 1e9), round((start + dur) * 1e9)))
    out = {}
    for (rank, step), o in ops.items():
        hi = max(round(base[str(step)] * 1e9), max(e for _, e in o))
        out[(rank, step)] = _gaps(o, min(0, min(s for s, _ in o)), hi)
    return out


def test_st_windows_equal_the_raw_parquet(st_store: Store, shared_datasets: Path) -> None:
    raw = _raw_st_windows(shared_datasets)
    df = bubbles(st_store, "st").join(
        st_store.con.sql(
            "SELECT rank, iteration, ts AS it_ts FROM iteration"
            " WHERE run_id = (SELECT run_id FROM run WHERE name = 'st')"
        ).pl(),
        on=["rank", "iteration"],
    )
    got: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for r in df.iter_rows(named=True):
        got[(r["rank"], r["iteration"])].append((r["ts"] - r["it_ts"], r["end_ts"] - r["it_ts"]))
    assert set(got) == set(raw)
    for key, windows in raw.items():
        assert len(got[key]) == len(windows), key
        for (a0, a1), (b0, b1) in zip(sorted(got[key]), windows, strict=True):
            # ingest rounds start and end separately from float32 seconds: <= 1 ns apart
            assert abs(a0 - b0) <= 1, (key, (a0, a1), (b0, b1))
            assert abs(a1 - b1) <= 1, (key, (a0, a1), (b0, b1))
    # Stage summary: the windows of the stage's ranks, summed; stage = pp coordinate.
    summary = bubble_summary(st_store, "st")
    assert summary["stage"].to_list() == [0, 1, 2, 3]
    for row in summary.iter_rows(named=True):
        ranks = [2 * row["stage"], 2 * row["stage"] + 1]  # dp2 x pp4: rank = stage * 2 + dp
        mine = [w for k, ws in raw.items() if k[0] in ranks for w in ws]
        assert row["bubbles"] == len(mine)
        assert abs(row["bubble_ns"] - sum(e - s for s, e in mine)) <= 2 * len(mine)
        assert row["bubble_ns"] == row["head_ns"] + row["inner_ns"] + row["tail_ns"]
        assert row["busy_ns"] + row["bubble_ns"] == row["span_ns"]
        assert row["mode"] == "timeline"
    # The last stage waits for the pipeline to fill (head) far longer than the first.
    head = dict(summary.select("stage", "head_ns").iter_rows())
    assert head[3] > head[2] > head[1] > head[0]


def test_st_windows_name_their_neighbours(st_store: Store) -> None:
    df = bubbles(st_store, "st", iteration=23).filter(pl.col("rank") == 6)
    assert df["position"].to_list()[0] == "head"
    assert df["op_after"].to_list()[0] == "forward-compute"
    assert df["waiting_on"].to_list()[0] == "forward-recv"  # stage 3 waits for the first forward
    inner = df.filter(pl.col("position") == "inner")
    assert set(inner["op_before"]) <= {"forward-compute", "backward-compute"}
    assert df["allocated_bytes"].is_null().all()  # the op timeline has no memory events
    big = bubbles(st_store, "st", min_ns=1_000_000)
    assert (big["dur"] >= 1_000_000).all()
    assert big.height < bubbles(st_store, "st").height


def test_st_emulated_bubbles_match_the_recording(st_store: Store) -> None:
    rec = bubble_summary(st_store, "st")
    emu = bubble_summary(st_store, "st_emu")
    assert emu["bubbles"].to_list() == rec["bubbles"].to_list()
    for a, b in zip(rec["bubble_ns"], emu["bubble_ns"], strict=True):
        assert b == pytest.approx(a, rel=1e-4)  # replay error of the emulator: ~1e-5


def test_dlrm_device_windows_equal_the_raw_json(real_store: Store, shared_datasets: Path) -> None:
    df = bubbles(real_store, "dlrm")
    assert set(df["mode"]) == {"device"}
    assert (df["capacity_bytes"] == 34079899648).all()  # V100-SXM2-32GB totalGlobalMem
    assert df["allocated_bytes"].is_null().all()  # no memory events in the trace
    for f in sorted((shared_datasets / "param-dlrm-8rank" / "kineto").iterdir()):
        rank = int(re.match(r"worker(\d+)_", f.name).group(1))  # type: ignore[union-attr]
        raw = rawtrace.load(f)
        ((it, (lo, hi)),) = raw.steps.items()
        ops = [(o.ts, o.end) for o in raw.ops if o.kernel_type == "compute" and o.end > o.ts]
        want = _gaps(ops, min(lo, min(s for s, _ in ops)), max(hi, max(e for _, e in ops)))
        mine = df.filter(pl.col("rank") == rank)
        assert mine["iteration"].unique().to_list() == [it]
        assert list(zip(mine["ts"], mine["end_ts"], strict=True)) == want, rank


@pytest.mark.slow
def test_sample_host_windows_equal_a_plain_sweep(sample_store: Store) -> None:
    """Host mode: the main thread is idle outside cpu_ops and while blocked in a comm call."""
    con = sample_store.con
    run_id = sample_store.require_run("sample")
    df = bubbles(sample_store, "sample")
    assert set(df["mode"]) == {"host"}
    assert dict(df.group_by("rank").agg(pl.col("stage").first()).iter_rows()) == {
        r: r // 4 for r in range(8)
    }
    ev = con.execute(
        "SELECT rank, track_id, iteration, ts, ts + dur, category FROM event"
        " WHERE run_id = ? AND dur > 0",
        [run_id],
    ).fetchall()
    comm = con.sql(
        "SELECT c.rank, e.track_id, c.host_ts, c.host_ts + c.host_dur FROM ("
        " SELECT rank, event_id, host_ts, host_dur FROM collective WHERE run_id = $1"
        " UNION ALL SELECT rank, event_id, host_ts, host_dur FROM p2p WHERE run_id = $1) c"
        " JOIN event e ON e.run_id = $1 AND e.rank = c.rank AND e.event_id = c.event_id",
        params=[run_id],
    ).fetchall()
    steps = con.execute(
        "SELECT rank, iteration, ts, ts + dur FROM iteration WHERE run_id = ?", [run_id]
    ).fetchall()
    main = {}
    for rank in range(8):
        tracks = [t for r, t, _, _ in comm if r == rank]
        main[rank] = max(set(tracks), key=tracks.count)
    for rank, it, lo, hi in steps:
        cpu = [
            (s, e) for r, t, i, s, e, c in ev if (r, t, i, c) == (rank, main[rank], it, "cpu_op")
        ]
        lo, hi = min(lo, min(s for s, _ in cpu)), max(hi, max(e for _, e in cpu))
        blocked = [(max(s, lo), min(e, hi)) for r, t, s, e in comm if r == rank and t == main[rank]]
        blocked = [(s, e) for s, e in blocked if s < e]
        # busy = inside some cpu_op and inside no blocking call; idle = the rest of [lo, hi)
        cuts = sorted({lo, hi, *(x for iv in cpu + blocked for x in iv if lo <= x <= hi)})
        cover_c, cover_m = _coverage(cuts, cpu), _coverage(cuts, blocked)
        idle: list[tuple[int, int]] = []
        for k, (a, b) in enumerate(itertools.pairwise(cuts)):
            if cover_c[k] > 0 and cover_m[k] == 0:  # busy
                continue
            if idle and idle[-1][1] == a:
                idle[-1] = (idle[-1][0], b)
            else:
                idle.append((a, b))
        mine = df.filter((pl.col("rank") == rank) & (pl.col("iteration") == it))
        assert list(zip(mine["ts"], mine["end_ts"], strict=True)) == idle, (rank, it)
    # Memory at each window's start: the allocated total after the last allocator event there.
    mem = defaultdict(list)
    for rank, ts, total in con.execute(
        "SELECT rank, ts, max(total_allocated) FROM memory WHERE run_id = ?"
        " AND device_type = 'cpu' GROUP BY ALL ORDER BY rank, ts",
        [run_id],
    ).fetchall():
        mem[rank].append((ts, total))
    for r in df.sample(200, seed=1).iter_rows(named=True):
        i = bisect.bisect_right([t for t, _ in mem[r["rank"]]], r["ts"]) - 1
        assert r["allocated_bytes"] == (mem[r["rank"]][i][1] if i >= 0 else None)
    assert df["capacity_bytes"].is_null().all()  # CPU ranks: no device capacity
    # The pipeline's second stage waits on its receives from the first.
    assert "recv pp" in set(df.filter(pl.col("stage") == 1)["waiting_on"].drop_nulls())
    assert "bubbles" in ANALYSES


@pytest.mark.slow
def test_emulated_sliced_run_reports_exemplars(sample_store: Store, tmp_path: Path) -> None:
    """An emulated run of a sliced run: class members read their exemplar's events."""
    from prism_trace.layout.choice import infer_layout
    from prism_trace.slicing.slicer import slice_run

    db = tmp_path / "s.duckdb"
    shutil.copy(sample_store.path, db)
    with open_store(db) as s:
        layout = infer_layout(s, "sample")
        slice_run(s, run="sample", layout=layout, world=8, from_ranks=[0, 1, 4, 5], out_run="sl")
        emulate_run(s, run="sl", out_run="sl_emu")
        summary = bubble_summary(s, "sl_emu")
        windows = bubbles(s, "sl_emu")
    assert summary["stage"].to_list() == [0, 1]
    assert summary["ranks"].to_list() == [2, 2]  # the class exemplars: 0, 1 | 4, 5
    assert set(windows["rank"]) == {0, 1, 4, 5}
    assert (summary["bubble_pct"] > 0).all()

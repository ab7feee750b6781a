"""Memory replay (``replay.memory``): re-timing allocator events onto emulated nodes, and the
distributed-optimizer shard rule for a changed DP degree (synthetic data: none of the bundled
recordings carries optimizer-state sizes)."""

from __future__ import annotations

import polars as pl
from prism_trace.replay.memory.retime import memory_peaks, optimizer_shard_delta, retime_memory


def _mem(rows: list[tuple[int, int, int, int]]) -> pl.DataFrame:
    """(unit, ts, bytes, total_allocated) rows on one cuda device."""
    return pl.DataFrame(
        {
            "unit": [r[0] for r in rows],
            "ts": [r[1] for r in rows],
            "device_type": ["cuda"] * len(rows),
            "device_id": [0] * len(rows),
            "addr": list(range(len(rows))),
            "bytes": [r[2] for r in rows],
            "total_allocated": [r[3] for r in rows],
            "total_reserved": [0] * len(rows),
            "iteration": [1] * len(rows),
        },
        schema_overrides={"unit": pl.Int64, "ts": pl.Int64, "bytes": pl.Int64},
    )


def _nodes(rows: list[tuple[int, int, int, int, int]]) -> pl.DataFrame:
    """(unit, rec_ts, rec_end, emu_ts, emu_end) host nodes."""
    return pl.DataFrame(
        {
            "unit": [r[0] for r in rows],
            "rec_ts": [r[1] for r in rows],
            "rec_end": [r[2] for r in rows],
            "emu_ts": [r[3] for r in rows],
            "emu_end": [r[4] for r in rows],
            "host": [True] * len(rows),
        },
        schema_overrides={"unit": pl.Int64},
    )


def test_events_move_with_their_enclosing_node() -> None:
    # Node A [0, 100] runs as recorded; node B [200, 300] is emulated 50 later and 20 longer.
    nodes = _nodes([(0, 0, 100, 0, 100), (0, 200, 300, 250, 370)])
    mem = _mem(
        [
            (0, 10, 100, 1100),  # in A: stays
            (0, 150, -100, 1000),  # between A and B: follows A's end (+0)
            (0, 210, 500, 1500),  # in B: at the same fraction of B (10 of 100 -> 12 of 120)
            (0, 350, -500, 1000),  # after B: follows B's end (+70)
        ]
    )
    out = retime_memory(mem, nodes)
    assert out["ts"].to_list() == [10, 150, 262, 420]
    assert out["total_allocated"].to_list() == [1100, 1000, 1500, 1000]


def test_reordering_changes_the_peak() -> None:
    # Recorded: A allocates 300 and frees it, then B allocates 200 (peak 1300). Emulated, B runs
    # inside A's lifetime: both are live at once (peak 1500).
    nodes = _nodes([(0, 0, 100, 0, 100), (0, 200, 300, 40, 140)])
    mem = _mem([(0, 10, 300, 1300), (0, 90, -300, 1000), (0, 210, 200, 1200)])
    out = retime_memory(mem, nodes)
    assert out["ts"].to_list() == [10, 50, 90]
    assert out["total_allocated"].to_list() == [1300, 1500, 1200]
    peaks = memory_peaks(out, by="unit")
    assert peaks.rows() == [(0, 1500)]


def test_distributed_optimizer_shard_follows_the_dp_degree() -> None:
    # 12 GiB of optimizer state per rank at dp=8 -> 3 GiB at dp=32 (the shard is S / dp).
    gib = 2**30
    assert optimizer_shard_delta(12 * gib, 8, 32) == -9 * gib
    assert optimizer_shard_delta(12 * gib, 8, 4) == 12 * gib
    assert optimizer_shard_delta(12 * gib, 8, 8) == 0
    assert optimizer_shard_delta(0, 8, 32) == 0  # no optimizer-state information: no-op
    nodes = _nodes([(0, 0, 100, 0, 100), (1, 0, 100, 0, 100)])
    mem = _mem([(0, 10, 100, 16 * gib), (1, 10, 100, 16 * gib)])
    delta = pl.DataFrame({"unit": [0, 1], "delta": [optimizer_shard_delta(12 * gib, 8, 32), 0]})
    out = retime_memory(mem, nodes, delta=delta)
    assert memory_peaks(out, by="unit").sort("unit").rows() == [(0, 7 * gib), (1, 16 * gib)]


def test_no_events_no_rows() -> None:
    out = retime_memory(_mem([]), _nodes([(0, 0, 1, 0, 1)]))
    assert out.is_empty()
    assert memory_peaks(out.rename({"unit": "rank"})).is_empty()


def test_backend_worker_ops_are_the_other_threads_ops_inside_a_call() -> None:
    """gloo's worker ops (another thread, inside a call the unit's issuing thread makes) are
    told apart; the issuing thread's own ops, ops outside every call, and a unit without calls
    are not."""
    from prism_trace.replay.memory.retime import backend_worker_ops

    nodes = pl.DataFrame(
        {
            "unit": [0, 0, 0, 0, 0, 0, 1],
            "track_id": [0, 0, 0, 1, 1, 2, 1],
            "kind": ["host", "collective", "host", "host", "host", "host", "host"],
            "rec_ts": [50, 100, 150, 150, 300, 200, 150],
            "rec_end": [60, 200, 160, 160, 310, 205, 160],
        }
    )
    assert backend_worker_ops(nodes).to_list() == [False, False, False, True, False, True, False]

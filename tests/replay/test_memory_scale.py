"""Memory at a slice's target scale (``replay.memory.scale``): shard allocations of resized
reduce-scatters and all-gathers, and the allocations of repeated or dropped microbatches
(synthetic events; the ZeRO-1 ladder check is in tests/prism_trace/test_slicing_microbatches.py)."""

from __future__ import annotations

import polars as pl
from prism_trace.replay.memory.retime import retime_memory
from prism_trace.replay.memory.scale import follow_copies, rescale_shards


def _mem(rows: list[tuple[int, int, int]]) -> pl.DataFrame:
    """(ts, addr, bytes) events of unit 0 on the cpu, totals from 0."""
    total, totals = 0, []
    for _, _, b in rows:
        total += b
        totals.append(total)
    return pl.DataFrame(
        {
            "unit": [0] * len(rows),
            "ts": [r[0] for r in rows],
            "device_type": ["cpu"] * len(rows),
            "device_id": [-1] * len(rows),
            "addr": [r[1] for r in rows],
            "bytes": [r[2] for r in rows],
            "total_allocated": totals,
            "total_reserved": [0] * len(rows),
            "iteration": [1] * len(rows),
        },
        schema_overrides={"unit": pl.Int64, "ts": pl.Int64, "bytes": pl.Int64, "addr": pl.Int64},
    )


def _calls(rows: list[tuple[int, int, int, int, int]]) -> pl.DataFrame:
    """(ts, end, shard, n, n_new) calls of unit 0."""
    return pl.DataFrame(
        [(0, *r) for r in rows], schema=["unit", "ts", "end", "shard", "n", "n_new"], orient="row"
    )


def test_zero1_shards_follow_the_group_size() -> None:
    """A ZeRO-1 step recorded at dp 2 (buffer 800, shard 400), resized to dp 4: the
    reduce-scatter's output and the all-gather's input halve, the per-peer staging buffer becomes
    three quarter-shards (one per peer), the all-gather's list of 2 shards keeps its total, and
    the full buffer does not change."""
    mem = _mem(
        [
            (0, 1, 800),  # the padded bucket (full buffer, the reduce-scatter's input)
            (5, 2, 400),  # reduce-scatter output: the rank's shard
            (12, 3, 400),  # gloo staging, one per peer (n - 1 = 1), inside the call
            (18, 3, -400),
            (25, 1, -800),
            (30, 4, 400),  # all-gather input (the updated shard)
            (31, 5, 400),  # all-gather output list: n = 2 shards
            (32, 6, 400),
            (45, 5, -400),
            (46, 6, -400),
            (47, 4, -400),
            (48, 2, -400),
        ]
    )
    calls = _calls([(10, 20, 400, 2, 4), (35, 40, 400, 2, 4)])
    out = rescale_shards(mem, calls)
    assert out["bytes"].to_list() == [
        800, 200, 600, -600, -800, 200, 400, 400, -400, -400, -200, -200,
    ]  # fmt: skip
    assert out["total_allocated"].to_list() == [
        800, 1000, 1600, 1000, 200, 400, 800, 1200, 800, 400, 200, 0,
    ]  # fmt: skip
    # Nothing changes when the group keeps its size, or for a shard size nobody allocated.
    assert rescale_shards(mem, _calls([(10, 20, 400, 2, 2)])).equals(mem)
    assert rescale_shards(mem, _calls([(10, 20, 300, 2, 4)])).equals(mem)


def test_cuda_blocks_round_the_shard() -> None:
    mem = _mem([(0, 1, 1024), (30, 1, -1024)])  # a 1000-byte shard in a 1024-byte block
    out = rescale_shards(mem, _calls([(10, 20, 1000, 4, 8)]))
    assert out["bytes"].to_list() == [512, -512]


def test_copied_ops_copy_their_allocations() -> None:
    """Op B is replayed twice (the second copy a new node), op C is dropped: B's allocation and
    free appear once per copy, C's free is gone (a dropped microbatch drops as many frees as
    allocations), A's events stay."""
    mem = _mem([(5, 1, 100), (22, 2, 50), (28, 2, -50), (45, 1, -100)])
    recorded = pl.DataFrame(
        {
            "unit": [0, 0, 0],
            "event_id": [10, 11, 12],
            "rec_ts": [0, 20, 40],
            "rec_end": [10, 30, 50],
        }
    )
    nodes = pl.DataFrame(
        {
            "unit": [0, 0, 0],
            "node_id": [0, 1, 7],
            "event_id": [10, 11, 11],
            "rec_ts": [0, 20, 20],
            "rec_end": [10, 30, 30],
            "emu_ts": [0, 20, 30],
            "emu_end": [10, 30, 40],
            "host": [True] * 3,
        }
    )
    m, n = follow_copies(mem, recorded, nodes)
    assert m["bytes"].to_list() == [100, 50, -50, 50, -50]
    assert n.sort("node_id")["rec_ts"].to_list() == [0, 20, 20 + 51]
    out = retime_memory(m, n)
    assert out["ts"].to_list() == [5, 22, 28, 32, 38]
    assert out["total_allocated"].to_list() == [100, 150, 100, 150, 100]


def test_per_member_copies_are_freed_together() -> None:
    """A list collective's outputs, one allocation per member by op B (recorded 2 members, B and
    B2), freed together later by op D. The slice repeated B to 4 members: the 4 allocations all
    live until D, and D frees each of them once."""
    mem = _mem([(21, 1, 40), (26, 2, 40), (61, 1, -40), (62, 2, -40)])
    recorded = pl.DataFrame(
        {"unit": [0] * 3, "event_id": [11, 12, 13], "rec_ts": [20, 25, 60], "rec_end": [22, 27, 65]}
    )
    nodes = pl.DataFrame(
        {
            "unit": [0] * 5,
            "node_id": [1, 8, 9, 2, 3],  # B, two copies of B, B2, D
            "event_id": [11, 11, 11, 12, 13],
            "rec_ts": [20, 20, 20, 25, 60],
            "rec_end": [22, 22, 22, 27, 65],
            "emu_ts": [20, 23, 26, 29, 60],
            "emu_end": [22, 25, 28, 31, 65],
            "host": [True] * 5,
        }
    )
    m, n = follow_copies(mem, recorded, nodes)
    assert sorted(m["bytes"].to_list()) == [-40] * 4 + [40] * 4
    out = retime_memory(m, n).sort("ts", maintain_order=True)
    assert out["bytes"].to_list() == [40] * 4 + [-40] * 4  # all four live until D
    assert out["total_allocated"].to_list() == [40, 80, 120, 160, 120, 80, 40, 0]
    assert out["ts"].to_list()[4:] == [61, 61, 61, 62]

"""Vectorised nesting against hand-built cases and a naive stack walk."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from prism_trace.formats.kineto.reader import read_kineto
from prism_trace.formats.nesting import innermost_enclosing, nest_events


def frame(rows: list[tuple[int, int, int, int | None]]) -> pl.DataFrame:
    """Rows of (event_id, track_id, ts, dur)."""
    return pl.DataFrame(
        rows,
        schema={"event_id": pl.Int64, "track_id": pl.Int32, "ts": pl.Int64, "dur": pl.Int64},
        orient="row",
    )


def nested(rows: list[tuple[int, int, int, int | None]]) -> dict[int, tuple[int | None, int]]:
    out = nest_events(frame(rows))
    return {r["event_id"]: (r["parent_id"], r["depth"]) for r in out.iter_rows(named=True)}


def stack_walk(df: pl.DataFrame) -> dict[int, tuple[int | None, int]]:
    """The reference: visit by (track, ts, -dur, id); pop ended events; the top is the parent."""
    rows = sorted(
        df.iter_rows(named=True),
        key=lambda r: (r["track_id"], r["ts"], -(r["dur"] or 0), r["event_id"]),
    )
    out: dict[int, tuple[int | None, int]] = {}
    stack: list[tuple[int, int]] = []
    track: Any = object()
    for r in rows:
        if r["track_id"] != track:
            stack, track = [], r["track_id"]
        while stack and stack[-1][1] <= r["ts"]:
            stack.pop()
        out[r["event_id"]] = (stack[-1][0] if stack else None, len(stack))
        stack.append((r["event_id"], r["ts"] + (r["dur"] or 0)))
    return out


def test_nested_and_siblings() -> None:
    got = nested([(0, 0, 0, 100), (1, 0, 10, 30), (2, 0, 15, 5), (3, 0, 50, 20), (4, 0, 100, 5)])
    assert got == {0: (None, 0), 1: (0, 1), 2: (1, 2), 3: (0, 1), 4: (None, 0)}


def test_zero_duration_and_boundaries() -> None:
    # a zero-length event at a parent's start is inside it; at its end it is not
    got = nested([(0, 0, 10, 10), (1, 0, 10, 0), (2, 0, 20, 0), (3, 0, 15, 0), (4, 0, 15, None)])
    assert got == {0: (None, 0), 1: (0, 1), 2: (None, 0), 3: (0, 1), 4: (0, 1)}


def test_equal_starts_longest_first() -> None:
    got = nested([(5, 0, 0, 10), (6, 0, 0, 30), (7, 0, 0, 30), (8, 0, 0, 0)])
    # equal starts: longer first, then by id; identical spans nest
    assert got == {6: (None, 0), 7: (6, 1), 5: (7, 2), 8: (5, 3)}


def test_tracks_are_independent_and_row_order_kept() -> None:
    df = frame([(2, 1, 5, 1), (0, 0, 0, 10), (1, 1, 0, 10), (3, 0, 5, 1)])
    out = nest_events(df)
    assert out["event_id"].to_list() == [2, 0, 1, 3]
    assert out["parent_id"].to_list() == [1, None, None, 0]
    assert out["depth"].to_list() == [1, 0, 0, 1]


def test_overrun_is_clamped_to_parent() -> None:
    # 1 overruns 0; 2 starts after 0 ended, so it is top-level, not 1's child
    got = nested([(0, 0, 0, 10), (1, 0, 5, 10), (2, 0, 12, 1)])
    assert got == {0: (None, 0), 1: (0, 1), 2: (None, 0)}


def test_empty_and_null_ts() -> None:
    assert nest_events(frame([])).columns == [
        "event_id",
        "track_id",
        "ts",
        "dur",
        "parent_id",
        "depth",
    ]
    got = nested([(0, 0, 0, 10), (1, 0, None, 1)])  # type: ignore[list-item]
    assert got == {0: (None, 0), 1: (None, None)}


def test_random_well_nested_trees_match_stack_walk() -> None:
    rng = random.Random(7)
    for _ in range(200):
        rows: list[tuple[int, int, int, int | None]] = []

        def grow(track: int, lo: int, hi: int, depth: int, rows: list[Any] = rows) -> None:
            t = lo
            while t < hi and rng.random() < 0.7:
                start = rng.randint(t, hi)
                end = rng.randint(start, hi)
                rows.append((len(rows) + 1000, track, start, end - start))
                if depth < 4 and end > start:
                    grow(track, start, end, depth + 1, rows)
                t = end if end > t else t + 1

        for track in range(3):
            grow(track, 0, 1000, 0)
        rng.shuffle(rows)
        df = frame(rows)
        got = {
            r["event_id"]: (r["parent_id"], r["depth"])
            for r in nest_events(df).iter_rows(named=True)
        }
        assert got == stack_walk(df)


@pytest.mark.shared_data
def test_real_trace_matches_stack_walk(shared_datasets: Path) -> None:
    path = shared_datasets / "hta-nccl-rank0" / "nccl_data.json.gz"
    ev = read_kineto(path).events.filter(pl.col("category") != "instant")
    want = stack_walk(ev.select("event_id", "track_id", "ts", "dur"))
    got = {r["event_id"]: (r["parent_id"], r["depth"]) for r in ev.iter_rows(named=True)}
    assert got == want
    assert max(d for _, d in got.values()) > 5


def naive_enclosing(events: pl.DataFrame, points: list[tuple[int, int]]) -> list[int | None]:
    """For each (track, ts): the enclosing event that started last (ties: shortest, then id)."""
    rows = list(events.iter_rows(named=True))
    out: list[int | None] = []
    for track, ts in points:
        inside = [
            r for r in rows if r["track_id"] == track and r["ts"] <= ts <= r["ts"] + (r["dur"] or 0)
        ]
        best = max(inside, key=lambda r: (r["ts"], -(r["dur"] or 0), r["event_id"]), default=None)
        out.append(None if best is None else best["event_id"])
    return out


def enclosing(
    rows: list[tuple[int, int, int, int | None]], points: list[tuple[int, int]]
) -> list[int | None]:
    pts = pl.DataFrame(points, schema={"track_id": pl.Int32, "ts": pl.Int64}, orient="row")
    return innermost_enclosing(nest_events(frame(rows)), pts).to_list()


def test_innermost_enclosing_hand_built() -> None:
    rows = [(0, 0, 0, 100), (1, 0, 10, 30), (2, 0, 15, 5), (3, 0, 50, 20), (4, 1, 0, 1000)]
    points = [(0, 16), (0, 25), (0, 45), (0, 40), (0, 100), (0, 101), (1, 5), (2, 5), (0, -1)]
    # 25: 2 has ended, 1 encloses; 40: an end is inclusive; 101: after everything
    assert enclosing(rows, points) == [2, 1, 0, 1, 0, None, 4, None, None]


def test_innermost_enclosing_random_matches_naive() -> None:
    rng = random.Random(11)
    rows: list[tuple[int, int, int, int | None]] = []

    def grow(track: int, lo: int, hi: int, depth: int) -> None:
        t = lo
        while t < hi and depth < 5:
            start = rng.randint(t, hi)
            end = rng.randint(start, hi)
            rows.append((len(rows), track, start, end - start))
            if end - start > 2:
                grow(track, start + 1, end - 1, depth + 1)
            t = end + rng.randint(0, 3)

    for track in range(3):
        grow(track, 0, 300, 0)
    points = [(rng.randint(0, 3), rng.randint(-5, 310)) for _ in range(400)]
    assert enclosing(rows, points) == naive_enclosing(frame(rows), points)

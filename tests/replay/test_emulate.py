"""The store shell on a hand-built 2-rank graph: emulated runs, their rows, and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from prism_trace.replay import (
    CompletionConfig,
    EmulationConfig,
    MissingParticipantError,
    emulate_run,
)

from prism_trace.errors import DuplicateRunError, RunStateError
from prism_trace.store.connection import Store, open_store


def q(store: Store, sql: str, *params: object) -> list[tuple]:
    return store.con.execute(sql, list(params)).fetchall()


def row_counts(store: Store) -> dict[str, int]:
    tables = ("run", "rank", "event", "iteration", "collective", "p2p", "graph_node", "track")
    return {t: q(store, f"SELECT count(*) FROM {t}")[0][0] for t in tables}


def contents(store: Store) -> dict[str, list[tuple]]:
    """Every row of every table, sorted: what a refused emulation leaves exactly as it was."""
    tables = [t for (t,) in q(store, "SELECT table_name FROM duckdb_tables() ORDER BY 1")]
    return {t: q(store, f'SELECT * FROM "{t}" ORDER BY ALL') for t in tables}


def hand_store(tmp_path: Path, *, drop_rank1_collective: bool = False) -> Store:
    """Two ranks, one iteration (ts 0..200 on both).

    rank 0: a [0, 10) → all_reduce [10, 40) (waited for rank 1) → send to 1 [40, 45) → d [50, 60)
    rank 1: b [0, 30) → all_reduce [30, 40) (last arriver: transfer 10) → recv from 0 [40, 47)
    """
    s = open_store(tmp_path / "h.duckdb")
    nodes = [
        # rank, node_id, kind, ts, dur, group, seq, peer, comm_kind
        (0, 0, "host", "a", 0, 10, None, None, None, None),
        (0, 1, "collective", "all_reduce", 10, 30, 0, 0, None, "all_reduce"),
        (0, 2, "send", "send", 40, 5, 0, 0, 1, "send"),
        (0, 3, "host", "d", 50, 10, None, None, None, None),
        (1, 0, "host", "b", 0, 30, None, None, None, None),
        (1, 1, "collective", "all_reduce", 30, 10, 0, 0, None, "all_reduce"),
        (1, 2, "recv", "recv", 40, 7, 0, 0, 0, "recv"),
    ]
    if drop_rank1_collective:
        nodes = [n for n in nodes if not (n[0] == 1 and n[1] == 1)]
    with s.transaction() as con:
        con.execute(
            "INSERT INTO run (run_id, name, kind, world_size, source_format)"
            " VALUES (1, 'h', 'recorded', 2, 'kineto')"
        )
        con.executemany("INSERT INTO rank (run_id, rank) VALUES (1, ?)", [[0], [1]])
        con.execute(
            "INSERT INTO comm_group (run_id, group_id, name, description, size, ranks)"
            " VALUES (1, 0, '0', 'default_pg', 2, [0, 1])"
        )
        con.executemany(
            "INSERT INTO graph_node (run_id, rank, node_id, kind, track_id, name, ts, dur,"
            " iteration, group_id, seq, peer, comm_kind)"
            " VALUES (1, ?, ?, ?, 0, ?, ?, ?, 1, ?, ?, ?, ?)",
            [list(n) for n in nodes],
        )
        con.execute(
            "INSERT INTO graph_edge SELECT 1, a.rank, a.node_id, b.node_id, 'program', 'end',"
            " b.ts - (a.ts + a.dur) FROM graph_node a JOIN graph_node b"
            " ON a.rank = b.rank AND b.node_id = (SELECT min(node_id) FROM graph_node c"
            " WHERE c.rank = a.rank AND c.node_id > a.node_id)"
        )
        con.executemany(
            "INSERT INTO iteration (run_id, rank, iteration, ts, dur, name)"
            " VALUES (1, ?, 1, 0, 200, 'ProfilerStep#1')",
            [[0], [1]],
        )
    return s


def test_emulated_run_rows(tmp_path: Path) -> None:
    store = hand_store(tmp_path)
    report = emulate_run(store, run="h", out_run="e")
    rid = report.run_id
    assert q(store, "SELECT kind, parent_run_id, world_size FROM run WHERE run_id = ?", rid) == [
        ("emulated", 1, 2)
    ]
    ev = {
        (r, name): (ts, dur)
        for r, name, ts, dur in q(
            store, "SELECT rank, name, ts, dur FROM event WHERE run_id = ?", rid
        )
    }
    # exact replay: the collective completes at the last arrival (30) + transfer (10)
    assert ev[(0, "all_reduce")] == (10, 30)
    assert ev[(1, "all_reduce")] == (30, 10)
    # both arrive at 40: of tied arrivals the shorter (send, 5) is the transfer; the receive
    # keeps its recorded completion skew (+2), so the replay is exact
    assert ev[(0, "send")] == (40, 5)
    assert ev[(1, "recv")] == (40, 7)
    assert ev[(0, "d")] == (50, 10)
    assert q(store, "SELECT category FROM event WHERE run_id = ? AND name = 'a'", rid) == [
        ("cpu_op",)
    ]
    assert q(
        store, "SELECT rank, iteration, dur FROM iteration WHERE run_id = ? ORDER BY rank", rid
    ) == [(0, 1, 200), (1, 1, 200)]
    assert q(
        store,
        "SELECT rank, kind, host_ts, host_dur, group_size FROM collective WHERE run_id = ?"
        " ORDER BY rank",
        rid,
    ) == [(0, "all_reduce", 10, 30, 2), (1, "all_reduce", 30, 10, 2)]
    assert q(
        store, "SELECT rank, direction, peer FROM p2p WHERE run_id = ? ORDER BY rank", rid
    ) == [(0, "send", 1), (1, "recv", 0)]
    assert q(store, "SELECT count(*) FROM rank WHERE run_id = ?", rid) == [(2,)]
    d = report.as_dict()
    assert d["collective_instances"] == 1
    assert d["p2p_instances"] == 1
    assert "emulated run 'e'" in report.summary()


def test_replace_and_refusals(tmp_path: Path) -> None:
    store = hand_store(tmp_path)
    emulate_run(store, run="h", out_run="e")
    with pytest.raises(DuplicateRunError, match="'e' already exists"):
        emulate_run(store, run="h", out_run="e")
    r2 = emulate_run(store, run="h", out_run="e", replace=True)
    assert q(store, "SELECT count(*) FROM run WHERE name = 'e'") == [(1,)]
    assert q(store, "SELECT count(*) FROM event WHERE run_id = ?", r2.run_id) == [(7,)]
    with pytest.raises(RunStateError, match="recorded run"):
        emulate_run(store, run="e", out_run="h", replace=True)
    with pytest.raises(RunStateError, match="only a recorded or sliced run"):
        emulate_run(store, run="e", out_run="e2")


def test_missing_participant_names_group_seq_and_ranks(tmp_path: Path) -> None:
    store = hand_store(tmp_path, drop_rank1_collective=True)
    before = row_counts(store)
    with pytest.raises(MissingParticipantError) as exc:
        emulate_run(store, run="h", out_run="e")
    assert (exc.value.group, exc.value.seq, exc.value.ranks) == (0, 0, [1])
    assert "group 0, seq 0" in str(exc.value)
    assert row_counts(store) == before
    # a partial recording may be emulated on purpose
    report = emulate_run(
        store,
        run="h",
        out_run="e",
        config=EmulationConfig(completion=CompletionConfig(allow_partial=True)),
    )
    assert report.collective_instances == 1


def test_common_completion_ignores_skew(tmp_path: Path) -> None:
    store = hand_store(tmp_path)
    cfg = EmulationConfig(completion=CompletionConfig(rule="common"))
    rid = emulate_run(store, run="h", out_run="c", config=cfg).run_id
    ends = q(
        store,
        "SELECT name, rank, ts + dur FROM event WHERE run_id = ? AND name IN ('send', 'recv', 'd')"
        " ORDER BY name",
        rid,
    )
    assert ends == [("d", 0, 60), ("recv", 1, 45), ("send", 0, 45)]


def test_error_while_writing_rolls_everything_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The events go in on a worker thread while the memory is worked out: an error then stops
    the insert and rolls the whole run back (the replaced run stays as it was)."""
    import prism_trace.replay.emulate.write as write_module

    store = hand_store(tmp_path)
    first = emulate_run(store, run="h", out_run="e")
    before = row_counts(store)

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("memory failed")

    monkeypatch.setattr(write_module, "with_memory", fail)
    every_row = contents(store)
    with pytest.raises(RuntimeError, match="memory failed"):
        emulate_run(store, run="h", out_run="e", replace=True)
    assert row_counts(store) == before
    assert contents(store) == every_row
    assert q(store, "SELECT run_id FROM run WHERE name = 'e'") == [(first.run_id,)]
    monkeypatch.undo()
    again = emulate_run(store, run="h", out_run="e", replace=True)
    assert q(store, "SELECT count(*) FROM event WHERE run_id = ?", again.run_id) == [(7,)]


def test_a_refused_remove_gpu_leaves_every_table_as_it_was(tmp_path: Path) -> None:
    """`remove-gpu=0` on a run without tp/dp coordinates is refused by the prepare stage, after
    the run was loaded and its replaced run claimed: nothing changes."""
    from prism_trace.replay.whatif.config import WhatIfError, parse_what_if

    store = hand_store(tmp_path)
    emulate_run(store, run="h", out_run="e")
    every_row = contents(store)
    config = EmulationConfig(what_if=parse_what_if(["remove-gpu=0"]))
    with pytest.raises(WhatIfError, match="has no tp/dp coordinates"):
        emulate_run(store, run="h", out_run="e", replace=True, config=config)
    assert contents(store) == every_row
    assert not store.in_transaction

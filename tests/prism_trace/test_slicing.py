"""Slicing real recorded runs to larger data-parallel worlds, and its refusals."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from prism_trace.errors import DuplicateRunError, PrismError
from prism_trace.layout.mesh import ParallelAxis, ParallelLayout
from prism_trace.slicing.plan import RULES, SliceError
from prism_trace.slicing.report import SliceReport
from prism_trace.slicing.slicer import slice_run
from prism_trace.store.connection import Store, open_store
from tests.conftest import sample_copy, store_contents


def q(store: Store, sql: str, *params: object) -> list[tuple]:
    return store.con.execute(sql, list(params)).fetchall()


def counts(store: Store, table: str, run_id: int, rank: int) -> Counter[str]:
    rows = q(
        store,
        f"SELECT kind, count(*) FROM {table} WHERE run_id = ? AND rank = ? GROUP BY kind",
        run_id,
        rank,
    )
    return Counter(dict(rows))


def group_sets(store: Store, run_id: int) -> dict[str, list[frozenset[int]]]:
    out: dict[str, list[frozenset[int]]] = {}
    for axis, ranks in q(store, "SELECT axis, ranks FROM comm_group WHERE run_id = ?", run_id):
        out.setdefault(axis, []).append(frozenset(ranks))
    return out


def containing(groups: list[frozenset[int]], rank: int) -> frozenset[int]:
    (found,) = [g for g in groups if rank in g]
    return found


def comm_sequence(store: Store, run_id: int, rank: int) -> list[tuple]:
    return q(
        store,
        "SELECT n.kind, n.comm_kind, g.axis, n.seq FROM graph_node n"
        " LEFT JOIN comm_group g ON g.run_id = n.run_id AND g.group_id = n.group_id"
        " WHERE n.run_id = ? AND n.rank = ? AND n.kind IN ('collective', 'send', 'recv')"
        " ORDER BY g.axis, n.kind, n.seq, n.node_id",
        run_id,
        rank,
    )


def check_invariants(store: Store, report: SliceReport) -> None:
    """What every sliced run must satisfy, whatever its size."""
    sid, pid = report.run_id, report.parent_run_id
    layout = report.layout
    assert q(store, "SELECT kind, parent_run_id, world_size FROM run WHERE run_id = ?", sid) == [
        ("sliced", pid, layout.world_size)
    ]
    config = json.loads(q(store, "SELECT config_json FROM run WHERE run_id = ?", sid)[0][0])
    assert config["layout"] == layout.spec
    rows = np.array(
        q(
            store,
            "SELECT rank, class_id, represented_by, tp, cp, ep, dp, pp FROM rank"
            " WHERE run_id = ? ORDER BY rank",
            sid,
        )
    )
    ranks = np.arange(layout.world_size)
    np.testing.assert_array_equal(rows[:, 0], ranks)
    c = layout.coords(ranks)
    for i, a in enumerate(ParallelAxis):
        np.testing.assert_array_equal(rows[:, 3 + i], c[a])
    # class_id = lowest rank with the same (pp, tp, cp, ep): the dp=0 member.
    np.testing.assert_array_equal(
        rows[:, 1], ranks - c[ParallelAxis.DP] * layout.strides[ParallelAxis.DP]
    )
    assert sorted(set(rows[:, 1].tolist())) == sorted(k.exemplar for k in report.classes)
    assert sum(k.count for k in report.classes) == layout.world_size
    for k in report.classes:
        members = rows[rows[:, 1] == k.exemplar]
        assert set(members[:, 2].tolist()) == {k.representative}
        assert members.shape[0] == k.count
        # The class graph is the representative's graph, node for node.
        assert counts(store, "graph_node", sid, k.exemplar) == counts(
            store, "graph_node", pid, k.representative
        )
        assert counts(store, "graph_edge", sid, k.exemplar) == counts(
            store, "graph_edge", pid, k.representative
        )
    # Only exemplars carry graphs.
    assert {
        r for (r,) in q(store, "SELECT DISTINCT rank FROM graph_node WHERE run_id = ?", sid)
    } <= {k.exemplar for k in report.classes}
    # Comm nodes: group of the same axis containing the exemplar; peer inside it; bytes kept.
    bad = q(
        store,
        """SELECT s.rank, s.node_id, s.name, sg.axis, rg.axis, s.peer, sg.ranks
           FROM graph_node s
           JOIN rank k ON k.run_id = s.run_id AND k.rank = s.rank
           JOIN graph_node r ON r.run_id = ? AND r.rank = k.represented_by AND r.node_id = s.node_id
           LEFT JOIN comm_group sg ON sg.run_id = s.run_id AND sg.group_id = s.group_id
           LEFT JOIN comm_group rg ON rg.run_id = r.run_id AND rg.group_id = r.group_id
           WHERE s.run_id = ? AND (
                s.kind <> r.kind OR s.event_id IS DISTINCT FROM r.event_id
             OR s.msg_bytes IS DISTINCT FROM r.msg_bytes OR s.seq IS DISTINCT FROM r.seq
             OR (r.group_id IS NOT NULL AND (sg.axis IS DISTINCT FROM rg.axis
                                             OR NOT list_contains(sg.ranks, s.rank)))
             OR (r.peer IS NULL) <> (s.peer IS NULL)
             OR (s.peer IS NOT NULL AND (s.peer = s.rank
                 OR (sg.ranks IS NOT NULL AND NOT list_contains(sg.ranks, s.peer)))))
           LIMIT 5""",
        pid,
        sid,
    )
    assert bad == []
    n_groups = q(store, "SELECT count(*), count(axis) FROM comm_group WHERE run_id = ?", sid)[0]
    assert n_groups == (report.groups, report.groups)
    n_comm = q(
        store,
        "SELECT count(*) FROM graph_node WHERE run_id = ?"
        " AND kind IN ('collective', 'send', 'recv')",
        sid,
    )[0][0]
    assert sum(report.rescaled.values()) == n_comm
    assert set(report.rescaled) == set(RULES)


def check_same_world(store: Store, report: SliceReport, *, exact: bool = True) -> None:
    """A slice to the recorded world reproduces the recording: each target rank's class graph
    has the counts of the recorded rank of that number, and its groups the same members."""
    sid, pid = report.run_id, report.parent_run_id
    rec_groups, tgt_groups = group_sets(store, pid), group_sets(store, sid)
    assert set(tgt_groups) == set(rec_groups)
    for r, cls in q(store, "SELECT rank, class_id FROM rank WHERE run_id = ? ORDER BY rank", sid):
        if exact:
            assert counts(store, "graph_node", sid, cls) == counts(store, "graph_node", pid, r), r
            assert counts(store, "graph_edge", sid, cls) == counts(store, "graph_edge", pid, r), r
        else:
            assert comm_sequence(store, sid, cls) == comm_sequence(store, pid, r), r
        for axis in rec_groups:
            if any(r in g for g in rec_groups[axis]):
                assert containing(tgt_groups[axis], r) == containing(rec_groups[axis], r), (r, axis)


def row_counts(store: Store) -> dict[str, int]:
    tables = ("run", "rank", "comm_group", "graph_node", "graph_edge")
    return {t: q(store, f"SELECT count(*) FROM {t}")[0][0] for t in tables}


# --- the bundled sample --------------------------------------------------------------------------


def test_sample_to_dp4(sample_store: Store) -> None:
    layout = ParallelLayout.parse("tp=2,dp=4,pp=2")
    report = slice_run(
        sample_store, run="sample", layout=layout, world=16, from_ranks=[0, 1, 4, 5], out_run="s16"
    )
    check_invariants(sample_store, report)
    assert [(k.exemplar, k.representative, k.count, k.pp, k.tp) for k in report.classes] == [
        (0, 0, 4, 0, 0),
        (1, 1, 4, 0, 1),
        (8, 4, 4, 1, 0),
        (9, 5, 4, 1, 1),
    ]
    assert report.mapping == {
        0: "0..6 step 2",
        1: "1..7 step 2",
        4: "8..14 step 2",
        5: "9..15 step 2",
    }
    groups = group_sets(sample_store, report.run_id)
    assert {a: len(g) for a, g in groups.items()} == {"world": 1, "tp": 8, "dp": 4, "pp": 8}
    assert containing(groups["dp"], 9) == frozenset({9, 11, 13, 15})
    assert containing(groups["world"], 0) == frozenset(range(16))
    # Stage 1 of tp 0 exchanges with stage 0 of the same (tp, dp): rank 0 in the target.
    peers = q(
        sample_store,
        "SELECT DISTINCT peer FROM graph_node WHERE run_id = ? AND rank = 8 AND peer IS NOT NULL",
        report.run_id,
    )
    assert peers == [(0,)]
    # default_pg all-reduces grow from 8 to 16 ranks; tp/dp/pp groups keep their size... except dp.
    n_world_ar = q(
        sample_store,
        "SELECT count(*) FROM graph_node n JOIN comm_group g USING (run_id, group_id)"
        " WHERE n.run_id = ? AND g.axis IN ('world', 'dp') AND n.comm_kind = 'all_reduce'",
        report.run_id,
    )[0][0]
    assert report.rescaled["all_reduce"] == n_world_ar > 0
    assert report.rescaled["p2p"] > 0
    assert report.as_dict()["mapping"]["4"] == "8..14 step 2"
    json.dumps(report.as_dict())


def test_sample_same_world_and_defaults(sample_store: Store) -> None:
    layout = ParallelLayout.parse("tp=2,dp=2,pp=2")
    report = slice_run(sample_store, run="sample", layout=layout, world=8, out_run="s8")
    assert [k.representative for k in report.classes] == [0, 1, 4, 5]
    check_invariants(sample_store, report)
    check_same_world(sample_store, report)
    # Representatives from dp replica 1 serve as well.
    other = slice_run(
        sample_store, run="sample", layout=layout, world=8, from_ranks=[2, 3, 6, 7], out_run="s8b"
    )
    assert [k.representative for k in other.classes] == [2, 3, 6, 7]
    check_invariants(sample_store, other)
    check_same_world(sample_store, other)


def test_replace(sample_store: Store) -> None:
    layout = ParallelLayout.parse("tp=2,dp=3,pp=2")
    first = slice_run(sample_store, run="sample", layout=layout, world=12, out_run="r12")
    before = row_counts(sample_store)
    with pytest.raises(DuplicateRunError, match="'r12' already exists"):
        slice_run(sample_store, run="sample", layout=layout, world=12, out_run="r12")
    again = slice_run(
        sample_store, run="sample", layout=layout, world=12, out_run="r12", replace=True
    )
    assert row_counts(sample_store) == before
    assert again.run_id != first.run_id
    check_invariants(sample_store, again)
    with pytest.raises(SliceError, match="recorded run"):
        slice_run(
            sample_store, run="sample", layout=layout, world=12, out_run="sample", replace=True
        )


@pytest.mark.parametrize(
    ("spec", "world", "from_ranks", "error", "fragment"),
    [
        ("tp=4,dp=1,pp=2", 8, None, SliceError, "axis `tp` differs: recorded tp=2, target tp=4"),
        # no what-if changes pp: the refusal offers the slice that keeps it, at the same world
        (
            "tp=2,dp=2,pp=4",
            16,
            None,
            SliceError,
            "no what-if changes pp: keep pp=2 (--layout tp=2,cp=1,ep=1,dp=4,pp=2 --world 16)",
        ),
        ("tp=2,cp=2,dp=2,pp=2", 16, None, SliceError, "axis `cp` differs"),
        ("tp=2,dp=4,pp=2", 8, None, SliceError, "--world 8 does not match"),
        (
            "tp=2,dp=4,pp=2",
            16,
            [0, 1],
            SliceError,
            "no representative for the roles tp=0,cp=0,ep=0,pp=1",
        ),
        ("tp=2,dp=4,pp=2", 16, [], SliceError, "no representative for the roles"),
        ("tp=2,dp=4,pp=2", 16, [0, 1, 4, 9], SliceError, "--from-ranks [9] are not recorded"),
        ("tp=2,dp=2,pp=2", 0, None, SliceError, "--world 0 is outside [1, "),
    ],
)
def test_refusals_leave_the_store_unchanged(
    sample_store: Store,
    spec: str,
    world: int,
    from_ranks: list[int] | None,
    error: type[Exception],
    fragment: str,
) -> None:
    before = store_contents(sample_store)
    with pytest.raises(error) as exc:
        slice_run(
            sample_store,
            run="sample",
            layout=ParallelLayout.parse(spec),
            world=world,
            from_ranks=from_ranks,
            out_run="bad",
        )
    assert fragment in str(exc.value)
    assert isinstance(exc.value, PrismError)
    assert store_contents(sample_store) == before
    assert sample_store.run_id("bad") is None


def test_sliced_run_cannot_be_sliced(sample_store: Store) -> None:
    layout = ParallelLayout.parse("tp=2,dp=2,pp=2")
    slice_run(sample_store, run="sample", layout=layout, world=8, out_run="once")
    with pytest.raises(SliceError, match="only a recorded run"):
        slice_run(sample_store, run="once", layout=layout, world=8, out_run="twice")


# --- hand-built graphs: ops that cannot be mapped -------------------------------------------------


def _hand_store(tmp_path: Path, nodes: list[tuple]) -> Store:
    """dp=2 x pp=2 (rank = dp + 2 pp), groups: world, dp pairs, pp pairs, and one without members;
    ``nodes`` are (rank, node_id, kind, name, group_id, peer, comm_kind) graph rows."""
    s = open_store(tmp_path / "h.duckdb")
    with s.transaction() as con:
        con.execute(
            "INSERT INTO run (run_id, name, kind, world_size) VALUES (1, 'h', 'recorded', 4)"
        )
        con.executemany("INSERT INTO rank (run_id, rank) VALUES (1, ?)", [[r] for r in range(4)])
        groups = [
            (0, "default_pg", [0, 1, 2, 3]),
            (1, "dp", [0, 1]),
            (2, "dp", [2, 3]),
            (3, "pp", [0, 2]),
            (4, "pp", [1, 3]),
            (5, "mystery", None),
        ]
        con.executemany(
            "INSERT INTO comm_group (run_id, group_id, name, description, size, ranks)"
            " VALUES (1, ?, ?, ?, ?, ?)",
            [[g, str(g), d, None if r is None else len(r), r] for g, d, r in groups],
        )
        if not nodes:
            return s
        con.executemany(
            "INSERT INTO graph_node (run_id, rank, node_id, kind, event_id, name, group_id, seq,"
            " peer, msg_bytes, comm_kind) VALUES (1, ?, ?, ?, ?, ?, ?, 0, ?, 1024, ?)",
            [[r, n, k, 100 + n, name, g, p, ck] for r, n, k, name, g, p, ck in nodes],
        )
        con.execute(
            "INSERT INTO graph_edge SELECT 1, rank, node_id, node_id + 1, 'program', 'end', 0"
            " FROM graph_node WHERE run_id = 1 AND node_id < 2"
        )
    return s


GOOD = [
    (r, n, k, name, g, p, ck)
    for r in range(4)
    for n, k, name, g, p, ck in [
        (0, "host", "fwd", None, None, None),
        (
            1,
            "send" if r < 2 else "recv",
            "pp-send" if r < 2 else "pp-recv",
            3 + r % 2,
            (r + 2) % 4,
            None,
        ),
        (2, "collective", "grads-reduce-scatter", 1 + r // 2, None, "reduce_scatter"),
        (3, "collective", "loss-all-reduce", 0, None, "all_reduce"),
    ]
]


def test_hand_built_graph_to_dp8(tmp_path: Path) -> None:
    store = _hand_store(tmp_path, GOOD)
    layout = ParallelLayout.parse("dp=8,pp=2")
    report = slice_run(store, run="h", layout=layout, world=16, out_run="x")
    check_invariants(store, report)
    assert report.rescaled == {
        "same_size": 0,
        "all_reduce": 2,
        "reduce_scatter_all_gather": 2,
        "all_to_all": 0,
        "p2p": 2,
        "other": 0,
    }
    # Exemplar 8 (stage 1) receives from rank 0; its dp group is 8..15; groups are minted per axis.
    rows = q(
        store,
        "SELECT n.node_id, n.peer, g.name, g.ranks FROM graph_node n LEFT JOIN comm_group g"
        " USING (run_id, group_id) WHERE n.run_id = ? AND n.rank = 8 ORDER BY n.node_id",
        report.run_id,
    )
    assert rows == [
        (0, None, None, None),
        (1, 0, "pp:0", [0, 8]),
        (2, None, "dp:1", list(range(8, 16))),
        (3, None, "world:0", list(range(16))),
    ]


@pytest.mark.parametrize(
    ("node", "fragment"),
    [
        (
            (0, 4, "collective", "odd-all-reduce", 5, None, "all_reduce"),
            "collective 'odd-all-reduce' (node 4, event 104) on recorded rank 0: group 5 ('5',"
            " description 'mystery') has no axis",
        ),
        (
            (0, 4, "send", "stray-send", None, 9, None),
            "send 'stray-send' (node 4, event 104) on recorded rank 0: peer 9",
        ),
        (
            (0, 4, "collective", "nogroup", None, None, "barrier"),
            "'nogroup' (node 4, event 104) on recorded rank 0",
        ),
        (
            (0, 4, "collective", "alien", 2, None, "all_reduce"),
            "rank 0 is not a member of its group '2'",
        ),
    ],
)
def test_unmappable_ops_are_errors(tmp_path: Path, node: tuple, fragment: str) -> None:
    store = _hand_store(tmp_path, [*GOOD, node])
    before = store_contents(store)
    with pytest.raises(SliceError) as exc:
        slice_run(store, run="h", layout=ParallelLayout.parse("dp=4,pp=2"), world=8, out_run="x")
    assert fragment in str(exc.value)
    assert store_contents(store) == before
    assert q(store, "SELECT count(axis) FROM comm_group")[0][0] == 0  # rolled back


# --- real traces ---------------------------------------------------------------------------------


@pytest.mark.shared_data
def test_st_same_world_from_dp0(real_store: Store) -> None:
    layout = ParallelLayout.parse("dp=2,pp=4")
    report = slice_run(
        real_store, run="st", layout=layout, world=8, from_ranks=[0, 2, 4, 6], out_run="st8"
    )
    assert [(k.exemplar, k.representative, k.pp, k.count) for k in report.classes] == [
        (0, 0, 0, 2),
        (2, 2, 1, 2),
        (4, 4, 2, 2),
        (6, 6, 3, 2),
    ]
    assert report.built_graph
    check_invariants(real_store, report)
    check_same_world(real_store, report)
    # `world`: the grad-norm all-reduce (optimizer-clip-main-grad) of the op-timeline graph
    assert set(group_sets(real_store, report.run_id)) == {"dp", "embd", "pp", "tp", "world"}


@pytest.mark.shared_data
def test_st_to_dp64(real_store: Store) -> None:
    layout = ParallelLayout.parse("dp=64,pp=4")
    report = slice_run(
        real_store, run="st", layout=layout, world=256, from_ranks=[0, 2, 4, 6], out_run="st256"
    )
    check_invariants(real_store, report)
    assert report.mapping == {0: "0..63", 2: "64..127", 4: "128..191", 6: "192..255"}
    groups = group_sets(real_store, report.run_id)
    assert {a: len(g) for a, g in groups.items()} == {
        "dp": 4,
        "embd": 64,
        "pp": 64,
        "tp": 256,
        "world": 1,  # the grad-norm all-reduce of the op-timeline graph
    }
    assert containing(groups["embd"], 0) == frozenset({0, 192})
    assert containing(groups["dp"], 64) == frozenset(range(64, 128))
    # Stage 1 sends forward to stage 2 and backward to stage 0, at dp 0.
    peers = q(
        real_store,
        "SELECT kind, list(DISTINCT peer ORDER BY peer) FROM graph_node"
        " WHERE run_id = ? AND rank = 64 AND peer IS NOT NULL GROUP BY kind ORDER BY kind",
        report.run_id,
    )
    assert peers == [("recv", [0, 128]), ("send", [0, 128])]
    n_rs_ag = q(
        real_store,
        "SELECT count(*) FROM graph_node WHERE run_id = ?"
        " AND comm_kind IN ('reduce_scatter', 'all_gather')",
        report.run_id,
    )[0][0]
    assert report.rescaled["reduce_scatter_all_gather"] == n_rs_ag > 0
    # ST's all-reduces are on embd and tp groups, but for the grad-norm all-reduce
    # (optimizer-clip-main-grad, 32 steps x 4 classes) on the world group
    assert report.rescaled["all_reduce"] == 128


@pytest.mark.shared_data
def test_dlrm_from_rank0(real_store: Store) -> None:
    layout = ParallelLayout.parse("dp=8")
    report = slice_run(
        real_store, run="dlrm", layout=layout, world=8, from_ranks=[0], out_run="dlrm8"
    )
    assert [(k.exemplar, k.representative, k.count) for k in report.classes] == [(0, 0, 8)]
    check_invariants(real_store, report)
    # DLRM ranks run different kernels; their communication is the same.
    check_same_world(real_store, report, exact=False)
    big = slice_run(
        real_store,
        run="dlrm",
        layout=ParallelLayout.parse("dp=1024"),
        world=1024,
        out_run="dlrm1024",
    )
    check_invariants(real_store, big)
    assert big.rescaled["all_reduce"] > 0
    assert big.rescaled["all_to_all"] > 0


@pytest.mark.shared_data
def test_chakra_resnet_from_rank0(real_store: Store) -> None:
    report = slice_run(
        real_store,
        run="resnet",
        layout=ParallelLayout.parse("dp=64"),
        world=64,
        from_ranks=[0],
        out_run="resnet64",
    )
    check_invariants(real_store, report)
    check_same_world(real_store, report)
    assert (
        report.rescaled["same_size"]
        == report.nodes - counts(real_store, "graph_node", report.run_id, 0)["host"]
    )
    big = slice_run(
        real_store,
        run="resnet",
        layout=ParallelLayout.parse("dp=128"),
        world=128,
        from_ranks=[0],
        out_run="resnet128",
    )
    check_invariants(real_store, big)
    assert big.rescaled["all_reduce"] == report.rescaled["same_size"]


def test_refusal_comes_before_building_the_graph(tmp_path: Path) -> None:
    store = _hand_store(tmp_path, [])  # no graph yet: slice_run would build it
    with pytest.raises(SliceError, match="no representative for the roles"):
        slice_run(
            store,
            run="h",
            layout=ParallelLayout.parse("dp=4,pp=2"),
            world=8,
            from_ranks=[0],
            out_run="x",
        )
    assert q(store, "SELECT count(*) FROM graph_node") == [(0,)]


def test_a_slice_refused_after_building_the_graph_leaves_every_row(
    sample_template: Path, tmp_path: Path
) -> None:
    """The recorded graph is built inside the slice's transaction: a slice refused once the graph
    exists (an op it cannot map) takes the graph, the recorded run's axes and all back."""
    store = sample_copy(sample_template, tmp_path / "s.duckdb")
    # Rank 0's dp group without its member list: inference still reads dp from the other dp
    # groups, but rank 0's gradient all-reduces on it cannot be mapped.
    store.con.execute("UPDATE comm_group SET ranks = NULL WHERE group_id = 5")
    before = store_contents(store)
    assert not before["graph_node"]
    with pytest.raises(SliceError, match=r"group 5 \('5', description 'dp'\) has no axis"):
        slice_run(
            store, run="sample", layout=ParallelLayout.parse("tp=2,dp=2,pp=2"), world=8, out_run="x"
        )
    assert store_contents(store) == before
    store.close()


def test_target_order_may_differ(sample_store: Store) -> None:
    layout = ParallelLayout.parse("tp=2,dp=4,pp=2", order="dp-tp-pp")
    report = slice_run(sample_store, run="sample", layout=layout, world=16, out_run="reordered")
    check_invariants(sample_store, report)
    assert [(k.exemplar, k.representative, k.ranks) for k in report.classes] == [
        (0, 0, "0..3"),
        (4, 1, "4..7"),
        (8, 4, "8..11"),
        (12, 5, "12..15"),
    ]
    assert report.as_dict()["order"] == "dp-cp-ep-tp-pp"  # size-1 axes keep their slots

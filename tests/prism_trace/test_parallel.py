"""ParallelLayout: rank <-> coordinates, groups, spec parsing, layouts inferred from real runs."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from prism_trace.errors import PrismError
from prism_trace.layout.assign import assign_axes
from prism_trace.layout.choice import infer_layout
from prism_trace.layout.mesh import LayoutError, ParallelAxis, ParallelLayout, axis_name, parse_axes
from prism_trace.layout.roles import group_axis
from prism_trace.store.connection import Store, open_store
from tests.conftest import store_contents


def _new_store(
    tmp_path: Path, world: int, groups: list[tuple[str, str | None, list[int]]]
) -> Store:
    """A store with one recorded run of ``world`` ranks and the given (name, description,
    ranks) communicators, nothing else."""
    s = open_store(tmp_path / "h.duckdb")
    with s.transaction() as con:
        con.execute(
            "INSERT INTO run (run_id, name, kind, world_size) VALUES (1, 'h', 'recorded', ?)",
            [world],
        )
        con.executemany(
            "INSERT INTO rank (run_id, rank) VALUES (1, ?)", [[r] for r in range(world)]
        )
        con.executemany(
            "INSERT INTO comm_group (run_id, group_id, name, description, size, ranks)"
            " VALUES (1, ?, ?, ?, ?, ?)",
            [[i, n, d, len(r), r] for i, (n, d, r) in enumerate(groups)],
        )
    return s


# --- pure layout -------------------------------------------------------------------------------

LAYOUTS = [
    ("tp=2,dp=2,pp=2", None),
    ("tp=8,cp=2,ep=1,dp=4,pp=3", None),
    ("tp=2,cp=3,ep=2,dp=2,pp=2", "pp-dp-ep-cp-tp"),
    ("dp=5,pp=4", "dp-pp"),
    ("tp=4,dp=3", "dp-tp"),
]


@pytest.mark.parametrize(("spec", "order"), LAYOUTS)
def test_coords_rank_of_round_trip(spec: str, order: str | None) -> None:
    layout = ParallelLayout.parse(spec, order)
    ranks = np.arange(layout.world_size)
    coords = layout.coords(ranks)
    for a in ParallelAxis:
        assert coords[a].min() >= 0
        assert coords[a].max() < layout.size(a)
    np.testing.assert_array_equal(layout.rank_of(coords), ranks)
    # Every coordinate tuple occurs exactly once.
    assert len(set(zip(*(coords[a].tolist() for a in ParallelAxis), strict=True))) == ranks.size
    assert ParallelLayout.parse(layout.spec, layout.order_spec) == layout


@pytest.mark.parametrize(("spec", "order"), LAYOUTS)
def test_groups_partition_the_world_and_match_group_index(spec: str, order: str | None) -> None:
    layout = ParallelLayout.parse(spec, order)
    ranks = np.arange(layout.world_size)
    coords = layout.coords(ranks)
    for n in range(1, 6):
        for axes in itertools.combinations(list(ParallelAxis), n):
            groups = layout.groups(axes)
            assert groups.shape == (
                layout.world_size // int(np.prod([layout.size(a) for a in axes])),
                int(np.prod([layout.size(a) for a in axes])),
            )
            np.testing.assert_array_equal(np.sort(groups.ravel()), ranks)
            assert (np.diff(groups[:, 0]) > 0).all()  # sorted by lowest rank
            assert (np.diff(groups, axis=1) > 0).all()  # members by rank
            index = layout.group_index(axes, ranks)
            for row, members in enumerate(groups):
                np.testing.assert_array_equal(np.flatnonzero(index == row), members)
                for a in ParallelAxis:
                    if a not in axes:  # members share every other coordinate
                        assert np.unique(coords[a][members]).size == 1
            assert np.array_equal(layout.groups(axis_name(axes)), groups)


def test_groups_of_a_known_layout() -> None:
    # Megatron order: rank = tp + 2 * dp + 4 * pp.
    layout = ParallelLayout.parse("tp=2,dp=2,pp=2")
    assert layout.groups(("tp",)).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp").tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("tp-dp").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("tp-pp").tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.groups("world").tolist() == [list(range(8))]
    assert layout.groups("embd").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords([5]) == {
        ParallelAxis.TP: np.array([1]),
        ParallelAxis.CP: np.array([0]),
        ParallelAxis.EP: np.array([0]),
        ParallelAxis.DP: np.array([0]),
        ParallelAxis.PP: np.array([1]),
    }
    # The ST op timeline: rank = stage * dp + dp_rank; embedding = first and last stage.
    st = ParallelLayout.parse("dp=2,pp=4", order="dp-pp")
    assert st.groups("dp").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert st.groups("pp").tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert st.groups("embd").tolist() == [[0, 6], [1, 7]]
    assert st.group_index("embd", np.arange(8)).tolist() == [0, 1, -1, -1, -1, -1, 0, 1]
    # Another order: dp fastest, then tp.
    other = ParallelLayout.parse("tp=2,dp=2,pp=2", order="dp-tp-pp")
    assert other.groups("tp").tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert other.groups("dp").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_layout_facts() -> None:
    layout = ParallelLayout.parse("tp=8, cp=1, ep=1, dp=128, pp=8")
    assert layout.world_size == 8192
    assert layout.strides[ParallelAxis.DP] == 8
    assert layout.strides[ParallelAxis.PP] == 1024
    assert layout.spec == "tp=8,cp=1,ep=1,dp=128,pp=8"
    assert str(ParallelAxis.DP) == "dp"
    assert ParallelAxis.DP == "dp"
    # Axes of size 1 do not change the mapping, so the order normalises them away.
    assert ParallelLayout.parse("dp=2,pp=4", order="dp-pp") == ParallelLayout(dp=2, pp=4)
    assert ParallelLayout.parse("dp=2,pp=4", order="pp-dp") != ParallelLayout(dp=2, pp=4)
    assert parse_axes("dp-cp") == (ParallelAxis.CP, ParallelAxis.DP)
    assert axis_name(["cp", "dp"]) == "dp-cp"
    assert axis_name(["pp", "ep", "tp"]) == "tp-ep-pp"


@pytest.mark.parametrize(
    ("spec", "order", "fragment"),
    [
        ("", None, "empty"),
        ("tp=0", None, "positive integer"),
        ("tp=-2", None, "positive integer"),
        ("tp=two", None, "positive integer"),
        ("xp=2", None, "unknown axis 'xp'"),
        ("tp=2,tp=4", None, "given twice"),
        ("tp", None, "not `axis=size`"),
        ("tp=2,dp=4", "tp-xx", "unknown axis"),
        ("tp=2,dp=4", "tp-tp", "twice"),
        ("tp=2,dp=4", "dp-pp", "leaves out tp"),
    ],
)
def test_parse_errors(spec: str, order: str | None, fragment: str) -> None:
    with pytest.raises(LayoutError, match=None) as exc:
        ParallelLayout.parse(spec, order)
    assert fragment in str(exc.value)
    assert isinstance(exc.value, PrismError)
    assert isinstance(exc.value, ValueError)


def test_coords_out_of_range() -> None:
    layout = ParallelLayout.parse("dp=4")
    with pytest.raises(LayoutError, match="rank 4 is outside"):
        layout.coords([0, 4])
    with pytest.raises(LayoutError, match="`dp` coordinate out of range"):
        layout.rank_of({"dp": [4]})


# --- group_axis --------------------------------------------------------------------------------


def test_group_axis_by_description_and_members() -> None:
    layout = ParallelLayout.parse("tp=2,cp=2,dp=2,pp=3")
    tp = layout.groups("tp")[0].tolist()
    dpcp = layout.groups("dp-cp")[1].tolist()
    assert group_axis(layout, tp, "tp") == "tp"
    assert group_axis(layout, tp, "TENSOR_MODEL_PARALLEL_GROUP") == "tp"
    assert group_axis(layout, tp, None) == "tp"
    assert group_axis(layout, dpcp, "DATA_PARALLEL_GROUP_WITH_CP") == "dp-cp"
    assert group_axis(layout, dpcp, "something") == "dp-cp"
    assert group_axis(layout, list(range(24)), "default_pg") == "world"
    assert group_axis(layout, list(range(24)), None) == "world"
    embd = layout.groups("embd")[0].tolist()
    assert group_axis(layout, embd, None) == "embd"
    assert group_axis(layout, embd, "embd") == "embd"
    assert group_axis(layout, layout.groups("dp")[0].tolist(), "dp_stage0") == "dp"
    assert group_axis(layout, layout.groups("pp")[0].tolist(), "pp_dp0") == "pp"
    assert group_axis(ParallelLayout.parse("dp=2"), [1], "tp") == "tp"  # one-rank group
    with pytest.raises(LayoutError, match=r"group 'x'.*described as 'tp'"):
        group_axis(layout, dpcp, "tp", name="x")
    with pytest.raises(LayoutError, match=r"group 'y'.*fits no axis combination"):
        group_axis(layout, [0, 1, 2], None, name="y")


# --- inference from runs -----------------------------------------------------------------------


def test_infer_layout_sample(sample_store: Store) -> None:
    layout = infer_layout(sample_store, "sample")
    assert layout == ParallelLayout.parse("tp=2,dp=2,pp=2")
    axes = assign_axes(sample_store, "sample", layout)
    rows = sample_store.con.execute(
        "SELECT description, axis, ranks FROM comm_group ORDER BY group_id"
    ).fetchall()
    assert set(axes.values()) == {"world", "tp", "dp", "pp"}
    for desc, axis, ranks in rows:
        assert axis == ("world" if desc == "default_pg" else desc)
        assert ranks in layout.groups(axis).tolist()
    coords = sample_store.con.execute(
        "SELECT rank, tp, cp, ep, dp, pp FROM rank ORDER BY rank"
    ).fetchall()
    c = layout.coords(np.arange(8))
    assert coords == [(r, *(int(c[a][r]) for a in ParallelAxis)) for r in range(8)]


def test_infer_layout_rejects_a_misfit_group(tmp_path: Path) -> None:
    store = _new_store(
        tmp_path, 4, [("t0", "tp", [0, 1]), ("t1", "tp", [2, 3]), ("bad", "dp", [0, 3])]
    )
    with pytest.raises(LayoutError, match=r"group 'bad'.*\[0, 3\]"):
        infer_layout(store, "h")
    with pytest.raises(LayoutError, match=r"group 'bad'"):
        assign_axes(store, "h", ParallelLayout.parse("tp=2,dp=2"))
    assert store.con.execute("SELECT count(axis) FROM comm_group").fetchall() == [(0,)]


def test_refused_axes_write_nothing_inside_a_larger_transaction(tmp_path: Path) -> None:
    """A command's transaction joins `assign_axes`'s: a refusal must come before any write, or
    the command that catches it (`prism graph`) would commit half the axes."""
    store = _new_store(tmp_path, 4, [("d0", "dp", [0, 1]), ("d1", "dp", [2, 3])])
    store.con.execute("INSERT INTO rank (run_id, rank) VALUES (1, 7)")  # outside dp=2,pp=2
    before = store_contents(store)
    with store.transaction(), pytest.raises(LayoutError, match="rank 7 is outside"):
        assign_axes(store, "h", ParallelLayout.parse("dp=2,pp=2"))
    assert store_contents(store) == before


def test_infer_layout_world_mismatch(tmp_path: Path) -> None:
    store = _new_store(tmp_path, 6, [("t0", "tp", [0, 1, 2, 3])])
    with pytest.raises(LayoutError, match="its world has 6"):
        infer_layout(store, "h")


def test_infer_layout_unknown_run(sample_store: Store) -> None:
    with pytest.raises(PrismError, match="no run named 'nope'"):
        infer_layout(sample_store, "nope")


@pytest.mark.shared_data
def test_infer_layout_real(real_store: Store) -> None:
    st = infer_layout(real_store, "st")
    assert st == ParallelLayout.parse("dp=2,pp=4", order="dp-pp")
    assert st.strides[ParallelAxis.DP] == 1
    assert st.strides[ParallelAxis.PP] == 2
    axes = assign_axes(real_store, "st", st)
    names = dict(
        real_store.con.execute(
            "SELECT g.name, g.axis FROM comm_group g JOIN run r USING (run_id) WHERE r.name = 'st'"
        ).fetchall()
    )
    assert len(axes) == 16
    assert names["dp_stage0"] == "dp"
    assert names["pp_dp1"] == "pp"
    assert names["embd_dp0"] == "embd"
    assert names["tp_stage2_dp1"] == "tp"
    assert infer_layout(real_store, "dlrm") == ParallelLayout.parse("dp=8")
    assert infer_layout(real_store, "resnet") == ParallelLayout.parse("dp=64")
    # A world with one axis of size > 1: its default group is that axis's group.
    assert set(assign_axes(real_store, "dlrm", ParallelLayout.parse("dp=8")).values()) == {"dp"}

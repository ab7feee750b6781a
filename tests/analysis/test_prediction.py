"""The prediction check's comparison (analysis.prediction): the KS statistic on known samples,
the number rule of op names, and the structure comparison on the sample's emulations: none
where there is none, and the differences a wider dp, a resized collective or a lost op make."""

from __future__ import annotations

import itertools
import json

import duckdb
import numpy as np
import pytest
from prism_trace.analysis.prediction.compare import compare_replayed, compare_runs
from prism_trace.analysis.prediction.sides import run_side
from prism_trace.analysis.prediction.steps import ks_critical, ks_two_sample
from prism_trace.analysis.prediction.structure import NUMBER_RULE, compare_structure

from prism_trace.errors import PrismError
from prism_trace.store.connection import Store


def test_ks_statistic_of_a_hand_computed_case() -> None:
    # F_a steps 1/4 at 1, 2, 3, 4; F_b steps 1/5 at 3..7. At x = 4: F_a = 1, F_b = 2/5.
    assert ks_two_sample([1, 2, 3, 4], [3, 4, 5, 6, 7]) == pytest.approx(0.6)
    assert ks_two_sample([3, 4, 5, 6, 7], [4, 3, 2, 1]) == pytest.approx(0.6)  # symmetric
    # Ties: at x = 1, F_a = 2/3 and F_b = 1/3; at x = 2 both are 1.
    assert ks_two_sample([1, 1, 2], [1, 2, 2]) == pytest.approx(1 / 3)
    assert ks_two_sample([5.0, 1.0, 3.0], [3.0, 1.0, 5.0]) == 0.0
    assert ks_two_sample([1, 2], [10, 20, 30]) == 1.0
    assert ks_critical(40, 40) == pytest.approx(1.3581 * np.sqrt(80 / 1600), rel=1e-4)
    with pytest.raises(ValueError, match="non-empty"):
        ks_two_sample([], [1.0])


def test_ks_statistic_matches_the_definition() -> None:
    """``max_x |F_a(x) - F_b(x)|`` over a fine grid of x, on random samples with ties."""
    rng = np.random.default_rng(7)
    for n, m in itertools.product((1, 5, 40), (3, 17)):
        a = rng.integers(0, 12, n).astype(float)
        b = rng.integers(0, 12, m).astype(float) + 1.5
        grid = np.linspace(-1, 15, 3201)
        fa = (a[None, :] <= grid[:, None]).mean(axis=1)
        fb = (b[None, :] <= grid[:, None]).mean(axis=1)
        assert ks_two_sample(a, b) == pytest.approx(float(np.abs(fa - fb).max()))


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("prism_comm:pg=7;desc=pp;seq=16", "prism_comm:pg=12;desc=pp;seq=16", True),
        ("ProfilerStep#3", "ProfilerStep#11", True),
        ("nccl:all_reduce 0x7fab12", "nccl:all_reduce 0x5e00", True),
        ("aten::conv2d", "aten::conv3d", False),
        ("layer12", "layer13", False),
    ],
)
def test_numbers_that_do_not_continue_a_word_are_per_run_ids(a: str, b: str, same: bool) -> None:
    con = duckdb.connect()
    norm = [
        con.execute("SELECT regexp_replace(?, ?, '\\1N', 'g')", [x, NUMBER_RULE]).fetchone()[0]  # type: ignore[index]
        for x in (a, b)
    ]
    assert (norm[0] == norm[1]) is same, norm


@pytest.fixture(scope="module")
def store(sliced_sample_store: Store) -> Store:
    """The sample with `e8` (emulated from its slice to its own layout, 8 ranks) and `e16`
    (from its slice `s4` to tp=2,dp=4,pp=2, 16 ranks)."""
    from prism_trace.replay import emulate_run

    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.slicer import slice_run

    layout = ParallelLayout.parse("tp=2,dp=2,pp=2")
    slice_run(sliced_sample_store, run="sample", layout=layout, world=8, out_run="s_own")
    emulate_run(sliced_sample_store, run="s_own", out_run="e8")
    emulate_run(sliced_sample_store, run="s4", out_run="e16")
    return sliced_sample_store


def test_no_difference_where_there_is_none(store: Store) -> None:
    c = compare_runs(store, "e8", "sample")
    st = c.structure
    assert st.ops_compared
    assert st.differences == {"collectives": 0, "p2p": 0, "ops": 0, "classes": 0}
    assert [k.label for k in st.classes] == ["pp=0,tp=0", "pp=0,tp=1", "pp=1,tp=0", "pp=1,tp=1"]
    assert all(k.counts["ops"][0] == k.counts["ops"][1] > 100 for k in st.classes)
    assert all(k.counts["collectives"][0] > 0 and k.counts["p2p"][0] > 0 for k in st.classes)
    # Every figure is there, and the JSON form is JSON.
    d = json.loads(json.dumps(c.as_dict(), allow_nan=False))
    assert d["step_time"]["predicted_n"] == d["step_time"]["recorded_n"] == 8
    assert 0 <= d["step_time"]["ks_d"] <= 1
    # each step's ranks as one sample: 1 step compared a side here, against 8 rank-steps
    steps = len(d["step_time"]["iterations"])
    assert d["step_time"]["ks_critical_steps_5pct"] == pytest.approx(
        ks_critical(steps, steps), abs=1e-6
    )
    assert d["step_time"]["ks_critical_steps_5pct"] > d["step_time"]["ks_critical_5pct"]
    assert {w["kind"] for w in d["waits"]} >= {"all_reduce", "send", "recv"}
    assert len(d["ranks"]) == 8
    assert all(r["peak_recorded"] and r["comm_recorded_ns"] for r in d["ranks"])
    text = c.summary()
    assert "0 differences" in text
    assert "KS D" in text
    assert "per rank" in text


def test_a_wider_dp_shows_in_the_collectives(store: Store) -> None:
    """The dp-4 emulation against the dp-2 recording: every class's gradient all-reduces run
    over 4 ranks instead of 2; nothing else differs."""
    st = compare_structure(store, run_side(store, "e16"), run_side(store, "sample"), 2)
    assert st.differences == {"collectives": 8, "p2p": 0, "ops": 0, "classes": 0}
    listed = " | ".join(t for k in st.classes for t in k.listed)
    assert "over 4 ranks (dp): predicted 1, recorded 0" in listed
    assert "over 2 ranks (dp): predicted 0, recorded 1" in listed


def test_a_hand_edited_prediction_shows_each_edit(store: Store) -> None:
    """A collective resized and an op deleted in the predicted run: two collective keys (the
    old size lost, the new one gained) and one op key differ, in that class only."""
    e8 = store.require_run("e8")
    with store.transaction() as con:
        ((group, seq),) = con.execute(
            "SELECT group_id, seq FROM collective WHERE run_id = ? AND rank = 4"
            " AND iteration = 2 AND kind = 'all_reduce' ORDER BY group_id, seq LIMIT 1",
            [e8],
        ).fetchall()
        con.execute(
            "UPDATE collective SET msg_bytes = msg_bytes + 8 WHERE run_id = ? AND rank = 4"
            " AND group_id = ? AND seq = ?",
            [e8, group, seq],
        )
        con.execute(
            "DELETE FROM event WHERE run_id = ? AND rank = 4 AND event_id = (SELECT max(event_id)"
            " FROM event WHERE run_id = ? AND rank = 4 AND iteration = 2"
            " AND category = 'cpu_op' AND name = 'aten::linear')",
            [e8, e8],
        )
    st = compare_runs(store, "e8", "sample").structure
    assert st.differences == {"collectives": 2, "p2p": 0, "ops": 1, "classes": 0}
    (edited,) = [k for k in st.classes if sum(k.differences.values())]
    assert edited.label == "pp=1,tp=0"
    assert edited.counts["ops"][0] == edited.counts["ops"][1] - 1
    assert any("op aten::linear (cpu_op): predicted 27, recorded 28" in t for t in edited.listed)


def test_what_cannot_be_compared_is_refused(store: Store) -> None:
    with pytest.raises(PrismError, match="16 ranks and the recording 'sample' 8"):
        compare_runs(store, "e16", "sample")
    with pytest.raises(PrismError, match="sliced and holds no timing"):
        compare_runs(store, "s_own", "sample")
    with pytest.raises(PrismError, match="a prediction is compared with a recording"):
        compare_runs(store, "sample", "e8")
    with pytest.raises(PrismError, match="--replayed takes a replayed run"):
        compare_replayed(store, "e8", "sample")

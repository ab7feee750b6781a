"""The replay's per-op call cost outside the profiled span (``replay.call_overhead``)."""

from __future__ import annotations

from itertools import pairwise

import pytest

torch = pytest.importorskip("torch")

from prism_trace.replay.hybrid.call_overhead import call_overhead, expected_events  # noqa: E402
from prism_trace.replay.hybrid.options import KernelReplayOptions  # noqa: E402
from prism_trace.replay.hybrid.replay import replay_run  # noqa: E402
from prism_trace.replay.kernels.rebuild import build_program  # noqa: E402
from prism_trace.replay.kernels.units import select_units  # noqa: E402

# Slow: replays real kernels; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def program(sample_store: object) -> object:
    from prism_trace.graph.build import build_graph

    con = sample_store.con  # type: ignore[attr-defined]
    if not con.execute("SELECT count(*) FROM graph_node").fetchall()[0][0]:
        build_graph(sample_store, "sample")  # type: ignore[arg-type]
    ops = con.sql(
        "SELECT o.*, e.iteration FROM et_op o LEFT JOIN event e USING (run_id, rank, event_id)"
        " WHERE o.rank = 0"
    ).pl()
    comm = [
        e
        for (e,) in con.execute(
            "SELECT event_id FROM graph_node WHERE rank = 0 AND kind IN"
            " ('collective', 'send', 'recv')"
        ).fetchall()
    ]
    units, skipped = select_units(ops, comm)
    return build_program(units, ops, device=lambda _: torch.device("cpu"), skipped=skipped)


def test_expected_events_name_every_op_once(program: object) -> None:
    ev = expected_events(program)  # type: ignore[arg-type]
    ops = [(k, name) for k, name in ev if k is not None]
    calls = program.calls  # type: ignore[attr-defined]
    assert [k for k, _ in ops] == sorted(calls)
    units = program.units  # type: ignore[attr-defined]
    assert all(name == units[k].name for k, name in ops)
    # Views rebuilt before an op and buffers of nested storages after it are events of their own.
    extra = [name for k, name in ev if k is None]
    assert set(extra) <= {"aten::as_strided", "aten::empty_strided"}
    assert len(extra) == sum(len(c.aliases) for c in calls.values()) + sum(
        len(v)
        for v in program.nested_outputs.values()  # type: ignore[attr-defined]
    )


def test_matching_survives_extra_and_missing_events(program: object) -> None:
    """Events the pass does not predict (real communication, hooks) are passed over; an op whose
    event is missing leaves its unit at 0 and no other unit takes a neighbour's event, even where
    ops of the same name follow each other."""
    ev = expected_events(program)  # type: ignore[arg-type]
    units = program.units  # type: ignore[attr-defined]
    calls = program.calls  # type: ignore[attr-defined]
    clock = 7_000_000_000  # the profiler's clock minus perf_counter_ns
    T = [0] * (2 * len(units))
    spans: list[tuple[str, int, int]] = []
    ops = [k for k, _ in ev if k is not None]
    # Drop the first op of a run of two same-named ops (the hard case for matching by name).
    missing = next(a for a, b in pairwise(ops[40:]) if units[a].name == units[b].name)
    t = 0
    for i, (k, name) in enumerate(ev):
        if i % 7 == 0:
            spans.append(("c10d::allreduce_", clock + t, 3_000))  # not predicted
            t += 4_000
        if k is None:
            spans.append((name, clock + t, 500))
            t += 1_000
            continue
        # Ops 12 µs long, 10 µs apart (the instrumentation's callbacks between them).
        T[2 * k], T[2 * k + 1] = t, t + 12_000 + k % 5  # window = span + (k % 5) ns
        if k != missing:
            spans.append((name, clock + t + k % 5, 12_000))
        t += 22_000
    got = call_overhead(program, [T], [spans])  # type: ignore[arg-type]
    assert got.units == len(calls)
    assert got.matched == got.units - 1
    want = [k % 5 if k in calls and k != missing else 0 for k in range(len(units))]
    assert got.per_unit.tolist() == want


def test_profiled_replay_spends_the_gaps_less_its_call_cost(sample_store: object) -> None:
    """Under the recording's instrumentation every op of the sample's rank 0 is found in both
    calibration passes, each call costs something outside its span, and the replay spends that
    much less of the recorded gaps."""
    opts = KernelReplayOptions(iterations=1, warmup=0, threads=1, instrument="profiler")
    rep = replay_run(sample_store, run="sample", ranks=[0], out_run="rp-prof", options=opts)  # type: ignore[arg-type]
    plain = replay_run(
        sample_store,  # type: ignore[arg-type]
        run="sample",
        ranks=[0],
        out_run="rp-prof-plain",
        options=KernelReplayOptions(
            iterations=1, warmup=0, threads=1, instrument="profiler", call_overhead=False
        ),
    )
    r, p = rep.ranks[0], plain.ranks[0]
    assert r.call_overhead["units"] == r.support["supported"] == 1110
    assert r.call_overhead["matched_units"] == 1110
    assert r.call_overhead["ns_per_pass"] > 0  # the observer's callbacks (how much: a benchmark)
    assert p.call_overhead == {}
    assert p.gap_ns - r.call_overhead["ns_per_pass"] <= r.gap_ns < p.gap_ns

"""Each rule of the op-timeline dependency model, on one hand-written rank."""

from __future__ import annotations

import polars as pl

from prism_trace.graph.deps_op_timeline import op_timeline_edges


def _nodes(ops: list[tuple[str, int, int]], *, step: int = 1, first_id: int = 0) -> pl.DataFrame:
    """``(name, ts, dur)`` rows of rank 0 → graph nodes numbered in the given order."""
    return pl.DataFrame(
        {
            "rank": [0] * len(ops),
            "node_id": list(range(first_id, first_id + len(ops))),
            "name": [o[0] for o in ops],
            "ts": [o[1] for o in ops],
            "dur": [o[2] for o in ops],
            "iteration": [step] * len(ops),
            "mc": [0] * len(ops),
        }
    )


def _edges(nodes: pl.DataFrame) -> dict[tuple[int, int], tuple[str, int]]:
    e = op_timeline_edges(nodes)
    assert set(e["anchor"].to_list()) <= {"end"}
    return {(s, d): (k, dl) for s, d, k, dl in e.select("src", "dst", "kind", "delay").iter_rows()}


def test_1f1b_stage_compute_p2p_and_post_chain() -> None:
    # Stage 0 of pp = 2 with two microbatches (1F1B: one warm-up forward).
    n = _nodes(
        [
            ("forward-compute", 0, 10),  # 0 F0
            ("forward-send", 10, 1),  # 1
            ("forward-compute", 11, 10),  # 2 F1
            ("forward-send", 21, 9),  # 3 fused with 4
            ("backward-recv", 21, 9),  # 4
            ("backward-compute", 30, 20),  # 5 B0
            ("backward-recv", 50, 10),  # 6
            ("backward-compute", 60, 20),  # 7 B1
            ("gc", 80, 0),  # 8
            ("optimizer-clip-main-grad", 80, 1),  # 9
            ("optimizer", 83, 8),  # 10: 2 ns of CPU time after the clip
        ]
    )
    assert _edges(n) == {
        # compute stream
        (0, 2): ("program", 1),  # F1 also follows nothing else: its own delay is the send's 1
        (2, 5): ("program", 0),
        (5, 7): ("program", 0),
        # p2p streams
        (1, 3): ("stream", 0),
        (4, 6): ("stream", 0),
        # the k-th send after the k-th forward; the k-th receive feeds the k-th backward and is
        # posted after the backward before it; the first backward-recv after the forward two
        # computes before the first backward (F0)
        (0, 1): ("data", 0),
        (2, 3): ("data", 0),
        (4, 5): ("data", 0),
        (6, 7): ("data", 0),
        (5, 6): ("data", 0),
        (0, 4): ("data", 11),
        # post-backward chain: gc after the last compute, clip after gc, optimizer after clip
        (7, 8): ("program", 0),
        (8, 9): ("program", 0),
        (9, 10): ("program", 2),
    }


def test_overlapped_dp_and_model_chunks() -> None:
    n = _nodes(
        [
            ("params-all-gather", 0, 1),  # 0
            ("forward-compute", 1, 10),  # 1
            ("backward-compute", 11, 20),  # 2
            ("grads-reduce-scatter", 31, 9),  # 3
            ("gc", 31, 0),  # 4
            ("separate-grads-all-reduce", 40, 5),  # 5
            ("optimizer-clip-main-grad", 45, 1),  # 6
            ("optimizer", 46, 8),  # 7
        ]
    )
    e = _edges(n)
    assert e[(0, 1)] == ("data", 0)  # the chunk's all-gather before its first forward
    # the data-parallel stream; the delay is against the latest of all dependencies (the backward)
    assert e[(0, 3)] == ("stream", 0)
    assert e[(2, 3)] == ("data", 0)  # overlapped DP: reduce-scatter after the chunk's last backward
    assert e[(3, 5)] == ("program", 0)  # the separate all-reduce after the last reduce-scatter
    assert e[(4, 5)] == ("program", 0)  # ... and after gc (delay against the later of the two)
    assert (5, 6) in e
    assert (6, 7) in e
    assert (4, 3) not in e  # with overlap, the reduce-scatter is not in the post chain


def test_non_overlapped_dp_puts_reduce_scatter_in_the_chain() -> None:
    n = _nodes(
        [
            ("params-all-gather", 0, 1),  # 0
            ("forward-compute", 1, 10),  # 1
            ("backward-compute", 11, 20),  # 2
            ("layernorm-grads-all-reduce", 31, 1),  # 3
            ("embedding-grads-all-reduce", 32, 3),  # 4
            ("grads-reduce-scatter", 35, 5),  # 5
            ("optimizer-clip-main-grad", 40, 1),  # 6
            ("optimizer", 41, 8),  # 7
        ]
    )
    e = _edges(n)
    # no gc: the chain hangs off the last compute
    assert [(s, d) for (s, d), (k, _) in sorted(e.items()) if k == "program"] == [
        (1, 2),
        (2, 3),
        (3, 4),
        (4, 5),
        (5, 6),
        (6, 7),
    ]
    assert e[(0, 5)] == ("stream", 0)


def test_steps_and_unknown_ops() -> None:
    one = _nodes([("forward-compute", 0, 10), ("data-loader", 12, 3), ("optimizer", 15, 5)])
    two = _nodes([("forward-compute", 25, 10), ("optimizer", 35, 5)], step=2, first_id=3)
    e = _edges(pl.concat([one, two]))
    assert e == {
        (0, 1): ("program", 2),  # an unknown op follows the rank's previous op; nothing waits on it
        (0, 2): ("program", 5),  # the optimizer (the post chain) after the last compute
        (2, 3): ("program", 5),  # step 2's first op after step 1's op that ended last
        (3, 4): ("program", 0),
    }

"""Slicing at a fixed global batch: the target's microbatches per rank, whole microbatches of the
recorded schedule repeated or dropped (``prism_trace.slicing.schedule``, ``rebatch``, ``batch``).

Hand-made jobs are built from the generator's own schedules (``datasets._schedule``: 1F1B by
stage parity, GPipe), so a sliced class graph can be compared with the graph of the same job
recorded at the target's dp: same ops, same send/recv and collectives, same sequence numbers, in
the same program order. The op names here are made up; nothing may key on them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from prism_trace.datasets._interleaved import stage_plan
from prism_trace.datasets._schedule import schedule

from prism_trace.layout.mesh import ParallelLayout
from prism_trace.slicing.batch import target_microbatches
from prism_trace.slicing.plan import SliceError
from prism_trace.slicing.slicer import slice_run
from prism_trace.store.connection import Store, open_store
from tests.conftest import store_contents

# --- hand-made jobs -------------------------------------------------------------------------------


def _ops(action: str, stage: int, stages: int) -> list[str]:
    """Made-up compute ops of one action of a stage."""
    if action == "fwd":
        return (
            (["tok_embed"] if stage == 0 else [])
            + ["blk_f", "blk_f"]
            + (["head_f", "xent"] if stage == stages - 1 else [])
        )
    return (
        (["xent_grad", "head_b"] if stage == stages - 1 else [])
        + ["blk_b", "blk_b"]
        + (["tok_embed_b"] if stage == 0 else [])
    )


def _peer_stage(action: str, stage: int, stages: int) -> int:
    """The stage a send/recv goes to: the next one for a forward's output and a backward's
    input, else the previous; across the wrap-around of interleaved 1F1B's virtual pipeline
    (the last stage's chunk feeds the first stage's next chunk) at the ends."""
    nxt = action in ("send_fwd", "recv_bwd")
    return (stage + 1) % stages if nxt else (stage - 1) % stages


def _rank_nodes(
    kind: str,
    stage: int,
    stages: int,
    dp: int,
    d: int,
    m: int,
    steps: int,
    ddp: bool,
    chunks: int = 1,
) -> list:
    """``(node_id, kind, name, iteration, group_id, seq, peer, comm_kind)`` of one rank.

    Groups: ``dp`` groups ``0..stages-1`` (one per stage), ``pp`` groups ``stages..`` (one per
    dp index). A rank is ``d + dp * stage``. ``ddp``: a gradient bucket is all-reduced inside the
    last backward of each step, as DDP does. ``chunks`` (interleaved): chunk ``c`` of the stage
    is virtual stage ``c * stages + s``, with its ops.
    """
    pp_group = stages + d
    seqs: Counter[tuple] = Counter()
    out = []

    def add(k: str, name: str, step: int, group=None, peer=None, ck=None) -> None:
        seq = None
        if k in ("send", "recv", "collective"):
            key = (group, peer, k)
            seq = seqs[key]
            seqs[key] += 1
            name = f"{name} seq={seq}"  # names that change per call, as in real annotations
        out.append((len(out), k, name, step, group, seq, peer, ck))

    for step in range(1, steps + 1):
        add("host", "zero_grad", step)
        plan = stage_plan(kind, stage=stage, stages=stages, microbatches=m, chunks=chunks)  # type: ignore[arg-type]
        last_bwd = max(i for i, a in enumerate(plan) if a.kind == "bwd")
        for i, a in enumerate(plan):
            if a.kind in ("fwd", "bwd"):
                virtual = a.chunk * stages + stage
                for j, name in enumerate(_ops(a.kind, virtual, stages * chunks)):
                    add("host", name, step)
                    if ddp and i == last_bwd and j == 2:
                        add("collective", "bucket", step, stage, None, "all_reduce")
            else:
                peer = d + dp * _peer_stage(a.kind, stage, stages)
                direction = "send" if a.kind.startswith("send") else "recv"
                if direction == "recv":
                    add("host", "buffer", step)
                add(direction, f"p2p {direction}", step, pp_group, peer, direction)
        add("collective", "grad_sync", step, stage, None, "all_reduce")
        add("host", "opt_step", step)
    return out


def job(
    path: Path,
    kind: str,
    *,
    dp: int,
    pp: int,
    m: int,
    steps: int = 2,
    ddp: bool = False,
    chunks: int = 1,
) -> Store:
    """A recorded run ``job`` of ``dp * pp`` ranks, every step ``kind`` with ``m`` microbatches
    (``chunks`` model chunks per stage for ``interleaved``)."""
    s = open_store(path)
    world = dp * pp
    with s.transaction() as con:
        con.execute(
            "INSERT INTO run (run_id, name, kind, world_size) VALUES (1, 'job', 'recorded', ?)",
            [world],
        )
        con.executemany(
            "INSERT INTO rank (run_id, rank) VALUES (1, ?)", [[r] for r in range(world)]
        )
        groups = [(st, "dp", [d + dp * st for d in range(dp)]) for st in range(pp)]
        groups += [(pp + d, "pp", [d + dp * st for st in range(pp)]) for d in range(dp)]
        con.executemany(
            "INSERT INTO comm_group (run_id, group_id, name, description, size, ranks)"
            " VALUES (1, ?, ?, ?, ?, ?)",
            [[g, str(g), desc, len(r), r] for g, desc, r in groups],
        )
        rows = []
        for st in range(pp):
            for d in range(dp):
                r = d + dp * st
                for n, k, name, it, g, seq, peer, ck in _rank_nodes(
                    kind, st, pp, dp, d, m, steps, ddp, chunks
                ):
                    nb = 4096 if k in ("send", "recv") else 65536 if k == "collective" else None
                    rows.append([r, n, k, 1000 + n, name, 100 * n, 90, it, g, seq, peer, nb, ck])
        con.executemany(
            "INSERT INTO graph_node (run_id, rank, node_id, kind, track_id, event_id, name, ts,"
            " dur, iteration, group_id, seq, peer, msg_bytes, comm_kind)"
            " VALUES (1, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        con.execute(
            "INSERT INTO graph_edge SELECT 1, a.rank, a.node_id, b.node_id, 'program', 'end', 10"
            " FROM graph_node a JOIN graph_node b ON a.run_id = b.run_id AND a.rank = b.rank"
            " AND b.node_id = a.node_id + 1 WHERE a.run_id = 1"
        )
    return s


# --- the comparison helper (also used on real recordings) ---------------------------------------


def program_order(store: Store, run: str, rank: int) -> dict[int | None, list[tuple]]:
    """Per step, one rank's nodes along its ``program`` edges (track by track): what each does,
    never its name for a communication op (names carry sequence numbers and group ids), but its
    kind, size, group axis, peer and sequence number."""
    run_id = store.require_run(run)
    rows = store.con.execute(
        "SELECT n.node_id, n.iteration, n.track_id, n.kind,"
        " CASE WHEN n.kind IN ('send', 'recv', 'collective') THEN NULL ELSE n.name END,"
        " n.comm_kind, n.msg_bytes, g.axis, n.peer, n.seq"
        " FROM graph_node n LEFT JOIN comm_group g USING (run_id, group_id)"
        " WHERE n.run_id = ? AND n.rank = ?",
        [run_id, rank],
    ).fetchall()
    nodes = {r[0]: r[1:] for r in rows}
    nxt: dict[int, int] = {}
    for src, dst in store.con.execute(
        "SELECT src, dst FROM graph_edge WHERE run_id = ? AND rank = ? AND kind = 'program'",
        [run_id, rank],
    ).fetchall():
        assert src not in nxt, f"node {src} has two program successors"
        nxt[src] = dst
    heads = sorted(set(nodes) - set(nxt.values()), key=lambda n: (nodes[n][1], n))
    out: dict[int | None, list[tuple]] = {}
    seen = 0
    for head in heads:
        n: int | None = head
        while n is not None:
            it, *what = nodes[n]
            out.setdefault(it, []).append(tuple(what))
            seen += 1
            n = nxt.get(n)
    assert seen == len(nodes), "program edges do not chain every node once"
    return out


def assert_same_classes(store: Store, sliced: str, recorded: str, pairs: dict[int, int]) -> None:
    """Each class exemplar of ``sliced`` runs what the recorded rank it maps to runs, step by
    step (``pairs``: exemplar -> rank of the target-scale recording with the same role)."""
    for ex, rank in pairs.items():
        got, want = program_order(store, sliced, ex), program_order(store, recorded, rank)
        assert got.keys() == want.keys()
        for it in want:
            assert got[it] == want[it], f"exemplar {ex} vs recorded rank {rank}, step {it}"


def stage_shape(store: Store, run: str, rank: int) -> list[str]:
    """A rank's compute per step as ``F``/``B`` units (made-up op names of this module)."""
    out = []
    for ops in program_order(store, run, rank).values():
        names = [name for _, _, name, *_ in ops]
        units = [
            "F" if name == "blk_f" else "B"
            for prev, name in zip([None, *names], names, strict=False)
            if name in ("blk_f", "blk_b") and prev != name
        ]
        out.append("".join(units))
    return out


def _slice(store: Store, dp: int, pp: int, name: str, **kw: object) -> dict:
    layout = ParallelLayout.parse(f"dp={dp},pp={pp}")
    report = slice_run(store, run="job", layout=layout, world=dp * pp, out_run=name, **kw)
    ((cfg,),) = store.con.execute(
        "SELECT config_json FROM run WHERE run_id = ?", [report.run_id]
    ).fetchall()
    return json.loads(cfg)


def _copy_job(tmp_path: Path, store: Store, target: Path) -> None:
    """Add the recorded job of the target's dp to ``store`` as run ``target_job``."""
    other = open_store(target)
    rows = {
        t: other.con.execute(f"SELECT * FROM {t} WHERE run_id = 1").fetchall()
        for t in ("comm_group", "rank", "graph_node", "graph_edge")
    }
    ((world,),) = other.con.execute("SELECT world_size FROM run WHERE run_id = 1").fetchall()
    other.close()
    with store.transaction() as con:
        con.execute(
            "INSERT INTO run (run_id, name, kind, world_size) VALUES (99, 'target_job',"
            " 'recorded', ?)",
            [world],
        )
        for t, rs in rows.items():
            if rs:
                marks = ", ".join("?" * len(rs[0]))
                con.executemany(f"INSERT INTO {t} VALUES ({marks})", [[99, *r[1:]] for r in rs])
    assign_axes(store, "target_job")


def assign_axes(store: Store, run: str) -> None:
    """Write the recorded run's group axes (slicing does it for the runs it slices)."""
    from prism_trace.layout.assign import write_axes
    from prism_trace.layout.choice import infer_layout

    with store.transaction() as con:
        write_axes(con, store.require_run(run), infer_layout(store, run), run=run)


# --- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "pp", "dp", "m", "dp_new"),
    [
        ("1f1b", 3, 2, 8, 4),  # 8 -> 4 microbatches: halved
        ("1f1b", 3, 4, 4, 2),  # 4 -> 8: doubled
        ("1f1b", 2, 2, 4, 4),  # 4 -> 2: one steady pair left on stage 0
        ("1f1b", 2, 4, 2, 2),  # 2 -> 4 from one steady pair
        ("gpipe", 2, 2, 4, 4),
        ("gpipe", 3, 4, 3, 2),
        ("1f1b", 1, 2, 4, 4),  # no pipeline: gradient accumulation
        ("1f1b", 1, 4, 2, 8),  # 2 -> 1
    ],
)
def test_fixed_global_batch_matches_the_job_at_the_target(
    tmp_path: Path, kind: str, pp: int, dp: int, m: int, dp_new: int
) -> None:
    """The sliced class graphs are the graphs of the job recorded at the target's dp with
    ``m * dp / dp_new`` microbatches: every stage keeps its warm-up forwards, steady pairs and
    cool-down, and neighbouring stages' send/recv pair up (same counts and sequence numbers)."""
    store = job(tmp_path / "a.duckdb", kind, dp=dp, pp=pp, m=m)
    m_new = m * dp // dp_new
    cfg = _slice(store, dp_new, pp, "s", global_batch="fixed")
    assert cfg["global_batch"] == "fixed"
    assert cfg["microbatches"] == {"recorded": m, "target": m_new, "schedule": kind}
    job(tmp_path / "b.duckdb", kind, dp=dp_new, pp=pp, m=m_new).close()
    _copy_job(tmp_path, store, tmp_path / "b.duckdb")
    assert_same_classes(store, "s", "target_job", {dp_new * s: dp_new * s for s in range(pp)})
    for s in range(pp):
        want = "".join(
            "F" if a.kind == "fwd" else "B"
            for a in schedule(kind, stage=s, stages=pp, microbatches=m_new)  # type: ignore[arg-type]
            if a.kind in ("fwd", "bwd")
        )
        assert stage_shape(store, "s", dp_new * s) == [want, want]


@pytest.mark.parametrize(
    ("pp", "chunks", "dp", "m", "dp_new"),
    [
        (2, 2, 2, 8, 4),  # 8 -> 4: two of three periods dropped on stage 0
        (2, 2, 2, 8, 1),  # 8 -> 16
        (2, 3, 2, 8, 4),  # three chunks
        (3, 2, 2, 18, 4),  # the wrap-around is no neighbour: no marker
        (3, 3, 2, 18, 4),
        (4, 2, 3, 16, 4),  # 16 -> 12: one period of 4 microbatches left on stage 0
    ],
)
def test_fixed_global_batch_of_interleaved_1f1b(
    tmp_path: Path, pp: int, chunks: int, dp: int, m: int, dp_new: int
) -> None:
    """Interleaved 1F1B (Megatron's virtual pipeline stages, with the wrap-around from the last
    stage to the first): at a fixed global batch the sliced graphs are those of the job recorded
    at the target's dp, op for op, with the same send/recv and sequence numbers; the plan says
    how many chunks it found."""
    store = job(tmp_path / "a.duckdb", "interleaved", dp=dp, pp=pp, m=m, chunks=chunks)
    m_new = m * dp // dp_new
    layout = ParallelLayout.parse(f"dp={dp_new},pp={pp}")
    report = slice_run(
        store, run="job", layout=layout, world=dp_new * pp, out_run="s", global_batch="fixed"
    )
    assert (
        f"microbatches per rank and step: {m} -> {m_new} (interleaved of {chunks} chunks a"
        " stage, global batch fixed)"
    ) in report.summary()
    ((text,),) = store.con.execute(
        "SELECT config_json FROM run WHERE run_id = ?", [report.run_id]
    ).fetchall()
    cfg = json.loads(text)
    assert cfg["microbatches"] == {
        "recorded": m,
        "target": m_new,
        "schedule": "interleaved",
        "chunks": chunks,
    }
    target = tmp_path / "b.duckdb"
    job(target, "interleaved", dp=dp_new, pp=pp, m=m_new, chunks=chunks).close()
    _copy_job(tmp_path, store, target)
    assert_same_classes(store, "s", "target_job", {dp_new * s: dp_new * s for s in range(pp)})


@pytest.mark.parametrize(
    ("pp", "chunks", "dp", "m", "dp_new", "said"),
    [
        (2, 2, 2, 8, 8, "8 -> 2 microbatches per rank: interleaved 1F1B on 2 pipeline stages"),
        (4, 2, 2, 8, 1, "no period of 4 microbatches seen repeating"),  # 3/4 of a period
        # 16 -> 8: stage 0's steady state (6 pairs) holds no whole period of 8 pairs
        (4, 2, 2, 16, 4, "a period: 4 microbatches through its 2 chunks"),
    ],
)
def test_interleaved_refusals(
    tmp_path: Path, pp: int, chunks: int, dp: int, m: int, dp_new: int, said: str
) -> None:
    """A target below ``2 pp`` microbatches (Megatron then runs every forward first), and a
    recording whose steady state holds fewer than two periods to tell them by: one line each,
    the store as it was."""
    store = job(tmp_path / "a.duckdb", "interleaved", dp=dp, pp=pp, m=m, chunks=chunks)
    before = store_contents(store)
    with pytest.raises(SliceError) as exc:
        _slice(store, dp_new, pp, "s", global_batch="fixed")
    assert said in str(exc.value)
    assert "\n" not in str(exc.value)
    assert store_contents(store) == before


def test_neighbouring_stages_pair_up_in_the_emulator(tmp_path: Path) -> None:
    """A sliced 1F1B pipeline of three stages, halved and doubled, emulates: every send finds its
    receive (the emulator refuses a graph whose pairs do not match)."""
    from prism_trace.replay.emulate.driver import emulate_run

    store = job(tmp_path / "a.duckdb", "1f1b", dp=2, pp=3, m=8)
    for dp_new, name in ((4, "half"), (1, "double")):
        _slice(store, dp_new, 3, name, global_batch="fixed")
        report = emulate_run(store, run=name, out_run=f"e_{name}")
        assert report.world_size == 3 * dp_new
        sid = store.require_run(name)
        sends = store.con.execute(
            "SELECT rank, peer, count(*), min(seq), max(seq) FROM graph_node WHERE run_id = ?"
            " AND kind = 'send' GROUP BY ALL ORDER BY ALL",
            [sid],
        ).fetchall()
        recvs = store.con.execute(
            "SELECT peer, rank, count(*), min(seq), max(seq) FROM graph_node WHERE run_id = ?"
            " AND kind = 'recv' GROUP BY ALL ORDER BY ALL",
            [sid],
        ).fetchall()
        assert sorted(sends) == sorted(recvs)
        assert {n for *_, n, _, _ in sends} == {2 * 8 * 2 // dp_new}  # steps x microbatches


def test_the_dp_what_if_keeps_a_fixed_global_batch(tmp_path: Path) -> None:
    """``--what-if dp=N`` on a fixed-batch slice re-slices with the batch fixed: 8 microbatches
    at dp 2 -> 4 at dp 4 (the slice) -> 16 at dp 1 (the what-if), 2 steps of 16 sends."""
    from prism_trace.replay.emulate.config import EmulationConfig
    from prism_trace.replay.emulate.driver import emulate_run
    from prism_trace.replay.whatif.config import WhatIfConfig

    store = job(tmp_path / "a.duckdb", "1f1b", dp=2, pp=2, m=8)
    _slice(store, 4, 2, "s", global_batch="fixed")
    config = EmulationConfig(what_if=WhatIfConfig(dp=1))
    report = emulate_run(store, run="s", out_run="e", config=config)
    assert report.world_size == 2
    ((sends,),) = store.con.execute(
        "SELECT count(*) FROM p2p WHERE run_id = ? AND rank = 0 AND direction = 'send'",
        [store.require_run("e")],
    ).fetchall()
    assert sends == 2 * 16


def test_per_rank_is_the_default_and_keeps_the_graphs(tmp_path: Path) -> None:
    """Each rank keeps its recorded microbatches: the job at twice the dp with as many."""
    store = job(tmp_path / "a.duckdb", "1f1b", dp=2, pp=2, m=4)
    cfg = _slice(store, 4, 2, "s")
    assert cfg["global_batch"] == "per-rank"
    assert "microbatches" not in cfg
    job(tmp_path / "b.duckdb", "1f1b", dp=4, pp=2, m=4).close()
    _copy_job(tmp_path, store, tmp_path / "b.duckdb")
    assert_same_classes(store, "s", "target_job", {0: 0, 4: 4})


def test_explicit_microbatches(tmp_path: Path) -> None:
    store = job(tmp_path / "a.duckdb", "1f1b", dp=2, pp=2, m=4)
    cfg = _slice(store, 2, 2, "s", microbatches=6)
    assert cfg["microbatches"] == {"recorded": 4, "target": 6, "schedule": "1f1b"}
    assert stage_shape(store, "s", 0) == ["F" + "FB" * 5 + "B"] * 2


@pytest.mark.parametrize(
    ("kw", "dp_new", "fragment"),
    [
        (
            {"global_batch": "fixed"},
            3,
            "--global-batch fixed: the recording runs 4 microbatches per rank at dp=2; at dp=3"
            " that is 4 * 2 / 3 = 2.66667 per rank, not a whole number >= 1",
        ),
        (
            {"global_batch": "fixed"},
            16,
            "at dp=16 that is 4 * 2 / 16 = 0.5 per rank, not a whole number >= 1",
        ),
        (
            {"microbatches": 1},
            2,
            "4 -> 1 microbatches per rank: 1F1B on 2 pipeline stages needs at least 2 per rank"
            " to keep its warm-up and one forward/backward pair",
        ),
        ({"global_batch": "fixed", "microbatches": 2}, 2, "give one of them"),
        ({"global_batch": "half"}, 2, "--global-batch 'half': expected one of per-rank, fixed"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(
    tmp_path: Path, kw: dict, dp_new: int, fragment: str
) -> None:
    store = job(tmp_path / "a.duckdb", "1f1b", dp=2, pp=2, m=4)
    before = store_contents(store)
    with pytest.raises(SliceError) as exc:
        _slice(store, dp_new, 2, "s", **kw)
    assert fragment in str(exc.value)
    assert "\n" not in str(exc.value)
    assert store_contents(store) == before


def test_cli(tmp_path: Path) -> None:
    """``prism slice --global-batch fixed`` prints the change; a refusal is one line."""
    from click.testing import CliRunner

    from prism_trace.cli import main

    job(tmp_path / "a.duckdb", "1f1b", dp=2, pp=2, m=4).close()
    base = ["slice", str(tmp_path / "a.duckdb"), "--run", "job", "--out-run", "s"]
    res = CliRunner().invoke(
        main, [*base, "--layout", "dp=4,pp=2", "--world", "8", "--global-batch", "fixed"]
    )
    assert res.exit_code == 0, res.output
    assert "microbatches per rank and step: 4 -> 2 (1f1b, global batch fixed)" in res.output
    res = CliRunner().invoke(
        main,
        [*base, "--replace", "--layout", "dp=3,pp=2", "--world", "6", "--global-batch", "fixed"],
    )
    assert res.exit_code != 0
    assert res.output.count("\n") == 1
    assert "4 * 2 / 3 = 2.66667 per rank, not a whole number >= 1" in res.output


def test_an_unrecognised_schedule_is_refused(tmp_path: Path) -> None:
    """A stage whose backward units do not follow its forwards as 1F1B or GPipe would (here the
    last stage runs two forwards, then alternates): refused in one line naming the rank."""
    store = job(tmp_path / "a.duckdb", "1f1b", dp=2, pp=2, m=4)
    with store.transaction() as con:  # stage 1: swap its second backward and third forward
        rows = con.execute(
            "SELECT node_id, name FROM graph_node WHERE run_id = 1 AND rank = 2 AND iteration = 1"
            " ORDER BY node_id"
        ).fetchall()
        names = [n for _, n in rows]
        f = [i for i, n in enumerate(names) if n == "blk_f"]
        b = [i for i, n in enumerate(names) if n == "blk_b"]
        swap = {f[4]: "blk_b", f[5]: "blk_b", b[2]: "blk_f", b[3]: "blk_f"}
        for i, name in swap.items():
            con.execute(
                "UPDATE graph_node SET name = ? WHERE run_id = 1 AND rank = 2 AND node_id = ?",
                [name, rows[i][0]],
            )
    before = store_contents(store)
    with pytest.raises(SliceError) as exc:
        _slice(store, 4, 2, "s", global_batch="fixed")
    msg = str(exc.value)
    assert msg.startswith("recorded rank 2, step 1: schedule not recognised: stage 1 of 2, 4")
    assert "\n" not in msg
    assert store_contents(store) == before


def test_ddp_last_microbatch_counts(tmp_path: Path) -> None:
    """Without a pipeline, a last backward that also reduces gradients (DDP) is still a
    microbatch: 4 recorded, 2 at twice the dp, the bucket's all-reduce kept in the last one."""
    store = job(tmp_path / "a.duckdb", "1f1b", dp=2, pp=1, m=4, ddp=True)
    cfg = _slice(store, 4, 1, "s", global_batch="fixed")
    assert cfg["microbatches"]["recorded"] == 4
    job(tmp_path / "b.duckdb", "1f1b", dp=4, pp=1, m=2, ddp=True).close()
    _copy_job(tmp_path, store, tmp_path / "b.duckdb")
    assert_same_classes(store, "s", "target_job", {0: 0})


def test_target_microbatches() -> None:
    assert target_microbatches(8, 2, 4) == 4
    assert target_microbatches(4, 4, 2) == 8
    assert target_microbatches(3, 4, 6) == 2
    with pytest.raises(SliceError):
        target_microbatches(3, 2, 4)


def _compute_order(store: Store, run: str, rank: int, step: int) -> str:
    """``F``/``B`` of a rank's emulated compute in one step, in time order."""
    rows = store.con.execute(
        "SELECT name FROM event WHERE run_id = ? AND rank = ? AND iteration = ?"
        " AND (name LIKE 'forward%compute' OR name LIKE 'backward%compute') ORDER BY ts",
        [store.require_run(run), rank, step],
    ).fetchall()
    return "".join("F" if n.startswith("forward") else "B" for (n,) in rows)


@pytest.mark.shared_data
def test_op_timeline_st_to_dp1_doubles_the_microbatches(real_store: Store) -> None:
    """Megatron's ST op timeline (dp 2, pp 4, 4 microbatches; compute, send/recv and collectives
    on separate streams): at dp 1 and a fixed global batch every stage runs 8, Megatron's 1F1B
    shape, and the emulator pairs every send."""
    from prism_trace.replay.emulate.driver import emulate_run

    layout = ParallelLayout.parse("dp=1,pp=4")
    report = slice_run(
        real_store, run="st", layout=layout, world=4, out_run="st_gb1", global_batch="fixed"
    )
    assert report.microbatches["microbatches"] == {"recorded": 4, "target": 8, "schedule": "1f1b"}
    emulate_run(real_store, run="st_gb1", out_run="st_gb1_e")
    ((step,),) = real_store.con.execute(
        "SELECT min(iteration) FROM event WHERE run_id = ?", [real_store.require_run("st_gb1_e")]
    ).fetchall()
    for stage in range(4):
        a = 3 - stage
        want = "F" * a + "FB" * (8 - a) + "B" * a
        assert _compute_order(real_store, "st_gb1_e", stage, step) == want
    with pytest.raises(SliceError, match="1F1B on 4 pipeline stages needs at least 4 per rank"):
        slice_run(
            real_store,
            run="st",
            layout=ParallelLayout.parse("dp=4,pp=4"),
            world=16,
            out_run="st_gb4",
            global_batch="fixed",
        )


def test_sample_with_tp_collectives_inside_microbatches(sample_store: Store) -> None:
    """The bundled gloo sample (tp 2, dp 2, pp 2, GPipe, 4 microbatches, TP all-reduces and the
    LM head's all-gather inside every microbatch, gloo's worker threads taking calls in turn):
    at dp 4 and a fixed global batch, 2 microbatches, and every TP collective still matches."""
    from prism_trace.replay.emulate.driver import emulate_run

    layout = ParallelLayout.parse("tp=2,dp=4,pp=2")
    report = slice_run(
        sample_store, run="sample", layout=layout, world=16, out_run="gb4", global_batch="fixed"
    )
    assert report.microbatches["microbatches"] == {"recorded": 4, "target": 2, "schedule": "gpipe"}
    emulate_run(sample_store, run="gb4", out_run="gb4_e")
    sid, rid = sample_store.require_run("gb4"), sample_store.require_run("sample")
    per_step = (
        "SELECT rank, iteration, kind, count(*) FROM graph_node WHERE run_id = ?"
        " AND kind IN ('send', 'recv') GROUP BY ALL ORDER BY ALL"
    )
    got = sample_store.con.execute(per_step, [sid]).fetchall()
    assert {n for *_, n in got} == {2}
    recorded = sample_store.con.execute(per_step, [rid]).fetchall()
    assert {n for *_, n in recorded} == {4}


# --- real recordings ------------------------------------------------------------------------------


def _step_bytes(store: Store, run: str, ranks: list[int]) -> list[int]:
    """Bytes allocated per rank and step (``memory``), for ``ranks``."""
    return [
        int(b)
        for (b,) in store.con.execute(
            "SELECT sum(bytes) FILTER (WHERE bytes > 0) FROM memory WHERE run_id = ?"
            " AND list_contains(?, rank) AND iteration IS NOT NULL GROUP BY rank, iteration",
            [store.require_run(run), ranks],
        ).fetchall()
    ]


def _ladder(tmp_path: Path, *extra: str) -> Store:
    """Record a 1F1B wait-mode ladder at dp 2 and 4, pp 2, a fixed global batch of 16 (dp 2: 4
    microbatches per rank, dp 4: 2), two steps; ingest each as ``dp2``/``dp4`` with its graph."""
    from prism_trace.graph.build import build_graph
    from prism_trace.ingestion.pipeline import ingest

    out = tmp_path / "ladder"
    args = ["--out", str(out), "--dp", "2,4", "--pp", "2", "--compute", "wait"]
    args += ["--schedule", "1f1b", "--global-batch", "16", "--steps", "2", "--layers", "4"]
    args += ["--wait-ms-per-layer", "1", "--no-et", *extra]
    cmd = [sys.executable, "-m", "prism_trace.datasets.ladder", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    store = open_store(tmp_path / "l.duckdb")
    for dp in (2, 4):
        (folder,) = out.glob(f"tp1-dp{dp}-pp2-*")
        ingest(store, [folder], run=f"dp{dp}", progress=False)
        build_graph(store, f"dp{dp}")
        assign_axes(store, f"dp{dp}")
    return store


def _slice_ladder(store: Store, src: str, dp_new: int) -> str:
    name = f"s{dp_new}"
    layout = ParallelLayout.parse(f"dp={dp_new},pp=2")
    report = slice_run(
        store, run=src, layout=layout, world=2 * dp_new, out_run=name, global_batch="fixed"
    )
    assert report.microbatches["microbatches"]["target"] == 16 // (2 * dp_new)
    return name


@pytest.mark.slow
@pytest.mark.torch
def test_ladder_dp2_and_dp4_slice_into_each_other(tmp_path: Path) -> None:
    """dp 2 sliced to dp 4 at a fixed global batch runs, class by class and step by step, the
    ops, collectives and send/recv of the dp 4 recording's ranks, and the other way round."""
    pytest.importorskip("torch")
    store = _ladder(tmp_path)
    for src, dp_new in (("dp2", 4), ("dp4", 2)):
        name = _slice_ladder(store, src, dp_new)
        assert_same_classes(store, name, f"dp{dp_new}", {0: 0, dp_new: dp_new})
    # `prism predict --global-batch fixed` makes the same graphs: no difference in a step's ops,
    # collectives (kind, bytes, group) or p2p against the recording; per-rank work would differ.
    from prism_trace import compare_runs, predict_run

    fixed = predict_run(store, run="dp2", against="dp4", compare=compare_runs, global_batch="fixed")
    assert fixed.comparison.structure.differences == {
        "collectives": 0,
        "p2p": 0,
        "ops": 0,
        "classes": 0,
    }
    per_rank = predict_run(store, run="dp2", against="dp4", compare=compare_runs)
    assert per_rank.comparison.structure.differences["ops"] > 0
    # The memory follows the dropped microbatches to the target's peak, also when the small
    # recording's graph is built inside the prediction's own transaction (the write stage reads
    # the memory through a second connection, which cannot see that graph: the load stage does).
    rec = store.require_run("dp2")
    with store.transaction() as con:
        for table in ("graph_edge", "graph_node"):
            con.execute(f"DELETE FROM {table} WHERE run_id = ?", [rec])
    predict_run(
        store,
        run="dp2",
        against="dp4",
        compare=compare_runs,
        global_batch="fixed",
        out_run="kept",
    )
    # What each rank allocates in each step is exact: every event of a dropped microbatch left
    # out. (The peak also depends on when gloo's worker thread lets go of a buffer, which a loaded
    # host moves from one recording to the next; bench_predict measures it on a quiet one.) The
    # emulated run holds its class exemplars' memory: ranks 0 (stage 0) and 4 (stage 1).
    for exemplar, stage in ((0, [0, 1, 2, 3]), (4, [4, 5, 6, 7])):
        assert set(_step_bytes(store, "kept", [exemplar])) == set(_step_bytes(store, "dp4", stage))


def _step_bytes(store: Store, run: str, ranks: list[int]) -> list[int]:
    """Bytes allocated per rank and step (``memory``), for ``ranks``."""
    return [
        int(b)
        for (b,) in store.con.execute(
            "SELECT sum(bytes) FILTER (WHERE bytes > 0) FROM memory WHERE run_id = ?"
            " AND list_contains(?, rank) AND iteration IS NOT NULL GROUP BY rank, iteration",
            [store.require_run(run), ranks],
        ).fetchall()
    ]


def _assert_same_ops(store: Store, sliced: str, recorded: str, pairs: dict[int, int]) -> None:
    """``assert_same_classes``, but which of gloo's worker threads ran a call's work is the
    recording's chance (it varies rank to rank): the issuing thread's ops in order, the worker
    threads' ops as one multiset per step."""

    def split(steps: dict[int | None, list[tuple]]) -> dict[int | None, tuple[list, list]]:
        out = {}
        for it, ops in steps.items():
            main = next(op[0] for op in ops if op[1] in ("send", "recv", "collective"))
            out[it] = (
                [op for op in ops if op[0] == main],
                sorted((op[1:] for op in ops if op[0] != main), key=repr),
            )
        return out

    for ex, rank in pairs.items():
        got = split(program_order(store, sliced, ex))
        want = split(program_order(store, recorded, rank))
        assert got.keys() == want.keys()
        for it in want:
            assert got[it] == want[it], f"exemplar {ex} vs recorded rank {rank}, step {it}"


@pytest.mark.slow
@pytest.mark.torch
def test_zero1_ladder_memory_at_the_target_dp(tmp_path: Path) -> None:
    """The same ladder with ZeRO-1, sliced both ways and emulated: each class runs the target
    recording's ops (its per-member ops repeated or dropped with dp), and allocates per step
    what the target recording's ranks of its stage do (the median over ranks and steps, which
    one rank's retained gloo buffers do not move): the activations of the changed number of
    microbatches, the reduce-scatter and all-gather shards at the target's size."""
    pytest.importorskip("torch")
    from prism_trace.replay.emulate.driver import emulate_run

    store = _ladder(tmp_path, "--zero", "1")
    for src, dp_new in (("dp2", 4), ("dp4", 2)):
        name = _slice_ladder(store, src, dp_new)
        # The ops made once per member of a list all-gather / reduce-scatter (the caller's
        # output allocations, gloo's copies out of its buffer) number the target dp's.
        _assert_same_ops(store, name, f"dp{dp_new}", {0: 0, dp_new: dp_new})
        emulate_run(store, run=name, out_run=f"e{dp_new}")
        for stage in (0, 1):
            got = _step_bytes(store, f"e{dp_new}", [dp_new * stage])
            want = _step_bytes(store, f"dp{dp_new}", [dp_new * stage + d for d in range(dp_new)])
            assert sorted(got)[len(got) // 2] == sorted(want)[len(want) // 2]
    # Drawn durations move when a call's buffers are allocated and freed, not how many are live
    # at once: each rank peaks as without variance. (gloo's worker ops float free of the call
    # in the emulator; anchored to them, the buffers left the call and the peak rose ~17 %.)
    from prism_trace import compare_runs, predict_run

    for variance in ("replica", None):
        predict_run(
            store,
            run="dp2",
            against="dp4",
            compare=compare_runs,
            variance=variance,
            out_run=f"v-{variance}",
        )

    def peaks(run: str) -> list[tuple[int, int]]:
        return store.con.execute(
            "SELECT rank, max(total_allocated) FROM memory WHERE run_id = ?"
            " GROUP BY rank ORDER BY rank",
            [store.require_run(run)],
        ).fetchall()

    assert peaks("v-replica") == peaks("v-None")


def _interleaved_ladder(tmp_path: Path, batch: list[str], folder: str) -> Store:
    """Interleaved 1F1B recorded at dp 2 and 4 (pp 2, 2 chunks a stage, wait mode, 2 steps),
    ingested as runs ``dp2`` and ``dp4`` (``folder``: the recordings' name, ``{dp}`` for dp)."""
    from tests.conftest import ingest_runs

    out = tmp_path / "rec"
    args = ["--out", str(out), "--dp", "2,4", "--pp", "2", "--tp", "1", "--compute", "wait"]
    args += ["--schedule", "interleaved", "--chunks", "2", *batch]
    args += ["--layers", "4", "--steps", "2", "--wait-ms-per-layer", "1", "--no-et"]
    cmd = [sys.executable, "-m", "prism_trace.datasets.ladder", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    runs = {f"dp{d}": [out / folder.format(dp=d)] for d in (2, 4)}
    store = ingest_runs(tmp_path / "i.duckdb", runs)
    assert isinstance(store, Store)
    return store


@pytest.mark.slow
@pytest.mark.torch
def test_an_interleaved_ladder_predicts_per_rank_work(tmp_path: Path) -> None:
    """With each rank's work kept (4 microbatches at dp 2 and 4), the prediction's step has the
    recording's ops, collectives and p2p and allocates per step what the recording does."""
    pytest.importorskip("torch")
    from prism_trace import compare_runs, predict_run

    folder = "tp1-dp{dp}-pp2-interleaved-v2-wait-mb4-s2"
    store = _interleaved_ladder(tmp_path, ["--microbatches", "4"], folder)
    got = predict_run(store, run="dp2", against="dp4", compare=compare_runs, out_run="p4")
    c = got.comparison
    assert c.structure.differences == {"collectives": 0, "p2p": 0, "ops": 0, "classes": 0}
    # What each rank allocates per step is the recording's (its peak also depends on when
    # gloo's worker lets go of a buffer, which a loaded host moves between recordings).
    for exemplar, stage in ((0, [0, 1, 2, 3]), (4, [4, 5, 6, 7])):
        assert set(_step_bytes(store, "p4", [exemplar])) == set(_step_bytes(store, "dp4", stage))


@pytest.mark.slow
@pytest.mark.torch
def test_an_interleaved_ladder_at_a_fixed_global_batch(tmp_path: Path) -> None:
    """A global batch of 32 (8 microbatches of 2 a rank at dp 2, 4 at dp 4): the dp 2 recording
    sliced to dp 4 keeps the global batch, and its step has the dp 4 recording's ops,
    collectives and p2p. Neither goes to dp 8 (2 microbatches: every forward first; and dp 4's
    steady state holds one period), each refused in one line with the store as it was."""
    pytest.importorskip("torch")
    from prism_trace import compare_runs, predict_run

    folder = "tp1-dp{dp}-pp2-interleaved-v2-wait-gb32-s2"
    store = _interleaved_ladder(tmp_path, ["--global-batch", "32"], folder)
    got = predict_run(
        store, run="dp2", against="dp4", compare=compare_runs, global_batch="fixed", out_run="p4"
    )
    c = got.comparison
    assert c.structure.differences == {"collectives": 0, "p2p": 0, "ops": 0, "classes": 0}
    layout = ParallelLayout.parse("dp=4,pp=2")
    report = slice_run(store, run="dp2", layout=layout, world=8, out_run="s4", global_batch="fixed")
    ((cfg,),) = store.con.execute(
        "SELECT config_json FROM run WHERE run_id = ?", [report.run_id]
    ).fetchall()
    assert json.loads(cfg)["microbatches"] == {
        "recorded": 8,
        "target": 4,
        "schedule": "interleaved",
        "chunks": 2,
    }
    before = store_contents(store)
    layout = ParallelLayout.parse("dp=8,pp=2")
    refusals = {
        "dp2": r"^8 -> 2 microbatches per rank: interleaved 1F1B on 2 pipeline stages",
        # 4 microbatches: one period in stage 0's steady state, none to compare it with
        "dp4": r"nor interleaved 1F1B .*\(no period of 2 microbatches seen repeating",
    }
    for run, said in refusals.items():
        with pytest.raises(SliceError, match=said) as exc:
            slice_run(store, run=run, layout=layout, world=16, out_run="s8", global_batch="fixed")
        assert "\n" not in str(exc.value)
    assert store_contents(store) == before

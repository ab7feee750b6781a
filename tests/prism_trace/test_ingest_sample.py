"""Ingest the bundled generated sample (real gloo DP x TP x PP traces); check it against raw JSON.

Runs everywhere: the sample is in the repository, so this is the suite's core ingest check when
../shared is absent.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from prism_trace.store.connection import Store

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"
_ANNOT = re.compile(r"^prism_comm:(.*)$")


@pytest.fixture(scope="module")
def store(sample_store: Store) -> Store:
    """The module's own copy of the sample ingested by conftest's `sample_template` (the same
    `ingest(store, [SAMPLE], run="sample")` call, made once per test run)."""
    return sample_store


def raw(rank: int, kind: str) -> dict:
    return json.loads(gzip.decompress((SAMPLE / f"rank{rank}.{kind}.json.gz").read_bytes()))


def annotations(rank: int) -> list[dict[str, str]]:
    out = []
    for e in raw(rank, "kineto")["traceEvents"]:
        m = _ANNOT.match(e.get("name", ""))
        if m and e.get("ph") == "X":
            out.append(dict(kv.split("=", 1) for kv in m.group(1).split(";")))
    return out


def q(store: Store, sql: str, *params: object) -> list[tuple]:
    return store.con.execute(sql, list(params)).fetchall()


def test_ranks_and_layout(store: Store) -> None:
    meta = json.loads((SAMPLE / "run.json").read_text())
    world = meta["world_size"]
    assert q(store, "SELECT world_size, source_format FROM run") == [(world, "mixed")]
    rows = q(store, "SELECT rank, backend, tp, dp, pp FROM rank ORDER BY rank")
    assert [r[0] for r in rows] == list(range(world))
    assert {r[1] for r in rows} == {"gloo"}
    for rank, _, tp, dp, pp in rows:
        layout = raw(rank, "kineto")["prism_layout"]
        assert (tp, dp, pp) == (layout["tp_rank"], layout["dp_rank"], layout["pp_rank"])


def test_collectives_and_p2p_match_annotations(store: Store) -> None:
    meta = json.loads((SAMPLE / "run.json").read_text())
    for rank in range(meta["world_size"]):
        ann = annotations(rank)
        want_c = Counter((a["pg"], a["op"]) for a in ann if a["op"] not in ("send", "recv"))
        want_p = Counter(
            (a["pg"], a["op"], int(a["peer"])) for a in ann if a["op"] in ("send", "recv")
        )
        got_c = Counter(
            {
                (g, k): n
                for g, k, n in q(
                    store,
                    "SELECT g.name, c.kind, count(*) FROM collective c"
                    " JOIN comm_group g USING (run_id, group_id) WHERE c.rank = ? GROUP BY ALL",
                    rank,
                )
            }
        )
        got_p = Counter(
            {
                (g, d, p): n
                for g, d, p, n in q(
                    store,
                    "SELECT g.name, p.direction, p.peer, count(*) FROM p2p p"
                    " JOIN comm_group g USING (run_id, group_id) WHERE p.rank = ? GROUP BY ALL",
                    rank,
                )
            }
        )
        assert got_c == want_c
        assert got_p == want_p
        # Sequence numbers are the generator's own, per group.
        seqs = sorted(int(a["seq"]) for a in ann if a["op"] not in ("send", "recv"))
        got = sorted(r[0] for r in q(store, "SELECT seq FROM collective WHERE rank = ?", rank))
        assert got == seqs


def test_every_collective_instance_matches(store: Store) -> None:
    rows = q(
        store,
        "SELECT count(*), count(*) FILTER (WHERE matched) FROM collective_instance",
    )
    assert rows[0][0] > 0
    assert rows[0][0] == rows[0][1]
    # Every send pairs with the peer's receive of the same group, sequence and size.
    unpaired = q(
        store,
        """SELECT count(*) FROM p2p s LEFT JOIN p2p r
           ON r.run_id = s.run_id AND r.rank = s.peer AND r.peer = s.rank
              AND r.group_id = s.group_id AND r.seq = s.seq AND r.direction = 'recv'
              AND r.bytes = s.bytes
           WHERE s.direction = 'send' AND r.rank IS NULL""",
    )
    assert unpaired == [(0,)]


@pytest.mark.slow
def test_iterations_and_linking(store: Store) -> None:
    meta = json.loads((SAMPLE / "run.json").read_text())
    for rank in range(meta["world_size"]):
        steps = [
            e
            for e in raw(rank, "kineto")["traceEvents"]
            if e.get("name", "").startswith("ProfilerStep#")
        ]
        got = q(
            store, "SELECT iteration, dur FROM iteration WHERE rank = ? ORDER BY iteration", rank
        )
        assert [g[0] for g in got] == sorted(int(e["name"].split("#")[1]) for e in steps)
        assert [g[1] for g in got] == [
            round(e["dur"] * 1000) for e in sorted(steps, key=lambda e: e["ts"])
        ]
        nodes = raw(rank, "et")["nodes"]
        et_only = sum(
            1
            for n in nodes
            if n["name"].startswith("[pytorch|profiler|execution_")
            or n["name"] == "## process_group:init ##"
        )
        ((ops, linked),) = q(store, "SELECT et_ops, et_ops_linked FROM rank WHERE rank = ?", rank)
        assert ops == len(nodes)
        assert linked == len(nodes) - et_only
    mismatched = q(
        store,
        "SELECT count(*) FROM et_op o JOIN event e USING (run_id, rank, event_id)"
        " WHERE o.name <> e.name",
    )
    assert mismatched == [(0,)]


def test_memory_events(store: Store) -> None:
    for rank in (0, 7):
        n = sum(1 for e in raw(rank, "kineto")["traceEvents"] if e.get("name") == "[memory]")
        recorded = "SELECT count(*) FROM memory WHERE rank = ? AND NOT inferred"
        assert q(store, recorded, rank) == [(n,)]
    # Rank 7 of the sample loses three blocks unseen (docs/ingest.md), rank 0 none.
    inferred = "SELECT count(*) FROM memory WHERE rank = ? AND inferred"
    assert [q(store, inferred, r)[0][0] for r in (0, 7)] == [0, 3]

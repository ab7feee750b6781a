"""Ingest every real public trace set; check the store against counts taken from the raw files."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store
from tests.conftest import copy_of_template

# Slow: ingests every shared real trace; `scripts/test -m "not slow"` leaves it out.
pytestmark = [pytest.mark.shared_data, pytest.mark.slow]

ASTRA = "chakra-et/astrasim_et_examples"


@pytest.fixture(scope="module")
def store(
    shared_datasets: Path, tmp_path_factory: pytest.TempPathFactory, real_template: Path
) -> Store:
    """One store holding every shared set as its own run.

    dlrm, st and the 64-rank ResNet come from ``real_template`` (the same ``ingest`` of the same
    folders, done once per test run for the modules that share it); every other set is
    ingested here."""
    db = copy_of_template(real_template, tmp_path_factory, "real")
    s = open_store(db)
    s.con.execute("UPDATE run SET name = 'resnet64' WHERE name = 'resnet'")
    assert sorted(r for (r,) in q(s, "SELECT name FROM run")) == ["dlrm", "resnet64", "st"]
    sets = {
        "hta": ["hta-nccl-rank0"],
        "ring": [f"{ASTRA}/custom_ring_allreduce_8npus_1MB"],
        "conv101": ["chakra-et/chakra_tests/chakra.0.et_schema1.0.1_HEAD.gz"],
        "conv110": ["chakra-et/chakra_tests/chakra.0.et_schema1.1.0_commit-e366cf2.gz"],
        "allgather_et": [
            "chakra-et/chakra_tests/host_et_1.0.2-chakra.0.0.4_allgather_2rank_rank0.json.gz"
        ],
        "resnet_2gpu": ["param-resnet-et/resnet_2gpu_rank1_et_1.1.0.json.gz"],
    }
    for coll in ("all_gather", "all_reduce", "all_to_all", "reduce_scatter"):
        for n in (4, 8, 16):
            sets[f"{coll}_{n}"] = [f"{ASTRA}/microbenchmarks/{coll}/{n}npus_1MB"]
    for run, rel in sets.items():
        # The 2023 converter's file holds dependency cycles (a kernel and its op wait on each
        # other): refused by default, kept when allowed (test_chakra_cycle_refused_unless_allowed).
        ingest(
            s,
            [shared_datasets / p for p in rel],
            run=run,
            progress=False,
            allow_cycles=run == "conv101",
        )
    # Single files whose rank no content or name gives: --rank.
    for run, rel in {
        "resnet_pair": [
            "param-resnet-et/resnet_kineto.json.gz",
            "param-resnet-et/resnet_et_1.1.0.json.gz",
        ],
        "linear_pair": [
            "param-resnet-et/linear_kineto.json.gz",
            "param-resnet-et/linear_et_1.0.1.json.gz",
        ],
    }.items():
        for i, p in enumerate(rel):
            ingest(s, [shared_datasets / p], run=f"{run}_{i}", rank=0, progress=False)
    return s


def q(store: Store, sql: str, *params: object) -> list[tuple]:
    return store.con.execute(sql, list(params)).fetchall()


def raw_kineto(path: Path) -> list[dict]:
    return json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]


def test_dlrm_counts_match_raw_files(store: Store, shared_datasets: Path) -> None:
    kdir = shared_datasets / "param-dlrm-8rank" / "kineto"
    assert q(store, "SELECT world_size FROM run WHERE name = 'dlrm'") == [(8,)]
    for f in sorted(kdir.iterdir()):
        rank = int(re.match(r"worker(\d+)_", f.name).group(1))  # type: ignore[union-attr]
        ev = raw_kineto(f)
        kernels = sum(1 for e in ev if e.get("cat") == "kernel")
        steps = sum(1 for e in ev if re.fullmatch(r"ProfilerStep#\d+", e.get("name", "")))
        colls = Counter(
            e["name"].split(":", 1)[1]
            for e in ev
            if e.get("cat") == "user_annotation" and e.get("name", "").startswith("nccl:")
        )
        got_k = q(
            store,
            "SELECT count(*) FROM kernel k JOIN run USING (run_id)"
            " WHERE run.name = 'dlrm' AND rank = ? AND category = 'kernel'",
            rank,
        )[0][0]
        assert got_k == kernels
        got_s = q(
            store,
            "SELECT count(*) FROM iteration JOIN run USING (run_id)"
            " WHERE run.name = 'dlrm' AND rank = ?",
            rank,
        )[0][0]
        assert got_s == steps
        got_c = dict(
            q(
                store,
                "SELECT c.kind, count(*) FROM collective c JOIN run USING (run_id)"
                " JOIN comm_group g USING (run_id, group_id)"
                " WHERE run.name = 'dlrm' AND c.rank = ? AND g.name = '0' GROUP BY c.kind",
                rank,
            )
        )
        assert got_c == dict(colls)
    # Every rank recorded the same collective instances: each one matches across all 8 ranks.
    rows = q(
        store,
        "SELECT count(*), count(*) FILTER (WHERE matched AND participants = 8)"
        " FROM collective_instance JOIN run USING (run_id) WHERE run.name = 'dlrm'",
    )
    assert rows[0][0] > 0
    assert rows[0][0] == rows[0][1]


def test_dlrm_host_et_links(store: Store, shared_datasets: Path) -> None:
    for r in range(8):
        nodes = json.loads(
            gzip.decompress(
                (shared_datasets / f"param-dlrm-8rank/et/dlrm_eg_{r}.json.gz").read_bytes()
            )
        )["nodes"]
        roots = sum(
            1
            for n in nodes
            if n["name"].startswith("[pytorch|profiler|execution_")
            or n["name"] == "## process_group:init ##"
        )
        row = q(
            store,
            "SELECT et_ops, et_ops_linked FROM rank JOIN run USING (run_id)"
            " WHERE run.name = 'dlrm' AND rank = ?",
            r,
        )[0]
        assert row == (len(nodes), len(nodes) - roots)
        # Linked pairs agree on the op name.
        bad = q(
            store,
            "SELECT count(*) FROM et_op o JOIN event e USING (run_id, rank, event_id)"
            " JOIN run USING (run_id) WHERE run.name = 'dlrm' AND o.rank = ? AND o.name <> e.name",
            r,
        )[0][0]
        assert bad == 0


def test_hta_nccl_collectives(store: Store, shared_datasets: Path) -> None:
    ev = raw_kineto(shared_datasets / "hta-nccl-rank0/nccl_data.json.gz")
    # allreduce and broadcast are the collectives here; bytes = elements x element size.
    kinds = {"allreduce": "all_reduce", "broadcast": "broadcast"}
    size = {"Float": 4, "Long": 8, "Byte": 1, "Int": 4, "Half": 2, "BFloat16": 2, "Double": 8}
    rpc = sorted(
        (e["ts"], kinds[a["Collective name"]], a["Out msg nelems"] * size[a["dtype"]])
        for e in ev
        if e.get("name") == "record_param_comms"
        and (a := e["args"]).get("Collective name") in kinds
    )
    got = q(
        store,
        "SELECT c.kind, c.msg_bytes, c.group_size, g.ranks, c.kernel_dur IS NOT NULL"
        " FROM collective c JOIN run USING (run_id) JOIN comm_group g USING (run_id, group_id)"
        " WHERE run.name = 'hta' ORDER BY c.host_ts",
    )
    assert [(g[0], g[1]) for g in got] == [(k, b) for _, k, b in rpc]
    assert all(g[2] == 2 and g[3] == [0, 1] and g[4] for g in got)


def test_op_timeline_counts(store: Store, shared_datasets: Path) -> None:
    raw = pl.read_parquet(shared_datasets / "megatron-straggler-st-8rank/trace-ST.parquet")
    want = dict(raw.group_by("rank").len().iter_rows())
    got = dict(
        q(
            store,
            "SELECT rank, count(*) FROM event JOIN run USING (run_id)"
            " WHERE run.name = 'st' GROUP BY rank",
        )
    )
    assert got == want
    steps = json.loads(
        (shared_datasets / "megatron-straggler-st-8rank/result-ST.json").read_text()
    )["step_t_base"]
    rows = q(
        store,
        "SELECT iteration, dur FROM iteration JOIN run USING (run_id)"
        " WHERE run.name = 'st' AND rank = 0 ORDER BY iteration",
    )
    assert len(rows) == len(steps)
    for it, dur in rows:
        assert dur == pytest.approx(steps[str(it)] * 1e9, abs=1)
    # Every send has its receive on the peer with the same sequence number.
    unpaired = q(
        store,
        """SELECT count(*) FROM p2p s JOIN run USING (run_id)
           LEFT JOIN p2p r ON r.run_id = s.run_id AND r.rank = s.peer AND r.peer = s.rank
                AND r.direction = 'recv' AND r.seq = s.seq
           WHERE run.name = 'st' AND s.direction = 'send' AND r.rank IS NULL""",
    )[0][0]
    assert unpaired == 0


def test_chakra_sets(store: Store) -> None:
    for coll in ("all_gather", "all_reduce", "all_to_all", "reduce_scatter"):
        for n in (4, 8, 16):
            rows = q(
                store,
                "SELECT count(*), min(c.kind), min(c.msg_bytes), max(c.msg_bytes),"
                " count(DISTINCT c.rank) FROM collective c JOIN run USING (run_id)"
                " WHERE run.name = ?",
                f"{coll}_{n}",
            )
            # comm_size (1 MiB) is each rank's input: an all-gather's nccl-tests size is its
            # output, n MiB, with the group size from the number of files (ingest.fill_sizes)
            size = (n if coll == "all_gather" else 1) << 20
            assert rows == [(n, coll, size, size, n)]
    per_rank = q(
        store,
        "SELECT count(*) FROM collective JOIN run USING (run_id)"
        " WHERE run.name = 'resnet64' GROUP BY rank",
    )
    assert len(per_rank) == 64
    assert len({r[0] for r in per_rank}) == 1
    sends = q(
        store,
        "SELECT rank, peer FROM p2p JOIN run USING (run_id)"
        " WHERE run.name = 'ring' AND direction = 'send' GROUP BY ALL",
    )
    assert {(r, p) for r, p in sends} == {(r, (r + 1) % 8) for r in range(8)}


def test_every_set_was_ingested_with_ranks(store: Store) -> None:
    runs = dict(
        q(store, "SELECT name, (SELECT count(*) FROM rank k WHERE k.run_id = r.run_id) FROM run r")
    )
    assert runs["dlrm"] == 8
    assert runs["st"] == 8
    assert runs["resnet64"] == 64
    assert runs["ring"] == 8
    assert runs["resnet_2gpu"] == 1
    assert all(v >= 1 for v in runs.values())


def test_info_describes_the_run(store: Store) -> None:
    from prism_trace.query.info import describe_run

    info = describe_run(store, "dlrm")
    assert len(info["ranks"]) == 8
    assert info["world_size"] == 8
    assert info["unmatched_collectives"] == 0
    assert all(len(r["iteration_times_ns"]) == 1 for r in info["ranks"])

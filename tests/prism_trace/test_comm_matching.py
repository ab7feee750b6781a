"""Collective matching only where the trace supports it: traces that say less than ours.

Inputs are variants of the DLRM Kineto traces written to tmp dirs: ``record_param_comms`` without
args, only the ``c10d::`` ops (no record_param_comms, no backend annotation), and two ranks of a
128-rank job whose calls are different exchanges.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest
from prism_trace.datasets.variants import kineto_variant, two_ranks_of_many

from prism_trace.formats.kineto.sql import _op_kind_sql
from prism_trace.graph.matching import UNMATCHED, match_comms, settle_order_matching
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store


def _dlrm(shared: Path) -> list[Path]:
    return sorted((shared / "param-dlrm-8rank" / "kineto").glob("*.json.gz"))


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory, shared_datasets: Path) -> Store:
    tmp = tmp_path_factory.mktemp("variants")
    src = _dlrm(shared_datasets)
    for i, f in enumerate(src):
        kineto_variant(f, tmp / "stripped" / f"rank{i}.json.gz", strip_comm_args=True)
        kineto_variant(f, tmp / "c10d" / f"rank{i}.json.gz", drop=r"^(record_param_comms|nccl:)")

    two_ranks_of_many(src, tmp / "two")  # rank 64's exchanges are 1000 times larger
    store = open_store(tmp / "v.duckdb")
    for name in ("stripped", "c10d", "two"):
        ingest(store, [tmp / name], run=name, progress=False)
    return store


def test_every_c10d_name_is_a_kind() -> None:
    names = {
        "c10d::_allgather_base_": "all_gather",
        "nccl:_all_gather_base": "all_gather",
        "_allgather_base": "all_gather",
        "c10d::_reduce_scatter_base_": "reduce_scatter",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "allgather_into_tensor_coalesced": "all_gather",
        "reduce_scatter_tensor_coalesced": "reduce_scatter",
        "allreduce_coalesced": "all_reduce",
        "c10d::alltoall_base_": "all_to_all",
        "c10d::barrier": "barrier",
        "c10d::broadcast_": "broadcast",
        "c10d::send": "send",
        "c10d::recv_": "recv",
        "isend": "send",
        "irecv": "recv",
        "coalesced": None,
        "c10d::wait": None,
    }
    con = duckdb.connect()
    for name, kind in names.items():
        got = con.execute(f"SELECT {_op_kind_sql('?')}", [name]).fetchall()[0][0]
        assert got == kind, name


def test_stripped_args_match_by_order(variants: Store) -> None:
    report = match_comms(variants, "stripped")
    assert (report.instances, report.complete, report.mixed) == (8, 8, 0)
    assert [m["mode"] for m in report.matching] == ["order"]


def test_c10d_ops_alone_are_every_call(variants: Store, shared_datasets: Path) -> None:
    per_rank = variants.con.execute(
        "SELECT rank, count(*) FROM collective JOIN run USING (run_id) WHERE name = 'c10d'"
        " GROUP BY rank ORDER BY rank"
    ).fetchall()
    c10d_ops = variants.con.execute(
        "SELECT count(*) FROM event JOIN run USING (run_id) WHERE run.name = 'c10d'"
        " AND event.name IN ('c10d::alltoall_base_', 'c10d::allreduce_') AND rank = 0"
    ).fetchall()[0][0]
    assert [n for _, n in per_rank] == [c10d_ops] * 8
    report = match_comms(variants, "c10d")
    assert (report.instances, report.complete, report.mixed) == (8, 8, 0)


def test_different_exchanges_are_left_unmatched(variants: Store) -> None:
    report = match_comms(variants, "two")
    assert report.mixed == 0
    (entry,) = report.matching
    assert entry["mode"] == UNMATCHED
    assert "rank 64 all_to_all 24576000 B" in str(entry["reason"])
    groups = variants.con.execute(
        "SELECT g.name, g.size, g.ranks FROM comm_group g JOIN run USING (run_id)"
        " WHERE run.name = 'two' AND description = ? ORDER BY name",
        [UNMATCHED],
    ).fetchall()
    assert groups == [("0/unmatched/0", 1, [0]), ("0/unmatched/64", 1, [64])]
    # Every instance is one rank's own call: emulation runs it at that rank's timing.
    assert report.instances == 16


def test_shared_sets_have_no_mixed_instances(real_store: Store) -> None:
    for run in ("st", "dlrm", "resnet"):
        assert match_comms(real_store, run).mixed == 0, run


def _calls(rows: list[tuple[int, int, str, int]]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "rank": [r[0] for r in rows],
            "group_name": ["0"] * len(rows),
            "seq": [r[1] for r in rows],
            "kind": [r[2] for r in rows],
            "msg_bytes": [r[3] for r in rows],
            "seq_by_order": [True] * len(rows),
        }
    )


_GROUPS = pl.DataFrame(
    {
        "group_id": [0],
        "name": ["0"],
        "description": ["default_pg"],
        "backend": ["nccl"],
        "size": [4],
        "ranks": [[0, 1, 2, 3]],
    },
    schema={
        "group_id": pl.Int32,
        "name": pl.Utf8,
        "description": pl.Utf8,
        "backend": pl.Utf8,
        "size": pl.Int32,
        "ranks": pl.List(pl.Int32),
    },
)


def test_kinds_out_of_order_are_unmatched() -> None:
    calls = _calls([(0, 0, "all_reduce", 8), (0, 1, "all_gather", 8)])
    calls = pl.concat([calls, _calls([(1, 0, "all_gather", 8), (1, 1, "all_reduce", 8)])])
    out, groups, matching = settle_order_matching(calls, _GROUPS, [0, 1])
    assert matching[0]["mode"] == UNMATCHED
    assert "seq_by_order" not in out.columns
    assert sorted(out["group_name"].unique().to_list()) == ["0/unmatched/0", "0/unmatched/1"]
    assert groups["group_id"].to_list() == [0, 1, 2]


def test_a_recorded_member_without_the_call_is_unmatched() -> None:
    calls = _calls([(0, 0, "all_reduce", 8), (1, 0, "all_reduce", 8), (1, 1, "all_reduce", 8)])
    _, _, matching = settle_order_matching(calls, _GROUPS, [0, 1])
    assert matching[0]["mode"] == UNMATCHED
    assert "fewer calls" in str(matching[0]["reason"])


def test_uneven_all_to_all_splits_still_match() -> None:
    calls = _calls([(0, 0, "all_to_all", 3072), (1, 0, "all_to_all", 9216)])
    _, _, matching = settle_order_matching(calls, _GROUPS, [0, 1])
    assert matching[0]["mode"] == "order"
    sized = _calls([(0, 0, "all_reduce", 3072), (1, 0, "all_reduce", 3076)])
    _, _, matching = settle_order_matching(sized, _GROUPS, [0, 1])
    assert matching[0]["mode"] == UNMATCHED


def test_kernel_args_stand_in_for_stripped_host_records(
    tmp_path: Path, shared_datasets: Path
) -> None:
    """HTA's NCCL trace with record_param_comms args removed: the NCCL kernels' args still say
    the group, the sizes and the element type, and the calls come out as before."""
    src = shared_datasets / "hta-nccl-rank0" / "nccl_data.json.gz"
    kineto_variant(src, tmp_path / "stripped" / "rank0.json.gz", strip_comm_args=True)
    store = open_store(tmp_path / "h.duckdb")
    ingest(store, [src], run="h", progress=False)
    ingest(store, [tmp_path / "stripped"], run="hs", progress=False)
    sql = (
        "SELECT c.seq, c.kind, c.in_bytes, c.out_bytes, c.dtype, g.name, g.description, g.ranks"
        " FROM collective c JOIN run r USING (run_id) JOIN comm_group g USING (run_id, group_id)"
        " WHERE r.name = ? ORDER BY c.seq"
    )
    original = store.con.execute(sql, ["h"]).fetchall()
    stripped = store.con.execute(sql, ["hs"]).fetchall()
    assert len(original) == 21
    assert stripped == original

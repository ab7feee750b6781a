"""Communication as older PyTorch versions record it, built from real traces (``brought_traces``).

What would break: a PyTorch 2.3-era NCCL trace, whose ``record_param_comms`` name their group by
``Process Group ID`` (an address, another on every rank) and whose ``wait`` calls state no
ranks, stopped ingest with ``NOT NULL constraint failed: collective.group_id`` and a polars
warning on stderr; and its ranks' calls, named by two different ids, would never match.
"""

from __future__ import annotations

from pathlib import Path

import brought_traces as bt
import pytest

from prism_trace.graph.build import build_graph
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import open_store

pytestmark = pytest.mark.shared_data


def _pt23_pair(shared_datasets: Path, folder: Path) -> list[Path]:
    """HTA's NCCL rank 0 as PyTorch 2.3 writes it, and the same calls as a rank 1 whose process
    group has another address (the group's id differs across processes)."""
    src = bt.load(shared_datasets / "hta-nccl-rank0" / "nccl_data.json.gz")
    folder.mkdir()
    out = []
    for rank, address in ((0, 94_733_712_617_296), (1, 140_103_204_981_136)):
        t = bt.as_pt23_comms(src, group_id=address)
        t["distributedInfo"]["rank"] = rank
        out.append(bt.save(t, folder / f"rank{rank}.json.gz"))
    return out


def test_groups_named_by_id_are_one_group_across_ranks(
    shared_datasets: Path, tmp_path: Path
) -> None:
    files = _pt23_pair(shared_datasets, tmp_path / "pt23")
    with open_store(tmp_path / "t.duckdb") as store:
        # warnings are errors in this suite: a polars warning fails the test
        ingest(store, files, run="pt23", progress=False)
        ingest(store, [shared_datasets / "hta-nccl-rank0"], run="named", progress=False)
        groups = store.con.execute(
            "SELECT r.name, g.name, g.ranks FROM comm_group g JOIN run r USING (run_id)"
            " ORDER BY ALL"
        ).fetchall()
        assert groups == [("named", "0", [0, 1]), ("pt23", "0", [0, 1])]
        calls = store.con.execute(
            "SELECT r.name, c.rank, c.kind, count(*) FROM collective c JOIN run r USING (run_id)"
            " GROUP BY ALL ORDER BY ALL"
        ).fetchall()
        assert calls == [
            ("named", 0, "all_reduce", 15),
            ("named", 0, "broadcast", 6),
            ("pt23", 0, "all_reduce", 15),
            ("pt23", 0, "broadcast", 6),
            ("pt23", 1, "all_reduce", 15),
            ("pt23", 1, "broadcast", 6),
        ]
        # one instance per call, issued by both ranks (a group per rank matched nothing)
        (both,) = store.con.execute(
            "SELECT count(*) FROM (SELECT group_id, seq FROM collective c"
            " JOIN run r USING (run_id) WHERE r.name = 'pt23' GROUP BY ALL"
            " HAVING count(DISTINCT rank) = 2)"
        ).fetchone()
        assert both == 21
        build_graph(store, "pt23")

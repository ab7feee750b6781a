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


def test_gloo_spans_on_worker_threads_are_the_calls(tmp_path: Path) -> None:
    """A CPU-only gloo job recorded by an older PyTorch: only the ``gloo:<op>`` spans of the
    worker threads say a call happened. They were not communication (temporal: 100 % idle,
    skew: "no communication calls", emulate: a 15 µs run without iterations); in the sample as
    recorded (its calls described on the issuing thread) they are not counted twice."""
    from prism_trace.analysis import temporal
    from prism_trace.replay.emulate.driver import emulate_run

    sample = sorted(Path("datasets/sample").glob("rank*.kineto.json.gz"))
    (tmp_path / "old").mkdir()
    files = [bt.save(bt.as_old_gloo(bt.load(p)), tmp_path / "old" / p.name) for p in sample]
    with open_store(tmp_path / "t.duckdb") as store:
        ingest(store, files, run="old", progress=False)
        ingest(store, sample, run="sample", progress=False)
        rows = store.con.execute(
            """SELECT r.name, c.rank, c.kind, count(*), bool_and(t.tid <> t.pid::BIGINT)
               FROM collective c JOIN run r USING (run_id)
               JOIN event e USING (run_id, rank, event_id)
               JOIN track t USING (run_id, rank, track_id)
               WHERE c.rank = 0 GROUP BY ALL ORDER BY ALL"""
        ).fetchall()
        # rank 0: its 34 all-reduces, on the gloo worker threads (not the main thread)
        assert rows == [("old", 0, "all_reduce", 34, True), ("sample", 0, "all_reduce", 34, False)]
        old = temporal(store, "old")
        assert old["idle_pct"].max() < 20.0
        assert old["comm_pct"].min() > 10.0
        report = emulate_run(store, run="old", out_run="old-e")
        steps = store.con.execute(
            "SELECT count(DISTINCT iteration), min(dur) FROM iteration i JOIN run r USING (run_id)"
            " WHERE r.name = 'old-e'"
        ).fetchone()
        assert report is not None
        assert steps[0] == 2
        assert steps[1] > 100_000_000  # each step hundreds of ms, as recorded

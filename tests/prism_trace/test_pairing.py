"""Which rank each file of an ingest is read with (``ingestion.pairing``).

What would break: a host ET that states no rank beside the Kineto trace of its process (a
single-GPU job: ``resnet_et_1.1.0.json.gz`` + ``resnet_kineto.json.gz``) was refused ("cannot
tell the rank"), and ``--rank`` refused the two files of that one rank; ETs of several ranks
would get no rank, or the wrong Kineto trace's.
"""

from __future__ import annotations

import json
from pathlib import Path

import brought_traces as bt
import pytest

from prism_trace.errors import UsageError
from prism_trace.ingestion.discover import TraceFile
from prism_trace.ingestion.pairing import file_ranks
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import open_store


def _kineto(path: Path, pid: int, rank: int | None) -> TraceFile:
    head = {"schemaVersion": 1}
    if rank is not None:
        head["distributedInfo"] = {
            "backend": "nccl",
            "pg_config": [{"pg_name": "0", "ranks": [0, 1, 2, 3]}],  # nested, before the rank
            "rank": rank,
            "world_size": 4,
        }
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": pid}]
    path.write_text(json.dumps({**head, "traceEvents": events}))
    return TraceFile(path, "kineto")


def _et(path: Path, pid: int) -> TraceFile:
    path.write_text(json.dumps({"schema": "1.1.0", "pid": pid, "nodes": []}))
    return TraceFile(path, "host_et")


def test_an_et_takes_the_rank_of_the_trace_of_its_process(tmp_path: Path) -> None:
    files = [
        _kineto(tmp_path / "host_a.trace.json", 4101, 2),
        _kineto(tmp_path / "host_b.trace.json", 4102, 3),
        _et(tmp_path / "eg_x.json", 4102),  # by pid: host_b's
        _et(tmp_path / "host_a.et.json", 999),  # no pid match; by name: host_a's
    ]
    assert file_ranks(files, None) == {files[2].path: 3, files[3].path: 2}


def test_the_only_trace_is_rank_0_and_its_et_pairs_with_it(tmp_path: Path) -> None:
    files = [_kineto(tmp_path / "k.json", 77, None), _et(tmp_path / "e.json", 1)]
    assert file_ranks(files, None) == {files[0].path: 0, files[1].path: 0}
    two = [*files, _kineto(tmp_path / "k2.json", 78, None)]
    assert file_ranks(two, None) == {}  # two traces of no rank: their readers refuse them


def test_rank_applies_to_one_ranks_files(tmp_path: Path) -> None:
    pair = [_kineto(tmp_path / "k.json", 77, None), _et(tmp_path / "e.json", 1)]
    assert file_ranks(pair, 5) == {pair[0].path: 5, pair[1].path: 5}
    two = [*pair, _kineto(tmp_path / "k2.json", 78, None)]
    with pytest.raises(UsageError, match=r"--rank applies to one rank's files .* 2 traces"):
        file_ranks(two, 5)


@pytest.mark.shared_data
@pytest.mark.slow
def test_a_host_et_and_kineto_pair_of_one_rank(shared_datasets: Path, tmp_path: Path) -> None:
    """PARAM's linear pair: the ET states no rank, the Kineto trace none either (a one-GPU
    job). Without ``--rank`` both are rank 0; ``--rank 3`` applies to both."""
    src = shared_datasets / "param-resnet-et"
    files = [src / "linear_et_1.0.1.json.gz", src / "linear_kineto.json.gz"]
    with open_store(tmp_path / "t.duckdb") as store:
        assert ingest(store, files, run="pair", progress=False).ranks == [0]
        assert ingest(store, files, run="pair3", rank=3, progress=False).ranks == [3]
        linked = store.con.execute(
            "SELECT r.name, e.rank, count(*) FILTER (e.event_id IS NOT NULL) > 0"
            " FROM et_op e JOIN run r USING (run_id) GROUP BY ALL ORDER BY ALL"
        ).fetchall()
        assert linked == [("pair", 0, True), ("pair3", 3, True)]


@pytest.mark.shared_data
@pytest.mark.slow
def test_a_single_gpu_training_pair_emulates(shared_datasets: Path, tmp_path: Path) -> None:
    """ResNet's host ET and its Kineto trace with profiler steps and memory records (a plain
    single-GPU training trace): emulate crashed in the rank-step code ("cannot reshape array
    of size 0"), a run without collectives having no instance."""
    from prism_trace.replay.emulate.driver import emulate_run

    src = shared_datasets / "param-resnet-et"
    folder = tmp_path / "pair"
    folder.mkdir()
    (folder / "resnet_et_1.1.0.json.gz").write_bytes((src / "resnet_et_1.1.0.json.gz").read_bytes())
    kineto = bt.with_memory_records(bt.with_profiler_steps(bt.load(src / "resnet_kineto.json.gz")))
    bt.save(kineto, folder / "resnet_kineto.json.gz")
    with open_store(tmp_path / "t.duckdb") as store:
        assert ingest(store, [folder], run="pair", progress=False).ranks == [0]
        emulate_run(store, run="pair", out_run="pair-e")
        (steps,) = store.con.execute(
            "SELECT count(*) FROM iteration i JOIN run r USING (run_id) WHERE r.name = 'pair-e'"
        ).fetchone()
        assert steps == 30

"""The batch Kineto reader gives every file the frames the per-file reader gives it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from prism_trace.errors import PrismError
from prism_trace.formats.base import FRAME_SCHEMAS, TraceTables
from prism_trace.formats.kineto.batch import read_kineto_batch, try_read_kineto_batch
from prism_trace.formats.kineto.reader import read_kineto
from tests.prism_trace.test_kineto import DLRM, HTA, LINEAR, RESNET, synthetic_events, write_trace

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"


def batch_of(paths: list[Path], ranks: list[int | None] | None = None) -> list[TraceTables]:
    """The batch read itself (no fallback): fails the test if the batch was refused."""
    with duckdb.connect() as con:
        got = try_read_kineto_batch(
            paths, ranks=ranks if ranks is not None else [None] * len(paths), con=con
        )
    assert got is not None, "the batch fell back to the per-file reader"
    return got


def assert_same(paths: list[Path], ranks: list[int | None] | None = None) -> None:
    got = batch_of(paths, ranks)
    for path, rank, g in zip(paths, ranks or [None] * len(paths), got, strict=True):
        w = read_kineto(path, rank=rank)
        assert (g.path, g.format, g.world_size) == (w.path, w.format, w.world_size)
        for name in FRAME_SCHEMAS:
            assert_frame_equal(getattr(g, name), getattr(w, name), check_exact=True)


def comm_events(rank: int) -> list[dict[str, Any]]:
    """A collective with its NCCL kernel, a send, and a bare c10d op (the world's group)."""
    host = {"pid": 100, "tid": 100}
    return [
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "record_param_comms",
            **host,
            "ts": 1070,
            "dur": 10,
            "args": {
                "Collective name": "allreduce",
                "Process Group Name": "0",
                "Process Group Description": "default_pg",
                "Process Group Ranks": "[0, 1, 2, 3]",
                "Group size": 4,
                "Seq": 1,
                "In msg nelems": 1024,
                "Out msg nelems": 1024,
                "dtype": "Float",
            },
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            **host,
            "ts": 1072,
            "dur": 2,
            "args": {"correlation": 77},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
            "pid": 0,
            "tid": 7,
            "ts": 1200 + 10 * rank,
            "dur": 40,
            "args": {"correlation": 77, "stream": 7, "device": 0},
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "record_param_comms",
            **host,
            "ts": 1085,
            "dur": 3,
            "args": {
                "Collective name": "send",
                "Process Group Name": "1",
                "Process Group Ranks": "[0, 1]",
                "Dst Rank": 1 - rank % 2,
                "In msg nelems": 8,
                "dtype": "Half",
            },
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "c10d::broadcast_",
            **host,
            "ts": 1300,
            "dur": 5,
            "args": {"Input Dims": [[4, 2]], "Input type": ["float"]},
        },
    ]


def synthetic_set(root: Path) -> list[Path]:
    """Four ranks sharing pids, correlation and flow ids (unique within a file only)."""
    paths = []
    for rank in range(4):
        events = synthetic_events() + comm_events(rank)
        if rank == 2:  # no steps, a second thread and stream of its own
            events = [e for e in events if not str(e.get("name", "")).startswith("Profiler")]
            extra = copy.deepcopy(events[2])
            extra.update(tid=101, ts=1500)
            events.append(extra)
        for e in events:  # shift each rank's times so the files differ
            if "ts" in e:
                e["ts"] += 3 * rank
        paths.append(
            write_trace(
                root / f"rank{rank}_trace.json.gz",
                events,
                baseTimeNanoseconds=10**18 + rank * 7,
                distributedInfo={"rank": rank, "world_size": 4, "backend": "nccl"},
            )
        )
    return paths


def test_synthetic_batch_equals_per_file(tmp_path: Path) -> None:
    paths = synthetic_set(tmp_path)
    assert_same(paths)
    t = batch_of(paths)
    # the joins that need the file key did their work: one of each flow a file, calls linked
    for tables in t:
        assert sorted(tables.flows["kind"].to_list()) == ["fwdbwd", "launch", "launch", "sync"]
        assert tables.collectives["kernel_event_id"].null_count() < tables.collectives.height
    assert t[3].collectives.filter(pl.col("kind") == "broadcast")["group_size"].to_list() == [4]


def test_empty_file_and_rank_argument_in_a_batch(tmp_path: Path) -> None:
    paths = synthetic_set(tmp_path)[:2]
    empty = write_trace(tmp_path / "x.json", [{"ph": "M", "name": "process_name", "pid": 1}])
    assert_same([paths[0], empty, paths[1]], [None, 9, None])


def test_sample_batch_equals_per_file() -> None:
    paths = sorted(SAMPLE.glob("*.kineto.json*"))
    assert len(paths) >= 2
    assert_same(paths)


@pytest.mark.slow
@pytest.mark.shared_data
def test_real_traces_batch_equals_per_file(shared_datasets: Path) -> None:
    dlrm = sorted((shared_datasets / DLRM).glob("*.gz"))
    assert_same(dlrm)
    others = [shared_datasets / p for p in (HTA, RESNET, LINEAR)]
    assert_same(others, [None, 0, 0])


def test_bad_file_in_a_batch_reads_as_alone(tmp_path: Path) -> None:
    """A batch holding a bad file is read file by file: the first bad file's own message."""
    good = synthetic_set(tmp_path)[:2]
    bad_events = synthetic_events()
    bad_events[1]["ts"] = "1000"  # a string ts: refused
    bad = write_trace(tmp_path / "rank7_trace.json", bad_events)
    lossy = tmp_path / "rank8_trace.json"  # epoch µs with ns decimals a DOUBLE cannot hold
    lossy.write_text(
        '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1,'
        ' "ts": 1700000000000000.3, "dur": 1}]}'
    )
    with duckdb.connect() as con:
        assert try_read_kineto_batch([good[0], bad], ranks=[None, None], con=con) is None
    with duckdb.connect() as con:
        assert try_read_kineto_batch([good[0], lossy], ranks=[None, None], con=con) is None
    with pytest.raises(PrismError) as alone:
        read_kineto(bad)
    with pytest.raises(PrismError) as batched:
        read_kineto_batch([good[0], bad, good[1]])
    assert str(batched.value) == str(alone.value)
    assert "traceEvents[1]" in str(batched.value)
    # a file the batch cannot take (a lossy ts) is still read, as the per-file reader reads it
    got = read_kineto_batch([good[0], lossy])
    assert_frame_equal(got[1].events, read_kineto(lossy).events)


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_ingest_stores_the_same_rows_batched_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Every table of the run, ingesting the sample's Kineto ranks with and without batches.

    The host ETs are left out: batching changes only how Kineto files are read, and the ET
    linking reads the stored Kineto rows, so it would add seconds and no case."""
    from prism_trace.formats.kineto import batch as kineto_batch
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store
    from prism_trace.store.write import RUN_TABLES

    job = tmp_path / "job"
    job.mkdir()
    for f in sorted(SAMPLE.glob("rank[0-5].kineto.json.gz")):
        (job / f.name).write_bytes(f.read_bytes())

    def dump(db: Path) -> dict[str, list[tuple[Any, ...]]]:
        with open_store(db) as store:
            ingest(store, [job], run="s", progress=False, workers=workers)
            out = {}
            for tbl in RUN_TABLES:
                drop = "run_id, ingested_at" if tbl == "source_file" else "run_id"
                out[tbl] = store.con.execute(
                    f"SELECT * EXCLUDE ({drop}) FROM {tbl} ORDER BY ALL"
                ).fetchall()
            return out

    seen: list[int] = []
    if workers == 1:  # the reads here go through the batch (the workers' are in other processes)
        real = kineto_batch.try_read_kineto_batch

        def spy(paths: list[Path], **kw: Any) -> list[TraceTables] | None:
            got = real(paths, **kw)
            seen.append(0 if got is None else len(got))
            return got

        monkeypatch.setattr(kineto_batch, "try_read_kineto_batch", spy)
    batched = dump(tmp_path / "b.duckdb")
    if workers == 1:
        assert sum(seen) == 6, seen
        monkeypatch.setattr(kineto_batch, "try_read_kineto_batch", real)
    monkeypatch.setattr(kineto_batch, "BATCH_FILES", 1)  # every file a batch of its own
    alone = dump(tmp_path / "a.duckdb")
    assert all(batched[t] for t in ("event", "collective", "flow"))
    assert batched == alone

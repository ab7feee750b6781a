"""Shared fixtures: where the real public traces are, and the bundled generated sample.

The session's template stores are built once per test run, not once per xdist worker: a worker
builds a template under a file lock in the run's shared temporary folder and the others copy it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from filelock import FileLock

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "datasets" / "sample"


def _shared_root() -> Path:
    env = os.environ.get("PRISM_SHARED_DATASETS")
    return Path(env) if env else REPO.parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    """The real traces in ../shared/datasets (or $PRISM_SHARED_DATASETS); skip when absent."""
    root = _shared_root()
    if not root.is_dir():
        pytest.skip(f"real traces not found at {root} (set PRISM_SHARED_DATASETS)")
    return root


CHAKRA_RESNET = "chakra-et/astrasim_et_examples/resnet50_dp_64npus_text_converted"


def ingest_runs(db: Path, runs: dict[str, list[Path]]) -> object:
    """A new store at ``db`` holding each of ``runs`` (name → paths), ingested quietly."""
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    store = open_store(db)
    for name, paths in runs.items():
        ingest(store, paths, run=name, progress=False)
    return store


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """The store file ``build`` writes, built by the first worker that asks for it.

    Under pytest-xdist every worker has its own temporary folder below one folder of the run, so
    the template lives there, behind a lock; without xdist that is the session's own folder. The
    store is built under another name and renamed when closed, so a build that fails half-way is
    never taken for a finished template.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    db = root / "templates" / f"{name}.duckdb"
    db.parent.mkdir(exist_ok=True)
    with FileLock(str(db) + ".lock"):
        if not db.exists():
            partial = db.with_name(f"{name}.partial.duckdb")
            partial.unlink(missing_ok=True)
            build(partial)
            partial.rename(db)
    return db


def _copy_of(template: Path, tmp_path_factory: pytest.TempPathFactory, name: str) -> object:
    """A writable store of the module's own, copied from a store ingested once per session."""
    from prism_trace.store.connection import open_store

    return open_store(copy_of_template(template, tmp_path_factory, name))


@pytest.fixture(scope="session")
def sample_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample ingested once per test run as run `sample` (a closed store file)."""
    return built_once(
        tmp_path_factory,
        "sample",
        lambda db: ingest_runs(db, {"sample": [SAMPLE]}).close(),  # type: ignore[attr-defined]
    )


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory: pytest.TempPathFactory, sample_template: Path) -> object:
    """A store per test module holding the bundled sample as run `sample`."""
    return _copy_of(sample_template, tmp_path_factory, "sample")


def _slice_sample(template: Path, db: Path) -> None:
    """The sample, its graph and three `tp=2,dp=N,pp=2` slices: runs `s4`, `s2048`, `s16384`."""
    from prism_trace.graph.build import build_graph
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.slicer import slice_run
    from prism_trace.store.connection import open_store

    shutil.copyfile(template, db)
    with open_store(db) as store:
        build_graph(store, "sample")
        for dp in (4, 2048, 16384):
            layout = ParallelLayout.parse(f"tp=2,dp={dp},pp=2")
            slice_run(store, run="sample", layout=layout, world=layout.world_size, out_run=f"s{dp}")


@pytest.fixture(scope="session")
def sliced_sample_template(tmp_path_factory: pytest.TempPathFactory, sample_template: Path) -> Path:
    """The sample, its graph and its slices to 16, 8192 and 65536 ranks, built once per test run."""
    return built_once(
        tmp_path_factory, "sample_sliced", lambda db: _slice_sample(sample_template, db)
    )


@pytest.fixture(scope="module")
def sliced_sample_store(
    tmp_path_factory: pytest.TempPathFactory, sliced_sample_template: Path
) -> object:
    """A store per test module holding `sample` with its graph and the slices `s4`, `s2048` and
    `s16384` (`tp=2,dp=N,pp=2`)."""
    return _copy_of(sliced_sample_template, tmp_path_factory, "sliced")


@pytest.fixture(scope="session")
def dlrm_hta_template(tmp_path_factory: pytest.TempPathFactory, shared_datasets: Path) -> Path:
    """param-dlrm-8rank as `dlrm` and hta-nccl-rank0 as `hta`, ingested once per test run."""
    runs = {
        "dlrm": [shared_datasets / "param-dlrm-8rank"],
        "hta": [shared_datasets / "hta-nccl-rank0"],
    }
    return built_once(
        tmp_path_factory,
        "dlrm_hta",
        lambda db: ingest_runs(db, runs).close(),  # type: ignore[attr-defined]
    )


def _emulate_st(shared_datasets: Path, db: Path) -> None:
    from prism_trace.replay import emulate_run

    store = ingest_runs(db, {"st": [shared_datasets / "megatron-straggler-st-8rank"]})
    emulate_run(store, run="st", out_run="st_emu")  # type: ignore[arg-type]
    store.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def st_emulated_template(tmp_path_factory: pytest.TempPathFactory, shared_datasets: Path) -> Path:
    """The ST op timeline as `st` and its emulation `st_emu`, built once per test run."""
    return built_once(tmp_path_factory, "st_emulated", lambda db: _emulate_st(shared_datasets, db))


def sample_copy(template: Path, db: Path, run: str = "sample") -> Store:
    """A store at ``db`` holding the sample as ``run``: a copy of ``sample_template`` with the
    run renamed (the name lives in the `run` row only), instead of another 5 s ingest."""
    from prism_trace.store.connection import open_store

    shutil.copyfile(template, db)
    store = open_store(db)
    if run != "sample":
        store.con.execute("UPDATE run SET name = ? WHERE name = 'sample'", [run])
    return store


def copy_of_template(template: Path, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A writable copy of a template store file, in a new temporary folder of its own."""
    db = tmp_path_factory.mktemp(name) / template.name
    shutil.copyfile(template, db)
    return db


@pytest.fixture(scope="session")
def real_template(tmp_path_factory: pytest.TempPathFactory, shared_datasets: Path) -> Path:
    """The ST op timeline, dlrm and the 64-rank Chakra ResNet, ingested once per test run."""
    runs = {
        "st": [shared_datasets / "megatron-straggler-st-8rank"],
        "dlrm": [shared_datasets / "param-dlrm-8rank"],
        "resnet": [shared_datasets / CHAKRA_RESNET],
    }
    return built_once(
        tmp_path_factory,
        "real",
        lambda db: ingest_runs(db, runs).close(),  # type: ignore[attr-defined]
    )


@pytest.fixture(scope="module")
def real_store(tmp_path_factory: pytest.TempPathFactory, real_template: Path) -> object:
    """A store per test module holding the ST op timeline, dlrm and the 64-rank Chakra ResNet."""
    return _copy_of(real_template, tmp_path_factory, "real")


def _file_seconds() -> dict[str, float]:
    """Each test file's seconds in the last recorded full run (empty when unreadable)."""
    try:
        data = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files run costliest first; a file's tests keep their order.

    Under ``--dist loadfile`` a file runs on one worker and each worker takes the next file as it
    finishes one, so handing out the longest files first leaves the least idle time at the end.
    The cost is each file's seconds in the last full run (``file_seconds.json``, written by
    ``benchmarks/bench_test_time.py --save-file-seconds``); a file it lacks counts as all-slow
    files do not: files whose every test is slow, then the others, in collection order.
    """
    every_slow: dict[str, bool] = {}
    for item in items:
        file = item.nodeid.split("::")[0]
        slow = item.get_closest_marker("slow") is not None
        every_slow[file] = every_slow.get(file, True) and slow
    seconds = _file_seconds()

    def cost(item: pytest.Item) -> tuple[float, bool]:
        file = item.nodeid.split("::")[0]
        return (-seconds.get(file, 0.0), not every_slow[file])

    items.sort(key=cost)


def store_contents(store: Store) -> dict[str, list[tuple]]:
    """Every row of every table, sorted: what a refused command must leave exactly as it was."""
    from prism_trace.store.tables import TABLES

    return {
        t.name: store.con.execute(f"SELECT * FROM {t.name} ORDER BY ALL").fetchall() for t in TABLES
    }


def db_contents(db: Path) -> dict[str, list[tuple]]:
    """``store_contents`` of the store at ``db``, opened read-only."""
    from prism_trace.store.connection import open_store

    with open_store(db, read_only=True) as store:
        return store_contents(store)

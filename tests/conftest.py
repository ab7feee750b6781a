"""Shared fixtures: where the real public traces are, and the bundled generated sample."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

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
    from prism_trace.ingest import ingest
    from prism_trace.store import open_store

    store = open_store(db)
    for name, paths in runs.items():
        ingest(store, paths, run=name, progress=False)
    return store


def _copy_of(template: Path, tmp_path_factory: pytest.TempPathFactory, name: str) -> object:
    """A writable store of the module's own, copied from a store ingested once per session."""
    from prism_trace.store import open_store

    db = tmp_path_factory.mktemp(name) / template.name
    shutil.copyfile(template, db)
    return open_store(db)


@pytest.fixture(scope="session")
def sample_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample ingested once per session as run `sample` (a closed store file)."""
    db = tmp_path_factory.mktemp("sample_template") / "s.duckdb"
    ingest_runs(db, {"sample": [SAMPLE]}).close()  # type: ignore[attr-defined]
    return db


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory: pytest.TempPathFactory, sample_template: Path) -> object:
    """A store per test module holding the bundled sample as run `sample`."""
    return _copy_of(sample_template, tmp_path_factory, "sample")


@pytest.fixture(scope="session")
def real_template(tmp_path_factory: pytest.TempPathFactory, shared_datasets: Path) -> Path:
    """The ST op timeline, dlrm and the 64-rank Chakra ResNet, ingested once per session."""
    db = tmp_path_factory.mktemp("real_template") / "r.duckdb"
    ingest_runs(
        db,
        {
            "st": [shared_datasets / "megatron-straggler-st-8rank"],
            "dlrm": [shared_datasets / "param-dlrm-8rank"],
            "resnet": [shared_datasets / CHAKRA_RESNET],
        },
    ).close()  # type: ignore[attr-defined]
    return db


@pytest.fixture(scope="module")
def real_store(tmp_path_factory: pytest.TempPathFactory, real_template: Path) -> object:
    """A store per test module holding the ST op timeline, dlrm and the 64-rank Chakra ResNet."""
    return _copy_of(real_template, tmp_path_factory, "real")

"""Shared fixtures: where the real public traces are, and the bundled generated sample."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory: pytest.TempPathFactory) -> object:
    """A store per test module holding the bundled sample as run `sample`."""
    return ingest_runs(tmp_path_factory.mktemp("sample") / "s.duckdb", {"sample": [SAMPLE]})


@pytest.fixture(scope="module")
def real_store(tmp_path_factory: pytest.TempPathFactory, shared_datasets: Path) -> object:
    """A store per test module holding the ST op timeline, dlrm and the 64-rank Chakra ResNet."""
    return ingest_runs(
        tmp_path_factory.mktemp("real") / "r.duckdb",
        {
            "st": [shared_datasets / "megatron-straggler-st-8rank"],
            "dlrm": [shared_datasets / "param-dlrm-8rank"],
            "resnet": [shared_datasets / CHAKRA_RESNET],
        },
    )

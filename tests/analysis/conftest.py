"""Stores for the analysis tests: the bundled sample, and the real DLRM and HTA-NCCL traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_trace.ingest import ingest
from prism_trace.store import Store, open_store

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"


@pytest.fixture(scope="session")
def sample_store(sample_template: Path) -> Store:
    """The bundled gloo CPU sample as run `sample` (the session's one ingest), read-only."""
    return open_store(sample_template, read_only=True)


@pytest.fixture(scope="session")
def real_store(shared_datasets: Path, tmp_path_factory: pytest.TempPathFactory) -> Store:
    """param-dlrm-8rank as run `dlrm` and hta-nccl-rank0 as run `hta`, reopened read-only."""
    db = tmp_path_factory.mktemp("analysis_real") / "r.duckdb"
    with open_store(db) as s:
        ingest(s, [shared_datasets / "param-dlrm-8rank"], run="dlrm", progress=False)
        ingest(s, [shared_datasets / "hta-nccl-rank0"], run="hta", progress=False)
    return open_store(db, read_only=True)

"""Stores for the analysis tests: the bundled sample, and the real DLRM and HTA-NCCL traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_trace.store.connection import Store, open_store


@pytest.fixture(scope="session")
def sample_store(sample_template: Path) -> Store:
    """The bundled gloo CPU sample as run `sample` (the session's one ingest), read-only."""
    return open_store(sample_template, read_only=True)


@pytest.fixture(scope="session")
def real_store(dlrm_hta_template: Path) -> Store:
    """param-dlrm-8rank as run `dlrm` and hta-nccl-rank0 as run `hta` (the session's one ingest),
    read-only."""
    return open_store(dlrm_hta_template, read_only=True)

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

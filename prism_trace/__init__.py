"""prism-trace: ingest profiler traces of a few ranks into DuckDB, and reason about the full job.

The Python API, one name per step of the walkthrough (docs/api.md shows a session):
``open_store`` -> ``ingest`` -> ``set_up_graph`` (or ``build_graph``) -> ``slice_run`` ->
``emulate_run`` -> ``validate_run`` / ``analyze``, and ``predict_run`` with ``compare_runs`` (a
small recording emulated at a larger one's scale and compared with it); the layout types
(``ParallelLayout``, ``ParallelAxis``), the emulation's config (``EmulationConfig``,
``parse_what_if``, ``Topology``) and every error class. This facade sits on top of the layers,
like the CLI: each name loads its module on first use, so ``import prism_trace`` stays cheap and
torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prism_trace.errors import (
    CollectiveMismatchError,
    ConfigError,
    CorruptStoreError,
    DuplicateRankError,
    DuplicateRunError,
    MissingExtensionError,
    MissingFieldError,
    NotAStoreError,
    OutOfMemoryError,
    OutputError,
    PrismError,
    ProcessFailedError,
    QueryError,
    RankUnknownError,
    RunNotFoundError,
    RunStateError,
    SchemaVersionError,
    SelectionError,
    StoreError,
    StoreLockedError,
    TraceFormatError,
    TruncatedTraceError,
    UnknownFormatError,
    UsageError,
)
from prism_trace.lazy_exports import lazy_exports
from prism_trace.version import __version__

if TYPE_CHECKING:
    from prism_trace.analysis import analyze
    from prism_trace.analysis.prediction.compare import compare_runs
    from prism_trace.graph.build import build_graph
    from prism_trace.graph.set_up import set_up_graph
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.layout.mesh import ParallelAxis, ParallelLayout
    from prism_trace.replay.emulate.config import EmulationConfig
    from prism_trace.replay.emulate.driver import emulate_run
    from prism_trace.replay.model.topology import Topology
    from prism_trace.replay.predict.run import predict_run
    from prism_trace.replay.validate.emulated import validate_run
    from prism_trace.replay.validate.replayed import validate_replayed
    from prism_trace.replay.whatif.config import WhatIfConfig, parse_what_if
    from prism_trace.slicing.slicer import slice_run
    from prism_trace.store.connection import Store, open_store

_API = {
    "EmulationConfig": "replay.emulate.config",
    "ParallelAxis": "layout.mesh",
    "ParallelLayout": "layout.mesh",
    "Store": "store.connection",
    "Topology": "replay.model.topology",
    "WhatIfConfig": "replay.whatif.config",
    "analyze": "analysis",
    "build_graph": "graph.build",
    "compare_runs": "analysis.prediction.compare",
    "emulate_run": "replay.emulate.driver",
    "ingest": "ingestion.pipeline",
    "open_store": "store.connection",
    "parse_what_if": "replay.whatif.config",
    "predict_run": "replay.predict.run",
    "set_up_graph": "graph.set_up",
    "slice_run": "slicing.slicer",
    "validate_replayed": "replay.validate.replayed",
    "validate_run": "replay.validate.emulated",
}

__all__ = [
    "CollectiveMismatchError",
    "ConfigError",
    "CorruptStoreError",
    "DuplicateRankError",
    "DuplicateRunError",
    "EmulationConfig",
    "MissingExtensionError",
    "MissingFieldError",
    "NotAStoreError",
    "OutOfMemoryError",
    "OutputError",
    "ParallelAxis",
    "ParallelLayout",
    "PrismError",
    "ProcessFailedError",
    "QueryError",
    "RankUnknownError",
    "RunNotFoundError",
    "RunStateError",
    "SchemaVersionError",
    "SelectionError",
    "Store",
    "StoreError",
    "StoreLockedError",
    "Topology",
    "TraceFormatError",
    "TruncatedTraceError",
    "UnknownFormatError",
    "UsageError",
    "WhatIfConfig",
    "__version__",
    "analyze",
    "build_graph",
    "compare_runs",
    "emulate_run",
    "ingest",
    "open_store",
    "parse_what_if",
    "predict_run",
    "set_up_graph",
    "slice_run",
    "validate_replayed",
    "validate_run",
]
__getattr__, __dir__ = lazy_exports(__name__, _API)

"""prism-trace: ingest profiler traces of a few ranks into DuckDB, and reason about the full job."""

from prism_trace.errors import (
    CollectiveMismatchError,
    DuplicateRankError,
    DuplicateRunError,
    MissingFieldError,
    OutOfMemoryError,
    PrismError,
    SchemaVersionError,
    StoreLockedError,
    TraceFormatError,
    TruncatedTraceError,
    UnknownFormatError,
)
from prism_trace.version import __version__

__all__ = [
    "CollectiveMismatchError",
    "DuplicateRankError",
    "DuplicateRunError",
    "MissingFieldError",
    "OutOfMemoryError",
    "PrismError",
    "SchemaVersionError",
    "StoreLockedError",
    "TraceFormatError",
    "TruncatedTraceError",
    "UnknownFormatError",
    "__version__",
]

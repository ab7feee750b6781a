"""The one exception tree of prism-trace: every failure a user can cause has a named class here.

Messages follow one shape so that a script or a person can act on them from a single line:
``<file>: <what is wrong> [at <event/node/offset>] [hint]``.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "DuplicateRankError",
    "DuplicateRunError",
    "MissingFieldError",
    "OutOfMemoryError",
    "PrismError",
    "RankUnknownError",
    "SchemaVersionError",
    "StoreLockedError",
    "TraceFormatError",
    "TruncatedTraceError",
    "UnknownFormatError",
]


class PrismError(Exception):
    """Base of every error prism-trace raises on purpose; the CLI prints these as one line."""


class TraceFormatError(PrismError, ValueError):
    """A trace file is not valid for its format: corrupt JSON/protobuf, wrong types, bad values."""


class TruncatedTraceError(TraceFormatError):
    """A trace file ends early: a cut gzip stream, JSON or a length-delimited protobuf record."""


class UnknownFormatError(TraceFormatError):
    """A file matches none of the supported trace formats."""


class MissingFieldError(TraceFormatError):
    """A field the format requires is absent."""


class RankUnknownError(TraceFormatError):
    """The rank of a trace cannot be told from its content or its file name."""


class DuplicateRankError(PrismError, ValueError):
    """The same rank would appear twice in one run."""


class DuplicateRunError(PrismError, ValueError):
    """A run name already exists in the store (use ``--replace``)."""


class CollectiveMismatchError(PrismError, ValueError):
    """A collective does not match across ranks: a count differs or a participant is missing."""


class SchemaVersionError(PrismError):
    """The store was written by an incompatible version of the schema."""


class StoreLockedError(PrismError):
    """Another process holds the DuckDB file open for writing."""


class OutOfMemoryError(PrismError):
    """DuckDB ran out of memory while ingesting a file: the machine's fault, not the file's."""

    @classmethod
    def of(cls, path: object, doing: str, first_line: str) -> OutOfMemoryError:
        """The one line for ``path``, saying what to change. (A classmethod, not ``__init__``:
        a worker's error crosses to the driver pickled, which calls ``cls(message)``.)"""
        return cls(
            f"{path}: DuckDB ran out of memory {doing} ({first_line}); raise"
            " PRISM_INGEST_MEMORY_LIMIT (e.g. 4GB), ingest with fewer --workers, or free memory"
        )

"""The one exception tree of prism-trace: every failure a user can cause has a named class here.

Messages follow one shape so that a script or a person can act on them from a single line:
``<file>: <what is wrong> [at <event/node/offset>] [hint]``.

The classes say what kind of thing was refused, so a script catches what it expects and a test
asserts the kind; each also derives from the built-in exception a Python caller would expect
(``ValueError`` for a refused value, ``LookupError`` for a name or rank that is not there,
``RuntimeError`` for a child process that failed). Packages add their own subclasses where a
concern has a family of refusals (``SliceError``, ``LayoutError``, the replay's
``TopologyError``, ``WhatIfError``, ``EmulationConfigError`` under `ConfigError` ...).
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "ConfigError",
    "CorruptStoreError",
    "DuplicateRankError",
    "DuplicateRunError",
    "MissingExtensionError",
    "MissingFieldError",
    "NotAStoreError",
    "OutOfMemoryError",
    "OutputError",
    "PrismError",
    "ProcessFailedError",
    "QueryError",
    "RankUnknownError",
    "RunNotFoundError",
    "RunStateError",
    "SchemaVersionError",
    "SelectionError",
    "StoreError",
    "StoreLockedError",
    "TraceFormatError",
    "TruncatedTraceError",
    "UnknownFormatError",
    "UsageError",
]


class PrismError(Exception):
    """Base of every error prism-trace raises on purpose; the CLI prints these as one line."""


class UsageError(PrismError, ValueError):
    """Options that must go together or exclude each other, or an option value out of its range.

    Raised for ``--workers``/``--engine``/``--scheduler`` of ingest, a malformed rank list, a world
    size or rank outside the world of ``prism run``, a blank run name, ``--out-run`` naming the
    input run, an unknown analysis word or window, ``--compare`` where it is unused, and an
    option this machine cannot serve (``--engine dask`` without dask, ``--device cuda`` without
    enough GPUs). Not to be confused with ``click.UsageError``, which click raises while parsing.
    """


class ConfigError(PrismError, ValueError):
    """A config file or a config value refused.

    A ``--config`` TOML file that cannot be read, is not TOML, or holds an unknown section or key,
    a value of the wrong type or one its dataclass refuses (``replay.config_file``); a value a
    config dataclass refuses however it is given (``TimingConfig``, ``CompletionConfig``, and the
    replay's subclasses ``TopologyError``, ``WhatIfError``, ``EmulationConfigError``,
    ``ReplayOptionsError``); an environment variable out of range (``PRISM_INGEST_MEMORY_LIMIT``);
    a ``prism`` process group that does not fit its ``configure(...)``.
    """


class RunNotFoundError(PrismError, LookupError):
    """No run of that name in the store (``Store.require_run``)."""


class SelectionError(PrismError, LookupError):
    """Ranks or iterations a run does not hold: ``--ranks``, ``--iteration``, a rank to replay or
    export, a rank without events to stand for it."""


class RunStateError(PrismError, ValueError):
    """A run of the wrong kind or state for the command.

    No graph (or no timeline to build one), not recorded where a recording is needed (validate),
    not replayed (``--replayed``), no iterations to compare, no coordinates for a ``--by``, no
    host ET or compute ops to replay, no stored config to print, a run ``--replace`` may not
    overwrite, or a launched run that measured no step.
    """


class QueryError(PrismError):
    """A SQL statement refused: empty, several statements, one that would write files, or one the
    store fails to run (``prism query``)."""


class OutputError(PrismError):
    """An output path refused or not writable: a folder where a file is wanted, a parent that is
    a file, or the OS refusing the write (``prism_trace.outputs`` and the writers)."""


class StoreError(PrismError):
    """A store that cannot be used: not a store, of another schema version, or locked."""


class NotAStoreError(StoreError):
    """A path that is no prism store: missing, not a DuckDB file, without the ``meta`` table,
    a folder that is no prism Parquet export, or a file DuckDB cannot open."""


class SchemaVersionError(StoreError):
    """The store was written by an incompatible version of the schema."""


class CorruptStoreError(StoreError):
    """A DuckDB store file that is damaged: shorter than its header says (cut short), or a block
    whose checksum DuckDB finds wrong (flipped bytes); the message names the file."""


class MissingExtensionError(StoreError):
    """A DuckDB extension the command needs (httpfs, for ``--parquet s3://...``) is not
    installed; prism never downloads one implicitly."""


class StoreLockedError(StoreError):
    """Another process holds the DuckDB file open for writing."""


class ProcessFailedError(PrismError, RuntimeError):
    """A child process prism started failed or did not finish: an ingest worker that died, a
    rank of `prism run` that failed or outlived its timeout, a replay process that raised."""


class TraceFormatError(PrismError, ValueError):
    """A trace file is not valid for its format: corrupt JSON/protobuf, wrong types, bad values;
    also a path given to ingest that does not exist or holds no trace files."""


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
    """A collective does not match across ranks: a count differs or a participant is missing
    (at ingest, or between the real ranks of a replay)."""


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

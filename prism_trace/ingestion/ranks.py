"""Which file gave each rank what, and the checks that refuse a set of files before its rows are
stored: a rank given twice, a rank or world size out of bounds, a file given twice or ingested
already."""

from __future__ import annotations

from pathlib import Path

from prism_trace.errors import DuplicateRankError, TraceFormatError
from prism_trace.formats.base import TraceTables
from prism_trace.ingestion.discover import TraceFile, fingerprint
from prism_trace.limits import check_rank, check_world_size
from prism_trace.store.connection import Store

__all__: list[str] = []


def _clash(path: Path, rank: int, other: Path) -> DuplicateRankError:
    """The error for a rank ``path`` gives that ``other`` gave already."""
    msg = (
        f"{path}: rank {rank} appears twice in one run (also in {other});"
        " ingest each job as its own --run"
    )
    return DuplicateRankError(msg)


class _RankBook:
    """Which file gave each rank what, so clashes are caught as files stream in."""

    def __init__(self) -> None:
        self.timeline: dict[int, tuple[str, Path]] = {}
        self.host_et: dict[int, Path] = {}

    def add(self, t: TraceTables) -> None:
        """Record ``t``'s ranks: a rank has one timeline source and one host ET at most.

        Raises:
            DuplicateRankError: another file gave one of them the same kind of source.
        """
        for r in t.rank_ids:
            if t.format == "host_et":
                other = self.host_et.get(r)
                self.host_et[r] = t.path
            else:
                prev = self.timeline.get(r)
                other = None if prev is None else prev[1]
                self.timeline[r] = (t.format, t.path)
            if other is not None:
                raise _clash(t.path, r, other)

    @property
    def ranks(self) -> list[int]:
        """Every rank some file gave, sorted."""
        return sorted(set(self.timeline) | set(self.host_et))


class _WorldSizes:
    """The world size each file states, so that two files of one job that disagree are refused
    (a rank of 8 beside a rank of 2 is two jobs, or a corrupt header)."""

    def __init__(self) -> None:
        self.first: tuple[int, Path] | None = None

    def check(self, path: Path, size: int) -> None:
        """Record ``path``'s world ``size``; refuse it if an earlier file stated another.

        Raises:
            TraceFormatError: one line naming both files and both sizes.
        """
        if self.first is None:
            self.first = (size, path)
            return
        size0, path0 = self.first
        if size != size0:
            msg = (
                f"{path}: world size {size} disagrees with {size0} in {path0}; the files of one"
                " run are one job"
            )
            raise TraceFormatError(msg)


def _check_bounds(t: TraceTables) -> None:
    """Whatever a reader let through, no rank or world size beyond ``MAX_RANKS`` is stored:
    ingest builds the default group's member list from them."""
    if t.world_size is not None:
        check_world_size(t.path, t.world_size, "the world size")
    for r in t.rank_ids:
        check_rank(t.path, r, "a rank")
        if t.world_size is not None and r >= t.world_size:
            msg = f"{t.path}: rank {r} is not below the world size {t.world_size} it states"
            raise TraceFormatError(msg)


def _check_fingerprints(store: Store, files: list[TraceFile], old_id: int | None) -> list[str]:
    """Refuse a file given twice in one ingest; returns each file's fingerprint (stored in
    ``source_file``).

    A file already ingested into another run of the store is taken again: runs are
    independent copies, and comparing two views of one recording (``prism diff`` of rank 3
    against rank 1 of the same job, or a run against its re-ingest with another layout) needs
    the file in both. ``source_file`` tells which runs share a file.
    """
    prints = [fingerprint(f.path) for f in files]
    seen_fp: dict[str, Path] = {}
    for f, fp in zip(files, prints, strict=True):
        if fp in seen_fp:
            msg = f"{f.path}: same content as {seen_fp[fp]}; each file may be given once"
            raise DuplicateRankError(msg)
        seen_fp[fp] = f.path
    del store, old_id  # other runs may hold the same file
    return prints

"""Where a command writes: one rule for output files and folders, and one-line refusals.

The rule every writer follows (`prism query -o`, `prism export ... -o`, `prism report -o`):
missing parent folders are created; an output *file* must not be an existing folder; an output
*folder* must be new or empty, so files of an earlier export never mix in. A path that cannot be
created or written (a read-only or special file system, a parent that is a file) is one
``OutputError`` naming it, never an ``OSError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from prism_trace.errors import OutputError

__all__ = ["output_dir", "output_file", "write_errors"]


def _reason(exc: OSError) -> str:
    """The OS's words for ``exc`` (``Permission denied``), without the errno and the path."""
    return exc.strerror or type(exc).__name__


@contextlib.contextmanager
def write_errors(path: Path) -> Iterator[None]:
    """Writes in this block: an ``OSError`` becomes one line naming ``path``.

    Raises:
        OutputError: the block raised an ``OSError``.
    """
    try:
        yield
    except OSError as exc:
        msg = f"{path}: cannot write: {_reason(exc)}"
        raise OutputError(msg) from exc


def _check_parents(path: Path) -> None:
    """Refuse ``path`` when one of its parents is a file (the OS would only say "File exists").

    Raises:
        OutputError: naming ``path`` and the parent that is not a folder.
    """
    blocker = next((p for p in path.parents if p.exists() or p.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        msg = f"{path}: cannot write: {blocker} is not a folder"
        raise OutputError(msg)


def output_file(path: Path, *, create: bool = True) -> Path:
    """``path``, ready to be written as a file: not a folder, its parent folders created.

    Args:
        path: the file.
        create: create the missing parent folders (``mkdir -p``); False only checks, so a
            command whose work takes long (a report) can refuse a bad path before that work,
            and create nothing when the work fails.

    Raises:
        OutputError: ``path`` is a folder, a parent is a file, or a parent cannot be created.
    """
    if path.is_dir():
        msg = f"{path}: is a folder; give a file path"
        raise OutputError(msg)
    _check_parents(path)
    if create:
        with write_errors(path):
            path.parent.mkdir(parents=True, exist_ok=True)
    return path


def output_dir(path: Path, *, create: bool = True) -> Path:
    """``path`` as a new or empty folder to write an export into, created with its parents.

    Args:
        path: the folder.
        create: create it; False only checks, so a command can refuse before its work and
            create the folder once it has something to write.

    Raises:
        OutputError: ``path`` is a file, a folder that is not empty, or cannot be created.
    """
    if path.exists() and not path.is_dir():
        msg = f"{path}: exists and is not a folder; give a new folder"
        raise OutputError(msg)
    if path.is_dir():
        with write_errors(path):
            first = min((p.name for p in path.iterdir()), default=None)
        if first is not None:
            msg = f"{path}: exists and is not empty (holds {first!r}); give a new folder"
            raise OutputError(msg)
    _check_parents(path)
    if create:
        with write_errors(path):
            path.mkdir(parents=True, exist_ok=True)
    return path

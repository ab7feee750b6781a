"""Where a command writes: one rule for every output file and folder, and one-line refusals.

The rule every writer follows (`prism query -o`, `prism export ... -o`, `prism report -o`):

- the target is a regular file (or, for an export folder, a new or empty folder) or does not
  exist yet; a character device (``/dev/full``), a FIFO, a socket or a block device is refused,
  never written through or replaced;
- a symbolic link is not followed out of its folder (a link to ``/proc/self/fd/1`` or to a file
  elsewhere is refused) unless the user asks (``--follow-symlinks``), and then the file it
  points to is written;
- the output is written to a temporary file (folder) beside the target and renamed into place
  only when complete, so a failed or killed write leaves the old target as it was and never a
  half file under the target's name (a hidden ``.<name>.*.part`` may remain after a SIGKILL);
- missing parent folders are created; a path that cannot be created or written is one
  ``OutputError`` naming it, never an ``OSError``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from prism_trace.errors import OutputError

__all__ = [
    "atomic_dir",
    "atomic_file",
    "output_dir",
    "output_file",
    "write_errors",
]

_KINDS = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


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


def _lstat(path: Path) -> os.stat_result | None:
    """``path``'s own status (a link's, not its target's), or None when nothing is there."""
    try:
        return path.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        msg = f"{path}: cannot write: {_reason(exc)}"
        raise OutputError(msg) from exc


def _unlinked(path: Path, *, follow_symlinks: bool) -> Path:
    """``path``, or where its symbolic link points when that stays in its folder or the user
    asked to follow links.

    Raises:
        OutputError: a link out of its folder (to ``/proc/self/fd/1``, to a file elsewhere)
            without ``follow_symlinks``.
    """
    st = _lstat(path)
    if st is None or not stat.S_ISLNK(st.st_mode):
        return path
    real = Path(os.path.realpath(path))
    if follow_symlinks or real.parent == Path(os.path.realpath(path.parent)):
        return real
    msg = (
        f"{path}: is a symbolic link to {os.readlink(path)!r}, outside its folder; give another"
        " path, or --follow-symlinks to write where it points"
    )
    raise OutputError(msg)


def _special(path: Path, st: os.stat_result) -> None:
    """Refuse a device, FIFO or socket at ``path`` (neither a file nor a folder)."""
    kind = _KINDS.get(stat.S_IFMT(st.st_mode))
    if kind is not None:
        msg = f"{path}: is {kind}, not a regular file; give a file path"
        raise OutputError(msg)


def output_file(path: Path, *, create: bool = True, follow_symlinks: bool = False) -> Path:
    """``path``, checked to be written as a file, its parent folders created.

    Args:
        path: the file.
        create: create the missing parent folders (``mkdir -p``); False only checks, so a
            command whose work takes long (a report) can refuse a bad path before that work,
            and create nothing when the work fails.
        follow_symlinks: write where a symbolic link at ``path`` points, wherever that is.

    Returns:
        The file to write: ``path``, or the file its link points to.

    Raises:
        OutputError: ``path`` is a folder, a device, FIFO or socket, a link out of its folder,
            a parent is a file, or a parent cannot be created.
    """
    _check_parents(Path(path))
    path = _unlinked(Path(path), follow_symlinks=follow_symlinks)
    st = _lstat(path)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            msg = f"{path}: is a folder; give a file path"
            raise OutputError(msg)
        _special(path, st)
    _check_parents(path)
    if create:
        with write_errors(path):
            path.parent.mkdir(parents=True, exist_ok=True)
    return path


def output_dir(path: Path, *, create: bool = True, follow_symlinks: bool = False) -> Path:
    """``path`` as a new or empty folder to write an export into, its parents created.

    Args:
        path: the folder.
        create: create its parent folders; False only checks, so a command can refuse before
            its work and create nothing when it fails. (The folder itself is made by
            ``atomic_dir``, which renames a complete one into place.)
        follow_symlinks: write where a symbolic link at ``path`` points, wherever that is.

    Returns:
        The folder to write: ``path``, or the folder its link points to.

    Raises:
        OutputError: ``path`` is a file, a device, a folder that is not empty, a link out of
            its folder, or its parent cannot be created.
    """
    _check_parents(Path(path))
    path = _unlinked(Path(path), follow_symlinks=follow_symlinks)
    st = _lstat(path)
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            _special(path, st)
            msg = f"{path}: exists and is not a folder; give a new folder"
            raise OutputError(msg)
        with write_errors(path):
            first = min((p.name for p in path.iterdir()), default=None)
        if first is not None:
            msg = f"{path}: exists and is not empty (holds {first!r}); give a new folder"
            raise OutputError(msg)
    _check_parents(path)
    if create:
        with write_errors(path):
            path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _mode(target: Path, default: int) -> int:
    """The permission bits the output gets: the replaced file's, else ``default`` less the
    umask (``mkstemp`` makes 0600 files, which a plain ``open`` would not)."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(target.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return default & ~umask


@contextlib.contextmanager
def atomic_file(path: Path, *, follow_symlinks: bool = False) -> Iterator[Path]:
    """A temporary file beside ``path`` to write; renamed onto ``path`` when the block ends.

    The target is checked as ``output_file`` checks it, before and again just before the
    rename; if the block raises, or the process dies, the target is left as it was.

    Yields:
        The temporary file's path (it exists, empty).

    Raises:
        OutputError: the target is refused, or a write or the rename fails.
    """
    target = output_file(Path(path), follow_symlinks=follow_symlinks)
    with write_errors(target):
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(name)
    try:
        with write_errors(target):
            yield tmp
            os.chmod(tmp, _mode(target, 0o666))
            st = _lstat(target)
            if st is not None and not stat.S_ISREG(st.st_mode):
                output_file(target)  # it changed under us: refuse it as at the start
            os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_dir(path: Path, *, follow_symlinks: bool = False) -> Iterator[Path]:
    """A temporary folder beside ``path`` to fill; renamed onto ``path`` when the block ends.

    ``path`` must be new or an empty folder (``output_dir``); a failed or killed export leaves
    no partial folder under its name.

    Yields:
        The temporary folder's path (it exists, empty).

    Raises:
        OutputError: the target is refused, filled meanwhile, or a write or the rename fails.
    """
    target = output_dir(Path(path), follow_symlinks=follow_symlinks)
    with write_errors(target):
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part"))
    try:
        with write_errors(target):
            yield tmp
            os.chmod(tmp, _mode(target, 0o777))
            # rename(2) replaces an empty folder and fails on one that was filled meanwhile.
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

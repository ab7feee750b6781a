"""Whether a file is a whole prism store: its DuckDB header, its length, and its schema's checksum.

DuckDB checks a block's checksum only when it reads the block, and reads data blocks lazily: a
store cut short after its last metadata block opened, and `info` and `query` read it as intact
(with tables emptied). The file's header says how many blocks it holds, so a short file is told
before DuckDB opens it. A file that is no DuckDB database (an SQLite file, which DuckDB would
try to open by downloading its sqlite extension; random bytes) is told by its magic bytes, and
a DuckDB database that is no prism store by its tables: a prism store has the ``meta`` table and
exactly the declared tables and columns, whose checksum ``schema_checksum`` is.
"""

from __future__ import annotations

import functools
import hashlib
import re
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from prism_trace.errors import CorruptStoreError, NotAStoreError
from prism_trace.store.tables import TABLES

if TYPE_CHECKING:
    import duckdb

__all__ = [
    "check_blocks",
    "check_store_file",
    "corrupt_store_error",
    "schema_checksum",
    "stored_schema_checksum",
]

_SQLITE_MAGIC = b"SQLite format 3\x00"
_DUCK_MAGIC = b"DUCK"
_HEADER = 4096
"""DuckDB's file starts with three 4 KiB headers: the main one, then two database headers
(written alternately; the one with the higher iteration is current)."""
_CORRUPT = re.compile(
    r"Corrupt database file|does not match stored checksum|Could not read enough bytes"
    r"|not a valid DuckDB database|Failed to read|block .* out of range",
    re.IGNORECASE,
)


def check_store_file(path: Path) -> bool:
    """Refuse ``path`` before DuckDB opens it when it is no DuckDB file; say whether it is
    shorter than its header says.

    A missing or empty file passes (a new store); so does a header this check cannot read (a
    DuckDB storage format it does not know), which DuckDB then judges. A file shorter than its
    header's block count is not always damaged: DuckDB truncates free blocks at the end after
    the header is written; ``check_blocks`` tells, once the file is open.

    Returns:
        True when the file is shorter than its header says (``check_blocks`` must look).

    Raises:
        NotAStoreError: a folder, a device, FIFO or socket, an SQLite database, or a file
            without DuckDB's magic bytes.
        CorruptStoreError: a DuckDB file shorter than its three headers.
    """
    try:
        st = path.stat()
        if stat.S_ISDIR(st.st_mode):
            msg = f"{path}: is a folder, not a prism-trace store (a DuckDB file)"
            raise NotAStoreError(msg)
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block DuckDB's open forever
            msg = f"{path}: is not a regular file (a device, FIFO or socket); not a store"
            raise NotAStoreError(msg)
        size = st.st_size
        if size == 0:
            return False
        with path.open("rb") as fh:
            head = fh.read(3 * _HEADER)
    except FileNotFoundError:
        return False
    except OSError as exc:
        msg = f"{path}: cannot read the store: {exc.strerror or type(exc).__name__}"
        raise NotAStoreError(msg) from exc
    if head.startswith(_SQLITE_MAGIC):
        msg = f"{path}: is an SQLite database, not a prism-trace store (a DuckDB file)"
        raise NotAStoreError(msg)
    if head[8:12] != _DUCK_MAGIC:
        msg = f"{path}: not a DuckDB database (no DuckDB header); not a prism-trace store"
        raise NotAStoreError(msg)
    if len(head) < 3 * _HEADER:
        msg = f"{path}: the store is cut short: {size} bytes, less than DuckDB's headers"
        raise CorruptStoreError(msg)
    expected = _expected_size(head)
    return expected is not None and size < expected


def check_blocks(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """Refuse a store one of whose blocks in use (a table's segment, a metadata block) lies past
    the end of its file: cut short after its metadata, DuckDB opened it and read the missing
    blocks' tables as empty.

    Raises:
        CorruptStoreError: naming the file, its size and the block past its end.
    """
    ((block_size,),) = con.execute("SELECT block_size FROM pragma_database_size()").fetchall()
    size = path.stat().st_size
    on_disk = (size - 3 * _HEADER) // int(block_size)
    tables = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
        ).fetchall()
    ]
    parts = [
        "SELECT max(greatest(block_id, coalesce(list_max(additional_block_ids), -1))) AS b"
        f" FROM pragma_storage_info('{t.replace(chr(39), chr(39) * 2)}')"
        for t in tables
    ]
    parts.append("SELECT max(block_id) AS b FROM pragma_metadata_info()")
    ((last,),) = con.execute(f"SELECT max(b) FROM ({' UNION ALL '.join(parts)})").fetchall()
    if last is not None and int(last) >= on_disk:
        msg = (
            f"{path}: the store is cut short: {size} bytes hold {on_disk} blocks, but block"
            f" {last} is in use; restore a copy or ingest again"
        )
        raise CorruptStoreError(msg)


def _expected_size(head: bytes) -> int | None:
    """The file size the current database header promises, or None when it is not readable.

    Each database header is: checksum, iteration, meta block, free list, block count, block
    allocation size (little-endian uint64s). The size is the headers plus ``count`` blocks.
    """
    best: tuple[int, int, int] | None = None
    for off in (_HEADER, 2 * _HEADER):
        _sum, iteration, _meta, _free, count, alloc = struct.unpack_from("<6Q", head, off)
        if count > 1 << 40 or alloc < 4096 or alloc > 1 << 30 or alloc & (alloc - 1):
            continue  # not a header of the layout known here
        if best is None or iteration > best[0]:
            best = (iteration, count, alloc)
    if best is None:
        return None
    return 3 * _HEADER + best[1] * best[2]


def corrupt_store_error(path: Path, exc: BaseException) -> CorruptStoreError | None:
    """DuckDB's error ``exc`` as one line naming ``path`` when it says the file is damaged
    (a block's checksum, a read past the end), else None."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if not _CORRUPT.search(str(exc)):
        return None
    msg = f"{path}: the store is damaged: {text[:200]}; restore a copy or ingest again"
    return CorruptStoreError(msg)


@functools.cache
def schema_checksum() -> str:
    """The checksum of the declared schema: every table's columns and types, in order."""
    text = "\n".join(f"{t.name}.{c.name} {c.type}" for t in TABLES for c in t.columns)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stored_schema_checksum(con: duckdb.DuckDBPyConnection) -> tuple[str, str | None]:
    """The checksum of the tables stored in ``con``'s database, as ``schema_checksum`` computes
    it of the declared ones, and the first difference from the declared schema (or None)."""
    rows = con.execute(
        "SELECT c.table_name, c.column_name, c.data_type FROM duckdb_columns() c"
        " JOIN duckdb_tables() t USING (database_name, schema_name, table_name)"
        " WHERE c.database_name = current_database() AND c.schema_name = 'main'"
        " ORDER BY c.table_name, c.column_index"
    ).fetchall()
    stored: dict[str, list[str]] = {}
    for table, column, dtype in rows:
        stored.setdefault(str(table), []).append(f"{table}.{column} {dtype}")
    lines: list[str] = []
    diff: str | None = None
    for t in TABLES:
        want = [f"{t.name}.{c.name} {c.type}" for c in t.columns]
        got = stored.pop(t.name, [])
        lines += got
        if diff is None and got != want:
            missing = next((w for w in want if w not in got), None)
            extra = next((g for g in got if g not in want), None)
            if missing:
                diff = f"table {t.name}: no column `{missing}`"
            elif extra:
                diff = f"table {t.name}: an extra column `{extra}`"
            else:
                diff = f"table {t.name}: its columns in another order"
    if diff is None and stored:
        diff = f"a table prism-trace does not declare: {min(stored)}"
    lines += [line for table in sorted(stored) for line in stored[table]]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16], diff

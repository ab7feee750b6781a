"""Loading a Kineto file's records into its work database: ``raw`` (every record of the events
array, in order, typed and checked) and ``ev0`` (its timed events)."""

from __future__ import annotations

import duckdb
import orjson

from prism_trace.errors import MissingFieldError, PrismError, TraceFormatError
from prism_trace.formats.kineto.sql import (
    _LOAD,
    _MAX_DUR_US,
    _MAX_TS_US,
    _SELECT_EXACT,
    _SELECT_FAST,
    ev0_sql,
)
from prism_trace.formats.kineto.work import _short, _Work

__all__: list[str] = []

# read_json buffers scale with the largest object allowed; a Kineto event is a few KB, and a file
# with a larger one is read again with the large limit (``load``).
_OBJECT_BYTES = 16 << 20
_OBJECT_BYTES_MAX = 1 << 30


class _Load(_Work):
    """The load stage of the reader (``reader._Reader``)."""

    def load_sql(self, select: str) -> str:
        """The load statement with ``select`` (the records' columns) at the object limit now."""
        return _LOAD.format(select=select.format(object_bytes=self.object_bytes))

    def read_records(self, select: str) -> None:
        """Make ``raw`` from the array's parts, or from the whole array if they are not JSON.

        A part is not valid JSON when a cut fell inside an event (a layout other than Kineto's
        one event a line); the whole array then goes to DuckDB as one file, which also gives
        the message for a trace that is really corrupt.
        """
        (keep_order,) = self.rows("SELECT current_setting('preserve_insertion_order')")[0]
        if not keep_order:
            msg = "the Kineto reader needs DuckDB's preserve_insertion_order on (its default)"
            raise PrismError(msg)
        parts = [str(p) for p in self.tef.parts]
        try:
            self.load_files(select, parts)
        except duckdb.Error as exc:
            if len(parts) == 1 or isinstance(exc, duckdb.OutOfMemoryException):
                raise self._fail(exc) from exc
            try:
                self.load_files(select, [str(self.tef.events_path)])
            except duckdb.Error as exc2:
                raise self._fail(exc2) from exc2

    def load_files(self, select: str, files: list[str]) -> None:
        """Run the load on ``files``; again with the large object limit if an event needs it."""
        try:
            self.con.execute(self.load_sql(select), [files])
        except duckdb.Error as exc:
            if "maximum_object_size" not in str(exc) or self.object_bytes == _OBJECT_BYTES_MAX:
                raise
            self.object_bytes = _OBJECT_BYTES_MAX
            self.con.execute(self.load_sql(select), [files])

    def load(self) -> None:
        """``raw``: every record of the array, in order, typed; ``ev0``: its timed events."""
        self.read_records(_SELECT_FAST)
        self.check_records()
        (lossy,) = self.rows("SELECT count(*) FROM raw WHERE ts_inexact")[0]
        if lossy:
            self.read_records(_SELECT_EXACT)
        bad = self.rows(
            """SELECT rowid, name, CASE WHEN ts_us_ns IS NULL THEN 'ts' ELSE 'pid' END
               FROM raw WHERE ph IN ('X', 'i', 'I') AND (ts_us_ns IS NULL OR pid IS NULL)
               ORDER BY rowid LIMIT 1"""
        )
        if bad:
            index, name, field = bad[0]
            msg = f"{self.path}: event #{index} ({name!r}) has no `{field}` at traceEvents[{index}]"
            raise MissingFieldError(msg)
        self.check_nested_keys()
        self.sql(ev0_sql(str(self.base_ns)))

    def check_nested_keys(self) -> None:
        """Refuse a key stated twice in an object nested in a record's ``args`` (the top level of
        ``args`` is checked as the records load, ``sql._SELECT_FAST``). Only ``args`` that hold a
        ``{`` after their first character can nest an object (real Kineto args rarely do), so the
        walk over every member (``json_tree``) runs on those alone."""
        dup = self.rows(
            """SELECT r.rowid, r.name, t.key
               FROM (SELECT rowid, name, args FROM raw WHERE args LIKE '{%{%') AS r,
                    json_tree(r.args) AS t
               WHERE t.key IS NOT NULL
               GROUP BY r.rowid, r.name, t.parent, t.key HAVING count(*) > 1
               ORDER BY r.rowid LIMIT 1"""
        )
        if dup:
            index, name, key = dup[0]
            label = f" ({name!r})" if isinstance(name, str) else ""
            msg = (
                f"{self.path}: traceEvents[{index}]{label}: duplicate key {key!r} in an object"
                " inside `args`; a key may appear once in an object"
            )
            raise TraceFormatError(msg)

    def check_records(self) -> None:
        """Refuse the file on its first record with a missing, mistyped or out-of-range field."""
        bad = self.rows(
            "SELECT rowid, name, bad, bad_value FROM raw"
            " WHERE bad IS NOT NULL ORDER BY rowid LIMIT 1"
        )
        if bad and bad[0][2] == "args key":
            index, name, _, key_json = bad[0]
            key = orjson.loads(key_json)
            label = f" ({name!r})" if isinstance(name, str) else ""
            msg = (
                f"{self.path}: traceEvents[{index}]{label}: duplicate key {key!r} in `args`;"
                " a key may appear once in an object"
            )
            raise TraceFormatError(msg)
        if bad:
            index, name, field, value = bad[0]
            what = "is missing" if value is None else f"is {_short(value)}"
            rules = {
                "ph": "a string",
                "ts": f"a number of µs below {_MAX_TS_US:.0e}",
                "dur": f"a number of µs in [0, {_MAX_DUR_US:.0e}]",
                "name": "a string",
                "pid": "an integer or a string",
                "tid": "an integer or a string",
                "cat": "a string",
                "args": "an object",
                "bp": "a string (a flow's binding point)",
                "s": "a string (an instant event's scope)",
            }
            label = f" ({name!r})" if name is not None else ""
            msg = (
                f"{self.path}: traceEvents[{index}]{label}: `{field}` {what};"
                f" expected {rules[field]}"
            )
            raise (MissingFieldError if value is None else TraceFormatError)(msg)

"""JSON output of every command: numbers stay numbers (DuckDB's HUGEINT sums arrive as Decimal)."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["dumps"]


def _plain(value: Any) -> Any:
    if isinstance(value, decimal.Decimal):
        # sum() over BIGINT is a HUGEINT, which reaches Python as Decimal: keep it a number.
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | frozenset | tuple):
        return sorted(value) if isinstance(value, set | frozenset) else list(value)
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return _finite(value.tolist())
    msg = f"cannot write {type(value).__name__} as JSON"
    raise TypeError(msg)


def _finite(value: Any) -> Any:
    """NaN and infinities are not JSON: they become null, as in pandas' and polars' writers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    """``obj`` as JSON text with numeric types kept; NaN/inf as null."""
    return json.dumps(_finite(obj), indent=indent, default=_plain, allow_nan=False)

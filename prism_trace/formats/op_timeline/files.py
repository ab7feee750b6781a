"""The files of an op timeline: the parquet of every rank's ops, its meta yaml and result json,
found beside each other, read and checked (types, ranges, nulls, duplicates) before any frame is
made."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import polars as pl

from prism_trace.errors import MissingFieldError, TraceFormatError
from prism_trace.formats.unique_keys import loads_unique, yaml_load_unique
from prism_trace.limits import (
    INT64_MAX,
    MAX_RANKS,
    check_count,
    check_regular_file,
    check_world_size,
    wrong_type,
)

__all__ = ["REQUIRED_COLUMNS", "sniff_op_timeline"]

REQUIRED_COLUMNS = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration")
"""Columns an op-timeline parquet must have."""

_ARG_COLUMNS = ("seq_id", "mc", "mb_id", "gmc")

_INTEGER = (
    pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt8, pl.UInt16, pl.UInt32, pl.UInt64,
)  # fmt: skip
_TIMES = ("start_ts", "duration")
# The parquet types each column may have; bools, structs, lists and strings for numbers are
# refused rather than cast.
_COLUMN_KINDS: dict[str, tuple[type, ...]] = {
    "optype": (pl.String, pl.Categorical, pl.Enum),
    "start_ts": (pl.Float32, pl.Float64, *_INTEGER),
    "duration": (pl.Float32, pl.Float64, *_INTEGER),
}
_MAX_SECONDS = 1e6  # an op or a step of more than 11 days is not a training step
_MAX_SIDECAR_BYTES = 64 << 20
# Parallel degrees of the meta yaml; each sizes the groups built, so each is checked the same way
# (`dsp_size` is StragglerAnalysis's name for the context-parallel degree).
_META_SIZES = ("dp_size", "pp_size", "tp_size", "cp_size", "dsp_size")


def _locate(path: Path) -> tuple[Path, Path | None, Path | None]:
    """The parquet, meta yaml and result json of an op timeline given as a file or a folder."""
    if path.is_dir():
        traces = sorted(path.glob("trace-*.parquet")) or sorted(path.glob("*.parquet"))
        if len(traces) != 1:
            found = [p.name for p in traces]
            msg = f"{path}: expected one `trace-<trial>.parquet`, found {found}"
            raise TraceFormatError(msg)
        parquet = traces[0]
    else:
        parquet = path
    folder = parquet.parent
    trial = parquet.stem[len("trace-") :] if parquet.stem.startswith("trace-") else None

    def beside(prefix: str, suffixes: tuple[str, ...]) -> Path | None:
        if trial is not None:
            for suf in suffixes:
                p = folder / f"{prefix}-{trial}{suf}"
                if p.is_file():
                    return p
        cands = sorted(p for suf in suffixes for p in folder.glob(f"{prefix}*{suf}"))
        return cands[0] if len(cands) == 1 else None

    return parquet, beside("meta", (".yaml", ".yml")), beside("result", (".json",))


def _read_meta(meta: Path | None) -> dict[str, Any]:
    """The meta yaml (``{}`` without one), its parallel sizes and world size checked."""
    if meta is None:
        return {}
    check_regular_file(meta)
    if meta.stat().st_size > _MAX_SIDECAR_BYTES:
        msg = f"{meta}: op-timeline meta is larger than {_MAX_SIDECAR_BYTES} bytes"
        raise TraceFormatError(msg)
    try:
        data = yaml_load_unique(meta.read_text(encoding="utf-8"), meta)
    except TraceFormatError:
        raise
    except (OSError, ValueError) as exc:  # unreadable, or not UTF-8
        msg = f"{meta}: cannot read op-timeline meta: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc
    if not isinstance(data, dict):
        msg = f"{meta}: op-timeline meta is not a mapping"
        raise TraceFormatError(msg)
    for key in _META_SIZES:
        if data.get(key) is not None:
            data[key] = check_count(meta, data[key], f"`{key}`")
    if data.get("world_size") is not None:
        data["world_size"] = check_world_size(meta, data["world_size"], "`world_size`")
    return data


def _read_step_base(result: Path | None) -> dict[int, float]:
    """``step_t_base`` of the result json (``{}`` without one): each step's recorded time, s."""
    if result is None:
        return {}
    check_regular_file(result)
    if result.stat().st_size > _MAX_SIDECAR_BYTES:
        msg = f"{result}: op-timeline result is larger than {_MAX_SIDECAR_BYTES} bytes"
        raise TraceFormatError(msg)
    try:
        data = loads_unique(result.read_text(encoding="utf-8"), result)
    except TraceFormatError:
        raise
    except (OSError, ValueError, RecursionError) as exc:
        msg = f"{result}: cannot read the op-timeline result: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc
    if not isinstance(data, dict):
        raise wrong_type(result, "the op-timeline result", data, "an object")
    base = data.get("step_t_base") or {}
    if not isinstance(base, dict):
        raise wrong_type(result, "`step_t_base`", base, "an object of step: seconds")
    try:
        out = {int(k): float(v) for k, v in base.items()}
    except (ValueError, TypeError, OverflowError) as exc:
        msg = f"{result}: cannot read `step_t_base`: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc
    for k, v in out.items():
        if not (math.isfinite(v) and 0 <= v <= _MAX_SECONDS):
            msg = f"{result}: `step_t_base` of step {k} is {v}, expected seconds in [0, 1e6]"
            raise TraceFormatError(msg)
    return out


def _read_parquet(parquet: Path) -> pl.DataFrame:
    """The ops, the required and optional columns only, checked and cast to the reader's types."""
    check_regular_file(parquet)
    try:
        schema = pl.read_parquet_schema(parquet)
    except Exception as exc:  # polars/pyarrow raise several unrelated types on bad files
        msg = f"{parquet}: not a readable parquet file: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc
    need = ", ".join(REQUIRED_COLUMNS)
    for col in REQUIRED_COLUMNS:
        if col not in schema:
            msg = f"{parquet}: missing required column `{col}` (an op timeline needs {need})"
            raise MissingFieldError(msg)
    cols = [*REQUIRED_COLUMNS, *(c for c in _ARG_COLUMNS if c in schema)]
    for col in cols:
        kinds = _COLUMN_KINDS.get(col, _INTEGER)
        if not any(isinstance(schema[col], k) for k in kinds):
            want = "a string" if col == "optype" else "numbers" if col in _TIMES else "integers"
            msg = f"{parquet}: column `{col}` is {schema[col]}, expected {want}"
            raise TraceFormatError(msg)
    try:
        df = pl.read_parquet(parquet, columns=cols)
    except Exception as exc:  # corrupt pages surface only on read
        msg = f"{parquet}: cannot read parquet data: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc
    nulls = df.select(pl.col(REQUIRED_COLUMNS).null_count()).row(0, named=True)
    bad = [c for c, k in nulls.items() if k]
    if bad:
        msg = f"{parquet}: null values in required columns {bad}"
        raise TraceFormatError(msg)
    # Values are checked in the file's own types, before the casts: a rank of 2**40 is then "row
    # N: `rank` is 1099511627776", not a failed i64 -> i32 conversion that names no row.
    _check_values(parquet, df)
    try:
        return df.with_columns(
            pl.col("dp_rank", "stage", "rank").cast(pl.Int32),
            pl.col("step").cast(pl.Int64),
            pl.col("optype").cast(pl.Utf8),
            pl.col("start_ts", "duration").cast(pl.Float64),
            *(pl.col(c).cast(pl.Int64) for c in _ARG_COLUMNS if c in schema),
        )
    except pl.exceptions.PolarsError as exc:
        msg = f"{parquet}: bad column types: {exc}".splitlines()[0]
        raise TraceFormatError(msg) from exc


def _check_values(parquet: Path, df: pl.DataFrame) -> None:
    """Refuse out-of-range values, naming the first bad row and its value.

    Runs on the columns as the file types them, so a value no cast could hold is still reported
    with its row rather than as a failed conversion of the whole column.
    """
    rules = [
        ("rank", (pl.col("rank") >= 0) & (pl.col("rank") < MAX_RANKS), f"in [0, {MAX_RANKS})"),
        ("dp_rank", pl.col("dp_rank").is_between(0, MAX_RANKS - 1), f"in [0, {MAX_RANKS})"),
        ("stage", pl.col("stage").is_between(0, MAX_RANKS - 1), f"in [0, {MAX_RANKS})"),
        ("step", pl.col("step").is_between(0, (1 << 31) - 1), "in [0, 2^31)"),
        *(
            (
                c,
                pl.col(c).is_finite() & pl.col(c).is_between(0, _MAX_SECONDS),
                "seconds in [0, 1e6]",
            )
            for c in _TIMES
        ),
        # Optional ids kept in `args`: an unsigned value past int64 would fail the cast.
        *(
            (c, pl.col(c) <= INT64_MAX, "an integer below 2^63")
            for c in _ARG_COLUMNS
            if c in df.columns
        ),
    ]
    checked = df.with_row_index("_row").select(
        "_row", *(c for c, _, _ in rules), *(ok.alias(f"_ok_{c}") for c, ok, _ in rules)
    )
    for col, _, want in rules:
        rows = checked.filter(~pl.col(f"_ok_{col}"))
        if rows.height:
            row, value = rows["_row"][0], rows[col][0]
            msg = f"{parquet}: row {row}: `{col}` is {value}, expected {want}"
            raise TraceFormatError(msg)


def _check_duplicates(parquet: Path, df: pl.DataFrame) -> None:
    """Refuse an op given twice: it would double the collectives and p2p calls."""
    key = ["rank", "step", "optype", "seq_id"] if "seq_id" in df.columns else df.columns
    dup = df.with_row_index("_row").filter(pl.struct(key).is_duplicated())
    if dup.height:
        first = dup.row(0, named=True)
        shown = ", ".join(f"{k}={first[k]}" for k in key)
        msg = f"{parquet}: row {first['_row']} is duplicated ({shown})"
        raise TraceFormatError(msg)


def sniff_op_timeline(path: Path) -> bool:
    """Whether ``path`` looks like an op timeline: a parquet with the required columns, or a folder
    with ``trace-*.parquet`` and ``meta-*.yaml``.
    """
    path = Path(path)
    if path.is_dir():
        return any(path.glob("trace-*.parquet")) and any(path.glob("meta*.y*ml"))
    if path.suffix != ".parquet" or not path.is_file():
        return False
    try:
        schema = pl.read_parquet_schema(path)
    except Exception:  # anything unreadable is simply not ours
        return False
    return all(c in schema for c in REQUIRED_COLUMNS)

"""Rank lists as users write them (``0,2,4``, ``0..7``, ``0..7:2``), parsed in one place."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import click

from prism_trace.errors import PrismError, UsageError

__all__ = ["MAX_RANKS", "AsciiInt", "RankList", "ascii_int", "format_ranks", "parse_ranks"]

# A bound on what one spec may expand to: `0..1e9` must not allocate a billion ints.
MAX_RANKS = 1 << 20

# ``a..b`` (ours) or ``a-b`` (Slurm, NCCL logs): ranks are never negative, so no ambiguity.
_RANGE = re.compile(r"^(\d+)\s*(?:\.\.|-)\s*(\d+)(?::(\d+))?$", re.ASCII)
_INT = re.compile(r"[+-]?[0-9]+")


def ascii_int(text: str) -> int:
    """``text`` as an integer written in ASCII digits (an optional sign, surrounding blanks).

    ``int()`` also reads other scripts' digits (``int("٣") == 3``) and ``1_000``; a rank, a
    degree or a size typed with them is more likely a paste gone wrong than meant, so such text
    is refused where users write numbers.

    Raises:
        ValueError: anything else.
    """
    body = text.strip(" \t")
    if not _INT.fullmatch(body):
        msg = f"{text!r} is not a whole number in ASCII digits"
        raise ValueError(msg)
    return int(body)


class AsciiInt(click.ParamType):
    """click's ``int`` option type, but in ASCII digits only (``ascii_int``)."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """``value`` as an int, or one usage-error line (click's hook)."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return ascii_int(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def parse_ranks(spec: str) -> list[int]:
    """The ranks of ``spec``, in the order given, duplicates dropped.

    ``0,2,4`` lists ranks; ``a..b`` (or ``a-b``) is a to b inclusive; ``a..b:s`` takes every
    s-th. Parts may be mixed: ``0..3,8,12..15``.

    Raises:
        UsageError: an empty or malformed part, a range that runs backwards or a step of 0, or
            more than `MAX_RANKS` ranks.
    """
    out: dict[int, None] = {}
    parts = [p.strip() for p in spec.split(",")]
    if not any(parts):
        msg = f"rank list {spec!r} is empty (give e.g. 0,2,4 or 0..7 or 0..7:2)"
        raise UsageError(msg)
    for part in parts:
        if part.isascii() and part.isdigit():
            out[int(part)] = None
        elif m := _RANGE.match(part):
            lo, hi, step = int(m[1]), int(m[2]), int(m[3] or 1)
            if hi < lo or step == 0:
                msg = f"rank range {part!r} in {spec!r}: needs start <= end and a step >= 1"
                raise UsageError(msg)
            if (hi - lo) // step + 1 + len(out) > MAX_RANKS:
                msg = f"rank list {spec!r} names more than {MAX_RANKS} ranks"
                raise UsageError(msg)
            out.update(dict.fromkeys(range(lo, hi + 1, step)))
        else:
            msg = (
                f"rank list {spec!r}: {part!r} is not a rank (a whole number >= 0), a range a..b"
                " or a strided range a..b:s"
            )
            raise UsageError(msg)
        if len(out) > MAX_RANKS:
            msg = f"rank list {spec!r} names more than {MAX_RANKS} ranks"
            raise UsageError(msg)
    return list(out)


class RankList(click.ParamType):
    """A click parameter of ranks (`parse_ranks`); a bad list is one usage error line."""

    name = "ranks"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Parse a rank list option (click's hook); a malformed one fails with its message."""
        if isinstance(value, list):
            return value
        try:
            return parse_ranks(str(value))
        except PrismError as exc:
            self.fail(str(exc), param, ctx)


def format_ranks(
    ranks: Sequence[int], *, stride: str = ":", sep: str = ",", limit: int | None = None
) -> str:
    """Ranks as arithmetic runs, the inverse of `parse_ranks`: ``[0, 2, 4, 6, 9]`` -> ``0..6:2,9``.

    ``stride=" step ", sep=", "`` gives the reports' wording (``0..4094 step 2, 9``); ``limit``
    keeps that many runs and ends with ``...``.
    """
    rs = sorted(set(ranks))
    runs: list[str] = []
    i = 0
    while i < len(rs):
        j, step = i, (rs[i + 1] - rs[i]) if i + 1 < len(rs) else 1
        while j + 1 < len(rs) and rs[j + 1] - rs[j] == step:
            j += 1
        if j - i >= 2:
            runs.append(f"{rs[i]}..{rs[j]}" + (f"{stride}{step}" if step != 1 else ""))
            i = j + 1
        else:
            runs.append(str(rs[i]))
            i += 1
    if limit is not None and len(runs) > limit:
        runs = [*runs[:limit], "..."]
    return sep.join(runs)

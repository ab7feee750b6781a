"""Slow-down factors: which nodes each ``SlowDown`` matches, and the factor every node takes.

Frames in, arrays out: the emulator multiplies a node's duration by its factor (or its transfer
time, on a communication node); a slow-down by name or kind that matches nothing is refused
rather than silently reporting the baseline.
"""

from __future__ import annotations

import fnmatch

import numpy as np
import polars as pl
from prism_trace.replay.whatif.config import SlowDown, WhatIfError

__all__ = ["check_slow_matches", "slow_factors"]

_COMM = ("collective", "send", "recv")


def _slow_mask(nodes: pl.DataFrame, s: SlowDown) -> np.ndarray:
    """The nodes ``s`` matches (``rank, name, kind`` per node), as a bool array."""
    cond = pl.lit(value=True)
    if not s.ops and not s.kinds:  # a slow rank computes slower; its network is unchanged
        cond = cond & ~pl.col("kind").is_in(_COMM)
    if s.ranks:
        cond = cond & pl.col("rank").is_in(list(s.ranks))
    if s.ops is not None:
        # Matched per distinct name in Python: fnmatch.translate's regex (atomic groups since
        # Python 3.12) is not one polars' regex engine reads.
        names = nodes["name"].fill_null("").unique().to_list()
        hit = [n for n in names if fnmatch.fnmatchcase(n, s.ops)]
        cond = cond & pl.col("name").fill_null("").is_in(hit)
    if s.kinds:
        cond = cond & pl.col("kind").is_in(list(s.kinds))
    return nodes.select(cond.alias("m"))["m"].to_numpy()


def slow_factors(
    nodes: pl.DataFrame, slow: tuple[SlowDown, ...], *, extra: np.ndarray | None = None
) -> np.ndarray:
    """Per node, the product of the factors of the slow-downs that match it.

    Args:
        nodes: ``rank, name, kind`` per node (``rank`` = the unit's own rank).
        slow: the slow-downs.
        extra: a per-node factor to multiply in (e.g. the failed-GPU replica's).

    Returns:
        float64 per node (1.0 where nothing matches).
    """
    factor = np.ones(nodes.height) if extra is None else np.asarray(extra, dtype=np.float64).copy()
    for s in slow:
        factor[_slow_mask(nodes, s)] *= s.factor
    return factor


def check_slow_matches(nodes: pl.DataFrame, slow: tuple[SlowDown, ...], run: str) -> None:
    """Refuse a slow-down by op name or node kind that matches no node of ``run``.

    Such a what-if changes nothing, and the emulation would quietly report the baseline as
    its result (a typo in a glob, a kind the run has none of). Rank-only slow-downs are not
    checked: their ranks are checked against the world instead.

    Raises:
        WhatIfError: the first slow-down that matches nothing, as one line.
    """
    for s in slow:
        if (s.ops is not None or s.kinds) and not _slow_mask(nodes, s).any():
            what = f"glob {s.ops!r}" if s.ops is not None else f"kind {','.join(s.kinds)}"
            where = f" on ranks {_rank_text(s.ranks)}" if s.ranks else ""
            msg = f"slow-down {what}{where} matches no node of run {run!r}; nothing would change"
            raise WhatIfError(msg)


def _rank_text(ranks: tuple[int, ...]) -> str:
    """A short list of ranks for a message."""
    text = ",".join(str(r) for r in ranks[:8])
    return text + ",..." if len(ranks) > 8 else text

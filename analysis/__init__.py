"""Analyses of a stored run: documented SQL views plus thin polars functions (HTA parity).

``ANALYSES`` maps each ``prism analyze`` word to a function ``(store, run) -> DataFrame``.
"""

from __future__ import annotations

from collections.abc import Callable

import polars as pl

from analysis.breakdown import idle, kernels, overlap, temporal
from analysis.stragglers import collective_skew, collective_waits, skew, straggler_ops
from analysis.views import load_views
from prism_trace.store import Store

__all__ = [
    "ANALYSES",
    "collective_skew",
    "collective_waits",
    "idle",
    "kernels",
    "load_views",
    "overlap",
    "skew",
    "straggler_ops",
    "temporal",
]

ANALYSES: dict[str, Callable[[Store, str], pl.DataFrame]] = {
    "temporal": temporal,
    "kernels": kernels,
    "overlap": overlap,
    "idle": idle,
    "skew": skew,
}
"""The `prism analyze DB --run NAME WHAT` words and their functions."""

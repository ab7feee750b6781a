"""The `prism analyze` words, spelled out here so the CLI loads without the analysis layer.

Click needs a command's choices when the CLI starts; taking them from ``prism_trace.analysis``
imported polars, numpy and every analysis module (~0.35 s) for every command, `prism ingest`
included. ``tests/test_layering.py`` checks this list against ``analysis.WORDS``.
"""

from __future__ import annotations

__all__ = ["ANALYZE_WORDS", "COMPARE_WORDS"]

ANALYZE_WORDS: tuple[str, ...] = (
    "temporal",
    "kernels",
    "overlap",
    "idle",
    "skew",
    "bubbles",
    "bubble-windows",
    "critical-path",
    "critical-path-summary",
    "diff",
)
"""Every `prism analyze` word of the analysis layer (``prism_trace.analysis.WORDS``)."""

COMPARE_WORDS: tuple[str, ...] = ("diff",)
"""The words that read ``--compare OTHER`` (``prism_trace.analysis.COMPARISONS``)."""

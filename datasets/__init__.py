"""The trace generator (real gloo runs of a tiny GPT with DP x TP x PP) and its bundled sample.

`SAMPLE` is the folder of the bundled 8-rank recording (tp2 x dp2 x pp2, 2 steps), installed with
the package so that the README's walkthrough runs from a wheel as from a checkout.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["SAMPLE"]

SAMPLE = Path(str(resources.files(__name__) / "sample"))

"""The wheel ships every package: setuptools' package list is written out by hand
(``package-dir`` maps replay/, analysis/ and datasets/ in), so a new subpackage must be added."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"prism_trace": "prism_trace", "replay": "prism_trace.replay"}
ROOTS |= {"analysis": "prism_trace.analysis", "datasets": "prism_trace.datasets"}


def test_every_package_folder_is_in_the_wheel() -> None:
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for folder, name in ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"

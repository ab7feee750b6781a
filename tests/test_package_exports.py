"""Each package's public names are its modules' public names, and each resolves, lazily, to the
object its module defines; the Python API's names too."""

from __future__ import annotations

import importlib
import importlib.machinery
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GENERATOR = REPO / "scripts" / "gen-package-exports"


def _generated_packages() -> list[str]:
    """The packages the generator writes (it is a script without .py: load it by its path)."""
    loader = importlib.machinery.SourceFileLoader("gen_package_exports", str(GENERATOR))
    module = types.ModuleType(loader.name)
    module.__file__ = str(GENERATOR)
    loader.exec_module(module)
    return sorted(module.packages())


PACKAGES = _generated_packages()


def test_every_package_init_is_what_the_generator_writes() -> None:
    res = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_generated_packages_are_the_concerns() -> None:
    assert "prism_trace.store" in PACKAGES
    assert "prism_trace.replay.emulate" in PACKAGES
    assert "prism_trace.replay" not in PACKAGES  # a layer facade, written by hand


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_is_its_modules_object(package: str) -> None:
    pkg = importlib.import_module(package)
    exports: dict[str, str] = getattr(pkg, "_EXPORTS", {})
    assert sorted(exports) == sorted(pkg.__all__)
    for name, module in exports.items():
        owner = importlib.import_module(f"{package}.{module}")
        assert name in owner.__all__, f"{package}.{module} does not export {name}"
        assert getattr(pkg, name) is getattr(owner, name)
        assert name in dir(pkg)
    with pytest.raises(AttributeError, match="has no attribute"):
        _ = pkg.no_such_name


def test_the_api_resolves_every_name() -> None:
    import prism_trace

    for name in prism_trace.__all__:
        assert getattr(prism_trace, name) is not None, name
    assert prism_trace.open_store.__module__ == "prism_trace.store.connection"
    assert prism_trace.emulate_run.__module__ == "prism_trace.replay.emulate.driver"

"""A package's public names, loaded from its modules only when first used.

Python runs a package's ``__init__`` before any module in it, so an ``__init__`` that imported
its modules would make ``import prism_trace.layout.mesh`` (pure, no DuckDB) pay for every
module of ``layout``, and would add import edges between packages that the code itself does
not have. Each package ``__init__`` therefore names its public names and the module that
defines each, imports them only for type checkers (``TYPE_CHECKING``), and resolves them here
on first access (PEP 562). ``tests/test_package_exports.py`` checks that the names, the
modules and the type checkers' imports agree with the modules' own ``__all__``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, which re-exports ``exports``.

    Args:
        package: the package's ``__name__``.
        exports: each public name -> the module (relative to ``package``) that defines it.

    Returns:
        ``(__getattr__, __dir__)`` to assign in the package's namespace.
    """

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg)
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        # Cached in the package, so the next access is a plain attribute read.
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__

"""The version of prism-trace: one source for the package metadata, stores and ``--version``."""

__all__ = ["__version__"]

__version__ = "0.1.0"

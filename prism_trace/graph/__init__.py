"""The execution graph of a run: per-format rules, dependencies and cross-rank matching."""

__all__: list[str] = []

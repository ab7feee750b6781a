"""Hybrid replay: real kernels for a few ranks against virtual peers, as a ``replayed`` run."""

__all__: list[str] = []

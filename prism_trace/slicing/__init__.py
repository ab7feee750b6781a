"""Slicing: a recorded run of a few ranks to the full-scale graph of a larger world."""

__all__: list[str] = []

"""Validation: how close emulated and replayed runs come to the recording, step and op."""

__all__: list[str] = []

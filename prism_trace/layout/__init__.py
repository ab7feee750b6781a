"""The parallel layout of a run: its axes and groups, where they come from, and symmetric peers."""

__all__: list[str] = []

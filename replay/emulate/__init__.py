"""Emulation: a run's graph loaded, prepared, run by the discrete-event core and written back."""

__all__: list[str] = []

"""The discrete-event core: per-unit graphs joined by communication, and its replica vector."""

__all__: list[str] = []

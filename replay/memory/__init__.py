"""Memory: recorded allocation timelines re-timed, and memory derived from host execution traces."""

__all__: list[str] = []

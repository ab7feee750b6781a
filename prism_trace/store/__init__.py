"""The store: the DuckDB file, its declared schema, and every write of a run to it."""

__all__: list[str] = []

"""Ingest: trace files found, read (here, by workers or on a cluster), linked, written at once."""

__all__: list[str] = []

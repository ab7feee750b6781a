"""Exports of a run to other tools: Chakra ET, Chrome trace (Perfetto) and Parquet."""

__all__: list[str] = []

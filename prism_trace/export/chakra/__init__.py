"""The Chakra ET export: one protobuf file per rank, from templates of each rank class."""

__all__: list[str] = []

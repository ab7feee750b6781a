"""The Chakra ET reader: length-delimited protobuf graphs, and the bundled Chakra schema."""

__all__: list[str] = []

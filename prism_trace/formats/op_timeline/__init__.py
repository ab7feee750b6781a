"""The op-timeline reader: Megatron-style parquet of every rank's timed ops."""

__all__: list[str] = []

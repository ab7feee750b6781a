"""The Kineto reader: torch.profiler Chrome-trace JSON of one rank, alone or in batches."""

__all__: list[str] = []

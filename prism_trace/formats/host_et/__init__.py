"""The host execution-trace reader: PyTorch ``ExecutionTraceObserver`` JSON of one rank."""

__all__: list[str] = []

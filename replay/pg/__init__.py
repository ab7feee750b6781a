"""The `prism` torch.distributed backend, and `prism run` that starts a script's ranks on it."""

__all__: list[str] = []

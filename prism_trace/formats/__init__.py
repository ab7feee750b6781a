"""Format readers: one sub-package per trace format, and the contract they all fulfil (``base``)."""

__all__: list[str] = []

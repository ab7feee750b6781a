"""Kernels: the compute ops of one rank rebuilt from its host execution trace, as a program."""

__all__: list[str] = []

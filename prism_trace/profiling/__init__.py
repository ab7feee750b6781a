"""Instrumentation helpers: starting torch's profiler cheaply and where its throwaway files go."""

__all__: list[str] = []

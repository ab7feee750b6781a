"""`python -m prism_trace.cli`: the same as the `prism` script."""

from prism_trace.cli import main

__all__: list[str] = []

main()

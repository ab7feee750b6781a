"""Questions put to a store as it is: `prism query` SQL, `prism info` summaries, JSON output."""

__all__: list[str] = []

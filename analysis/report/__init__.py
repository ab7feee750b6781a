"""The HTML report: its queries, its plotly figures and the page that holds them."""

__all__: list[str] = []

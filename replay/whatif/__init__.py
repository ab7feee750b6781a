"""What-ifs and variance: the ways an emulation departs from the recorded timing."""

__all__: list[str] = []

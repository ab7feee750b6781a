"""The timing model: collective transfer times, the network topology and its calibration."""

__all__: list[str] = []

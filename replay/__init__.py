"""Time: emulate a run's execution graph at any scale and validate it against the recording.

``emulate_run`` (store → emulated run) and ``validate_run`` (replay and slice fidelity) are the
entry points; ``replay.emulator`` is the pure core on arrays.
"""

from __future__ import annotations

from replay.emulator import DeadlockError, MissingParticipantError
from replay.run import EmulationConfig, EmulationReport, ReplayConfig, emulate_run
from replay.timing import TimingConfig
from replay.topology import Topology
from replay.validate import ValidationReport, validate_run

__all__ = [
    "DeadlockError",
    "EmulationConfig",
    "EmulationReport",
    "MissingParticipantError",
    "ReplayConfig",
    "TimingConfig",
    "Topology",
    "ValidationReport",
    "emulate_run",
    "validate_run",
]

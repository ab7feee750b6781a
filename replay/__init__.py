"""Time: emulate a run's execution graph at any scale, replay real kernels, validate.

``emulate_run`` (store → emulated run, with what-ifs), ``validate_run`` (replay and slice
fidelity), ``replay_run`` (real kernels of selected ranks against virtual-peer timing; needs
torch, imported only when called) and ``validate_replayed`` are the entry points;
``replay.emulator`` is the pure core on arrays, ``replay.process_group`` the timed fake backend.
"""

from __future__ import annotations

from prism_trace.replay.des.core import DeadlockError, MissingParticipantError
from prism_trace.replay.emulate.config import CompletionConfig, EmulationConfig, EmulationReport
from prism_trace.replay.emulate.driver import emulate_run
from prism_trace.replay.hybrid.options import KernelReplayOptions
from prism_trace.replay.hybrid.replay import replay_run
from prism_trace.replay.model.calibrate import calibrate_run
from prism_trace.replay.model.timing import TimingConfig
from prism_trace.replay.model.topology import Topology
from prism_trace.replay.validate.emulated import ValidationReport, validate_run
from prism_trace.replay.validate.replayed import validate_replayed
from prism_trace.replay.whatif.config import WhatIfConfig, parse_what_if

__all__ = [
    "CompletionConfig",
    "DeadlockError",
    "EmulationConfig",
    "EmulationReport",
    "KernelReplayOptions",
    "MissingParticipantError",
    "TimingConfig",
    "Topology",
    "ValidationReport",
    "WhatIfConfig",
    "calibrate_run",
    "emulate_run",
    "parse_what_if",
    "replay_run",
    "validate_replayed",
    "validate_run",
]

"""The `prism` command line, the top layer: it parses arguments and calls public functions.

Nothing below imports it. Each module registers its commands on ``main`` when imported.
"""

from prism_trace.cli import (
    export_cmds,
    network_cmds,
    predict_cmds,
    question_cmds,
    time_cmds,
    trace_cmds,
)
from prism_trace.cli._group import main

__all__ = [
    "export_cmds",
    "main",
    "network_cmds",
    "predict_cmds",
    "question_cmds",
    "time_cmds",
    "trace_cmds",
]

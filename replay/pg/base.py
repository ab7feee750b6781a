"""The `prism` backend's name, its environment switches, its error and its clock."""

from __future__ import annotations

import time

from prism_trace.errors import PrismError

__all__ = ["BACKEND", "ENV", "ScheduleMismatchError"]


BACKEND = "prism"


class ENV:
    """Environment variables that configure the backend in a process started by `prism run`."""

    SWITCH = "PRISM_PG"  # "1": `init_process_group(<any backend>)` uses `prism` (replay.pg.launch)
    WORLD_SIZE = "PRISM_WORLD_SIZE"  # N, the emulated world
    RANKS = "PRISM_RANKS"  # comma-separated global ranks that exist as processes
    SCHEDULE = "PRISM_SCHEDULE"  # pickled PeerSchedule of this process's rank (optional)
    REPORT = "PRISM_REPORT"  # where this process writes its JSON report at exit (optional)


class ScheduleMismatchError(PrismError, RuntimeError):
    """The script issued a call that the recorded schedule does not have at that point.

    Raised at the call, on the calling rank, so nothing waits for an instance that never comes.
    """


# Schedule and torch names of the same operation, to compare a call with its recorded kind.
_KIND_ALIASES = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all",
    "alltoall_base": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}


def _kind(name: str) -> str:
    return _KIND_ALIASES.get(name.lower(), name.lower())


def _now() -> int:
    return time.perf_counter_ns()


def _sleep_until(target_ns: int) -> None:
    # time.sleep never returns early; the loop only guards against signal wake-ups.
    while (left := target_ns - _now()) > 0:
        time.sleep(left / 1e9)

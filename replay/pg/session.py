"""The `prism` backend's session: what every group of this process shares, and the step marks."""

from __future__ import annotations

import atexit
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prism_trace.replay.pg.base import ENV
from prism_trace.replay.pg.timeline import _Timeline

from prism_trace.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from prism_trace.replay.peers import PeerSchedule

__all__ = ["PrismSession", "reset", "session", "start_session"]


@dataclass
class PrismSession:
    """The emulated world as this process sees it: its size, the real ranks, the timeline."""

    world_size: int
    real_ranks: frozenset[int]
    timeline: _Timeline

    def report(self) -> dict[str, Any]:
        """JSON-able summary: world, real ranks and the timeline's counts and step times."""
        return {
            "world_size": self.world_size,
            "real_ranks": sorted(self.real_ranks),
            "scheduled": self.timeline.schedule is not None
            and bool(getattr(self.timeline.schedule, "calls", ())),
            **self.timeline.report(),
        }


_SESSION: PrismSession | None = None


def start_session(
    *,
    world_size: int,
    real_ranks: Sequence[int],
    schedule: PeerSchedule | None = None,
    groups: Mapping[int, tuple[str, Sequence[int]]] | None = None,
) -> PrismSession:
    """Set the world the next `init_process_group("prism", ...)` joins.

    Args:
        world_size: Ranks of the emulated job.
        real_ranks: The global ranks that run as processes (this one included); the others are
            virtual.
        schedule: This rank's `PeerSchedule` (from a recorded or emulated run); None: virtual
            peers never hold anyone back.
        groups: ``comm_group.group_id -> (name, ranks)`` of the schedule's run, to tell apart
            recorded groups with the same members by name (torch names groups "0", "1", ... in
            creation order, so the script's groups get the recorded names).

    Returns:
        The new session (replacing any earlier one).
    """
    global _SESSION
    real = frozenset(int(r) for r in real_ranks)
    bad = sorted(r for r in real if not 0 <= r < world_size)
    if bad:
        msg = f"`real_ranks` {bad} are outside a world of {world_size}"
        raise ConfigError(msg)
    _SESSION = PrismSession(world_size, real, _Timeline(schedule, real, groups))
    _install_step_marks()
    return _SESSION


_MARKS_INSTALLED = False


def _optimizer_marks(optimizer: Any, *_: Any) -> None:
    if _SESSION is not None:
        _SESSION.timeline.mark(optimizer=optimizer)


def _install_step_marks() -> None:
    """Hook step boundaries once per process: profiler steps and optimizer steps."""
    global _MARKS_INSTALLED
    if _MARKS_INSTALLED:
        return
    _MARKS_INSTALLED = True
    import torch.optim.optimizer as topt
    import torch.profiler.profiler as tpp

    topt.register_optimizer_step_post_hook(_optimizer_marks)

    step = tpp.profile.step

    def marked_step(self: Any) -> None:
        if _SESSION is not None:
            _SESSION.timeline.close_step()
        step(self)
        if _SESSION is not None:  # after: the new ProfilerStep# opens at the end of step()
            _SESSION.timeline.mark(profiler_step=int(self.step_num))

    start = tpp.profile.start

    def marked_start(self: Any) -> None:
        start(self)
        if _SESSION is not None:  # start() opens ProfilerStep#<step_num> (0 at first)
            _SESSION.timeline.mark(profiler_step=int(self.step_num))

    marked_step.__doc__ = step.__doc__
    marked_start.__doc__ = start.__doc__
    tpp.profile.step = marked_step  # type: ignore[method-assign]
    tpp.profile.start = marked_start  # type: ignore[method-assign]


def reset() -> None:
    """Forget the session (the step hooks stay installed and do nothing without one)."""
    global _SESSION
    _SESSION = None


def session() -> PrismSession | None:
    """The current session, if `start_session` ran or a `prism` group was created."""
    return _SESSION


def _session_from_env(rank: int, world_size: int) -> PrismSession:
    ranks = os.environ.get(ENV.RANKS)
    real = [int(r) for r in ranks.split(",") if r] if ranks else [rank]
    payload: dict[str, Any] = {}
    path = os.environ.get(ENV.SCHEDULE)
    if path:
        import pickle

        payload = pickle.loads(Path(path).read_bytes())  # written by replay.pg.launch
    s = start_session(
        world_size=world_size,
        real_ranks=real,
        schedule=payload.get("schedule"),
        groups=payload.get("groups"),
    )
    report = os.environ.get(ENV.REPORT)
    if report:
        atexit.register(_write_report, Path(report), rank)
    return s


def _write_report(path: Path, rank: int) -> None:
    if _SESSION is not None:
        path.write_text(json.dumps({"rank": rank, **_SESSION.report()}, indent=1) + "\n")

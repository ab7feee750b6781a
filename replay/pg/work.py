"""The `prism` backend's Work: done when the real part is done and the virtual peers allow."""

from __future__ import annotations

import heapq
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from prism_trace.replay.pg.base import ScheduleMismatchError, _now, _sleep_until

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["PrismWork"]


class _Completer:
    """One daemon thread that completes futures at their due time (for `Work.get_future`)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, PrismWork]] = []
        self._cv = threading.Condition()
        self._n = 0
        self._thread: threading.Thread | None = None

    def add(self, work: PrismWork) -> None:
        with self._cv:
            self._n += 1
            heapq.heappush(self._heap, (work.target_ns or 0, self._n, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prism-pg", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                due, _, work = self._heap[0]
                left = due - _now()
                if left > 0:
                    self._cv.wait(left / 1e9)
                    continue
                heapq.heappop(self._heap)
            work.wait()


_COMPLETER = _Completer()


class PrismWork(dist._Work):  # type: ignore[misc]
    """A call in flight: waits for its real part, runs its epilogue, then sleeps until due."""

    def __init__(
        self,
        result: Any,
        *,
        target_ns: int | None,
        real: Sequence[Any] = (),
        epilogue: Callable[[], None] | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        """Set up the work.

        Args:
            result: The future's value (the output tensors).
            target_ns: Wall time (``perf_counter_ns``) at which the call completes; None: now.
            real: Works of the real part (gloo among the real members), waited first.
            epilogue: Fills the outputs from the real part's results; runs once.
            timeout: Longest allowed wait for the virtual peers (the group's timeout).
        """
        super().__init__()
        self.target_ns = target_ns
        self._result = result
        self._real = list(real)
        self._epilogue = epilogue
        self._lock = threading.Lock()
        self._done = False
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        if target_ns is not None and timeout is not None:
            limit = timeout.total_seconds() * 1e9
            if 0 < limit < target_ns - _now():
                hold = (target_ns - _now()) / 1e9
                msg = (
                    f"the virtual peers would hold this call for {hold:.1f} s, beyond the "
                    f"group's timeout of {timeout.total_seconds():g} s"
                )
                raise ScheduleMismatchError(msg)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the call completes; True."""
        with self._lock:
            if not self._done:
                for w in self._real:
                    w.wait()
                if self._epilogue is not None:
                    self._epilogue()
                if self.target_ns is not None:
                    _sleep_until(self.target_ns)
                self._done = True
                self._future.set_result(self._result)
        return True

    def is_completed(self) -> bool:
        """Whether `wait` would return at once."""
        if self._done:
            return True
        real_done = all(w.is_completed() for w in self._real)
        return real_done and (self.target_ns is None or _now() >= self.target_ns)

    def is_success(self) -> bool:
        """Calls never fail after they were issued (errors are raised at the call)."""
        return True

    def exception(self) -> None:
        """No exception: see `is_success`."""
        return None

    def result(self) -> Any:
        """The output tensors."""
        return self._result

    def get_future(self) -> torch.futures.Future[Any]:
        """A future completed at the call's completion (by a helper thread, not by waiting)."""
        if not self._done:
            if self.target_ns is None and not self._real:
                self.wait()
            else:
                _COMPLETER.add(self)
        return self._future

    def synchronize(self) -> None:
        """Same as `wait` (CPU: there is no stream to synchronize)."""
        self.wait()

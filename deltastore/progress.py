"""Byte-level progress of long operations: one callback shape for every operation.

``seed``, ``publish``, ``pull_weights``, ``verify_local`` and prune take an optional
``progress=`` callback of the shape :class:`ProgressCallback`: ``progress(phase, done_bytes,
total_bytes)``. Each phase starts with ``done_bytes == 0``, reports a non-decreasing count,
and ends with one call where ``done_bytes == total_bytes`` (``total_bytes`` is None only where
a phase cannot know its size up front, e.g. a full version written by another tool).

Calls are coalesced (at most one every :data:`REPORT_INTERVAL_S` per phase, plus the first and
the last) and serialised: a callback is never called from two threads at once, though it may
be called from a worker thread. A callback that raises aborts the operation at that point, as
any error there would; the phase reports nothing more.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

REPORT_INTERVAL_S = 0.02
"""Shortest time between two reports of one phase (the first and the last always go out)."""


class ProgressCallback(Protocol):
    """``progress(phase, done_bytes, total_bytes)`` (see the module docstring); ``phase``
    names the step, e.g. ``"diff"``, ``"write"``, ``"apply"``."""

    def __call__(self, phase: str, done_bytes: int, total_bytes: int | None, /) -> None: ...


class ProgressMeter:
    """Counts the bytes of one phase and reports them to a callback, coalesced, thread-safe;
    made by :meth:`start` (None without a callback, so a caller without one pays nothing)."""

    def __init__(self, callback: ProgressCallback, phase: str, total: int | None) -> None:
        self.callback = callback
        self.phase = phase
        self.total = total
        self.done = 0
        self._reported = -1
        self._last = 0.0
        self._failed = False
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls, callback: ProgressCallback | None, phase: str, total: int | None
    ) -> ProgressMeter | None:
        """A meter for ``phase`` that has reported ``done_bytes=0``; None without a callback."""
        if callback is None:
            return None
        meter = cls(callback, phase, total)
        with meter._lock:
            meter._report()
        return meter

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` more; report if the interval has passed or the total is reached."""
        with self._lock:
            self.done += nbytes
            reached = self.total is not None and self.done >= self.total
            if reached or time.monotonic() - self._last >= REPORT_INTERVAL_S:
                self._report()

    def finish(self, *, complete: bool = False) -> None:
        """Report the final count; ``complete`` first counts whatever is left of the total as
        done (e.g. tensors not passed to a publish, which are unchanged)."""
        with self._lock:
            if complete and self.total is not None:
                self.done = max(self.done, self.total)
            self._report()

    def _report(self) -> None:
        """Call the callback (under the lock, so reports never overtake each other)."""
        if self._failed or self.done == self._reported:
            return
        self._last = time.monotonic()
        self._reported = self.done
        try:
            self.callback(self.phase, self.done, self.total)
        except BaseException:
            self._failed = True
            raise


__all__ = ["REPORT_INTERVAL_S", "ProgressCallback", "ProgressMeter"]

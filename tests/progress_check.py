"""A progress callback that records every call, and the checks every operation's reports pass."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

import deltastore.progress

Call = tuple[str, int, int | None]


class Recorder:
    """Records ``(phase, done_bytes, total_bytes)`` calls; ``fail_when(call)`` may raise."""

    def __init__(self, fail_when: Callable[[Call], bool] | None = None) -> None:
        self.calls: list[Call] = []
        self.fail_when = fail_when
        self._busy = threading.Lock()

    def __call__(self, phase: str, done_bytes: int, total_bytes: int | None) -> None:
        # Calls are serialised by the library: a second one running at once is a bug.
        assert self._busy.acquire(blocking=False), "progress called from two threads at once"
        try:
            call = (phase, done_bytes, total_bytes)
            self.calls.append(call)
            if self.fail_when is not None and self.fail_when(call):
                raise RuntimeError(f"progress callback gave up at {call}")
        finally:
            self._busy.release()

    def phases(self) -> list[str]:
        """The phases in the order they ran (each once: a phase never comes back)."""
        order: list[str] = []
        for phase, _, _ in self.calls:
            if not order or order[-1] != phase:
                order.append(phase)
        return order

    def of(self, phase: str) -> list[tuple[int, int | None]]:
        return [(done, total) for p, done, total in self.calls if p == phase]

    def check(self) -> dict[str, int | None]:
        """Every phase starts at 0, never goes back, keeps one total and ends at it (when the
        total is known); returns each phase's total."""
        order = self.phases()
        assert len(order) == len(set(order)), f"a phase came back: {order}"
        totals: dict[str, int | None] = {}
        for phase in order:
            calls = self.of(phase)
            done = [d for d, _ in calls]
            assert done[0] == 0, f"{phase} starts at {done[0]}"
            assert done == sorted(done), f"{phase} went backwards: {done}"
            assert len({t for _, t in calls}) == 1, f"{phase} changed its total"
            total = calls[0][1]
            if total is not None:
                assert done[-1] == total, f"{phase} ended at {done[-1]} of {total}"
            totals[phase] = total
        return totals


def report_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """No coalescing: every counted step is reported, so the steps themselves can be checked."""
    monkeypatch.setattr(deltastore.progress, "REPORT_INTERVAL_S", 0.0)

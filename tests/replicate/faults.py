"""A share of requests failed, stalled or unanswered, at random (seeded), through FaultProxy."""

from __future__ import annotations

import random

from deltastore.testing.faults import Fault, FaultProxy


class RandomFaults(FaultProxy):
    """Each request gets, with probability ``share``, one of: a 503 (not forwarded), a stall
    that closes the connection (not forwarded), or (reads only) a forwarded request whose
    response is dropped. Seeded, so a failing run can be replayed."""

    def __init__(self, upstream: str, *, share: float, seed: int, stall_s: float = 0.3) -> None:
        super().__init__(upstream)
        self.share = share
        self.stall_s = stall_s
        self.rng = random.Random(seed)

    def _take(self, method: str, target: str, body: bytes) -> Fault | None:
        fault = super()._take(method, target, body)
        if fault is not None:
            return fault
        with self._lock:
            if self.rng.random() >= self.share:
                return None
            actions = ["status", "stall"] + (["drop-response"] if method in ("GET", "HEAD") else [])
            action = self.rng.choice(actions)
            self.injected.append(_injected(action, method, target))
        return Fault(action, status=503, stall_s=self.stall_s, body=_SLOW_DOWN)


_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
    b"<Message>injected</Message></Error>"
)


def _injected(action: str, method: str, target: str) -> object:
    from deltastore.testing.faults import Injected

    return Injected(action, method, target)

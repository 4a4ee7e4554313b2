"""A rank's kept publish threads."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest

from deltastore.publish import rank_state
from deltastore.publish.rank_state import RankSnapshot


def test_a_ctrl_c_while_the_publish_threads_start_leaves_none_of_them_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The threads start together at a barrier; a Ctrl-C in the caller's wait there must
    release them, or Python's exit joins threads that wait forever."""
    caller = threading.current_thread()
    barriers: list[threading.Barrier] = []

    class InterruptedInTheCaller(threading.Barrier):
        def __init__(self, parties: int) -> None:
            super().__init__(parties)
            barriers.append(self)

        def wait(self, timeout: float | None = None) -> int:
            if threading.current_thread() is not caller:
                return super().wait(timeout)
            while self.n_waiting < self.parties - 1:  # every thread is waiting
                time.sleep(0.001)
            raise KeyboardInterrupt

    monkeypatch.setattr(rank_state.threading, "Barrier", InterruptedInTheCaller)
    held = RankSnapshot(cast(Any, None), {}, cast(Any, None), workers=3)
    with pytest.raises(KeyboardInterrupt):
        held.pool()
    (barrier,) = barriers
    try:
        deadline = time.monotonic() + 10
        while barrier.n_waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert barrier.broken and barrier.n_waiting == 0
    finally:
        barrier.abort()  # (were it not released, this test's own exit would wait forever)

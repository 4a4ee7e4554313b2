"""A catch-up's durability, completed after the pull replies.

The tensors a catch-up writes in place are verified in the mapped files (the page cache the
engine reloads from) before :func:`~deltastore.pull.pull_weights` returns. Making them durable
(msync and fsync of each patched file), then writing the new state and clearing the pending
record, runs after the reply in one thread that holds the host's lock until all three are
done. Until then the pending record stays and no state names either version, so a crash in
between (process or power) is repaired by the next pull from that record, as for a crash
mid-apply.

In this process, the next pull of the dir, :func:`~deltastore.pull.verify_local` and
:class:`~deltastore.pull.LocalCheckpoint`'s state reads wait for the completion first;
a pull in another process waits on the host lock. A process that exits waits for its queued
completions first (an ``atexit`` hook).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable

from deltastore.errors import LockTimeoutError

log = logging.getLogger("deltastore.pull")


class Completion:
    """The steps a pull left to run after its reply, queued for the completion thread."""

    def __init__(self, local_dir: str, steps: Callable[[], None], release: Callable[[], None]):
        self.local_dir = local_dir
        self.error: BaseException | None = None
        """What stopped the steps (the pending record then stays for the next pull)."""
        self.done = threading.Event()
        self._steps = steps
        self._release = release

    def run(self) -> None:
        try:
            self._steps()
        except BaseException as exc:
            self.error = exc
            log.error(
                "%s: making the pull durable failed (%s); the pending record stays and the "
                "next pull repairs the checkpoint",
                self.local_dir,
                exc,
            )
        finally:
            self._release()
            self.done.set()


_completions: dict[str, Completion] = {}
_queue: queue.SimpleQueue[Completion] = queue.SimpleQueue()
_guard = threading.Lock()
_worker: list[threading.Thread] = []
"""The one completion thread, started with the first completion (kept: starting a thread
waits for it to be scheduled, tens of ms on a loaded host, on the reply path)."""


def _work() -> None:
    while True:
        _queue.get().run()


def _drain() -> None:
    """At interpreter exit: let every queued completion finish (the thread is a daemon)."""
    for completion in list(_completions.values()):
        completion.done.wait()


def _after_fork() -> None:
    """A forked child has no completion thread: it starts its own, and waits for nothing of
    its parent's (the parent's thread makes those durable)."""
    global _queue
    _queue = queue.SimpleQueue()
    _worker.clear()
    _completions.clear()


atexit.register(_drain)
os.register_at_fork(after_in_child=_after_fork)


def complete_behind(
    local_dir: str, steps: Callable[[], None], release: Callable[[], None]
) -> Completion:
    """Queue ``steps`` for ``local_dir`` on the completion thread, then ``release`` (the lock)."""
    completion = Completion(os.path.abspath(local_dir), steps, release)
    with _guard:
        _completions[completion.local_dir] = completion
        if not _worker or not _worker[0].is_alive():
            _worker[:] = [threading.Thread(target=_work, name="deltastore-durable", daemon=True)]
            _worker[0].start()
    _queue.put(completion)
    return completion


def wait_recorded(local_dir: str, timeout_s: float | None = None) -> BaseException | None:
    """Wait until this process's last pull of ``local_dir`` is durable and recorded.

    Returns the error its completion stopped on (None: recorded, or no pull of the dir ran
    here). A wait from the completion thread itself returns at once. Raises
    :class:`LockTimeoutError` when ``timeout_s`` passes first.
    """
    with _guard:
        completion = _completions.get(os.path.abspath(local_dir))
        worker = _worker[0] if _worker else None
    if completion is None or threading.current_thread() is worker:
        return None
    if not completion.done.wait(timeout_s):
        raise LockTimeoutError(
            f"{completion.local_dir}: the last pull was still being made durable after "
            f"{timeout_s:.0f} s; check the disk"
        )
    return completion.error


def wait_durable(
    local_checkpoint_dir: str | os.PathLike[str], timeout_s: float | None = None
) -> None:
    """Block until this process's last pull of ``local_checkpoint_dir`` is durable and its
    state recorded (a no-op when none is in flight).

    Raises the :class:`~deltastore.errors.PutBackError` its completion stopped on (the
    pending record then stays and the next pull repairs the checkpoint), or
    :class:`LockTimeoutError` when ``timeout_s`` passes first.
    """
    error = wait_recorded(os.fspath(local_checkpoint_dir), timeout_s)
    if error is not None:
        raise error

"""Counters of one pull, and the thread pool the apply, repair and verify steps share."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from deltastore.progress import ProgressCallback, ProgressMeter

_T = TypeVar("_T")


@dataclass
class ApplyStats:
    """Counters of one pull: what was read and written."""

    tensors: int = 0
    """Tensors written (applied, restored or copied)."""
    payloads: int = 0
    """Delta payloads read (one per changed tensor per version)."""
    bytes_read: int = 0
    """Bytes read from the store."""
    bytes_written: int = 0
    versions: list[int] = field(default_factory=list)
    progress: ProgressCallback | None = field(default=None, repr=False, compare=False)
    """Where the bytes read are reported (see :meth:`report`)."""
    _meter: ProgressMeter | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def report(self, phase: str, total: int | None) -> None:
        """From now on, bytes read count towards ``phase`` of ``total`` bytes (if a progress
        callback was given)."""
        self._meter = ProgressMeter.start(self.progress, phase, total)

    def end_report(self) -> None:
        """The current phase is over: report its final count."""
        meter, self._meter = self._meter, None
        if meter is not None:
            meter.finish()

    def add(
        self, *, tensors: int = 0, payloads: int = 0, bytes_read: int = 0, bytes_written: int = 0
    ) -> None:
        """Add to the counters (thread-safe: apply threads share one ``ApplyStats``)."""
        with self._lock:
            self.tensors += tensors
            self.payloads += payloads
            self.bytes_read += bytes_read
            self.bytes_written += bytes_written
        meter = self._meter
        if meter is not None and bytes_read:
            meter.advance(bytes_read)


def run_pool(
    jobs: Sequence[_T], fn: Callable[[_T], None], workers: int, *, name: str = "deltastore-apply"
) -> None:
    """Run ``fn`` on every job in a thread pool; stop starting jobs after the first error.

    Re-raises the first error once every started job has finished.
    """
    failed = threading.Event()
    errors: list[BaseException] = []

    def guarded(job: _T) -> None:
        if failed.is_set():
            return
        try:
            fn(job)
        except BaseException as exc:
            failed.set()
            errors.append(exc)

    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            guarded(job)
    else:
        with cf.ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
            list(pool.map(guarded, jobs))
    if errors:
        raise errors[0]

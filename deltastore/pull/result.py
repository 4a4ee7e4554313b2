"""What a pull counts while it runs (:class:`ApplyStats`) and reports (:class:`PullResult` on
one host, :class:`HostOutcome` per group rank, :class:`RepairSummary` of a repair), and the
thread pool the repair, reseed and header reads share."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from deltastore.progress import ProgressCallback, ProgressMeter

_T = TypeVar("_T")


@dataclass
class ApplyStats:
    """Counters of one pull, shared by its apply threads."""

    versions: list[int] = field(default_factory=list)
    tensors: int = 0
    payloads: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    progress: ProgressCallback | None = field(default=None, repr=False, compare=False)
    _meter: ProgressMeter | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def report(self, phase: str, total: int | None) -> None:
        """From now on, bytes read count towards ``phase`` of ``total`` bytes."""
        self._meter = ProgressMeter.start(self.progress, phase, total)

    def end_report(self) -> None:
        meter, self._meter = self._meter, None
        if meter is not None:
            meter.finish()

    def add(
        self, *, tensors: int = 0, payloads: int = 0, bytes_read: int = 0, bytes_written: int = 0
    ) -> None:
        with self._lock:
            self.tensors += tensors
            self.payloads += payloads
            self.bytes_read += bytes_read
            self.bytes_written += bytes_written
        meter = self._meter
        if meter is not None and bytes_read:
            meter.advance(bytes_read)


class FirstError:
    """The first error of a set of jobs run in threads: after it, no new job starts."""

    def __init__(self) -> None:
        self.failed = threading.Event()
        self.errors: list[BaseException] = []

    def run(self, fn: Callable[..., None], *args: object) -> None:
        if self.failed.is_set():
            return
        try:
            fn(*args)
        except BaseException as exc:
            self.record(exc)

    def record(self, exc: BaseException) -> None:
        self.failed.set()
        self.errors.append(exc)

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]


_kept: dict[tuple[str, int], cf.ThreadPoolExecutor] = {}
_kept_guard = threading.Lock()
os.register_at_fork(after_in_child=_kept.clear)  # a child has none of its parent's threads


def kept_pool(name: str, workers: int) -> cf.ThreadPoolExecutor:
    """The process's pool of ``workers`` threads named ``name``, kept between pulls (starting a
    thread waits to be scheduled, which on a loaded host costs more than a small pull)."""
    with _kept_guard:
        pool = _kept.get((name, workers))
        if pool is None:
            pool = _kept[name, workers] = cf.ThreadPoolExecutor(workers, thread_name_prefix=name)
        return pool


def run_pool(jobs: Sequence[_T], fn: Callable[[_T], None], workers: int, *, name: str) -> None:
    """Run ``fn`` on every job in a thread pool; stop starting jobs after the first error,
    and re-raise it once every started job has finished."""
    first = FirstError()
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            first.run(fn, job)
    else:
        list(kept_pool(name, workers).map(functools.partial(first.run, fn), jobs))
    first.raise_first()


@dataclass(frozen=True)
class RepairSummary:
    """What repairing one interrupted transition did, tensor by tensor."""

    from_version: int
    to_version: int
    kept: int
    applied: int
    restored: int

    def describe(self) -> str:
        return (
            f"repaired v{self.from_version:06d} -> v{self.to_version:06d}: {self.kept} kept, "
            f"{self.applied} applied, {self.restored} restored"
        )


@dataclass(frozen=True)
class HostOutcome:
    """One rank's outcome in a group pull (plain values: it crosses process boundaries)."""

    rank: int
    host: str
    local_dir: str
    success: bool
    message: str
    version: int | None = None
    action: str | None = None

    def describe(self) -> str:
        return f"rank {self.rank} (host {self.host}, {self.local_dir}): {self.message}"


@dataclass(frozen=True)
class PullResult:
    """What one :func:`~deltastore.pull.pull_weights` call did."""

    version: int
    """The version the local checkpoint now holds (verified)."""
    action: str
    """``noop``, ``applied`` (deltas on top of what was there), ``reseeded`` or ``repaired``
    (an interrupted transition was completed and nothing else was needed)."""
    versions_applied: list[int] = field(default_factory=list)
    tensors_applied: int = 0
    bytes_read: int = 0
    """Bytes read from the store (the wire bytes: compressed payloads, a full version's
    shards, index files are not counted)."""
    seconds: float = 0.0
    plan: str = ""
    repair: RepairSummary | None = None
    payloads_read: int = 0
    """Delta payloads read: one per changed tensor per version."""
    group: tuple[HostOutcome, ...] = ()
    bytes_reconstructed: int = 0
    """Bytes of local tensors written (patched, restored or copied in by a reseed)."""
    tensors_skipped: int = 0
    reseeds: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """``prepare`` (repair, checks, plan, preflight), ``reseed`` and ``apply``: the phases that
    ran (docs/api.md)."""

    @property
    def wire_bytes(self) -> int:
        """``bytes_read`` under the name the publisher's metrics use."""
        return self.bytes_read

    @property
    def message(self) -> str:
        repaired = f"{self.repair.describe()}; " if self.repair is not None else ""
        if self.action == "noop":
            return f"{repaired}already at v{self.version:06d}"
        return (
            f"{repaired}{self.action} to v{self.version:06d} ({len(self.versions_applied)} "
            f"version(s), {self.tensors_applied} tensors, {self.bytes_read} bytes read, "
            f"{self.seconds:.2f} s)"
        )

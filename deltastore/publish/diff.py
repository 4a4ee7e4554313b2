"""The diff pipeline: each passed tensor against the snapshot, encoded, compressed and digested
in a thread pool, its payload straight into the spool; and :class:`Step`, what the phases of one
publish share. Every per-tensor step is O(1) amortised: no step scans the tensors already
submitted.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from deltastore.codecs import ByteArray, FramedDelta, XorChanges, itemsize_of_dtype
from deltastore.errors import PublishError
from deltastore.progress import ProgressCallback, ProgressMeter
from deltastore.publish.config import Settings
from deltastore.publish.device import (
    GROUP_TENSOR_BYTES,
    HostStager,
    Staged,
    StagerStats,
    flat_bytes,
    hexdigest_after,
)
from deltastore.publish.messages import (
    METRIC_KEYS,
    DiffReport,
    Plan,
    StreamState,
    TensorChange,
    describe,
)
from deltastore.publish.rank_state import RankSnapshot
from deltastore.publish.snapshot import check_layout, nbytes_of
from deltastore.publish.spool import Encoded, PayloadSpool
from deltastore.storage.writer import VersionWriter

T = TypeVar("T")

NamedTensors = Iterable[tuple[str, Any]] | Mapping[str, Any]
"""What ``publish()`` takes: a mapping name → tensor (a state dict) or (name, tensor) pairs."""


@dataclass
class DiffResult:
    """What one rank's diff produced: the changed tensors, every passed name (None: unchanged)."""

    encoded: dict[str, Encoded] = field(default_factory=dict)
    passed: dict[str, Encoded | None] = field(default_factory=dict)
    staging: StagerStats | None = None

    def report(self, rank: int, error: BaseException | None, *, full: bool) -> DiffReport:
        """The message a rank sends rank 0 after its diff."""
        passed = {
            name: None if e is None else TensorChange(e.digest, e.length, e.changed_bytes)
            for name, e in self.passed.items()
        }
        return DiffReport(rank, describe(error), passed, full)


@dataclass
class Step:
    """One publish in flight: what its phases share."""

    held: RankSnapshot
    stream: StreamState
    spool: PayloadSpool
    progress: ProgressCallback | None
    metrics: dict[str, float] = field(default_factory=lambda: dict.fromkeys(METRIC_KEYS, 0.0))
    diff: DiffResult = field(default_factory=DiffResult)
    plan: Plan = field(default_factory=lambda: Plan(failure=None))
    slot: VersionWriter | None = None


def named_pairs(named_tensors: NamedTensors) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs from a mapping or an iterable of pairs (else PublishError)."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise PublishError(
                f"publish() takes a mapping name -> tensor or (name, tensor) pairs; got an item "
                f"of type {type(item).__name__}"
            )
        yield item[0], item[1]


@dataclass
class _Item:
    """One tensor queued for the encode pool."""

    name: str
    old: ByteArray
    staged: Staged | None
    itemsize: int
    changes: XorChanges | None = None
    """The change found on the tensor's device (``device_snapshot``; then nothing is staged)."""


@dataclass
class _Member:
    """A small tensor in the open group, its bytes already copied (``piece``)."""

    name: str
    tensor: Any
    old: ByteArray
    itemsize: int
    piece: Any


BATCH_BYTES = 4 * 1024**2
"""Tensors smaller than this are encoded several per pool task, up to this many bytes a task:
a task's fixed cost (a future, a queue hand-off, a lock) then spreads over many small tensors."""
BATCH_TENSORS = 256  # at most this many tensors in one pool task
WORD_CHANGE_BYTES = 16  # memory per changed 8-byte word kept by word_changes (position, value)


def word_changes(old: ByteArray, new: ByteArray, changed_bytes: int) -> XorChanges | None:
    """The change from ``old`` to ``new`` as the XOR of each 8-byte word that differs, or None
    where it would be large or the size is not whole words. Kept until the commit, it lets the
    snapshot advance without decoding the payload again, whatever the encoding."""
    if old.size % 8 or WORD_CHANGE_BYTES * changed_bytes > old.size // 8:
        return None
    old_words, new_words = old.view(np.uint64), new.view(np.uint64)
    positions = np.flatnonzero(old_words != new_words)
    return XorChanges(positions, old_words[positions] ^ new_words[positions])


class _Diff:
    """One rank's diff in flight: the open batch, at most ``2 * workers`` submitted batches
    (the producer waits on the oldest), and their results taken from the front."""

    def __init__(self, step: Step, settings: Settings) -> None:
        config = settings.config
        self.held, self.stream, self.spool = step.held, step.stream, step.spool
        self.settings, self.metrics = settings, step.metrics
        self.stager = HostStager(
            config.max_inflight_bytes,
            pin_memory=config.pin_memory,
            stage_host_tensors=config.stage_host_tensors,
        )
        self.executor = self.held.pool()
        self.batch_limit = min(BATCH_BYTES, config.max_inflight_bytes // 2)
        self.window = 2 * config.threads
        self.result = DiffResult()
        self.lock = threading.Lock()
        self.pending: deque[cf.Future[list[tuple[str, Encoded | None]]]] = deque()
        self.batch: list[_Item] = []
        self.batch_bytes = 0
        self.seen: set[str] = set()
        self.group: list[_Member] = []
        self.group_bytes = 0
        self.group_end = 0  # where the next piece may start in the device's buffer
        self.gathered: dict[Any, Any] = {}  # device -> the group's bytes, copied as taken

    def take(self, name: str, tensor: Any) -> None:
        """Check and load one tensor, diff it on its device or stage it, into the open batch;
        a small one that would take device calls of its own joins the group (kept in order),
        diffed or staged with the others in a few calls."""
        nbytes, itemsize = self._check(name, tensor)
        begun = time.perf_counter()
        old = self.held.old_bytes(name, self.stream)
        self.metrics["load_s"] += time.perf_counter() - begun
        device = self.held.device
        if self._groupable(tensor, nbytes):
            if self.group and (
                self.group_bytes + nbytes > self.batch_limit
                or tensor.device != self.group[0].tensor.device  # one group, one device
            ):
                self._flush_group()
            piece = self._timed_copy(lambda: self._gather(tensor, nbytes))
            self.group.append(_Member(name, tensor, old, itemsize, piece))
            self.group_bytes += nbytes
            if len(self.group) >= BATCH_TENSORS:
                self._flush_group()
            return
        self._flush_group()  # the group's tensors go first, as passed
        changes = None
        if device is not None:  # the diff on the device counts as the copy
            stats = self.stager.stats
            changes = self._timed_copy(lambda: device.changes(name, tensor, old, itemsize, stats))
        self._queue(name, tensor, nbytes, old, itemsize, changes)

    def _groupable(self, tensor: Any, nbytes: int) -> bool:
        """A small torch tensor diffed on its device, or else copied through the pool."""
        if self.held.device is not None:
            return self.held.device.groupable(tensor, nbytes)
        return 0 < nbytes < GROUP_TENSOR_BYTES and self.stager.pooled(tensor)

    def _gather(self, tensor: Any, nbytes: int) -> Any:
        """The tensor's bytes copied now, after the group's, into a buffer on its device: the
        caller may reuse a tensor's memory once the next is asked for (a bucketed gather), and
        a copy queued now runs before that on the device's stream."""
        import torch

        scratch = self.gathered.get(tensor.device)
        if scratch is None:
            size = max(self.batch_limit, GROUP_TENSOR_BYTES) + 8 * BATCH_TENSORS
            scratch = torch.empty(size, dtype=torch.uint8, device=tensor.device)
            self.gathered[tensor.device] = scratch
        start = -(-self.group_end // 8) * 8  # 8-aligned: the bytes are viewed as elements
        self.group_end = start + nbytes
        piece = scratch[start : self.group_end]
        piece.copy_(flat_bytes(torch, tensor))
        return piece

    def _flush_group(self) -> None:
        """Diff the group on its device (``device_snapshot``) and stage what must be staged
        in one pool buffer, then queue its tensors in one batch."""
        if not self.group:
            return
        group, self.group, self.group_bytes, self.group_end = self.group, [], 0, 0
        stats = self.stager.stats
        found: list[XorChanges | None] = [None] * len(group)
        device = self.held.device
        if device is not None:  # the diff on the device counts as the copy
            members = [(m.name, m.piece, m.old, m.itemsize) for m in group]
            found = self._timed_copy(lambda: device.changes_of_group(members, stats, as_bytes=True))
        pooled = [
            i for i, m in enumerate(group) if found[i] is None and self.stager.pooled(m.tensor)
        ]
        charge = sum(changes.nbytes for changes in found if changes is not None)
        if pooled:
            charge += self.stager.group_charge(sum(group[i].old.size for i in pooled))
        self._make_room(charge, len(group))
        staged: dict[int, Staged] = {}
        if pooled:
            pieces = [group[i].piece for i in pooled]
            copies = self._timed_copy(lambda: self.stager.stage_group(pieces))
            staged = dict(zip(pooled, copies, strict=True))
        alone = []  # neither diffed nor pooled: viewed in place, each as ever
        items = []
        for i, m in enumerate(group):
            if found[i] is None and i not in staged:
                alone.append(m)
                continue
            items.append(_Item(m.name, m.old, staged.get(i), m.itemsize, found[i]))
        self._add(items, charge)
        for m in alone:
            self._queue(m.name, m.tensor, m.old.size, m.old, m.itemsize, None)

    def _queue(
        self,
        name: str,
        tensor: Any,
        nbytes: int,
        old: ByteArray,
        itemsize: int,
        changes: XorChanges | None,
    ) -> None:
        """Put a tensor into the open batch: its changes, or else its bytes staged."""
        charge = self.stager.charge_for(tensor, nbytes) if changes is None else changes.nbytes
        self._make_room(charge, 1)
        staged = None
        if changes is None:
            staged = self._timed_copy(lambda: self.stager.stage(name, tensor))
        self._add([_Item(name, old, staged, itemsize, changes)], charge)

    def _make_room(self, charge: int, count: int) -> None:
        """Submit the open batch where ``count`` more tensors holding ``charge`` budget bytes
        would not fit in it: it holds budget nobody releases, so staging them into it could
        wait forever."""
        if self.batch and (
            self.batch_bytes + charge > self.batch_limit or len(self.batch) + count > BATCH_TENSORS
        ):
            self.submit()

    def _add(self, items: list[_Item], charge: int) -> None:
        """Items into the open batch, submitted once full."""
        self.batch += items
        self.batch_bytes += charge
        if self.batch_bytes >= self.batch_limit or len(self.batch) >= BATCH_TENSORS:
            self.submit()

    def _timed_copy(self, stage: Callable[[], T]) -> T:
        """``stage()``, its time counted in ``copy_s`` less its wait for the in-flight budget
        (the encoders' time, not the copy's)."""
        stats = self.stager.stats
        waited, begun = stats.budget_wait_s, time.perf_counter()
        staged = stage()
        waited = stats.budget_wait_s - waited
        self.metrics["copy_s"] += time.perf_counter() - begun - waited
        return staged

    def _check(self, name: str, tensor: Any) -> tuple[int, int]:
        """Refuse a tensor passed twice, unknown to the base or of another layout; else its size
        and its base dtype's element size."""
        if name in self.seen:
            raise PublishError(f"tensor {name!r} was passed twice in one publish")
        self.seen.add(name)
        source = self.held.snapshot.sources.get(name)
        if source is None:
            raise PublishError(
                f"tensor {name!r} is not in the base checkpoint {self.settings.base_checkpoint}; "
                "a delta cannot add tensors"
            )
        nbytes = nbytes_of(name, tensor)
        check_layout(name, tensor, nbytes, source)
        self.settings.encoding.check_size(nbytes, tensor=name)
        return nbytes, itemsize_of_dtype(source.dtype)

    def encode(self, batch: list[_Item]) -> list[tuple[str, Encoded | None]]:
        """Worker: a batch in one encoding call (a tensor diffed on its device coded from its
        changes), each changed tensor's frame into the spool."""
        begun = time.perf_counter()
        encoding = self.settings.encoding
        try:
            staged = [item for item in batch if item.staged is not None]
            staged_news = [item.staged.wait() for item in staged if item.staged is not None]
            framed = iter(
                encoding.encode_framed(
                    [item.old for item in staged], staged_news, [item.itemsize for item in staged]
                )
            )
            news = iter(staged_news)
            results: list[tuple[str, Encoded | None]] = []
            for item in batch:
                if item.changes is None:
                    delta, new = next(framed), next(news)
                else:
                    delta = encoding.encode_changes(item.old, item.changes, itemsize=item.itemsize)
                    new = None
                results.append((item.name, self._spooled(item, delta, new)))
        finally:
            for item in batch:
                if item.staged is not None:
                    item.staged.release()
            with self.lock:
                self.metrics["encode_s"] += time.perf_counter() - begun
        return results

    def _spooled(self, item: _Item, delta: FramedDelta, new: ByteArray | None) -> Encoded | None:
        """A changed tensor's frame appended to the spool, with its digest and changes (None:
        unchanged); ``new``: its staged bytes, None for one diffed on its device."""
        if not delta.changed_bytes:
            return None
        offset, length = self.spool.append(delta.frame)
        checksum, changes = self.settings.checksum, delta.xor_changes or item.changes
        if new is None:
            assert item.changes is not None
            digest = hexdigest_after(checksum, item.old, item.changes)
        else:
            digest = checksum.hexdigest(new)
            if changes is None:
                changes = word_changes(item.old, new, delta.changed_bytes)
        return Encoded(item.name, delta.changed_bytes, digest, offset, length, changes)

    def submit(self) -> None:
        self.pending.append(self.executor.submit(self.encode, self.batch))
        self.batch, self.batch_bytes = [], 0
        while self.pending and (len(self.pending) > self.window or self.pending[0].done()):
            self._take_oldest()

    def finish(self) -> DiffResult:
        """Flush the group, submit the open batch and wait for every result."""
        self._flush_group()
        if self.batch:
            self.submit()
        while self.pending:
            self._take_oldest()
        self.result.staging = self.stager.stats
        return self.result

    def abandon(self) -> None:
        """Release the open batch, cancel what has not started and wait for what has (the pool
        is kept: its running encodes end here)."""
        for item in self.batch:
            if item.staged is not None:
                item.staged.release()
        for future in self.pending:
            future.cancel()
        cf.wait(self.pending)

    def _take_oldest(self) -> None:
        for name, encoded in self.pending.popleft().result():
            self.result.passed[name] = encoded
            if encoded is not None:
                self.result.encoded[name] = encoded


def diff_tensors(named_tensors: NamedTensors, step: Step, settings: Settings) -> DiffResult:
    """Diff every passed tensor against the step's snapshot, in its kept threads.

    Host copies are staged under the in-flight byte budget and at most ``2 * workers`` encodes
    are pending, so a slow pool holds the producer back. Raises :class:`PublishError` naming a
    tensor passed twice, unknown to the base, or of another size, dtype or shape. Progress
    (phase ``diff``) counts each tensor once taken, then the unchanged rest as done.
    """
    started = time.perf_counter()
    diff = _Diff(step, settings)
    sources = step.held.snapshot.sources
    try:
        meter = ProgressMeter.start(step.progress, "diff", step.held.snapshot.total_bytes)
        for name, tensor in named_pairs(named_tensors):
            diff.take(name, tensor)
            if meter is not None:
                meter.advance(sources[name].nbytes)
        if meter is not None:
            meter.finish(complete=True)
        result = diff.finish()
    except BaseException:
        diff.abandon()
        raise
    finally:
        diff.stager.close()
    step.metrics["copy_s"] += diff.stager.stats.copy_wait_s
    step.metrics["diff_s"] = time.perf_counter() - started
    return result

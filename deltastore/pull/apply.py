"""Applying a run of deltas to a local checkpoint in place, verified before writing.

A run of deltas is applied in **one pass per tensor** (catch-up): each changed tensor's payload
is read once per version, payloads of a foldable encoding are folded and applied once, the
others in order. Payloads of one foldable, self-inverse encoding (``xor``) are applied straight
into the mapped file and the result verified there; one that does not verify is put back at
once by applying the same payloads again. A tensor with one payload of a self-inverse
encoding that checks a payload whole before writing (``auto``, ``sparse-v2``, ``xor``) goes
into a batch: the task's batch is decompressed in one call and applied straight into the map
in one codec call (:meth:`~deltastore.codecs.Encoding.apply_batch`), then each tensor is
verified there and one that does not verify is put back by applying its payload again; a
payload the codec refuses leaves its tensor untouched. (Per tensor, the Python calls around a
compiled decode and the GIL hand-offs of each call that releases it cost more than the decode
on 64 KB tensors.) Any other run is applied on a copy, verified *before* it is written. So
whatever happens, each tensor on disk is either at the version the run starts from, at the
version it ends at, or (a write torn by a crash) neither; :mod:`deltastore.pull.repair` relies
on exactly that.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deltastore.codecs import get_encoding
from deltastore.codecs.compression import decompress_many
from deltastore.errors import FormatError, IntegrityError, PutBackError
from deltastore.format.checkpoint import CheckpointTensor, scan_checkpoint
from deltastore.format.index import VersionIndex
from deltastore.format.names import version_dir_name
from deltastore.pull.batches import Span, Window, plan_windows, read_window, tasks_of
from deltastore.pull.fold import UndoRecord, applies_in_place, batches_in_place, fold_apply
from deltastore.pull.history import (
    TensorHistory,
    check_contiguous,
    check_local_names,
    collect_history,
)
from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.mapped import MappedFiles, mapped_files
from deltastore.pull.stats import ApplyStats
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.pull")


@dataclass(frozen=True)
class _Written:
    tensor: CheckpointTensor
    name: str
    undo: UndoRecord


class _ChainApplier:
    """Applies one run of deltas tensor by tensor, remembering how to put each write back."""

    def __init__(
        self,
        store: VersionStore,
        files: MappedFiles,
        local_tensors: dict[str, CheckpointTensor],
        applied_version: int,
        last: str,
        stats: ApplyStats | None,
    ) -> None:
        self.store = store
        self.files = files
        self.local_tensors = local_tensors
        self.applied_version = applied_version
        self.last = last
        self.stats = stats
        self.written: list[_Written] = []
        self._lock = threading.Lock()

    def nbytes(self, tensor: TensorHistory) -> int:
        """Bytes of ``tensor`` in the local checkpoint."""
        return self.local_tensors[tensor.name].entry.nbytes

    def read_span(self, span: Span) -> bytes:
        """One ranged read of a window (several payloads at once)."""
        data = self.store.read_range(span.version, span.shard, span.start, span.end)
        if self.stats is not None:
            self.stats.add(bytes_read=len(data))
        return data

    def apply_run(
        self, tensors: Sequence[TensorHistory], frames: Sequence[list[memoryview]], run: range
    ) -> None:
        """Apply the tensors ``run`` indexes (one pool task), each verified before the task ends.

        Tensors with one payload of an encoding that may be applied in place go in batches
        (:meth:`_apply_batch`, one codec call per encoding and file); the others one by one.
        Every tensor written is recorded (for a put-back) even when a later one fails.
        """
        written: list[_Written] = []
        # Every tensor of the run is written whole (unless one fails): its pages are made
        # writable in a few calls instead of two page faults per page.
        self.files.prepare_writes([self.local_tensors[tensors[i].name] for i in run])
        try:
            batches: dict[tuple[str, str], list[int]] = {}
            for i in run:
                tensor = tensors[i]
                if batches_in_place(tensor.payloads):
                    file = self.local_tensors[tensor.name].file
                    batches.setdefault((tensor.payloads[0].encoding, file), []).append(i)
                else:
                    target = self.local_tensors[tensor.name]
                    self._apply_one(tensor, target, frames[i], written)
            for batch in batches.values():
                self._apply_batch(tensors, frames, batch, written)
        finally:
            with self._lock:
                self.written.extend(written)
            if self.stats is not None:
                payloads = sum(len(tensors[i].payloads) for i in run)
                nbytes = sum(w.tensor.entry.nbytes for w in written)
                self.stats.add(tensors=len(written), payloads=payloads, bytes_written=nbytes)

    def _apply_batch(
        self,
        tensors: Sequence[TensorHistory],
        frames: Sequence[list[memoryview]],
        batch: list[int],
        written: list[_Written],
    ) -> None:
        """Apply the one payload of each tensor ``batch`` indexes (one encoding, one file)
        straight into the map in one codec call, then verify each; a payload that does not fit
        is refused before its tensor is written, a tensor that does not verify is put back.

        Each tensor is recorded in ``written`` as soon as the codec has written it, so the
        caller's put-back covers the ones after a failure too.
        """
        targets = [self.local_tensors[tensors[i].name] for i in batch]
        names = [tensors[i].name for i in batch]
        refs = [tensors[i].payloads[0] for i in batch]
        encoding = get_encoding(refs[0].encoding)
        sizes = np.array([t.entry.nbytes for t in targets], np.int64)
        payloads = decompress_many(
            [frames[i][0] for i in batch],
            [encoding.max_payload_size(int(size)) for size in sizes],
            encoding.exact_payload_size,
            lambda j: f"{refs[j].where} payload of tensor {names[j]!r}",
        )
        array = self.files.array(targets[0].file)
        starts = np.array([t.entry.start for t in targets], np.int64)
        applied, error = encoding.apply_batch(array, starts, sizes, payloads, names)
        first = len(written)
        written.extend(
            _Written(targets[j], names[j], UndoRecord((refs[j],), (frames[batch[j]][0],)))
            for j in range(applied)
        )
        if error is not None:
            raise FormatError(f"weight_v{refs[applied].version:06d}: {error}") from None
        for j in range(applied):
            tensor, view = tensors[batch[j]], array[starts[j] : starts[j] + sizes[j]]
            if not tensor.final.matches(view):
                fold_apply(view, tensor.payloads, frames[batch[j]], tensor.name, in_place=True)
                del written[first + j]  # put back (if that raised, the caller's put-back does)
                raise self._mismatch(tensor, "The tensor was put back as it was")

    def _apply_one(
        self,
        tensor: TensorHistory,
        target: CheckpointTensor,
        frames: list[memoryview],
        written: list[_Written],
    ) -> None:
        """Fold, apply, verify one tensor and record it in ``written`` before its bytes change;
        a tensor that does not verify is left (or put back) as it was, and raises."""
        view = self.files.view(target)
        if applies_in_place(tensor.payloads):
            # XOR-like payloads go straight into the map (one pass instead of copy, apply,
            # copy back); a result that does not verify is put back by applying them again.
            fold_apply(view, tensor.payloads, frames, tensor.name, in_place=True)
            if not tensor.final.matches(view):
                fold_apply(view, tensor.payloads[::-1], frames[::-1], tensor.name, in_place=True)
                raise self._mismatch(tensor, "The tensor was put back as it was")
            written.append(
                _Written(target, tensor.name, UndoRecord(tuple(tensor.payloads), tuple(frames)))
            )
            return
        result = fold_apply(view, tensor.payloads, frames, tensor.name)
        if not tensor.final.matches(result):
            raise self._mismatch(tensor, "Nothing of this tensor was written")
        written.append(
            _Written(target, tensor.name, UndoRecord.of(view, result, tensor.payloads, frames))
        )
        view[:] = result

    def _mismatch(self, tensor: TensorHistory, what_was_done: str) -> IntegrityError:
        first, final = tensor.payloads[0].version, tensor.payloads[-1].version
        return IntegrityError(
            f"{self.last}: tensor {tensor.name!r} does not match its published "
            f"{tensor.final.checksum.name} digest after applying v{first:06d}..v{final:06d} "
            f"(want {tensor.final.hex}); the delta is corrupt or the local checkpoint "
            f"is not at v{self.applied_version:06d}. {what_was_done}"
        )

    def put_back(self, cause: BaseException, local_dir: str) -> None:
        """Restore every tensor already written and flush; :class:`PutBackError` if that fails."""
        try:
            for written in self.written:
                written.undo.restore(self.files.view(written.tensor), written.name)
            self.files.flush()
        except Exception as putback:
            raise PutBackError(
                f"{self.last}: applying failed ({cause}) and putting back the "
                f"{len(self.written)} tensors already written failed too ({putback}); the "
                f"next pull repairs {local_dir}"
            ) from cause
        if self.written:
            log.warning("%s: put back %d tensors already written", self.last, len(self.written))


_pools: dict[int, cf.ThreadPoolExecutor] = {}
_pools_guard = threading.Lock()


def _apply_pool(workers: int) -> cf.ThreadPoolExecutor:
    """The process's apply threads for ``workers`` (kept between pulls: starting a thread
    waits for it to be scheduled, which on a loaded host costs more than a small pull)."""
    workers = max(1, workers)
    with _pools_guard:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = cf.ThreadPoolExecutor(
                workers, thread_name_prefix=f"deltastore-apply-{workers}"
            )
        return pool


os.register_at_fork(after_in_child=_pools.clear)  # a child has none of its parent's threads


def _run_windows(applier: _ChainApplier, windows: Sequence[Window], workers: int) -> None:
    """Read each window (one request per span) and apply it in tasks on a thread pool.

    The next window is read while the pool applies the current one; at most two windows are
    in flight. After the first error no new task or read starts; it is re-raised once every
    started task has finished (so the put-back sees every tensor written).
    """
    failed = threading.Event()
    errors: list[BaseException] = []

    def guarded(window: Window, frames: list[list[memoryview]], run: range) -> None:
        if failed.is_set():
            return
        try:
            applier.apply_run(window.tensors, frames, run)
        except BaseException as exc:
            failed.set()
            errors.append(exc)

    pool = _apply_pool(workers)
    in_flight: deque[list[cf.Future[None]]] = deque()
    try:
        for window in windows:
            if failed.is_set():
                break
            try:
                frames = window.frames(read_window(window, applier.read_span))
            except BaseException as exc:
                failed.set()
                errors.append(exc)
                break
            runs = tasks_of([applier.nbytes(t) for t in window.tensors])
            in_flight.append([pool.submit(guarded, window, frames, run) for run in runs])
            while len(in_flight) > 1:
                cf.wait(in_flight.popleft())
    finally:
        for started in in_flight:
            cf.wait(started)
    if errors:
        raise errors[0]


def apply_chain(
    store: VersionStore,
    deltas: Sequence[VersionIndex],
    local: LocalCheckpoint,
    applied_version: int,
    *,
    workers: int = 4,
    tensors: dict[str, CheckpointTensor] | None = None,
    stats: ApplyStats | None = None,
    files: MappedFiles | None = None,
) -> None:
    """Apply a run of deltas in place, one pass per changed tensor, verified before writing.

    ``deltas`` must build link by link on ``applied_version`` (else :class:`OutOfOrderError`);
    a tensor named by a delta must exist locally (else :class:`NameMismatchError`). Each
    changed tensor's result is checked against the digest of the last delta that changes it;
    on any failure the tensors already written are put back (and flushed), so the checkpoint
    still holds ``applied_version`` when the error is raised (:class:`PutBackError` when the
    put-back itself fails).

    Without ``files`` the data is flushed (msync + fsync) before returning, and a flush that
    fails raises :class:`PutBackError` too; the caller records the state. Given ``files``
    (open maps the caller owns), the written files stay mapped there, verified but not
    flushed: the caller flushes them before it records the state.
    """
    if not deltas:
        return
    check_contiguous(deltas, applied_version)
    history = collect_history(store, deltas)
    local_tensors = tensors if tensors is not None else scan_checkpoint(local.dir)
    check_local_names(history, local_tensors, local.dir)
    if stats is not None and stats.progress is not None:
        stats.report("apply", sum(p.end - p.start for t in history.values() for p in t.payloads))
    last = version_dir_name(deltas[-1].version)
    owned = files is None
    with contextlib.ExitStack() as stack:
        if files is None:
            files = stack.enter_context(mapped_files())
        applier = _ChainApplier(store, files, local_tensors, applied_version, last, stats)
        try:
            _run_windows(applier, plan_windows(list(history.values())), workers)
        except BaseException as exc:
            applier.put_back(exc, local.dir)
            raise
        if owned:
            flush_applied(files, last, local.dir)
    if stats is not None:
        stats.versions.extend(d.version for d in deltas)


def flush_applied(files: MappedFiles, last: str, local_dir: str) -> None:
    """Flush the files a run of deltas was applied to; :class:`PutBackError` if that fails
    (every tensor is written but maybe not durable: neither version can be named)."""
    try:
        files.flush()
    except BaseException as exc:
        raise PutBackError(
            f"the tensors of {last} were applied in {local_dir} but could not be flushed "
            f"({exc}); its pending record stays and the next pull repairs it"
        ) from exc


def apply_delta(
    store: VersionStore,
    index: VersionIndex,
    local: LocalCheckpoint,
    applied_version: int,
    *,
    workers: int = 4,
    tensors: dict[str, CheckpointTensor] | None = None,
    stats: ApplyStats | None = None,
) -> None:
    """Apply one delta version in place (see :func:`apply_chain`)."""
    apply_chain(
        store, [index], local, applied_version, workers=workers, tensors=tensors, stats=stats
    )


__all__ = ["ApplyStats", "apply_chain", "apply_delta", "flush_applied"]

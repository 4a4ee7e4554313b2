"""Applying a run of deltas to a local checkpoint in place, one pass per tensor.

Payloads are read in windows (one ranged request per run of nearby payloads of a shard) and
applied in tasks on a thread pool; payloads of one foldable encoding are folded and applied
once. A tensor whose payloads may be applied in place (:func:`applies_in_place`,
:func:`batches_in_place`: one codec call per encoding and file) is written straight into the
map, verified there, and put back by applying them again if it does not verify; any other is
applied on a copy and verified *before* it is written. So each tensor on disk is at the
version the run starts from, at the one it ends at, or (a write torn by a crash) neither:
:mod:`deltastore.pull.repair` relies on that. The encoding says what it allows
(``foldable``, ``self_inverse``, ...); nothing compares encoding names.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import itertools
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from deltastore.codecs import ByteArray, Encoding, decompress, get_encoding
from deltastore.codecs.compression import decompress_many
from deltastore.errors import FormatError, IntegrityError, PutBackError
from deltastore.format.checkpoint import CheckpointTensor, scan_checkpoint
from deltastore.format.index import VersionIndex
from deltastore.format.names import version_dir_name
from deltastore.format.payload import PayloadRef
from deltastore.pull.chain import (
    TensorHistory,
    check_contiguous,
    check_local_names,
    collect_history,
)
from deltastore.pull.local import MappedFiles, PullContext
from deltastore.pull.result import ApplyStats, FirstError, kept_pool
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.pull")


def read_payloads(
    store: VersionStore, payloads: Sequence[PayloadRef], stats: ApplyStats | None
) -> list[bytes]:
    """The compressed frames of ``payloads``, one ranged read each."""
    frames = [store.read_range(p.version, p.shard, p.start, p.end) for p in payloads]
    if stats is not None:
        stats.add(payloads=len(frames), bytes_read=sum(len(f) for f in frames))
    return frames


def fold_apply(
    current: ByteArray,
    payloads: Sequence[PayloadRef],
    frames: Sequence[bytes | memoryview],
    name: str,
    *,
    in_place: bool = False,
) -> ByteArray:
    """``current`` with ``payloads`` applied in order (consecutive ones of a foldable encoding
    folded into one), as a new array, or into ``current`` itself when ``in_place``;
    :class:`FormatError` naming the version whose payload does not fit."""
    result = current if in_place else current.copy()

    def raw(payload: PayloadRef, frame: bytes | memoryview, encoding: Encoding) -> bytes:
        return decompress(  # its declared size checked before allocating
            frame,
            max_size=encoding.max_payload_size(result.size),
            exact_size=result.size if encoding.exact_payload_size else None,
            what=f"{payload.where} payload of tensor {name!r}",
        )

    pairs = zip(payloads, frames, strict=True)
    for encoding, same in itertools.groupby(pairs, key=lambda pair: get_encoding(pair[0].encoding)):
        run = list(same)
        if not encoding.foldable:
            for payload, frame in run:
                _apply(encoding, result, raw(payload, frame, encoding), name, payload.version)
            continue
        # One payload (the common case) is applied straight from its decompressed bytes; a
        # private copy is made only when others fold into it (a frame's bytes are read-only).
        folded = np.frombuffer(raw(*run[0], encoding), dtype=np.uint8)
        if len(run) > 1:
            folded = folded.copy()
        for payload, frame in run[1:]:
            later = raw(payload, frame, encoding)
            try:
                folded = encoding.fold(folded, later, tensor=name)
            except FormatError as exc:
                raise FormatError(f"{payload.where}: {exc}") from None
        _apply(encoding, result, folded, name, run[-1][0].version)
    return result


def applies_in_place(payloads: Sequence[PayloadRef]) -> bool:
    """True when ``payloads`` may be applied straight into the tensor's mapped bytes: one
    encoding, foldable (every payload is decompressed, size-checked and folded before the
    tensor is touched) and self-inverse (applying them again puts the old bytes back)."""
    encodings = {get_encoding(p.encoding) for p in payloads}
    return len(encodings) == 1 and all(e.foldable and e.self_inverse for e in encodings)


def batches_in_place(payloads: Sequence[PayloadRef]) -> bool:
    """True when a tensor's ``payloads`` may go into a batch applied straight into the map:
    one payload of a self-inverse encoding that checks a payload whole before it writes (a
    refused one leaves the tensor untouched, a written one is put back by applying it again)
    and applies in batches."""
    if len(payloads) != 1:
        return False
    encoding = get_encoding(payloads[0].encoding)
    return encoding.self_inverse and encoding.checks_before_writing and encoding.applies_in_batches


def _apply(
    encoding: Encoding, target: ByteArray, raw: bytes | ByteArray, name: str, version: int
) -> None:
    try:
        encoding.apply(target, memoryview(raw), tensor=name)
    except FormatError as exc:
        raise FormatError(f"weight_v{version:06d}: {exc}") from None


@dataclass(frozen=True)
class UndoRecord:
    """What puts one written tensor back: ``frames`` when every payload's encoding is
    self-inverse (applied again, newest first), else changed ``positions`` and old ``values``."""

    payloads: tuple[PayloadRef, ...]
    frames: tuple[bytes | memoryview, ...] | None = None
    positions: npt.NDArray[np.intp] | None = None
    values: ByteArray | None = None

    @classmethod
    def of(
        cls,
        before: ByteArray,
        after: ByteArray,
        payloads: Sequence[PayloadRef],
        frames: Sequence[bytes | memoryview],
    ) -> UndoRecord:
        """The cheapest record that restores ``before`` from ``after``."""
        if all(get_encoding(p.encoding).self_inverse for p in payloads):
            return cls(tuple(payloads), frames=tuple(frames))
        positions = np.flatnonzero(before != after)
        return cls(tuple(payloads), positions=positions, values=before[positions].copy())

    def restore(self, view: ByteArray, name: str) -> None:
        """Write the old bytes back into ``view`` (the tensor as it was written)."""
        if self.frames is not None:
            view[:] = fold_apply(view, self.payloads[::-1], self.frames[::-1], name)
        else:
            assert self.positions is not None and self.values is not None
            view[self.positions] = self.values


WINDOW_BYTES = 32 * 1024**2
"""Compressed payload bytes one window reads at most (one tensor's own payloads excepted)."""
MAX_GAP = 1024**2
"""Bytes between two payloads of a shard that are read (and dropped) to save a request."""
TASK_BYTES = 8 * 1024**2
"""Model bytes one apply task covers at most (a larger tensor is a task of its own)."""


@dataclass(frozen=True)
class Span:
    """One ranged read: bytes ``[start, end)`` of a shard of a version."""

    version: int
    shard: str
    start: int
    end: int


@dataclass(frozen=True)
class Window:
    """Tensors whose payloads are read together, and the reads that fetch them: ``where[i][j]``
    is ``(span index, start, end)`` of tensor ``i``'s ``j``-th payload in that span's bytes."""

    tensors: tuple[TensorHistory, ...]
    spans: tuple[Span, ...]
    where: tuple[tuple[tuple[int, int, int], ...], ...]

    def frames(self, data: Sequence[bytes]) -> list[list[memoryview]]:
        """Each tensor's compressed frames, as views into the spans' bytes (``data``)."""
        views = [memoryview(d) for d in data]
        return [[views[s][a:b] for s, a, b in loc] for loc in self.where]


def plan_windows(
    tensors: Sequence[TensorHistory],
    *,
    window_bytes: int = WINDOW_BYTES,
    max_gap: int = MAX_GAP,
) -> list[Window]:
    """``tensors`` (each with at least one payload) cut into windows, in file order."""
    ordered = sorted(
        tensors, key=lambda t: (t.payloads[0].version, t.payloads[0].shard, t.payloads[0].start)
    )
    sizes = [sum(p.size for p in tensor.payloads) for tensor in ordered]
    runs = runs_of(sizes, window_bytes)
    return [_window(ordered[run.start : run.stop], max_gap, window_bytes) for run in runs]


def _window(tensors: list[TensorHistory], max_gap: int, window_bytes: int) -> Window:
    """The spans covering ``tensors``' payloads: one per run of payloads of a shard that lie
    within ``max_gap`` of each other (and span at most twice ``window_bytes``)."""
    refs = sorted(
        (p.version, p.shard, p.start, p.end, i, j)
        for i, tensor in enumerate(tensors)
        for j, p in enumerate(tensor.payloads)
    )
    where: list[list[tuple[int, int, int]]] = [[(0, 0, 0)] * len(t.payloads) for t in tensors]
    spans: list[Span] = []
    first = 0  # index in refs of the open span's first payload
    while first < len(refs):
        version, shard, begin, end = refs[first][:4]
        last = first + 1
        while last < len(refs):
            v, s, start, stop = refs[last][:4]
            if (
                v != version
                or s != shard
                or start - end > max_gap
                or stop - begin > 2 * window_bytes
            ):
                break
            end = max(end, stop)
            last += 1
        for _, _, start, stop, i, j in refs[first:last]:
            where[i][j] = (len(spans), start - begin, stop - begin)
        spans.append(Span(version, shard, begin, end))
        first = last
    return Window(tuple(tensors), tuple(spans), tuple(tuple(w) for w in where))


def tasks_of(sizes: Sequence[int], task_bytes: int = TASK_BYTES) -> list[range]:
    """Indexes of ``sizes`` (model bytes per tensor) cut into apply tasks."""
    return runs_of(sizes, task_bytes)


def runs_of(sizes: Sequence[int], limit: int) -> list[range]:
    """Indexes of ``sizes`` cut into runs, each ended by the item that brings it to ``limit``."""
    runs: list[range] = []
    begin, size = 0, 0
    for i, nbytes in enumerate(sizes):
        size += nbytes
        if size >= limit:
            runs.append(range(begin, i + 1))
            begin, size = i + 1, 0
    if begin < len(sizes):
        runs.append(range(begin, len(sizes)))
    return runs


@dataclass
class _ChainApplier:
    """Applies one run of deltas tensor by tensor, remembering how to put each write back."""

    store: VersionStore
    files: MappedFiles
    local_tensors: dict[str, CheckpointTensor]
    applied_version: int
    last: str
    stats: ApplyStats
    written: list[tuple[str, UndoRecord]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read_span(self, span: Span) -> bytes:
        data = self.store.read_range(span.version, span.shard, span.start, span.end)
        self.stats.add(bytes_read=len(data))
        return data

    def apply_run(
        self, tensors: Sequence[TensorHistory], frames: Sequence[list[memoryview]], run: range
    ) -> None:
        """Apply and verify the tensors ``run`` indexes (one pool task), in batches where
        :func:`batches_in_place` allows; every tensor written is recorded, even on a failure."""
        written: list[tuple[str, UndoRecord]] = []
        # Every tensor of the run is written whole (unless one fails): its pages are made
        # writable in a few calls instead of two page faults per page.
        self.files.prepare_writes([self.local_tensors[tensors[i].name] for i in run])
        try:
            batches: dict[tuple[str, str], list[int]] = {}
            for i in run:
                tensor = tensors[i]
                target = self.local_tensors[tensor.name]
                if batches_in_place(tensor.payloads):
                    batches.setdefault((tensor.payloads[0].encoding, target.file), []).append(i)
                else:
                    self._apply_one(tensor, target, frames[i], written)
            for batch in batches.values():
                self._apply_batch(tensors, frames, batch, written)
        finally:
            with self._lock:
                self.written.extend(written)
            nbytes = sum(self.local_tensors[name].entry.nbytes for name, _ in written)
            payloads = sum(len(tensors[i].payloads) for i in run)
            self.stats.add(tensors=len(written), payloads=payloads, bytes_written=nbytes)

    def _apply_batch(
        self,
        tensors: Sequence[TensorHistory],
        frames: Sequence[list[memoryview]],
        batch: list[int],
        written: list[tuple[str, UndoRecord]],
    ) -> None:
        """Apply the one payload of each tensor ``batch`` indexes (one encoding, one file) in
        one codec call, then verify each; each is recorded in ``written`` as soon as the codec
        has written it, so the caller's put-back restores every one after a failure."""
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
        written.extend(
            (names[j], UndoRecord((refs[j],), (frames[batch[j]][0],))) for j in range(applied)
        )
        if error is not None:
            raise FormatError(f"weight_v{refs[applied].version:06d}: {error}") from None
        for j in range(applied):
            if not tensors[batch[j]].final.matches(array[starts[j] : starts[j] + sizes[j]]):
                raise self._mismatch(tensors[batch[j]], "The tensor was put back as it was")

    def _apply_one(
        self,
        tensor: TensorHistory,
        target: CheckpointTensor,
        frames: list[memoryview],
        written: list[tuple[str, UndoRecord]],
    ) -> None:
        """Fold, apply, verify one tensor and record it in ``written`` once it is written; one
        that does not verify raises, left as it was or put back by the caller's put-back."""
        view = self.files.view(target)
        if applies_in_place(tensor.payloads):
            # XOR-like payloads go straight into the map (one pass instead of copy, apply,
            # copy back); a result that does not verify is put back by applying them again.
            fold_apply(view, tensor.payloads, frames, tensor.name, in_place=True)
            written.append((tensor.name, UndoRecord(tuple(tensor.payloads), tuple(frames))))
            if not tensor.final.matches(view):
                raise self._mismatch(tensor, "The tensor was put back as it was")
            return
        result = fold_apply(view, tensor.payloads, frames, tensor.name)
        if not tensor.final.matches(result):
            raise self._mismatch(tensor, "Nothing of this tensor was written")
        written.append((tensor.name, UndoRecord.of(view, result, tensor.payloads, frames)))
        view[:] = result

    def _mismatch(self, tensor: TensorHistory, what_was_done: str) -> IntegrityError:
        first, final = tensor.payloads[0].version, tensor.payloads[-1].version
        # At version 0 the checkpoint is the host's base: the base record leaves the tensors a
        # delta carries to this check, so a wrong base shows here.
        base = " (a copy of --base: is it the model the trainer was seeded from?)"
        return IntegrityError(
            f"{self.last}: tensor {tensor.name!r} does not match its published "
            f"{tensor.final.checksum.name} digest after applying v{first:06d}..v{final:06d} "
            f"(want {tensor.final.hex}); the delta is corrupt or the local checkpoint "
            f"is not at v{self.applied_version:06d}{base if self.applied_version == 0 else ''}. "
            f"{what_was_done}"
        )

    def put_back(self, cause: BaseException, local_dir: str) -> None:
        """Restore every tensor already written and flush; :class:`PutBackError` if that fails."""
        try:
            for name, undo in self.written:
                undo.restore(self.files.view(self.local_tensors[name]), name)
            self.files.flush()
        except Exception as putback:
            raise PutBackError(
                f"{self.last}: applying failed ({cause}) and putting back the "
                f"{len(self.written)} tensors already written failed too ({putback}); the "
                f"next pull repairs {local_dir}"
            ) from cause
        if self.written:
            log.warning("%s: put back %d tensors already written", self.last, len(self.written))


def _run_windows(applier: _ChainApplier, windows: Sequence[Window], workers: int) -> None:
    """Read each window and apply it in tasks on the pool, the next window read while the
    pool applies the current one. After the first error no new task or read starts; it is
    re-raised once every started task has finished (so the put-back sees every write)."""
    first = FirstError()
    workers = max(1, workers)
    pool = kept_pool(f"deltastore-apply-{workers}", workers)
    in_flight: deque[list[cf.Future[None]]] = deque()
    try:
        for window in windows:
            if first.failed.is_set():
                break
            try:
                frames = window.frames([applier.read_span(span) for span in window.spans])
            except BaseException as exc:
                first.record(exc)
                break
            sizes = [applier.local_tensors[t.name].entry.nbytes for t in window.tensors]
            run = functools.partial(first.run, applier.apply_run, window.tensors, frames)
            in_flight.append([pool.submit(run, task) for task in tasks_of(sizes)])
            while len(in_flight) > 1:
                cf.wait(in_flight.popleft())
    finally:
        for started in in_flight:
            cf.wait(started)
    first.raise_first()


def apply_chain(
    pull: PullContext,
    store: VersionStore,
    deltas: Sequence[VersionIndex],
    applied_version: int,
    tensors: dict[str, CheckpointTensor] | None,
    files: MappedFiles,
) -> None:
    """Apply a run of deltas from ``store`` (the pull's, or its verified copies) to the pull's
    local checkpoint in place through ``files`` (maps the caller owns and flushes with
    :func:`flush_applied` before it records the state), building link by link on
    ``applied_version`` (else :class:`OutOfOrderError`) onto tensors that exist locally (else
    :class:`NameMismatchError`; ``tensors``: the checkpoint as scanned, None to scan it). On
    any failure what was written is put back and flushed (:class:`PutBackError` if that fails).
    """
    local, stats = pull.local, pull.stats
    check_contiguous(deltas, applied_version)
    history = collect_history(store, deltas)
    local_tensors = tensors if tensors is not None else scan_checkpoint(local.dir)
    check_local_names(history, local_tensors, local.dir)
    if stats.progress is not None:
        stats.report("apply", sum(p.end - p.start for t in history.values() for p in t.payloads))
    last = version_dir_name(deltas[-1].version)
    applier = _ChainApplier(store, files, local_tensors, applied_version, last, stats)
    try:
        _run_windows(applier, plan_windows(list(history.values())), pull.workers)
    except BaseException as exc:
        applier.put_back(exc, local.dir)
        raise
    stats.versions.extend(d.version for d in deltas)


def flush_applied(files: MappedFiles, last: str, local_dir: str) -> None:
    """Flush the files a run of deltas was applied to; :class:`PutBackError` if that fails
    (every tensor is written but maybe not durable: neither version can be named)."""
    try:
        files.flush()
    except Exception as exc:  # (a Ctrl-C stays one: the pending record stays all the same)
        raise PutBackError(
            f"the tensors of {last} were applied in {local_dir} but could not be flushed "
            f"({exc}); its pending record stays and the next pull repairs it"
        ) from exc

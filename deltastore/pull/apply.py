"""Applying a run of deltas to a local checkpoint in place, verified before writing.

A run of deltas is applied in **one pass per tensor** (catch-up): each changed tensor's payload
is read once per version, payloads of a foldable encoding are folded and applied once, the
others in order. Payloads of one foldable, self-inverse encoding (``xor``) are applied straight
into the mapped file and the result verified there; one that does not verify is put back at
once by applying the same payloads again. Any other run is applied on a copy, verified
*before* it is written. So whatever happens, each tensor on disk is either at the version the
run starts from, at the version it ends at, or (a write torn by a crash) neither;
:mod:`deltastore.pull.repair` relies on exactly that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from deltastore.codecs import ByteArray
from deltastore.errors import IntegrityError, PutBackError
from deltastore.format.checkpoint import CheckpointTensor, scan_checkpoint
from deltastore.format.index import VersionIndex
from deltastore.format.names import version_dir_name
from deltastore.pull.fold import UndoRecord, applies_in_place, fold_apply, read_payloads
from deltastore.pull.history import (
    TensorHistory,
    check_contiguous,
    check_local_names,
    collect_history,
)
from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.mapped import MappedFiles, mapped_files
from deltastore.pull.stats import ApplyStats, run_pool
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

    def apply_one(self, tensor: TensorHistory) -> None:
        """Fold, apply, verify one tensor: a tensor that does not verify is left (or put back)
        as it was."""
        target = self.local_tensors[tensor.name]
        frames = read_payloads(self.store, tensor.payloads, self.stats)
        view = self.files.view(target)
        if applies_in_place(tensor.payloads):
            self._apply_in_place(tensor, target, view, frames)
            return
        result = fold_apply(view, tensor.payloads, frames, tensor.name)
        if not tensor.final.matches(result):
            raise self._mismatch(tensor, "Nothing of this tensor was written")
        undo = UndoRecord.of(view, result, tensor.payloads, frames)
        with self._lock:
            self.written.append(_Written(target, tensor.name, undo))
        view[:] = result
        if self.stats is not None:
            self.stats.add(tensors=1, bytes_written=target.entry.nbytes)

    def _apply_in_place(
        self, tensor: TensorHistory, target: CheckpointTensor, view: ByteArray, frames: list[bytes]
    ) -> None:
        """XOR-like payloads go straight into the map (one pass instead of copy, apply, copy
        back); a result that does not verify is put back by applying them again."""
        fold_apply(view, tensor.payloads, frames, tensor.name, in_place=True)
        if not tensor.final.matches(view):
            fold_apply(view, tensor.payloads[::-1], frames[::-1], tensor.name, in_place=True)
            raise self._mismatch(tensor, "The tensor was put back as it was")
        with self._lock:
            undo = UndoRecord(tuple(tensor.payloads), frames=tuple(frames))
            self.written.append(_Written(target, tensor.name, undo))
        if self.stats is not None:
            self.stats.add(tensors=1, bytes_written=target.entry.nbytes)

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


def apply_chain(
    store: VersionStore,
    deltas: Sequence[VersionIndex],
    local: LocalCheckpoint,
    applied_version: int,
    *,
    workers: int = 4,
    tensors: dict[str, CheckpointTensor] | None = None,
    stats: ApplyStats | None = None,
) -> None:
    """Apply a run of deltas in place, one pass per changed tensor, verified before writing.

    ``deltas`` must build link by link on ``applied_version`` (else :class:`OutOfOrderError`);
    a tensor named by a delta must exist locally (else :class:`NameMismatchError`). Each
    changed tensor's result is checked against the digest of the last delta that changes it;
    on any failure the tensors already written are put back (and flushed), so the checkpoint
    still holds ``applied_version`` when the error is raised (:class:`PutBackError` when the
    put-back itself fails). The data is flushed (msync + fsync) before returning; the caller
    records the state.
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
    with mapped_files() as files:
        applier = _ChainApplier(store, files, local_tensors, applied_version, last, stats)
        try:
            run_pool(sorted(history.values(), key=lambda t: t.name), applier.apply_one, workers)
        except BaseException as exc:
            applier.put_back(exc, local.dir)
            raise
        files.flush()
    if stats is not None:
        stats.versions.extend(d.version for d in deltas)


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


__all__ = ["ApplyStats", "apply_chain", "apply_delta"]

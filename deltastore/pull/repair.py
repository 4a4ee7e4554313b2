"""Repairing a transition a crash interrupted (``.weight_sync/pending.json``).

After a crash each tensor the transition touches is at the version it started from, at the
one it was going to, or (a torn write) neither (:mod:`deltastore.pull.apply`). Re-applying
blindly would revert the tensors already written under a self-inverse encoding (XOR); instead
each touched tensor is hashed and **kept** when it matches the target digest, **applied** (the
transition's payloads, folded) when it matches its previous digest, else **restored**: rebuilt
from the chain's start plus every delta that changes it, verified, and written.

The previous digest at ``from`` is that of the newest delta ≤ ``from`` that changed the tensor,
else the full version's recorded one, else the hash of the base's bytes. Anything that cannot
be proven this way raises, and the caller reseeds.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from deltastore.codecs import ByteArray, Checksum, Digest
from deltastore.errors import ApplyError, ConfigError, IntegrityError, NameMismatchError
from deltastore.format.checkpoint import CheckpointTensor, read_tensor, scan_checkpoint
from deltastore.format.state import PendingTransition
from deltastore.pull.apply import fold_apply, read_payloads
from deltastore.pull.chain import (
    Chain,
    FullTensor,
    TensorHistory,
    check_local_names,
    collect_history,
    full_tensors,
    resolve_chain,
)
from deltastore.pull.local import MappedFiles, PullContext
from deltastore.pull.result import ApplyStats, RepairSummary, run_pool
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.pull")


@dataclass
class _ChainStart:
    """Bytes and digests of tensors at a chain's start (the base dir or a full version)."""

    store: VersionStore
    chain: Chain
    base_dir: str | None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _tensors: dict[str, CheckpointTensor] | dict[str, FullTensor] | None = None

    def _find(self, name: str, nbytes: int) -> CheckpointTensor | FullTensor:
        with self._lock:
            if self._tensors is None:
                if self.chain.start_index is not None:
                    self._tensors = full_tensors(self.store, self.chain.start_index)
                elif self.base_dir is None:
                    raise ConfigError(
                        "restoring a tensor of a chain that starts at the base needs base_dir"
                    )
                else:
                    self._tensors = scan_checkpoint(self.base_dir)
        found = self._tensors.get(name)
        if found is None or found.entry.nbytes != nbytes:
            where = "the base" if self.chain.start_index is None else f"v{self.chain.start:06d}"
            raise NameMismatchError(f"tensor {name!r} differs in {where} and the local dir")
        return found

    def read(self, name: str, nbytes: int, stats: ApplyStats | None) -> ByteArray:
        """The tensor's bytes at the chain's start (a fresh writable array)."""
        found = self._find(name, nbytes)
        if isinstance(found, CheckpointTensor):
            return read_tensor(found, name)
        entry = found.entry
        raw = self.store.read_range(self.chain.start, found.shard, entry.start, entry.end)
        if stats is not None:
            stats.add(bytes_read=len(raw))
        return np.frombuffer(raw, dtype=np.uint8).copy()

    def digest(self, name: str, nbytes: int, checksum: Checksum) -> Digest:
        """The tensor's digest at the chain's start: recorded if the full version has it."""
        found = self._find(name, nbytes)
        if isinstance(found, FullTensor) and found.digest is not None:
            return found.digest
        return Digest.of(checksum, self.read(name, nbytes, None))


def _repair_tensor(
    start: _ChainStart,
    tensor: TensorHistory,
    view: ByteArray,
    start_version: int,
    stats: ApplyStats,
) -> tuple[str, ByteArray | None]:
    """``(kind, verified bytes to write)`` of one touched tensor: ``kept`` (None: nothing to
    write), ``applied`` or ``restored``; :class:`IntegrityError` if the result does not verify."""
    name, nbytes, final = tensor.name, view.size, tensor.final
    if final.matches(view):
        return "kept", None
    previous = tensor.digest_at(start_version) or start.digest(name, nbytes, final.checksum)
    if previous.matches(view):
        begin, payloads, kind = view, tensor.after(start_version), "applied"
    else:
        begin, payloads, kind = start.read(name, nbytes, stats), tensor.payloads, "restored"
    result = fold_apply(begin, payloads, read_payloads(start.store, payloads, stats), name)
    if not final.matches(result):
        raise IntegrityError(
            f"repair from v{start_version:06d}: tensor {name!r} does not match its published "
            f"digest after being {kind}; the chain is corrupt"
        )
    return kind, result


def repair_pending(pull: PullContext, pending: PendingTransition) -> RepairSummary:
    """Bring every tensor an interrupted transition touched to its target, verified and
    flushed (the caller then records the state). Raises a :class:`DeltastoreError` subclass
    when the repair cannot be proven (the caller then reseeds the whole checkpoint)."""
    store, local, stats = pull.store, pull.local, pull.stats
    start_version, target = pending.from_version, pending.to_version
    assert start_version is not None  # (an interrupted reseed is reseeded again)
    chain = resolve_chain(store, target)
    # The store must still hold the recorded transition (not pruned, republished, another
    # stream), else the repair cannot be proven.
    todo = chain.suffix_after(start_version)
    versions = [d.version for d in todo] if todo is not None else None
    if versions is None or (pending.versions and versions != pending.versions):
        raise ApplyError(
            f"the store's chain to v{target:06d} no longer passes through "
            f"v{start_version:06d} with versions {pending.versions}"
        )
    if pending.stream_id is not None and chain.stream_at(target) != pending.stream_id:
        raise ApplyError(
            f"v{target:06d} is now of stream {chain.stream_id}, the interrupted "
            f"transition was to stream {pending.stream_id}"
        )
    history = collect_history(store, chain.deltas)
    touched = {
        name: tensor
        for name, tensor in history.items()
        if any(p.version > start_version for p in tensor.payloads)
    }
    tensors = scan_checkpoint(local.dir)
    check_local_names(touched, tensors, local.dir)
    start = _ChainStart(store, chain, pull.base)
    outcomes: list[str] = []

    with MappedFiles() as files:

        def fix(name: str) -> None:
            view = files.view(tensors[name])
            kind, result = _repair_tensor(start, touched[name], view, start_version, stats)
            if result is not None:
                view[:] = result
                stats.add(tensors=1, bytes_written=view.size)
            outcomes.append(kind)

        run_pool(sorted(touched), fix, pull.workers, name="deltastore-repair")
        files.flush()
    counts = (outcomes.count(kind) for kind in ("kept", "applied", "restored"))
    summary = RepairSummary(start_version, target, *counts)
    log.warning("%s: %s", local.dir, summary.describe())
    return summary

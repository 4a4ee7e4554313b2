"""Repairing a transition a crash interrupted (``.weight_sync/pending.json``).

An in-place apply writes each changed tensor at most once, with bytes verified beforehand, so
after a crash each tensor the transition touches is at the version the transition started from,
at the version it was going to, or (a write torn mid-tensor) neither. Blindly re-applying would
revert the tensors already written under a self-inverse encoding (XOR); instead each touched
tensor is hashed and

* **kept** when it already matches the target digest,
* **applied** (the transition's payloads, folded) when it matches its previous digest,
* **restored** otherwise: rebuilt from the chain's start (the base or a full version) plus every
  delta of the chain that changes it, verified, and written — for that tensor alone.

The previous digest of a tensor at version ``from`` is that of the newest delta ≤ ``from`` on the
chain that changed it, else the one in the full version's shard metadata, else the hash of the
base's bytes. Anything that cannot be proven this way raises, and the caller reseeds.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np

from deltastore.codecs import ByteArray, Checksum, Digest, get_checksum
from deltastore.errors import ApplyError, ConfigError, IntegrityError, NameMismatchError
from deltastore.format.checkpoint import CheckpointTensor, read_tensor, scan_checkpoint
from deltastore.format.safetensors_io import TensorEntry
from deltastore.format.state import PendingTransition
from deltastore.pull.chain import Chain, resolve_chain
from deltastore.pull.fold import fold_apply, read_payloads
from deltastore.pull.history import TensorHistory, check_local_names, collect_history
from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.mapped import mapped_files
from deltastore.pull.stats import ApplyStats, run_pool
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.pull")


@dataclass(frozen=True)
class RepairSummary:
    """What repairing one interrupted transition did, tensor by tensor."""

    from_version: int
    to_version: int
    kept: int
    """Touched tensors already at the target."""
    applied: int
    """Tensors still at their previous version: the transition's payloads were applied."""
    restored: int
    """Tensors at neither (a torn write): rebuilt from the chain's start."""

    def describe(self) -> str:
        return (
            f"repaired v{self.from_version:06d} -> v{self.to_version:06d}: {self.kept} kept, "
            f"{self.applied} applied, {self.restored} restored"
        )


class _ChainStart:
    """Bytes and digests of tensors at a chain's start (the base dir or a full version)."""

    def __init__(self, store: VersionStore, chain: Chain, base_dir: str | None) -> None:
        self.store = store
        self.chain = chain
        self.base_dir = base_dir
        self._lock = threading.Lock()
        self._base: dict[str, CheckpointTensor] | None = None
        self._full: dict[str, tuple[str, TensorEntry, str | None]] | None = None
        self._full_checksum: Checksum | None = None

    def _base_tensors(self) -> dict[str, CheckpointTensor]:
        with self._lock:
            if self._base is None:
                if self.base_dir is None:
                    raise ConfigError(
                        "restoring a tensor of a chain that starts at the base needs base_dir"
                    )
                self._base = scan_checkpoint(self.base_dir)
            return self._base

    def _full_tensors(self) -> dict[str, tuple[str, TensorEntry, str | None]]:
        index = self.chain.start_index
        assert index is not None
        with self._lock:
            if self._full is None:
                self._full_checksum = get_checksum(index.checksum) if index.checksum else None
                found: dict[str, tuple[str, TensorEntry, str | None]] = {}
                for shard in index.shards():
                    header = self.store.read_shard_header(index.version, shard)
                    for name, entry in header.tensors.items():
                        found[name] = (shard, entry, header.metadata.get(name))
                self._full = found
            return self._full

    def read(self, name: str, nbytes: int, stats: ApplyStats | None) -> ByteArray:
        """The tensor's bytes at the chain's start (a fresh writable array)."""
        where = "the base" if self.chain.start_index is None else f"v{self.chain.start:06d}"
        if self.chain.start_index is None:
            tensor = self._base_tensors().get(name)
            if tensor is None or tensor.entry.nbytes != nbytes:
                raise NameMismatchError(f"tensor {name!r} differs in {where} and the local dir")
            return read_tensor(tensor, name)
        found = self._full_tensors().get(name)
        if found is None or found[1].nbytes != nbytes:
            raise NameMismatchError(f"tensor {name!r} differs in {where} and the local dir")
        shard, entry, _ = found
        raw = self.store.read_range(self.chain.start, shard, entry.start, entry.end)
        if stats is not None:
            stats.add(bytes_read=len(raw))
        return np.frombuffer(raw, dtype=np.uint8).copy()

    def digest(self, name: str, nbytes: int, checksum: Checksum) -> Digest:
        """The tensor's digest at the chain's start: recorded if the full version has it."""
        if self.chain.start_index is not None:
            found = self._full_tensors().get(name)
            if found is not None and found[2] is not None and self._full_checksum is not None:
                return Digest(self._full_checksum, found[2])
        return Digest.of(checksum, self.read(name, nbytes, None))


def repair_chain(store: VersionStore, pending: PendingTransition) -> tuple[Chain, list[int]]:
    """The chain of the pending target, checked to contain the recorded transition.

    Raises :class:`ApplyError` when the store no longer holds that transition (pruned,
    republished, another stream): the repair cannot be proven.
    """
    if pending.from_version is None:
        raise ApplyError(
            f"the interrupted transition to v{pending.to_version:06d} was a reseed (a copy)"
        )
    chain = resolve_chain(store, pending.to_version)
    todo = chain.suffix_after(pending.from_version)
    versions = [d.version for d in todo] if todo is not None else None
    if versions is None or (pending.versions and versions != pending.versions):
        raise ApplyError(
            f"the store's chain to v{pending.to_version:06d} no longer passes through "
            f"v{pending.from_version:06d} with versions {pending.versions}"
        )
    if pending.stream_id is not None and chain.stream_at(pending.to_version) != pending.stream_id:
        raise ApplyError(
            f"v{pending.to_version:06d} is now of stream {chain.stream_id}, the interrupted "
            f"transition was to stream {pending.stream_id}"
        )
    return chain, versions


def _repair_tensor(
    store: VersionStore,
    start: _ChainStart,
    tensor: TensorHistory,
    view: ByteArray,
    start_version: int,
    stats: ApplyStats | None,
) -> tuple[str, ByteArray | None]:
    """How one touched tensor is brought to its target: (kind, verified bytes to write).

    ``kept`` (None: nothing to write), ``applied`` or ``restored``; raises
    :class:`IntegrityError` when the result does not match the target digest.
    """
    name, nbytes, final = tensor.name, view.size, tensor.final
    if final.matches(view):
        return "kept", None
    previous = tensor.digest_at(start_version) or start.digest(name, nbytes, final.checksum)
    if previous.matches(view):
        payloads = tensor.after(start_version)
        result = fold_apply(view, payloads, read_payloads(store, payloads, stats), name)
        kind = "applied"
    else:
        base_bytes = start.read(name, nbytes, stats)
        frames = read_payloads(store, tensor.payloads, stats)
        result = fold_apply(base_bytes, tensor.payloads, frames, name)
        kind = "restored"
    if not final.matches(result):
        raise IntegrityError(
            f"repair from v{start_version:06d}: tensor {name!r} does not match its published "
            f"digest after being {kind}; the chain is corrupt"
        )
    return kind, result


def repair_pending(
    store: VersionStore,
    local: LocalCheckpoint,
    pending: PendingTransition,
    base_dir: str | None,
    *,
    workers: int = 4,
    stats: ApplyStats | None = None,
) -> RepairSummary:
    """Bring every tensor an interrupted transition touched to its target, verified.

    Returns what was kept, applied and restored; the data is flushed before returning (the
    caller then records the state). Raises a :class:`DeltastoreError` subclass when the repair
    cannot be proven (the caller then reseeds the whole checkpoint).
    """
    chain, _ = repair_chain(store, pending)
    start_version = pending.from_version
    assert start_version is not None
    history = collect_history(store, chain.deltas)
    touched = {
        name: tensor
        for name, tensor in history.items()
        if any(p.version > start_version for p in tensor.payloads)
    }
    tensors = scan_checkpoint(local.dir)
    check_local_names(touched, tensors, local.dir)
    start = _ChainStart(store, chain, base_dir)
    outcomes: list[str] = []

    with mapped_files() as files:

        def fix(name: str) -> None:
            view = files.view(tensors[name])
            kind, result = _repair_tensor(store, start, touched[name], view, start_version, stats)
            if result is not None:
                view[:] = result
                if stats is not None:
                    stats.add(tensors=1, bytes_written=view.size)
            outcomes.append(kind)

        run_pool(sorted(touched), fix, workers, name="deltastore-repair")
        files.flush()
    summary = RepairSummary(
        start_version,
        pending.to_version,
        outcomes.count("kept"),
        outcomes.count("applied"),
        outcomes.count("restored"),
    )
    log.warning("%s: %s", local.dir, summary.describe())
    return summary


__all__ = ["RepairSummary", "repair_chain", "repair_pending"]

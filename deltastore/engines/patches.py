"""Stage's heavy part: per changed tensor, the element positions a run of versions changed,
their new values (from the verified local checkpoint) and their old ones (for rollback).

Positions come from the chain's payloads, never from comparing the live weights: the tensor's
new bytes (the checkpoint, verified by the pull) with the run's payloads applied again newest
first give its bytes at the live version, because every payload of a self-inverse encoding
reverts when applied to its own result (``xor``, ``auto`` and the sparse encodings are). The
two are compared in memory, one tensor at a time per worker. A tensor whose run has a payload
of another encoding, and every tensor after a full version or a reseed on the way, is patched
whole instead: its new bytes read zero-copy from the checkpoint, its old ones copied from the
live tensor.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltastore.codecs import Digest, get_encoding
from deltastore.engines.targets import NUMPY_WORDS, CheckpointViews, Target, pinned_like
from deltastore.format.checkpoint import CheckpointTensor
from deltastore.pull.apply import fold_apply, read_payloads
from deltastore.pull.chain import TensorHistory
from deltastore.storage import VersionStore


@dataclass(frozen=True)
class TensorPatch:
    """What one commit writes into one target tensor, and what puts it back."""

    name: str
    """Checkpoint name of the tensor."""
    positions: torch.Tensor | None
    """Ascending word positions (``int64``) the run changed; None: the whole tensor."""
    new: torch.Tensor
    """The new words at ``positions`` (or the tensor's whole new bytes, ``uint8``)."""
    old: torch.Tensor
    """The words (or whole bytes) the live tensor holds at those positions now."""
    itemsize: int
    """Size of a word in bytes."""
    digest: Digest | None = None
    """The tensor's published digest at the target version, where the chain records one."""

    @property
    def elements(self) -> int:
        """Words written."""
        words = self.new.numel()
        return int(words if self.positions is not None else words // self.itemsize)

    @property
    def nbytes(self) -> int:
        """Host memory the patch holds (a whole patch's new bytes are the checkpoint's map)."""
        held = self.old.numel() * self.old.element_size()
        if self.positions is not None:
            held += self.positions.numel() * 8 + self.new.numel() * self.new.element_size()
        return int(held)


def delta_patches(
    store: VersionStore,
    history: Mapping[str, TensorHistory],
    checkpoint: Mapping[str, CheckpointTensor],
    targets: Mapping[str, Target],
    views: CheckpointViews,
    *,
    pin: bool,
    workers: int,
) -> list[TensorPatch]:
    """The patch of every tensor ``history`` changes, built on ``workers`` threads (numpy and
    zstd release the GIL in the heavy parts, so the serving threads keep running)."""

    def build(name: str) -> TensorPatch | None:
        tensor = history[name]
        target = targets[name]
        if not all(get_encoding(p.encoding).self_inverse for p in tensor.payloads):
            return whole_patch(target, checkpoint[name], views, pin=pin, digest=tensor.final)
        frames = read_payloads(store, tensor.payloads, None)
        new = views.array(checkpoint[name])
        old = fold_apply(new, tensor.payloads[::-1], frames[::-1], name)
        word = NUMPY_WORDS[target.itemsize]
        new_words, old_words = new.view(word), old.view(word)
        positions = np.flatnonzero(new_words != old_words)
        if not positions.size:
            return None  # changed and changed back: nothing to write
        return TensorPatch(
            name,
            pinned_like(positions.astype(np.int64, copy=False), pin),
            pinned_like(new_words[positions], pin),
            pinned_like(old_words[positions], pin),
            target.itemsize,
            tensor.final,
        )

    names = sorted(history, key=lambda n: -checkpoint[n].entry.nbytes)  # big ones first
    with cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix="deltastore-stage") as pool:
        built = list(pool.map(build, names))
    return sorted((p for p in built if p is not None), key=lambda p: p.name)


def whole_patch(
    target: Target,
    tensor: CheckpointTensor,
    views: CheckpointViews,
    *,
    pin: bool,
    digest: Digest | None = None,
) -> TensorPatch:
    """The tensor's whole new bytes (zero-copy from the checkpoint) and a copy of its old ones."""
    new = torch.from_numpy(views.array(tensor))
    live = target.bytes
    old = torch.empty(live.shape, dtype=torch.uint8, pin_memory=pin)
    old.copy_(live)
    return TensorPatch(target.name, None, new, old, target.itemsize, digest)


def whole_patches(
    names: Sequence[str],
    checkpoint: Mapping[str, CheckpointTensor],
    targets: Mapping[str, Target],
    views: CheckpointViews,
    *,
    pin: bool,
) -> list[TensorPatch]:
    """A whole patch of each non-empty tensor of ``names``."""
    return [
        whole_patch(targets[n], checkpoint[n], views, pin=pin)
        for n in sorted(names)
        if checkpoint[n].entry.nbytes
    ]

"""Seeding from a full version: staged beside the checkpoint, verified, then swapped in.

The full version is downloaded into ``.weight_sync/staging/`` and every tensor is checked
(names and sizes against the model, digests against the version) before the local weights are
touched; a corrupt or incomplete full version leaves the host at its verified version.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator

import xxhash

from deltastore.codecs import get_checksum
from deltastore.errors import IntegrityError, NameMismatchError
from deltastore.format.checkpoint import CheckpointTensor, scan_checkpoint
from deltastore.format.index import VersionIndex, check_shard_names
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.format.shard_stream import StreamedShardCheck
from deltastore.pull.chain import full_shard_check
from deltastore.pull.local import LocalCheckpoint, PullContext, synced_digest
from deltastore.pull.result import run_pool
from deltastore.storage import VersionStore
from deltastore.storage.durable import atomic_replace, fsync_path

STAGING_NAME = "staging"
FLUSH_BEHIND_S = 0.2
"""How often a downloading shard's bytes so far are flushed (see :func:`flushed_behind`)."""
_datasync = getattr(os, "fdatasync", os.fsync)


@contextlib.contextmanager
def flushed_behind(path: str, every_s: float = FLUSH_BEHIND_S) -> Iterator[None]:
    """Flush ``path`` to disk every ``every_s`` seconds while the block writes it, so the
    download (at network speed) and the write-back (at disk speed) overlap instead of running
    one after the other. A file that does not exist yet (or was replaced by a retry) is
    flushed on the next round."""
    done = threading.Event()

    def flush() -> None:
        while not done.wait(every_s):
            with contextlib.suppress(OSError):  # the final fsync reports a real failure
                fd = os.open(path, os.O_RDONLY)
                try:
                    _datasync(fd)
                finally:
                    os.close(fd)

    flusher = threading.Thread(target=flush, name="deltastore-flush-behind", daemon=True)
    flusher.start()
    try:
        yield
    finally:
        done.set()
        flusher.join()


class _WholeFile:
    """A download sink hashing the whole file (a full version without per-tensor digests)."""

    def __init__(self) -> None:
        self.hasher = xxhash.xxh3_128()
        self.update = self.hasher.update
        self.restart = self.hasher.reset  # a retry sends the file again from its first byte


def _download(
    store: VersionStore, version: int, shard: str, dst: str, sink: StreamedShardCheck | None
) -> int:
    """Copy one shard to ``dst`` (fsynced), its bytes fed to ``sink`` as they arrive; without
    one (no digests to verify the tensors by), hashed as read and again as written."""
    whole = _WholeFile() if sink is None else None
    with flushed_behind(dst):
        size = store.download(version, shard, dst, sink or whole)
    if whole is None:
        fsync_path(dst)
    elif synced_digest(dst) != whole.hasher.digest():
        raise IntegrityError(
            f"{version_dir_name(version)}/{shard}: the local copy {dst} differs from what was "
            "read; check the local disk"
        )
    return size


def stage_full(
    pull: PullContext, index: VersionIndex, model: dict[str, CheckpointTensor] | None
) -> str:
    """Download a full version into the staging dir and verify it (names and sizes against
    ``model``, each tensor against its recorded digest as it arrives, or, without digests,
    each file as read and as written); returns the dir. The local weights are untouched."""
    store, where = pull.store, version_dir_name(index.version)
    staging = os.path.join(pull.local.state_dir, STAGING_NAME)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    shards = index.shards()
    checksum = get_checksum(index.checksum) if index.checksum else None
    checks = {
        shard: full_shard_check(checksum, where, f"{store.url}/{where}/{shard}")
        for shard in shards
        if checksum is not None
    }

    def download(shard: str) -> None:  # shards download concurrently, one streamed GET each
        dst = os.path.join(staging, shard)
        size = _download(store, index.version, shard, dst, checks.get(shard))
        pull.stats.add(bytes_read=size, bytes_written=size)

    run_pool(list(shards), download, pull.workers, name="deltastore-reseed")
    # An ordinary HF index so the engine's loader finds the shards.
    atomic_replace(os.path.join(staging, INDEX_NAME), index.to_json())
    staged = scan_checkpoint(staging)
    if model is not None:  # names and sizes: the base's (else the local checkpoint's)
        sizes = {name: tensor.entry.nbytes for name, tensor in staged.items()}
        missing, extra = sorted(set(model) - set(sizes)), sorted(set(sizes) - set(model))
        resized = sorted(n for n in set(model) & set(sizes) if model[n].entry.nbytes != sizes[n])
        if missing or extra or resized:
            raise NameMismatchError(
                f"{store.url}/{where} is a full version that does not match the model: missing "
                f"{missing[:5]}, extra {extra[:5]}, other sizes {resized[:5]}; it is incomplete "
                "or of another model. Nothing local was changed"
            )
    for shard in shards:
        names = {n for n, t in staged.items() if os.path.basename(t.file) == shard}
        check_shard_names(index, shard, names, source=f"{store.url}/{where}/{shard}")
    bad = sorted(name for check in checks.values() for name in check.mismatched())
    if bad:
        raise IntegrityError(
            f"{store.url}/{where}: {len(bad)} tensor(s) do not match their published digests, "
            f"e.g. {bad[:5]}; the local weights were not changed"
        )
    return staging


def swap_in(staging: str, local: LocalCheckpoint) -> int:
    """Replace the local weights with the staged files (renames, then a dir fsync), inside a
    pending reseed record (a crash midway leaves a dir the next pull reseeds); returns the
    number of tensors swapped in."""
    tensors = len(scan_checkpoint(staging))
    local.clear_weights()
    for name in sorted(os.listdir(staging)):
        os.replace(os.path.join(staging, name), os.path.join(local.dir, name))
    fsync_path(local.dir)
    os.rmdir(staging)
    fsync_path(local.state_dir)
    return tensors


def discard_staging(local: LocalCheckpoint) -> None:
    """Remove a staging dir a failed or interrupted reseed left behind."""
    shutil.rmtree(os.path.join(local.state_dir, STAGING_NAME), ignore_errors=True)

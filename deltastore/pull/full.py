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
from deltastore.pull.history import full_shard_check
from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.stats import ApplyStats, run_pool
from deltastore.storage import VersionStore
from deltastore.storage.durable import atomic_replace, fsync_path

STAGING_NAME = "staging"
_COPY_CHUNK = 16 * 1024**2
FLUSH_BEHIND_S = 0.2
"""While a shard downloads, its bytes so far are flushed to disk this often, so the fsync
that ends the download has only the last moments' bytes left to write."""
_datasync = getattr(os, "fdatasync", os.fsync)


@contextlib.contextmanager
def flushed_behind(path: str, every_s: float = FLUSH_BEHIND_S) -> Iterator[None]:
    """Flush ``path`` to disk every ``every_s`` seconds while the block writes it.

    A download writes into the page cache at network speed and the fsync after it used to write
    everything back at disk speed, one after the other (docs/benchmarks.md, *Pull*). Flushing
    behind overlaps the two. A file that does not
    exist yet (or was replaced by a retry) is simply flushed on the next round.
    """
    done = threading.Event()

    def flush() -> None:
        while not done.wait(every_s):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                _datasync(fd)
            except OSError:
                pass  # the final fsync reports a real failure
            finally:
                os.close(fd)

    flusher = threading.Thread(target=flush, name="deltastore-flush-behind", daemon=True)
    flusher.start()
    try:
        yield
    finally:
        done.set()
        flusher.join()


def check_full_complete(
    store: VersionStore,
    index: VersionIndex,
    model: dict[str, CheckpointTensor] | None,
    staged: dict[str, CheckpointTensor] | None = None,
) -> None:
    """Refuse a full version whose tensor names or sizes differ from the model's.

    ``model`` is the base's (or, without a base, the local checkpoint's) tensors; None skips
    the check. ``staged`` is the version's tensors as downloaded (their local headers);
    without it the shard headers are read from the store (ranged reads, no data). Raises
    :class:`NameMismatchError` naming what differs.
    """
    if model is None:
        return
    sizes: dict[str, int] = {}
    if staged is not None:
        sizes = {name: tensor.entry.nbytes for name, tensor in staged.items()}
    else:

        def read(shard: str) -> None:  # shard headers are read concurrently: a round trip each
            header = store.read_shard_header(index.version, shard)
            sizes.update({name: entry.nbytes for name, entry in header.tensors.items()})

        run_pool(list(index.shards()), read, 8, name="deltastore-headers")
    missing = sorted(set(model) - set(sizes))
    extra = sorted(set(sizes) - set(model))
    resized = sorted(n for n in set(model) & set(sizes) if model[n].entry.nbytes != sizes[n])
    if missing or extra or resized:
        raise NameMismatchError(
            f"{store.url}/{version_dir_name(index.version)} is a full version that does not "
            f"match the model: missing {missing[:5]}, extra {extra[:5]}, other sizes "
            f"{resized[:5]}; it is incomplete or of another model. Nothing local was changed"
        )


class _WholeFile:
    """A download sink hashing the whole file (a full version without per-tensor digests)."""

    def __init__(self) -> None:
        self.hasher = xxhash.xxh3_128()

    def restart(self) -> None:
        self.hasher = xxhash.xxh3_128()

    def update(self, data: bytes) -> None:
        self.hasher.update(data)


def _download(
    store: VersionStore, version: int, shard: str, dst: str, sink: StreamedShardCheck | None
) -> int:
    """Copy one shard to ``dst`` (fsynced), its bytes fed to ``sink`` as they arrive.

    Without a sink (a version whose tensors carry no digests to verify them by) the copy is
    hashed as read and again as written.
    """
    whole = _WholeFile() if sink is None else None
    with flushed_behind(dst):
        size = store.download(version, shard, dst, sink or whole)
    with open(dst, "rb+") as fh:
        os.fsync(fh.fileno())
    if whole is None:
        return size
    copy_hash = xxhash.xxh3_128()
    with open(dst, "rb") as fh:
        while chunk := fh.read(_COPY_CHUNK):
            copy_hash.update(chunk)
    if copy_hash.digest() != whole.hasher.digest():
        raise IntegrityError(
            f"{version_dir_name(version)}/{shard}: the local copy {dst} differs from what was "
            "read; check the local disk"
        )
    return size


def stage_full(
    store: VersionStore,
    index: VersionIndex,
    local: LocalCheckpoint,
    *,
    model: dict[str, CheckpointTensor] | None = None,
    workers: int = 4,
    stats: ApplyStats | None = None,
) -> str:
    """Download a full version into the staging dir and verify every tensor; returns the dir.

    With ``model``, the staged shards' headers are checked against it
    (:func:`check_full_complete`) before their tensors are: no request is spent on remote
    headers, and a mismatch still raises before anything local changes (only the staging dir
    was written).

    Tensors are checked against the digests in the shard metadata when the publisher recorded
    them (deltastore always does), each hashed as its bytes arrive; a foreign full version
    without digests is checked by hashing each file as it is downloaded and again after it is
    written. Raises :class:`IntegrityError` / :class:`NameMismatchError`; the local weights
    are untouched.
    """
    where = version_dir_name(index.version)
    staging = os.path.join(local.state_dir, STAGING_NAME)
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
        if stats is not None:
            stats.add(bytes_read=size, bytes_written=size)

    run_pool(list(shards), download, workers, name="deltastore-reseed")
    # An ordinary HF index so the engine's loader finds the shards.
    atomic_replace(os.path.join(staging, INDEX_NAME), index.to_json())
    staged = scan_checkpoint(staging)
    check_full_complete(store, index, model, staged)
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
    """Replace the local weights with the staged files (renames, then a dir fsync).

    Returns the number of tensors swapped in. Call it inside a pending reseed record: a crash
    midway leaves a dir the next pull reseeds.
    """
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

"""Applying published versions to a local checkpoint: deltas in place, full versions by copy."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import xxhash

from deltastore.codecs import (
    ByteArray,
    Checksum,
    Encoding,
    check_compression,
    decompress,
    get_checksum,
    get_encoding,
)
from deltastore.codecs.encodings import OverwriteEncoding
from deltastore.errors import (
    ApplyError,
    ConfigError,
    DeltastoreError,
    FormatError,
    IntegrityError,
    NameMismatchError,
    OutOfOrderError,
)
from deltastore.format.checkpoint import CheckpointTensor, scan_checkpoint
from deltastore.format.index import VersionIndex, check_shard_names
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.format.safetensors_io import SafetensorsHeader
from deltastore.pull.local import LocalCheckpoint, fsync_dir
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.pull")

_COPY_CHUNK = 16 * 1024**2


@dataclass
class ApplyStats:
    """Counters of one apply: what was read and written."""

    tensors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    versions: list[int] = field(default_factory=list)


def codecs_of(index: VersionIndex) -> tuple[Encoding, Checksum]:
    """The encoding and checksum a delta index names; a clear error for unknown ones."""
    where = f"weight_v{index.version:06d}"
    try:
        encoding = get_encoding(index.encoding or "")
        check_compression(index.compression)
        checksum = get_checksum(index.checksum or "")
    except ConfigError as exc:
        raise FormatError(f"{where} cannot be applied: {exc}") from None
    return encoding, checksum


def _check_digest(checksum: Checksum, digest: object, *, name: str, where: str) -> str:
    if (
        not isinstance(digest, str)
        or len(digest) != checksum.hex_length
        or not all(c in "0123456789abcdef" for c in digest)
    ):
        raise FormatError(
            f"{where}: tensor {name!r} has no valid {checksum.name} digest in its shard metadata"
        )
    return digest


def read_delta_headers(store: VersionStore, index: VersionIndex) -> dict[str, SafetensorsHeader]:
    """Shard headers of a delta, each checked to hold exactly the names its index maps to it."""
    headers = {}
    for shard, names in index.shards().items():
        header = store.read_shard_header(index.version, shard)
        where = f"{store.url}/{version_dir_name(index.version)}/{shard}"
        check_shard_names(index, shard, set(header.tensors), source=where)
        for name in names:
            entry = header.tensors[name]
            if entry.dtype != "U8" or len(entry.shape) != 1:
                raise FormatError(f"{where}: payload of tensor {name!r} is not a 1-D U8 tensor")
        headers[shard] = header
    return headers


class _MappedFiles:
    """Writable mmaps of the local safetensors files, opened lazily and flushed together."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}

    def view(self, tensor: CheckpointTensor) -> ByteArray:
        if tensor.file not in self._maps:
            fd = os.open(tensor.file, os.O_RDWR)
            self._maps[tensor.file] = (fd, mmap.mmap(fd, 0))
        mm = self._maps[tensor.file][1]
        return np.frombuffer(
            mm, dtype=np.uint8, count=tensor.entry.nbytes, offset=tensor.entry.start
        )

    def flush(self) -> None:
        """msync, then fsync: the data is durable before any state names it."""
        for fd, mm in self._maps.values():
            mm.flush()
            os.fsync(fd)

    def close(self) -> None:
        for fd, mm in self._maps.values():
            with contextlib.suppress(BufferError):
                mm.close()
            os.close(fd)
        self._maps.clear()


@contextlib.contextmanager
def mapped_files() -> Iterator[_MappedFiles]:
    files = _MappedFiles()
    try:
        yield files
    finally:
        files.close()


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
    """Apply one delta version in place, verifying every tensor before it is written.

    Refuses (:class:`OutOfOrderError`) a delta that does not build on ``applied_version``, and
    (:class:`NameMismatchError`) one naming a tensor the local checkpoint lacks or sizes
    differently. A tensor whose result does not match its published digest is never written;
    tensors already written by this call are reverted before the error is raised, so the
    checkpoint still holds ``applied_version``. The caller flushes and records state.
    """
    where = f"weight_v{index.version:06d}"
    if index.base_version != applied_version:
        raise OutOfOrderError(
            f"out-of-order delta: local checkpoint at v{applied_version:06d}, {where} builds on "
            f"v{index.base_version:06d}"
        )
    encoding, checksum = codecs_of(index)
    headers = read_delta_headers(store, index)
    local_tensors = tensors if tensors is not None else scan_checkpoint(local.dir)
    jobs = []
    for shard, header in headers.items():
        for name, entry in header.tensors.items():
            target = local_tensors.get(name)
            if target is None:
                raise NameMismatchError(
                    f"{where} changes tensor {name!r}, which the local checkpoint {local.dir} "
                    "does not have; it was published against another base"
                )
            digest = _check_digest(checksum, header.metadata.get(name), name=name, where=where)
            encoding.check_size(target.entry.nbytes, tensor=name)
            jobs.append((name, shard, entry.start, entry.end, target, digest))

    with mapped_files() as files:
        applied: list[tuple[str, CheckpointTensor, bytes | tuple[ByteArray, ByteArray]]] = []

        def apply_one(job: tuple[str, str, int, int, CheckpointTensor, str]) -> None:
            name, shard, start, end, target, digest = job
            frame = store.read_range(index.version, shard, start, end)
            nbytes = target.entry.nbytes
            payload = decompress(
                frame,
                max_size=encoding.max_payload_size(nbytes),
                exact_size=nbytes if encoding.name == "xor" else None,
                what=f"{where} payload of tensor {name!r}",
            )
            view = files.view(target)
            result = view.copy()
            encoding.apply(result, payload, tensor=name)
            actual = checksum.hexdigest(result)
            if actual != digest:
                raise IntegrityError(
                    f"{where}: tensor {name!r} does not match its published {checksum.name} "
                    f"digest after applying (got {actual}, want {digest}); the delta is "
                    "corrupt or the local checkpoint is not at "
                    f"v{applied_version:06d}. Nothing of this tensor was written"
                )
            undo: bytes | tuple[ByteArray, ByteArray]
            if isinstance(encoding, OverwriteEncoding):
                positions, _ = encoding.decode(payload, nbytes, tensor=name)
                undo = (positions.copy(), view[positions].copy())
            else:
                undo = frame
            view[:] = result
            applied.append((name, target, undo))
            if stats is not None:
                stats.tensors += 1
                stats.bytes_read += len(frame)
                stats.bytes_written += nbytes

        try:
            with cf.ThreadPoolExecutor(
                max(1, workers), thread_name_prefix="deltastore-apply"
            ) as pool:
                futures = [pool.submit(apply_one, job) for job in jobs]
                errors = []
                for future in futures:
                    try:
                        future.result()
                    except BaseException as exc:
                        errors.append(exc)
                if errors:
                    raise errors[0]
        except BaseException:
            _revert(applied, files, encoding, where)
            files.flush()
            raise
        files.flush()
    if stats is not None:
        stats.versions.append(index.version)


def _revert(
    applied: list[tuple[str, CheckpointTensor, bytes | tuple[ByteArray, ByteArray]]],
    files: _MappedFiles,
    encoding: Encoding,
    where: str,
) -> None:
    """Undo the tensors this apply already wrote (xor again, or restore overwritten bytes)."""
    for name, target, undo in applied:
        view = files.view(target)
        if isinstance(undo, tuple):
            positions, old_values = undo
            view[positions] = old_values
        else:
            payload = decompress(undo, max_size=view.size, exact_size=view.size, what=name)
            encoding.apply(view, payload, tensor=name)
    if applied:
        log.warning("%s: reverted %d tensors already written", where, len(applied))


def seed_from_full(
    store: VersionStore,
    index: VersionIndex,
    local: LocalCheckpoint,
    *,
    stats: ApplyStats | None = None,
) -> None:
    """Replace the local weights with a copy of a full version, verified per tensor.

    Tensors are checked against the digests in the shard metadata when the publisher recorded
    them (deltastore always does); a foreign full checkpoint without digests is checked by
    hashing each file as it is downloaded and again after it is written.
    """
    where = f"weight_v{index.version:06d}"
    checksum = get_checksum(index.checksum) if index.checksum else None
    shards = index.shards()
    local.clear_weights()
    os.makedirs(local.dir, exist_ok=True)
    for shard in shards:
        dst = os.path.join(local.dir, shard)
        tmp = dst + ".partial"
        source_hash = xxhash.xxh3_128()
        size = 0
        with store.open_read(index.version, shard) as src, open(tmp, "wb") as out:
            while chunk := src.read(_COPY_CHUNK):
                source_hash.update(chunk)
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        copy_hash = xxhash.xxh3_128()
        with open(tmp, "rb") as fh:
            while chunk := fh.read(_COPY_CHUNK):
                copy_hash.update(chunk)
        if copy_hash.digest() != source_hash.digest():
            raise IntegrityError(f"{where}/{shard}: the local copy differs from what was read")
        os.replace(tmp, dst)
        if stats is not None:
            stats.bytes_read += size
            stats.bytes_written += size
    # An ordinary HF index so the engine's loader finds the shards.
    with open(os.path.join(local.dir, INDEX_NAME), "wb") as fh:
        fh.write(index.to_json())
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(local.dir)
    local_tensors = scan_checkpoint(local.dir)
    for shard in shards:
        header_names = {n for n, t in local_tensors.items() if os.path.basename(t.file) == shard}
        check_shard_names(index, shard, header_names, source=f"{store.url}/{where}/{shard}")
    if checksum is not None:
        verify_tensors(local_tensors, full_digests(store, index, checksum), where=where)
    if stats is not None:
        stats.tensors += len(local_tensors)
        stats.versions.append(index.version)


def full_digests(
    store: VersionStore, index: VersionIndex, checksum: Checksum
) -> dict[str, tuple[Checksum, str]]:
    """Per-tensor digests recorded in a full version's shard metadata (may be empty)."""
    digests: dict[str, tuple[Checksum, str]] = {}
    for shard in index.shards():
        header = store.read_shard_header(index.version, shard)
        for name in header.tensors:
            value = header.metadata.get(name)
            if value is not None:
                digests[name] = (
                    checksum,
                    _check_digest(checksum, value, name=name, where=f"weight_v{index.version:06d}"),
                )
    return digests


def verify_tensors(
    local_tensors: dict[str, CheckpointTensor],
    expected: dict[str, tuple[Checksum, str]],
    *,
    where: str,
    workers: int = 4,
) -> None:
    """Hash each local tensor named in ``expected``; :class:`IntegrityError` lists mismatches."""
    missing = sorted(set(expected) - set(local_tensors))
    if missing:
        raise NameMismatchError(f"{where}: the local checkpoint lacks tensors {missing[:5]}")

    def check(name: str) -> str | None:
        checksum, digest = expected[name]
        tensor = local_tensors[name]
        with open(tensor.file, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                view = memoryview(mm)[tensor.entry.start : tensor.entry.end]
                try:
                    actual = checksum.hexdigest(view)
                finally:
                    view.release()
            finally:
                mm.close()
        return None if actual == digest else name

    with cf.ThreadPoolExecutor(max(1, workers)) as pool:
        bad = [n for n in pool.map(check, sorted(expected)) if n is not None]
    if bad:
        raise IntegrityError(
            f"{where}: {len(bad)} tensor(s) do not match their published digests, e.g. {bad[:5]}"
        )


__all__ = [
    "ApplyError",
    "ApplyStats",
    "DeltastoreError",
    "apply_delta",
    "seed_from_full",
    "verify_tensors",
]

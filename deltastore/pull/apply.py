"""Applying published versions to a local checkpoint: deltas in place, full versions by copy.

A run of deltas is applied in **one pass per tensor** (catch-up): each changed tensor's payload
is read once per version, XOR payloads are folded together and XORed into the tensor once,
overwrite payloads are applied in order on a copy; the result is verified against the final
version's digest *before* it is written. So whatever happens, each tensor on disk is either at
the version the run starts from, at the version it ends at, or (a write torn by a crash)
neither; :mod:`deltastore.pull.repair` relies on exactly that.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

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
from deltastore.pull.local import LocalCheckpoint, copy_verified
from deltastore.storage import VersionStore
from deltastore.storage.durable import fsync_path

log = logging.getLogger("deltastore.pull")

_COPY_CHUNK = 16 * 1024**2
_T = TypeVar("_T")


class PutBackError(ApplyError):
    """A failed apply could not put back the tensors it had written: the checkpoint is dirty
    (its pending record stays, and the next pull repairs it)."""


@dataclass
class ApplyStats:
    """Counters of one pull: what was read and written."""

    tensors: int = 0
    """Tensors written (applied, restored or copied)."""
    payloads: int = 0
    """Delta payloads read (one per changed tensor per version)."""
    bytes_read: int = 0
    """Bytes read from the store."""
    bytes_written: int = 0
    versions: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(
        self, *, tensors: int = 0, payloads: int = 0, bytes_read: int = 0, bytes_written: int = 0
    ) -> None:
        """Add to the counters (thread-safe: apply threads share one ``ApplyStats``)."""
        with self._lock:
            self.tensors += tensors
            self.payloads += payloads
            self.bytes_read += bytes_read
            self.bytes_written += bytes_written


@dataclass(frozen=True)
class Digest:
    """A published digest of a tensor's full bytes, with the algorithm that made it."""

    checksum: Checksum
    hex: str

    def matches(self, data: ByteArray | bytes | memoryview) -> bool:
        return self.checksum.hexdigest(data) == self.hex


@dataclass(frozen=True)
class Payload:
    """Where one version's zstd frame for one tensor lies in the store."""

    version: int
    shard: str
    start: int
    end: int
    encoding: Encoding

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class TensorHistory:
    """The payloads of one tensor along a run of deltas, and its digest after each."""

    name: str
    payloads: list[Payload] = field(default_factory=list)
    digests: dict[int, Digest] = field(default_factory=dict)
    """Version → digest of the tensor's bytes at that version (only versions that change it)."""

    def after(self, version: int) -> list[Payload]:
        """Payloads still to apply on the tensor's bytes at ``version``."""
        return [p for p in self.payloads if p.version > version]

    def digest_at(self, version: int) -> Digest | None:
        """Digest at ``version`` if a delta ≤ ``version`` in this history changed the tensor."""
        known = [v for v in self.digests if v <= version]
        return self.digests[max(known)] if known else None

    @property
    def final(self) -> Digest:
        return self.digests[self.payloads[-1].version]


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


def collect_history(
    store: VersionStore, deltas: Sequence[VersionIndex]
) -> dict[str, TensorHistory]:
    """Read each delta's shard headers once: every changed tensor's payloads and digests."""
    history: dict[str, TensorHistory] = {}
    for index in deltas:
        where = f"weight_v{index.version:06d}"
        encoding, checksum = codecs_of(index)
        for shard, header in read_delta_headers(store, index).items():
            for name, entry in header.tensors.items():
                digest = _check_digest(checksum, header.metadata.get(name), name=name, where=where)
                tensor = history.setdefault(name, TensorHistory(name))
                tensor.payloads.append(
                    Payload(index.version, shard, entry.start, entry.end, encoding)
                )
                tensor.digests[index.version] = Digest(checksum, digest)
    return history


def check_contiguous(deltas: Sequence[VersionIndex], applied_version: int) -> None:
    """Refuse a run of deltas that does not build, link by link, on ``applied_version``."""
    current = applied_version
    for index in deltas:
        if index.base_version != current:
            raise OutOfOrderError(
                f"out-of-order delta: local checkpoint at v{current:06d}, "
                f"weight_v{index.version:06d} builds on v{index.base_version or 0:06d}"
            )
        current = index.version


def check_local_names(
    history: dict[str, TensorHistory], tensors: dict[str, CheckpointTensor], local_dir: str
) -> None:
    """Every changed tensor must exist locally with a size its encodings can address."""
    for name, tensor in history.items():
        target = tensors.get(name)
        if target is None:
            raise NameMismatchError(
                f"weight_v{tensor.payloads[0].version:06d} changes tensor {name!r}, which the "
                f"local checkpoint {local_dir} does not have; it was published against another base"
            )
        for payload in tensor.payloads:
            payload.encoding.check_size(target.entry.nbytes, tensor=name)


def _break_link(path: str) -> None:
    """Give ``path`` its own inode before writing it in place.

    A file sharing its inode with another path (a dir cloned with ``cp -al``, a hard link to the
    base) would carry every in-place write to that path too, behind its own state's back.
    """
    log.warning("%s has other hard links; copying it before writing it in place", path)
    copy_verified(path, path)
    fsync_path(os.path.dirname(path))


class _MappedFiles:
    """Writable mmaps of the local safetensors files, opened lazily and flushed together."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def view(self, tensor: CheckpointTensor) -> ByteArray:
        with self._lock:
            if tensor.file not in self._maps:
                if os.stat(tensor.file).st_nlink > 1:
                    _break_link(tensor.file)
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


def read_payloads(
    store: VersionStore, payloads: Sequence[Payload], stats: ApplyStats | None
) -> list[bytes]:
    """The compressed frames of ``payloads``, one ranged read each."""
    frames = [store.read_range(p.version, p.shard, p.start, p.end) for p in payloads]
    if stats is not None:
        stats.add(payloads=len(frames), bytes_read=sum(len(f) for f in frames))
    return frames


def _decompress(payload: Payload, frame: bytes, nbytes: int, name: str) -> bytes:
    return decompress(
        frame,
        max_size=payload.encoding.max_payload_size(nbytes),
        exact_size=nbytes if payload.encoding.name == "xor" else None,
        what=f"weight_v{payload.version:06d} payload of tensor {name!r}",
    )


def fold_apply(
    current: ByteArray, payloads: Sequence[Payload], frames: Sequence[bytes], name: str
) -> ByteArray:
    """``current`` with ``payloads`` applied in order, as a new array (``current`` untouched).

    Consecutive XOR payloads are folded (XORed together) and XORed into the tensor once.
    """
    nbytes = current.size
    result: ByteArray | None = None
    fold: ByteArray | None = None

    def flush_fold() -> None:
        nonlocal result, fold
        if fold is not None:
            if result is None:
                result = np.bitwise_xor(current, fold)
            else:
                np.bitwise_xor(result, fold, out=result)
            fold = None

    for payload, frame in zip(payloads, frames):
        raw = _decompress(payload, frame, nbytes, name)
        if payload.encoding.name == "xor":
            data = np.frombuffer(raw, dtype=np.uint8)
            if fold is None:
                fold = data.copy()
            else:
                np.bitwise_xor(fold, data, out=fold)
        else:
            flush_fold()
            if result is None:
                result = current.copy()
            try:
                payload.encoding.apply(result, raw, tensor=name)
            except FormatError as exc:
                raise FormatError(f"weight_v{payload.version:06d}: {exc}") from None
    flush_fold()
    return result if result is not None else current.copy()


_Undo = tuple[str, object]


def _undo_record(
    view: ByteArray, result: ByteArray, payloads: Sequence[Payload], frames: list[bytes]
) -> _Undo:
    """What it takes to put a tensor back: its XOR frames (small), else the bytes it changes."""
    if all(p.encoding.name == "xor" for p in payloads):
        return ("xor", frames)
    positions = np.flatnonzero(view != result)
    return ("bytes", (positions, view[positions].copy()))


def _undo(view: ByteArray, undo: _Undo, payloads: Sequence[Payload], name: str) -> None:
    kind, data = undo
    if kind == "xor":
        assert isinstance(data, list)
        # XOR is an involution: applying the same fold again restores the old bytes.
        view[:] = fold_apply(view, payloads, data, name)
    else:
        assert isinstance(data, tuple)
        positions: ByteArray = data[0]
        old: ByteArray = data[1]
        view[positions] = old


def run_pool(
    jobs: Sequence[_T], fn: Callable[[_T], None], workers: int, *, name: str = "deltastore-apply"
) -> None:
    """Run ``fn`` on every job in a thread pool; stop starting jobs after the first error."""
    failed = threading.Event()
    errors: list[BaseException] = []

    def guarded(job: _T) -> None:
        if failed.is_set():
            return
        try:
            fn(job)
        except BaseException as exc:
            failed.set()
            errors.append(exc)

    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            guarded(job)
    else:
        with cf.ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
            list(pool.map(guarded, jobs))
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
) -> None:
    """Apply a run of deltas in place, one pass per changed tensor, verified before writing.

    ``deltas`` must build link by link on ``applied_version`` (else :class:`OutOfOrderError`);
    a tensor named by a delta must exist locally (else :class:`NameMismatchError`). Each
    changed tensor's result is checked against the digest of the last delta that changes it;
    on any failure the tensors already written are put back, so the checkpoint still holds
    ``applied_version`` when the error is raised. The data is flushed (msync + fsync) before
    returning; the caller records the state.
    """
    if not deltas:
        return
    check_contiguous(deltas, applied_version)
    history = collect_history(store, deltas)
    local_tensors = tensors if tensors is not None else scan_checkpoint(local.dir)
    check_local_names(history, local_tensors, local.dir)
    last = f"weight_v{deltas[-1].version:06d}"

    with mapped_files() as files:
        written: list[tuple[TensorHistory, CheckpointTensor, _Undo]] = []
        written_lock = threading.Lock()

        def apply_one(tensor: TensorHistory) -> None:
            target = local_tensors[tensor.name]
            frames = read_payloads(store, tensor.payloads, stats)
            view = files.view(target)
            result = fold_apply(view, tensor.payloads, frames, tensor.name)
            if not tensor.final.matches(result):
                raise IntegrityError(
                    f"{last}: tensor {tensor.name!r} does not match its published "
                    f"{tensor.final.checksum.name} digest after applying "
                    f"v{tensor.payloads[0].version:06d}..v{tensor.payloads[-1].version:06d} "
                    f"(want {tensor.final.hex}); the delta is corrupt or the local checkpoint "
                    f"is not at v{applied_version:06d}. Nothing of this tensor was written"
                )
            undo = _undo_record(view, result, tensor.payloads, frames)
            with written_lock:
                written.append((tensor, target, undo))
            view[:] = result
            if stats is not None:
                stats.add(tensors=1, bytes_written=target.entry.nbytes)

        try:
            run_pool(sorted(history.values(), key=lambda t: t.name), apply_one, workers)
        except BaseException as exc:
            try:
                for tensor, target, undo in written:
                    _undo(files.view(target), undo, tensor.payloads, tensor.name)
                files.flush()
            except Exception as putback:
                raise PutBackError(
                    f"{last}: applying failed ({exc}) and putting back the {len(written)} "
                    f"tensors already written failed too ({putback}); the next pull repairs "
                    f"{local.dir}"
                ) from exc
            if written:
                log.warning("%s: put back %d tensors already written", last, len(written))
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
            stats.add(bytes_read=size, bytes_written=size)
    # An ordinary HF index so the engine's loader finds the shards.
    with open(os.path.join(local.dir, INDEX_NAME), "wb") as fh:
        fh.write(index.to_json())
        fh.flush()
        os.fsync(fh.fileno())
    fsync_path(local.dir)
    local_tensors = scan_checkpoint(local.dir)
    for shard in shards:
        header_names = {n for n, t in local_tensors.items() if os.path.basename(t.file) == shard}
        check_shard_names(index, shard, header_names, source=f"{store.url}/{where}/{shard}")
    if checksum is not None:
        verify_tensors(local_tensors, full_digests(store, index, checksum), where=where)
    if stats is not None:
        stats.add(tensors=len(local_tensors))
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


def hash_tensor(tensor: CheckpointTensor, checksum: Checksum) -> str:
    """Digest of a tensor's bytes in a checkpoint file (read through a read-only mmap)."""
    if tensor.entry.nbytes == 0:
        return checksum.hexdigest(b"")
    with open(tensor.file, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            view = memoryview(mm)[tensor.entry.start : tensor.entry.end]
            try:
                return checksum.hexdigest(view)
            finally:
                view.release()
        finally:
            mm.close()


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
        return None if hash_tensor(local_tensors[name], checksum) == digest else name

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
    "Digest",
    "Payload",
    "PutBackError",
    "TensorHistory",
    "apply_chain",
    "apply_delta",
    "collect_history",
    "fold_apply",
    "seed_from_full",
    "verify_tensors",
]

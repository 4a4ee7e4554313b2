"""``DeltaPublisher``: diff tensors against the last published state and publish a version."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from deltastore.codecs import (
    COMPRESSION_NAME,
    ByteArray,
    compress,
    decompress,
    get_checksum,
    get_encoding,
)
from deltastore.errors import ConfigError, DeltastoreError, HookError, PublishError, StreamError
from deltastore.format.index import VersionIndex
from deltastore.format.names import delta_shard_name, full_shard_name
from deltastore.format.safetensors_io import TensorLayout, build_header
from deltastore.publish.snapshot import (
    Snapshot,
    SnapshotTensor,
    check_against_snapshot,
    tensor_bytes,
)
from deltastore.storage import VersionStore, new_token

log = logging.getLogger("deltastore.publish")

METRIC_KEYS = (
    "version", "density", "changed_bytes", "total_bytes", "wire_bytes", "tensors_changed",
    "tensors", "copy_s", "encode_s", "write_s", "commit_s", "hook_s", "publish_s",
)  # fmt: skip
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
_COPY_CHUNK = 64 * 1024**2


@dataclass(frozen=True)
class PublishResult:
    """What one :meth:`DeltaPublisher.publish` call committed."""

    version: int
    kind: str
    """``delta`` or ``full``."""
    base_version: int | None
    tensors_changed: int
    changed_bytes: int
    total_bytes: int
    wire_bytes: int
    """Bytes of shard files written for this version."""

    @property
    def density(self) -> float:
        return self.changed_bytes / self.total_bytes if self.total_bytes else 0.0


@dataclass(frozen=True)
class _Encoded:
    """One diffed tensor: its new digest and where its compressed payload sits in the spool."""

    name: str
    changed_bytes: int
    digest: str
    offset: int
    length: int


class _PayloadSpool:
    """Compressed payloads appended as they are produced: memory up to a bound, then disk."""

    def __init__(self, memory_bytes: int) -> None:
        self._file: Any = tempfile.SpooledTemporaryFile(max_size=memory_bytes)  # noqa: SIM115
        self.size = 0

    def append(self, frame: bytes) -> tuple[int, int]:
        offset = self.size
        self._file.seek(offset)
        self._file.write(frame)
        self.size += len(frame)
        return offset, len(frame)

    def read(self, offset: int, length: int) -> bytes:
        self._file.seek(offset)
        return bytes(self._file.read(length))

    def copy_to(self, out: BinaryIO, offset: int, length: int) -> None:
        self._file.seek(offset)
        remaining = length
        while remaining:
            chunk = self._file.read(min(remaining, _COPY_CHUNK))
            out.write(chunk)
            remaining -= len(chunk)

    def close(self) -> None:
        self._file.close()


def _default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class DeltaPublisher:
    """Publishes versions of a model to a :class:`VersionStore`.

    ``base_checkpoint`` is the engines' own model path (version 0): the snapshot is seeded from
    its bytes, not from the trainer's tensors, so a non-byte-exact conversion still diffs
    against what the engines hold. ``encoding`` and ``checksum`` are validated here (an unknown
    name raises :class:`ConfigError` at construction). ``post_write`` is a reference-signature
    hook ``hook(args, version_dir, rollout_engines)``; the publisher binds ``args`` and
    ``rollout_engines`` and hands the store a one-argument hook.

    ``resume`` / ``new_stream`` decide what :meth:`seed` does on a store that already holds
    versions: by default that is an error (a restarted trainer must not silently restart at
    v1); ``new_stream=True`` starts a new stream after the latest version.
    """

    def __init__(
        self,
        store: VersionStore | str,
        base_checkpoint: str | os.PathLike[str],
        *,
        encoding: str = "xor",
        checksum: str = "xxh3-128",
        workers: int | None = None,
        storage_options: dict[str, Any] | None = None,
        post_write: Callable[[Any, str, Any], None] | None = None,
        args: Any = None,
        rollout_engines: Any = None,
        resume: bool = False,
        new_stream: bool = False,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        spool_memory_bytes: int = 256 * 1024**2,
    ) -> None:
        self.encoding = get_encoding(encoding)
        self.checksum = get_checksum(checksum)
        if isinstance(store, str):
            store = VersionStore(store, storage_options)
        self.store = store
        self.base_checkpoint = os.fspath(base_checkpoint)
        if not os.path.isdir(self.base_checkpoint):
            raise ConfigError(
                f"base checkpoint {self.base_checkpoint!r} is not a directory; pass the engines' "
                "model path (an HF safetensors checkpoint)"
            )
        if post_write is not None:
            hook = post_write
            self.store.post_write = lambda version_dir: hook(args, version_dir, rollout_engines)
        self.workers = workers or _default_workers()
        self.resume = resume
        self.new_stream = new_stream
        self.max_shard_bytes = max_shard_bytes
        self.spool_memory_bytes = spool_memory_bytes
        self.snapshot: Snapshot | None = None
        self.stream_id: str | None = None
        self.next_version = 1
        self.base_version = 0
        """Version the next delta builds on."""
        self._metrics: dict[str, float] = dict.fromkeys(METRIC_KEYS, 0.0)

    # ------------------------------------------------------------------ seed
    def seed(self, *, continue_latest: bool = False) -> None:
        """Snapshot the base checkpoint's bytes (version 0); publishes nothing.

        On an empty store a new stream starts at version 1. ``continue_latest=True`` (what
        ``deltastore publish --prev`` uses) continues the latest version's stream, taking the
        base checkpoint as that version's state; the caller is responsible for checking it.
        """
        latest = self.store.latest()
        if latest and not (continue_latest or self.resume or self.new_stream):
            raise StreamError(
                f"{self.store.url} already holds versions up to weight_v{latest:06d}; pass "
                "resume=True to continue that stream or new_stream=True to start a new one"
            )
        self.snapshot = Snapshot.from_checkpoint(self.base_checkpoint)
        if continue_latest and latest:
            index = self.store.index(latest)
            self.stream_id = index.stream_id or new_token()
            self.base_version = latest
        else:
            self.stream_id = new_token()
            self.base_version = 0
        self.next_version = latest + 1
        log.info(
            "seeded %d tensors (%d bytes) from %s; next version %d of stream %s",
            len(self.snapshot),
            self.snapshot.total_bytes,
            self.base_checkpoint,
            self.next_version,
            self.stream_id,
        )

    # --------------------------------------------------------------- publish
    def publish(
        self, named_tensors: Iterable[tuple[str, Any]], *, full: bool = False
    ) -> PublishResult:
        """Diff ``named_tensors`` against the snapshot and publish the change as one version.

        Tensors not passed are taken as unchanged. A step where nothing changed is still a
        version. ``full=True`` publishes a complete HF checkpoint (every tensor) that resets
        the chain. The snapshot advances only once the version is committed. Raises
        :class:`PublishError` (nothing committed) or :class:`HookError` (committed, but the
        post-write hook failed: re-run the hook before telling engines).
        """
        if self.snapshot is None:
            raise PublishError("publish() before seed(): call seed() once first")
        started = time.perf_counter()
        metrics = dict.fromkeys(METRIC_KEYS, 0.0)
        spool = _PayloadSpool(self.spool_memory_bytes)
        try:
            encoded = self._diff(named_tensors, spool, metrics)
            version = self.next_version
            result = self._write_and_commit(version, encoded, spool, metrics, full=full)
            self._advance(encoded, spool)
        finally:
            spool.close()
        self.next_version = version + 1
        self.base_version = version
        hook_started = time.perf_counter()
        try:
            self.store.after_write(version)
        except Exception as exc:
            raise HookError(
                f"weight_v{version:06d} is committed in {self.store.url} but the post-write hook "
                f"failed: {exc}; fix the hook and run it again before engines pull"
            ) from exc
        finally:
            metrics["hook_s"] = time.perf_counter() - hook_started
            metrics["publish_s"] = time.perf_counter() - started
            self._record(metrics, result)
        return result

    def _diff(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        spool: _PayloadSpool,
        metrics: dict[str, float],
    ) -> dict[str, _Encoded]:
        """Encode, compress and checksum every changed tensor in a thread pool."""
        assert self.snapshot is not None
        snapshot = self.snapshot
        encoding, checksum = self.encoding, self.checksum

        def encode(name: str, new: ByteArray) -> tuple[str, int, str, bytes] | None:
            old = snapshot[name].data
            delta = encoding.encode(old, new)
            if delta.changed_bytes == 0:
                return None
            return name, delta.changed_bytes, checksum.hexdigest(new), compress(delta.payload)

        encoded: dict[str, _Encoded] = {}
        seen: set[str] = set()
        # Bound the bytes held by queued work: copies wait for the pool to drain.
        max_in_flight = 2 * self.workers
        pending: list[cf.Future[tuple[str, int, str, bytes] | None]] = []

        def drain(keep: int) -> None:
            while len(pending) > keep:
                done = pending.pop(0).result()
                if done is not None:
                    name, changed, digest, frame = done
                    offset, length = spool.append(frame)
                    encoded[name] = _Encoded(name, changed, digest, offset, length)

        encode_started = time.perf_counter()
        with cf.ThreadPoolExecutor(self.workers, thread_name_prefix="deltastore-encode") as pool:
            try:
                for name, tensor in named_tensors:
                    if name in seen:
                        raise PublishError(f"tensor {name!r} was passed twice in one publish")
                    seen.add(name)
                    if name not in snapshot:
                        raise PublishError(
                            f"tensor {name!r} is not in the base checkpoint "
                            f"{self.base_checkpoint}; a delta cannot add tensors"
                        )
                    copy_started = time.perf_counter()
                    data = tensor_bytes(name, tensor)
                    check_against_snapshot(name, tensor, data, snapshot[name])
                    self.encoding.check_size(data.size, tensor=name)
                    metrics["copy_s"] += time.perf_counter() - copy_started
                    pending.append(pool.submit(encode, name, data))
                    drain(max_in_flight)
                drain(0)
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
        metrics["encode_s"] = time.perf_counter() - encode_started - metrics["copy_s"]
        return encoded

    def _write_and_commit(
        self,
        version: int,
        encoded: dict[str, _Encoded],
        spool: _PayloadSpool,
        metrics: dict[str, float],
        *,
        full: bool,
    ) -> PublishResult:
        assert self.snapshot is not None
        token = new_token()
        write_started = time.perf_counter()
        self.store.claim(version, token)
        try:
            if full:
                weight_map, wire = self._write_full_shards(version, encoded, spool)
            else:
                weight_map, wire = self._write_delta_shard(version, encoded, spool)
            metrics["write_s"] = time.perf_counter() - write_started
            commit_started = time.perf_counter()
            total = self.snapshot.total_bytes
            changed = sum(e.changed_bytes for e in encoded.values())
            index = VersionIndex(
                version=version,
                weight_map=weight_map,
                base_version=self.base_version if not full else None,
                encoding=None if full else self.encoding.name,
                compression=None if full else COMPRESSION_NAME,
                checksum=self.checksum.name,
                stream_id=self.stream_id,
                commit_token=token,
                totals={
                    "total_bytes": total,
                    "changed_bytes": changed,
                    "wire_bytes": wire,
                    "tensor_count": len(weight_map),
                },
                extra={"total_size": total} if full else {},
            )
            self.store.commit(version, index)
            metrics["commit_s"] = time.perf_counter() - commit_started
        except DeltastoreError:
            self.store.abort(version)
            raise
        except Exception as exc:
            self.store.abort(version)
            raise PublishError(
                f"publishing weight_v{version:06d} to {self.store.url} failed: {exc}; nothing "
                "was committed and the snapshot did not advance"
            ) from exc
        return PublishResult(
            version=version,
            kind="full" if full else "delta",
            base_version=None if full else self.base_version,
            tensors_changed=len(encoded),
            changed_bytes=changed,
            total_bytes=total,
            wire_bytes=wire,
        )

    def _write_delta_shard(
        self, version: int, encoded: dict[str, _Encoded], spool: _PayloadSpool
    ) -> tuple[dict[str, str], int]:
        if not encoded:
            return {}, 0
        shard = delta_shard_name(0, 1)
        names = sorted(encoded)
        entries = [TensorLayout(n, "U8", (encoded[n].length,)) for n in names]
        header = build_header(entries, {n: encoded[n].digest for n in names})
        with self.store.open_write(version, shard) as out:
            out.write(header)
            for n in names:
                spool.copy_to(out, encoded[n].offset, encoded[n].length)
        wire = len(header) + sum(encoded[n].length for n in names)
        return dict.fromkeys(names, shard), wire

    def _new_bytes(
        self, name: str, encoded: dict[str, _Encoded], spool: _PayloadSpool
    ) -> ByteArray:
        """A tensor's bytes after this publish: snapshot + payload, snapshot untouched."""
        assert self.snapshot is not None
        current = self.snapshot[name].data
        if name not in encoded:
            return current
        result = current.copy()
        self._apply_payload(name, result, encoded[name], spool)
        return result

    def _apply_payload(
        self, name: str, target: ByteArray, entry: _Encoded, spool: _PayloadSpool
    ) -> None:
        payload = decompress(
            spool.read(entry.offset, entry.length),
            max_size=self.encoding.max_payload_size(target.size),
            what=f"payload of tensor {name!r}",
        )
        self.encoding.apply(target, payload, tensor=name)

    def _write_full_shards(
        self, version: int, encoded: dict[str, _Encoded], spool: _PayloadSpool
    ) -> tuple[dict[str, str], int]:
        """Write every tensor (a complete HF checkpoint) in shards of bounded size."""
        assert self.snapshot is not None
        groups: list[list[str]] = [[]]
        size = 0
        for name, tensor in self.snapshot.tensors.items():
            if groups[-1] and size + tensor.data.size > self.max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += tensor.data.size
        weight_map: dict[str, str] = {}
        wire = 0
        with cf.ThreadPoolExecutor(self.workers, thread_name_prefix="deltastore-digest") as pool:
            for i, names in enumerate(groups):
                shard = full_shard_name(i, len(groups))
                digests = dict(zip(names, pool.map(lambda n: self._full_digest(n, encoded), names)))
                tensors: dict[str, SnapshotTensor] = self.snapshot.tensors
                entries = [TensorLayout(n, tensors[n].dtype, tensors[n].shape) for n in names]
                header = build_header(entries, {"format": "pt", **digests})
                with self.store.open_write(version, shard) as out:
                    out.write(header)
                    for n in names:
                        data = self._new_bytes(n, encoded, spool)
                        for lo in range(0, data.size, _COPY_CHUNK):
                            out.write(memoryview(data[lo : lo + _COPY_CHUNK]))
                wire += len(header) + sum(tensors[n].data.size for n in names)
                weight_map.update(dict.fromkeys(names, shard))
        return weight_map, wire

    def _full_digest(self, name: str, encoded: dict[str, _Encoded]) -> str:
        if name in encoded:
            return encoded[name].digest
        assert self.snapshot is not None
        return self.checksum.hexdigest(self.snapshot[name].data)

    def _advance(self, encoded: dict[str, _Encoded], spool: _PayloadSpool) -> None:
        """Apply the committed payloads to the snapshot (only after the commit)."""
        assert self.snapshot is not None
        snapshot = self.snapshot
        for name, entry in encoded.items():
            self._apply_payload(name, snapshot[name].data, entry, spool)

    # --------------------------------------------------------------- metrics
    def _record(self, metrics: dict[str, float], result: PublishResult) -> None:
        metrics.update(
            version=result.version,
            density=result.density,
            changed_bytes=result.changed_bytes,
            total_bytes=result.total_bytes,
            wire_bytes=result.wire_bytes,
            tensors_changed=result.tensors_changed,
            tensors=len(self.snapshot or ()),
        )
        self._metrics = metrics

    def pop_metrics(self) -> dict[str, float]:
        """Metrics of the last publish (all keys of :data:`METRIC_KEYS`), then cleared to zero."""
        metrics, self._metrics = self._metrics, dict.fromkeys(METRIC_KEYS, 0.0)
        return metrics

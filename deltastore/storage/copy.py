"""Copying one file of a version between stores: the one copier of version files, used by
replication (``deltastore.replicate``) and the mirror hooks (``deltastore.hooks``, both ways).

A file is cut into chunks; up to ``window`` chunks are read at once (ranged reads on a shared
pool) while the chunk at the head is written to the destination's stream (the transaction's
``open_write``, which completes only when the file is whole), so at most ``window`` chunks per
file are held. A failed try is discarded and repeated for transient errors. What the bytes
mean is the caller's (a job's streamed check, a read-back hasher).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from deltastore.errors import (
    StoreError,
    TransientStoreError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.names import version_dir_name
from deltastore.format.shard_stream import StreamedShardCheck, StreamHasher

if TYPE_CHECKING:
    from deltastore.storage.store import VersionStore

log = logging.getLogger("deltastore.storage")


class WritesFiles(Protocol):
    """``VersionWriter.open_write``, or any place that writes a version's files."""

    def open_write(self, name: str) -> Any: ...


class RangeSource(Protocol):
    """A :class:`~deltastore.storage.store.VersionStore`, or any reader of byte ranges."""

    @property
    def url(self) -> str: ...

    def read_range(self, version: int, name: str, start: int, end: int) -> bytes: ...


@dataclass(frozen=True)
class CopyJob:
    """One file of a version to copy (``size`` at the source); ``check`` makes a fresh check
    for each try, fed the file's bytes in order, which raises to fail the try (None: sizes
    only)."""

    version: int
    name: str
    size: int
    check: Callable[[], StreamedShardCheck] | None = None


@dataclass(frozen=True)
class FileCopied:
    size: int
    retries: int
    verified_tensors: int


class FileCopier:
    """Copies files from ``src`` into a transaction writing to ``dst`` (where each copy's size
    is checked), the ranged reads on ``reads``; ``read_back``: each copy is read back from the
    destination and its digest compared with the source's bytes."""

    def __init__(
        self,
        src: RangeSource,
        dst: VersionStore,
        reads: ThreadPoolExecutor,
        *,
        chunk: int,
        window: int,
        attempts: int,
        on_bytes: Callable[[int], None] = lambda n: None,
        read_back: Callable[[], StreamHasher] | None = None,
    ) -> None:
        self.src, self.dst, self.reads = src, dst, reads
        self.chunk, self.window, self.attempts = chunk, max(1, window), max(1, attempts)
        self.on_bytes = on_bytes
        self.read_back = read_back

    def copy(self, writer: WritesFiles, job: CopyJob, cancel: threading.Event) -> FileCopied:
        """Copy one file, retrying transient failures. Raises :class:`IntegrityError` /
        :class:`FormatError` for a corrupt source file, :class:`TransientStoreError` when the
        destination keeps failing or storing other bytes, :class:`InterruptedError` once
        ``cancel`` is set."""
        retries = 0
        while True:
            landed = [0]

            def count(n: int, landed: list[int] = landed) -> None:
                landed[0] += n
                self.on_bytes(n)

            try:
                checked = self._copy_once(writer, job, count, cancel)
                return FileCopied(job.size, retries, checked)
            except Exception as exc:
                self.on_bytes(-landed[0])
                if retries + 1 >= self.attempts or not _worth_retrying(exc):
                    raise
                retries += 1
                wait_before_retry(
                    f"{job.name} of {version_dir_name(job.version)}", retries, exc, 0.2, 5
                )

    def _copy_once(
        self,
        writer: WritesFiles,
        job: CopyJob,
        count: Callable[[int], None],
        cancel: threading.Event,
    ) -> int:
        source = f"{self.src.url}/{version_dir_name(job.version)}/{job.name}"
        checker = job.check() if job.check is not None else None
        file_hash = self.read_back() if self.read_back is not None else None
        starts = iter(range(0, job.size, self.chunk))
        pending: deque[Future[bytes]] = deque()

        def submit() -> None:
            start = next(starts, None)
            if start is not None:
                end = min(start + self.chunk, job.size)
                pending.append(
                    self.reads.submit(self.src.read_range, job.version, job.name, start, end)
                )

        try:
            with writer.open_write(job.name) as out:
                for _ in range(self.window):
                    submit()
                while pending:
                    if cancel.is_set():
                        raise InterruptedError(f"{source}: another file of its version failed")
                    data = pending.popleft().result()
                    submit()
                    _write_all(out, data)
                    if file_hash is not None:
                        file_hash.update(data)
                    if checker is not None:
                        checker.update(data)
                    count(len(data))
                if checker is not None:
                    checker.finish()
        finally:
            for future in pending:
                future.cancel()
        self._check_landed(job, None if file_hash is None else file_hash.hexdigest())
        return checker.checked if checker is not None else 0

    def _check_landed(self, job: CopyJob, source_digest: str | None) -> None:
        where = f"{self.dst.url}/{version_dir_name(job.version)}/{job.name}"
        size = self.dst.file_size(job.version, job.name)
        if size != job.size:
            raise TransientStoreError(
                f"{where} holds {size} bytes after the upload, the source {job.size}; the "
                "destination dropped or added bytes (retried; check the endpoint)"
            )
        if source_digest is None or self.read_back is None:
            return
        read_back = self.read_back()
        with self.dst.open_read(job.version, job.name) as fh:
            while chunk := fh.read(self.chunk):
                read_back.update(chunk)
        if read_back.hexdigest() != source_digest:
            raise TransientStoreError(
                f"{where} reads back other bytes than were read from the source (digest "
                f"{read_back.hexdigest()} vs {source_digest}); the destination corrupted it"
            )


def wait_before_retry(
    what: str, retries: int, exc: BaseException, first_s: float, max_s: float
) -> None:
    """Log that try ``retries`` of ``what`` failed, then sleep a jittered, doubling wait."""
    wait = random.uniform(0, min(max_s, first_s * 2**retries))
    log.warning("%s: try %d failed (%s); again in %.2f s", what, retries, exc, wait)
    time.sleep(wait)


def _write_all(out: BinaryIO, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = out.write(view)
        if written is None:  # a stream that takes everything and says nothing
            return
        view = view[written:]


def _worth_retrying(exc: BaseException) -> bool:
    """Store errors and I/O errors: an upload that failed or whose acknowledgement was lost is
    simply sent again. Never a corrupt source, a conflict, a pruned version, or a cancel."""
    return isinstance(exc, (StoreError, OSError)) and not isinstance(exc, _PERMANENT)


_PERMANENT = (VersionNotFoundError, VersionConflictError, InterruptedError, PermissionError)

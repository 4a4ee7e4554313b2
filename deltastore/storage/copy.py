"""Copying one file of a version between stores: ranged reads in parallel, written in order,
bounded memory. The one copier of version files: replication (``deltastore.replicate``) and
the mirror hooks (``deltastore.hooks``, both directions) use it; it lives here, below both.

A file is cut into chunks (replication uses the destination's block size). Up to ``window``
chunks are being read at once (ranged reads on a shared pool of threads) while the chunk at
the head is written to the destination's stream, so at most ``window`` chunks per file are
held, never a whole shard. The destination stream is the version transaction's
``open_write``: a local temp file renamed into place, or a multipart (S3) / resumable (GCS)
upload that completes only when the file is whole. A failed try is discarded (never
completed) and repeated for transient errors. What the bytes mean is the caller's: a job may
carry a streamed check (for a shard, each tensor against its digest) fed every byte as it
passes, and the copier may be given a whole-file hasher to compare a read-back of the
destination with what the source gave.
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
from deltastore.format.shard_stream import StreamHasher

if TYPE_CHECKING:
    from deltastore.storage.store import VersionStore

log = logging.getLogger("deltastore.storage")


class WritesFiles(Protocol):
    """What a version transaction offers for writing one file (``VersionWriter.open_write``)."""

    def open_write(self, name: str) -> Any: ...


class RangeSource(Protocol):
    """Where a copy reads from: a :class:`~deltastore.storage.store.VersionStore`, or any
    object that reads byte ranges of a version's files."""

    @property
    def url(self) -> str: ...

    def read_range(self, version: int, name: str, start: int, end: int) -> bytes: ...


class StreamCheck(Protocol):
    """What follows a file's bytes as they are copied (e.g. a
    :class:`~deltastore.format.shard_stream.StreamedShardCheck`); it raises to fail the try."""

    checked: int
    """Tensors checked (reported as ``verified_tensors``)."""

    def update(self, data: bytes | memoryview) -> None: ...

    def finish(self) -> object: ...


@dataclass(frozen=True)
class CopyJob:
    """One file of a version to copy."""

    version: int
    name: str
    size: int
    """Size at the source, in bytes."""
    check: Callable[[], StreamCheck] | None = None
    """A fresh check for each try, fed the file's bytes in order; None: sizes only."""


@dataclass(frozen=True)
class FileCopied:
    """What copying one file took."""

    size: int
    retries: int
    verified_tensors: int


class FileCopier:
    """Copies files from ``src`` into a destination transaction (see the module docstring).

    ``dst`` is the store the transaction writes to (each copied file's size is checked there);
    ``reads`` runs the ranged reads; ``read_back``, when given, makes each copy read the
    destination's file back and compare its digest with the source's bytes.
    """

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
        """Copy one file, retrying transient failures; checks its size at the destination, the
        job's check if it has one, and (with ``read_back``) the destination's bytes.

        Raises :class:`IntegrityError` / :class:`FormatError` for a corrupt source file and
        :class:`TransientStoreError` when the destination keeps failing, storing another size
        or other bytes. Once ``cancel`` is set (another file of the version failed) it stops
        at the next chunk with :class:`InterruptedError`.
        """
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
                wait = random.uniform(0, min(5.0, 0.2 * 2**retries))
                log.warning(
                    "%s of %s: try %d failed (%s); again in %.2f s",
                    job.name,
                    version_dir_name(job.version),
                    retries,
                    exc,
                    wait,
                )
                time.sleep(wait)

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

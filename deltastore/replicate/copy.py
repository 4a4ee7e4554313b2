"""Copying one file of a version: ranged reads in parallel, written in order, bounded memory.

A file is cut into chunks of the destination's block size. Up to ``window`` chunks are being
read at once (ranged reads on a shared pool of ``jobs`` threads) while the chunk at the head is
written to the destination's stream, so at most ``window`` chunks per file are held, never a
whole shard. The destination stream is the version transaction's ``open_write``: a local temp
file renamed into place, or a multipart (S3) / resumable (GCS) upload that completes only when
the file is whole. A failed try is discarded (never completed) and repeated for transient
errors.
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
from typing import Any, BinaryIO, Protocol

from deltastore.errors import (
    StoreError,
    TransientStoreError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.names import version_dir_name
from deltastore.replicate.digests import new_file_hasher, shard_checker
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.replicate")


class WritesFiles(Protocol):
    """What a version transaction offers for writing one file (``VersionWriter.open_write``)."""

    def open_write(self, name: str) -> Any: ...


@dataclass(frozen=True)
class CopyJob:
    """One file of a version to copy."""

    version: int
    name: str
    size: int
    """Size at the source, in bytes."""
    checksum: str | None
    """The index's ``checksum_format``."""
    is_shard: bool
    """A ``*.safetensors`` shard the index maps tensors to (headers parsed and checked)."""
    hash_tensors: bool
    """``verify`` on a full version: recompute every tensor's digest."""
    verify: bool


@dataclass(frozen=True)
class FileCopied:
    """What copying one file took."""

    size: int
    retries: int
    verified_tensors: int


class FileCopier:
    """Copies files from ``src`` into a destination transaction (see the module docstring)."""

    def __init__(
        self,
        src: VersionStore,
        dst: VersionStore,
        reads: ThreadPoolExecutor,
        *,
        chunk: int,
        window: int,
        attempts: int,
        on_bytes: Callable[[int], None],
    ) -> None:
        self.src, self.dst, self.reads = src, dst, reads
        self.chunk, self.window, self.attempts = chunk, max(1, window), max(1, attempts)
        self.on_bytes = on_bytes

    def copy(self, writer: WritesFiles, job: CopyJob, cancel: threading.Event) -> FileCopied:
        """Copy one file, retrying transient failures; checks its size at the destination and,
        with ``verify``, its tensors' digests and a read-back of the destination's bytes.

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
        checker = (
            shard_checker(
                source,
                job.size,
                job.checksum,
                check_digests=job.verify,
                hash_tensors=job.hash_tensors,
            )
            if job.is_shard
            else None
        )
        file_hash = new_file_hasher()
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
                    file_hash.update(data)
                    if checker is not None:
                        checker.update(data)
                    count(len(data))
                if checker is not None:
                    checker.finish()
        finally:
            for future in pending:
                future.cancel()
        self._check_landed(job, file_hash.hexdigest())
        return checker.checked if checker is not None else 0

    def _check_landed(self, job: CopyJob, source_digest: str) -> None:
        where = f"{self.dst.url}/{version_dir_name(job.version)}/{job.name}"
        size = self.dst.file_size(job.version, job.name)
        if size != job.size:
            raise TransientStoreError(
                f"{where} holds {size} bytes after the upload, the source {job.size}; the "
                "destination dropped or added bytes (retried; check the endpoint)"
            )
        if not job.verify:
            return
        read_back = new_file_hasher()
        with self.dst.open_read(job.version, job.name) as fh:
            while chunk := fh.read(self.chunk):
                read_back.update(chunk)
        if read_back.hexdigest() != source_digest:
            raise TransientStoreError(
                f"{where} reads back other bytes than were read from the source (xxh3-128 "
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

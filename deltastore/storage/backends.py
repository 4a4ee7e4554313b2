"""How a store talks to its filesystem: one small class per kind of store (local directory,
``memory://``, S3/GCS: writes, whole-file reads, capability flags, endpoint, error
translation), and retries. The store never branches on the kind itself.

s3fs and gcsfs already retry single HTTP calls underneath, so deltastore retries a whole
idempotent step (read an index, write a shard) a few times with jittered exponential backoff,
bounded in attempts and in total time, and only for errors that can pass (:func:`is_transient`,
via tenacity). Permanent errors fail at once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import tenacity

from deltastore.errors import ConfigError, StoreError, TransientStoreError
from deltastore.storage.durable import atomic_writer, create_new_file, fsync_path
from deltastore.storage.streams import PartUploads, file_blocks, streamed_blocks, streams_async

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

log = logging.getLogger("deltastore.storage")

T = TypeVar("T")

ENDPOINT_CONNECT_TIMEOUT_S = 3.0  # first contact with an explicitly configured endpoint
_S3_MIN_PART = 5 * 1024**2
_GCS_CHUNK = 256 * 1024
REMOTE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})

_memory_lock = threading.Lock()

Guard = Callable[[str, Callable[[], Any]], Any]
"""The store's retried, translated call: ``guard(what, fn)``."""


_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "ConditionalRequestConflict",
    "OperationAborted",
    # a streamed body cut short (botocore's wrappers, aiohttp's own)
    "ResponseStreamingError",
    "IncompleteReadError",
    "ClientPayloadError",
}


def _status_of(exc: BaseException) -> int | None:
    for attr in ("status", "code", "status_code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: 5xx, 429, S3's 409 ConditionalRequestConflict,
    throttling, timeouts and connection resets."""
    if isinstance(exc, TransientStoreError):
        return True
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    status = _status_of(exc)
    # 501 Not Implemented and 505 HTTP Version Not Supported will not pass on retry.
    if status is not None and status not in (501, 505) and (status >= 500 or status in (408, 429)):
        return True
    text = f"{type(exc).__name__} {exc}"
    if any(code in text for code in _TRANSIENT_CODES):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def _stop_by_deadline(deadline_s: float) -> tenacity.stop.stop_base:
    """Stop before a wait would end past the deadline (older tenacity: stop after it)."""
    stop_before = getattr(tenacity, "stop_before_delay", None)
    if stop_before is not None:
        return stop_before(deadline_s)  # type: ignore[no-any-return]
    return tenacity.stop_after_delay(deadline_s)


@dataclass(frozen=True)
class RetryPolicy:
    """How a store retries a failed idempotent step: ``attempts`` tries in all, none started
    after ``deadline_s``."""

    attempts: int = 5
    deadline_s: float = 60.0
    initial_wait_s: float = 0.2
    max_wait_s: float = 5.0
    sleep: Callable[[float], None] | None = None
    """Injectable sleep (tests assert waits without waiting)."""

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient failures (``what`` names the step in logs); the last
        error is re-raised unchanged once the attempts or the deadline are spent."""

        def log_retry(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "%s failed (attempt %d of %d, retrying in %.2f s): %s",
                what,
                state.attempt_number,
                self.attempts,
                state.upcoming_sleep,
                exc,
            )

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts) | _stop_by_deadline(self.deadline_s),
            wait=tenacity.wait_random_exponential(
                multiplier=self.initial_wait_s, max=self.max_wait_s
            ),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=log_retry,
            reraise=True,
            sleep=self.sleep or time.sleep,
        )
        try:
            return retrying(fn)
        except Exception as exc:
            attempts = retrying.statistics.get("attempt_number", 1)
            if is_transient(exc):
                log.error("%s: giving up after %d attempt(s): %s", what, attempts, exc)
            raise


class Backend(ABC):
    """How one kind of filesystem writes; capability flags say what it guarantees."""

    is_local = False
    is_remote = False
    exclusive_create: bool | None = None  # None: probed on the first write

    def __init__(self, fs: Callable[[], AbstractFileSystem], options: dict[str, Any]) -> None:
        self._fs = fs
        self.options = options

    @property
    def fs(self) -> AbstractFileSystem:
        return self._fs()

    def check_block_size(self, size: int) -> int:
        return size

    def display_url(self, protocol: str, root: str) -> str:
        # An HTTP filesystem's root is the whole URL already: do not prefix it twice.
        return root if "://" in root else f"{protocol}://{root.lstrip('/')}"

    @abstractmethod
    def create_only(self, path: str, data: bytes) -> None:
        """Write ``path`` only if absent, else ``FileExistsError`` (one attempt)."""

    @abstractmethod
    @contextlib.contextmanager
    def open_write(self, path: str, block_size: int, guard: Guard) -> Iterator[BinaryIO]:
        """A writable stream that makes ``path`` appear only once complete; if the caller
        raises, nothing appears (an upload is abandoned, never completed)."""

    def write_file(self, path: str, data: bytes | memoryview, guard: Guard) -> None:
        with self.open_write(path, 0, guard) as fh:
            fh.write(data)

    def read_options(self, block_size: int) -> dict[str, Any]:
        return {}

    def read_blocks(self, path: str, block_size: int) -> Generator[bytes, None, None] | None:
        """The whole file at ``path`` in blocks, from one read (one GET); None when this kind of
        store has no such read (the caller uses ``fs.get_file``)."""
        return file_blocks(self.fs, path, block_size)

    def make_durable(self, directory: str) -> None:
        return None  # local only: fsync the directory

    credential_hint = "file permissions"

    def endpoint(self) -> str | None:
        return None

    def endpoint_hint(self) -> str:
        endpoint = self.endpoint()
        return f"endpoint {endpoint}" if endpoint else "the default endpoint"

    def translate(self, url: str, retry: RetryPolicy, what: str, exc: Exception) -> StoreError:
        """Map a filesystem error to the error tree, naming the URL and what to check."""
        text = str(exc)
        if isinstance(exc, PermissionError) or "Forbidden" in text or "AccessDenied" in text:
            return StoreError(
                f"{what}: access denied on {url} ({exc}); check the credentials "
                f"({self.credential_hint}) and that they may read and write this prefix"
            )
        if is_transient(exc):
            return TransientStoreError(
                f"{what}: {url} kept failing with transient errors (last: {exc}) through "
                f"{retry.attempts} attempts within {retry.deadline_s:.0f} s; check "
                f"{self.endpoint_hint()} and the network, then retry"
            )
        return StoreError(
            f"{what} on {url} failed: {type(exc).__name__}: {exc}; check the URL, the "
            f"storage options and {self.endpoint_hint()}"
        )

    def check_reachable(self, url: str) -> None:
        return None  # before the first request: fail fast if the store cannot be reached


class LocalBackend(Backend):
    is_local = True
    exclusive_create = True

    def display_url(self, protocol: str, root: str) -> str:
        return root

    def create_only(self, path: str, data: bytes) -> None:
        create_new_file(path, data)

    @contextlib.contextmanager
    def open_write(self, path: str, block_size: int, guard: Guard) -> Iterator[BinaryIO]:
        # A sibling temp file, fsynced and renamed: a crash never leaves a partial file. The
        # directory is made durable once, before the index is written (make_durable).
        with atomic_writer(path, sync_dir=False) as fh:
            yield fh

    def make_durable(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        fsync_path(directory)


class MemoryBackend(Backend):
    exclusive_create = True

    def create_only(self, path: str, data: bytes) -> None:
        with _memory_lock:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)

    @contextlib.contextmanager
    def open_write(self, path: str, block_size: int, guard: Guard) -> Iterator[BinaryIO]:
        buffer = io.BytesIO()
        yield buffer
        self.fs.pipe_file(path, buffer.getvalue())


class ObjectStoreBackend(Backend):
    """S3 and GCS through s3fs / gcsfs: conditional creates, multipart/resumable uploads."""

    is_remote = True

    def __init__(
        self, fs: Callable[[], AbstractFileSystem], options: dict[str, Any], protocol: str
    ) -> None:
        super().__init__(fs, options)
        self.protocol = protocol
        self.credential_hint = (
            "GOOGLE_APPLICATION_CREDENTIALS or the 'token' storage option"
            if protocol in ("gs", "gcs")
            else "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or storage options"
        )

    def check_block_size(self, size: int) -> int:
        if self.protocol in ("s3", "s3a") and size < _S3_MIN_PART:
            raise ConfigError(f"block_size {size} is below S3's 5 MiB minimum part size")
        if self.protocol in ("gs", "gcs") and size % _GCS_CHUNK:
            raise ConfigError(f"block_size {size} is not a multiple of 256 KiB, as GCS requires")
        return size

    def create_only(self, path: str, data: bytes) -> None:
        # S3 If-None-Match: *, GCS ifGenerationMatch=0 (a simple upload: keep it small).
        self.fs.pipe_file(path, data, mode="create")

    def write_file(self, path: str, data: bytes | memoryview, guard: Guard) -> None:
        payload = bytes(data)
        guard(f"writing {path}", lambda: self.fs.pipe_file(path, payload))

    @contextlib.contextmanager
    def open_write(self, path: str, block_size: int, guard: Guard) -> Iterator[BinaryIO]:
        # A few block_size parts buffered at most; a caller's exception abandons the upload.
        if self.protocol in ("s3", "s3a"):
            remote: Any = PartUploads(self.fs, path, block_size)
        else:
            remote = guard(
                f"opening {path} for writing",
                lambda: self.fs.open(path, "wb", block_size=block_size),
            )
        try:
            yield remote
        except BaseException:
            with contextlib.suppress(Exception):
                remote.discard()
            remote.closed = True  # closing would complete the partial upload
            raise
        remote.close()  # completes the upload; the store translates its errors

    def read_options(self, block_size: int) -> dict[str, Any]:
        # Plain read-ahead of one block: gcsfs's default prefetcher buffers far more.
        return {"block_size": block_size, "cache_type": "readahead"}

    def read_blocks(self, path: str, block_size: int) -> Generator[bytes, None, None] | None:
        fs = self.fs
        return streamed_blocks(fs, path, block_size) if streams_async(fs) else None

    def endpoint(self) -> str | None:
        options = self.options
        if self.protocol in ("gs", "gcs"):
            value = options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST")
            return str(value) if value else None
        client = options.get("client_kwargs") or {}
        value = (
            options.get("endpoint_url")
            or (client.get("endpoint_url") if isinstance(client, dict) else None)
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        return str(value) if value else None

    def check_reachable(self, url: str) -> None:
        # A store that never answered and refuses connections is misconfigured, not flaky:
        # fail in seconds naming the endpoint instead of retrying for half a minute.
        endpoint = self.endpoint()
        if not endpoint:
            return
        parsed = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            address = (parsed.hostname or "localhost", port)
            socket.create_connection(address, timeout=ENDPOINT_CONNECT_TIMEOUT_S).close()
        except ConnectionRefusedError:
            raise StoreError(
                f"cannot reach {url}: endpoint {endpoint} refused the connection; is the "
                "server running? Check the endpoint URL (AWS_ENDPOINT_URL, "
                "STORAGE_EMULATOR_HOST or the storage options)"
            ) from None
        except OSError:
            pass  # a slow or filtered network: the retried request decides


def make_backend(
    protocols: tuple[str, ...], fs: Callable[[], AbstractFileSystem], options: dict[str, Any]
) -> Backend:
    if "file" in protocols or "local" in protocols:
        return LocalBackend(fs, options)
    if "memory" in protocols:
        return MemoryBackend(fs, options)
    return ObjectStoreBackend(fs, options, protocols[0])

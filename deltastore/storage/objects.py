"""The store's protocol objects and file writes: what :class:`VersionWriter` and prune use.

:class:`StoreObjects` is the writing half of :class:`~deltastore.storage.store.VersionStore`
(a base class, like :class:`~deltastore.storage.reads.FileReads`, so the store's public API
stays one object). It holds the small objects under ``_claims/`` (claims, tombstones,
successors, probes), the create-only write each of them relies on, and the streamed write of
a version's files. The writer is typed against this class, so it never imports the store
module (which imports the writer).
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from deltastore.errors import DeltastoreError, StoreError, TransientStoreError
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.storage.listing import (
    ABORT_SUFFIX,
    CLAIM_SUFFIX,
    CLAIMS_DIR,
    PROBE_PREFIX,
    SUCCESSOR_SUFFIX,
)
from deltastore.storage.retry import RetryPolicy

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from deltastore.errors import ConfigError
    from deltastore.format.index import VersionIndex
    from deltastore.storage.backends import Backend

T = TypeVar("T")


def new_token() -> str:
    """A unique commit/claim token."""
    return uuid.uuid4().hex


def json_field(data: bytes, *keys: str) -> str | int | None:
    """A nested field of a JSON object, or None when absent or malformed."""
    with contextlib.suppress(ValueError, AttributeError, UnicodeDecodeError):
        value = json.loads(data)
        for key in keys:
            value = value.get(key)
        return value if isinstance(value, (str, int)) else None
    return None


class StoreObjects:
    """Claims, tombstones, successors and file writes; see
    :class:`~deltastore.storage.store.VersionStore`. The stubs below are the store's."""

    url: str
    root: str
    block_size: int
    backend: Backend
    retry: RetryPolicy

    @property
    def fs(self) -> AbstractFileSystem:
        raise NotImplementedError

    def version_path(self, version: int) -> str:
        raise NotImplementedError

    def file_path(self, version: int, name: str) -> str:
        raise NotImplementedError

    def _guard(self, what: str, fn: Callable[[], T]) -> T:
        raise NotImplementedError

    def index(self, version: int) -> VersionIndex:
        raise NotImplementedError

    def missing_root_error(self) -> ConfigError:
        raise NotImplementedError

    def check_exclusive_create(self) -> bool:
        raise NotImplementedError

    def _translate(self, what: str, exc: Exception) -> DeltastoreError:
        return self.backend.translate(self.url, self.retry, what, exc)

    # ------------------------------------------------------------------ paths
    def claim_path(self, version: int) -> str:
        """Path of a version's claim object."""
        return posixpath.join(self.root, CLAIMS_DIR, version_dir_name(version) + CLAIM_SUFFIX)

    def probe_path(self, token: str) -> str:
        """Path of a create-only probe object (see :meth:`check_exclusive_create`)."""
        return posixpath.join(self.root, CLAIMS_DIR, f"{PROBE_PREFIX}{token}")

    def abort_path(self, version: int) -> str:
        """Path of a version's abort marker (written by prune to fence or unpublish it)."""
        return posixpath.join(self.root, CLAIMS_DIR, version_dir_name(version) + ABORT_SUFFIX)

    def successor_path(self, base: int, generation: int) -> str:
        """Path of the ``generation``-th successor object of version ``base`` (0: the base)."""
        name = f"weight_v{base:06d}{SUCCESSOR_SUFFIX}{generation}"
        return posixpath.join(self.root, CLAIMS_DIR, name)

    # ------------------------------------------------------- create-only objects
    def create_only(self, path: str, data: bytes) -> None:
        """Write ``path`` only if it does not exist; raises ``FileExistsError`` otherwise (one
        attempt, no retry: the low-level exclusive create every protocol object relies on)."""
        self.backend.create_only(path, data)

    def create_or_read(self, path: str, data: bytes) -> bytes | None:
        """Create-only write of ``path``: None if written now, else the existing object's bytes
        (the caller decides whether it is its own, written earlier with a lost acknowledgement).
        Retried as one unit."""

        def attempt() -> bytes | None:
            try:
                self.create_only(path, data)
                return None
            except FileExistsError:
                self.fs.invalidate_cache(posixpath.dirname(path))
                try:
                    return bytes(self.fs.cat_file(path))
                except FileNotFoundError:
                    # Reported as existing, yet gone: removed meanwhile. Try again.
                    raise TransientStoreError(
                        f"{path} was reported as existing but cannot be read"
                    ) from None

        return self._guard(f"create-only write of {path}", attempt)

    def _create_with_token(self, path: str, data: bytes, token: str, *keys: str) -> bool:
        """Create-only write; True if ours stands (written now, or earlier with a lost ack)."""
        existing = self.create_or_read(path, data)
        return existing is None or json_field(existing, *keys) == token

    def is_fenced(self, version: int) -> bool:
        """Whether ``version`` carries a tombstone (fenced or unpublished by prune, or aborted
        after taking its base's successor): it is never visible nor claimed again."""
        # Asked on every index read. A one-byte ranged GET answers in one request; s3fs's
        # existence check costs two when the object is absent, as it nearly always is (a
        # HEAD, then a listing in case the path is a directory), and its unranged cat_file
        # sends a HEAD first.
        path = self.abort_path(version)
        try:
            self._guard(f"checking {path}", lambda: self.fs.cat_file(path, start=0, end=1))
        except FileNotFoundError:
            return False
        except StoreError:
            return self.exists(path)  # a store that refuses a range of an empty object (416)
        return True

    def write_tombstone(self, version: int, reason: str) -> str:
        """Create ``version``'s tombstone (create-only); returns the token of the one that
        stands (ours, or an earlier one's)."""
        token = new_token()
        body = json.dumps(
            {"version": version, "reason": reason, "token": token, "time": time.time()}
        ).encode()
        existing = self.create_or_read(self.abort_path(version), body)
        if existing is None:
            return token
        found = json_field(existing, "token")
        return found if isinstance(found, str) else ""

    # ------------------------------------------------------------ plain objects
    def exists(self, path: str) -> bool:
        """Whether ``path`` exists, asked of the store (retried)."""
        return bool(self._guard(f"checking {path}", lambda: self.fs.exists(path)))

    def read_optional(self, path: str) -> bytes | None:
        """The bytes of ``path``, or None when it does not exist (retried)."""
        try:
            return bytes(self._guard(f"reading {path}", lambda: self.fs.cat_file(path)))
        except FileNotFoundError:
            return None

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete ``path`` (a file, or a directory with ``recursive``); absent is fine."""
        with contextlib.suppress(FileNotFoundError):
            self._guard(f"deleting {path}", lambda: self.fs.rm(path, recursive=recursive))

    # ------------------------------------------------------------ version files
    def write_file(self, version: int, name: str, data: bytes | memoryview) -> None:
        """Deprecated: use :meth:`VersionWriter.write_file` (kept while the publisher moves)."""
        if name == INDEX_NAME:
            raise StoreError(f"{name} is written only by commit()")
        self.backend.write_file(self.file_path(version, name), data, self._guard)

    @contextlib.contextmanager
    def open_write(self, version: int, name: str) -> Iterator[BinaryIO]:
        """Deprecated: use :meth:`VersionWriter.open_write`. A writable stream for one file of a
        claimed, uncommitted version.

        Locally the file is written to a sibling temp file, fsynced and renamed into place, so
        a crash never leaves a complete-looking partial file. Remotely at most ``block_size``
        bytes are buffered: larger files go up as a multipart (S3) or resumable (GCS) upload
        that completes on close; if the caller raises, the upload is abandoned, never completed.
        """
        if name == INDEX_NAME:
            raise StoreError(f"{name} is written only by commit()")
        path = self.file_path(version, name)
        body_done = False
        try:
            with self.backend.open_write(path, self.block_size, self._guard) as fh:
                yield fh
                body_done = True
        except (FileNotFoundError, DeltastoreError):
            raise
        except Exception as exc:
            if not body_done:
                raise
            raise self._translate(f"uploading {path}", exc) from exc

    def prepare_commit(self, version: int) -> None:
        """Before the index write: make the version's directory and file names durable (an
        empty delta has no shard, so its directory may not exist yet)."""
        self.backend.make_durable(self.version_path(version))

    def finish_commit(self, version: int) -> None:
        """After a commit stands: make it durable and visible to this client."""
        self.backend.make_durable(self.root)
        self.fs.invalidate_cache(self.version_path(version))

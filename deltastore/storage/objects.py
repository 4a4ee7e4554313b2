"""The store's protocol objects and file writes: what :class:`VersionWriter` and prune use.

:class:`StoreObjects` is held by every :class:`~deltastore.storage.store.VersionStore` (not
inherited, so the store's public face stays small): the small objects under ``_claims/``
(claims, tombstones, successors, probes), the create-only write they rely on, and the streamed
write of a version's files. Outside ``deltastore.storage`` only
:func:`~deltastore.storage.store.store_objects` reaches it (the conformance suite and fault tests).
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, BinaryIO, Protocol

from deltastore.errors import ConfigError, DeltastoreError, StoreError, TransientStoreError
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.storage.listing import (
    ABORT_SUFFIX,
    CLAIM_SUFFIX,
    CLAIMS_DIR,
    PROBE_PREFIX,
    SUCCESSOR_SUFFIX,
)
from deltastore.storage.retry import RetryPolicy

log = logging.getLogger("deltastore.storage")

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from deltastore.format.index import VersionIndex
    from deltastore.storage.backends import Backend, Guard
    from deltastore.storage.listing import StoreListing


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


class ObjectsOwner(Protocol):
    """What :class:`StoreObjects` needs of the store that holds it."""

    url: str
    root: str
    block_size: int
    retry: RetryPolicy
    post_write: Callable[[str], None] | None
    supports_exclusive_create: bool | None

    @property
    def fs(self) -> AbstractFileSystem: ...

    def index(self, version: int) -> VersionIndex: ...

    def listing(self) -> StoreListing: ...

    def refresh(self, version: int | None = None) -> None: ...


class StoreObjects:
    """Claims, tombstones, successors and file writes of one store; see the module docstring.

    ``guard`` is the store's retried, translated call (every idempotent step goes through it),
    ``backend`` what differs between kinds of store. The store's url, root, index, listing and
    refresh are the objects' own (prune and the writer see one face).
    """

    def __init__(self, store: ObjectsOwner, backend: Backend, guard: Guard) -> None:
        self.store, self.backend, self._guard = store, backend, guard
        self.url, self.root = store.url, store.root
        self.index, self.listing, self.refresh = store.index, store.listing, store.refresh

    @property
    def fs(self) -> AbstractFileSystem:
        return self.store.fs

    def translate(self, what: str, exc: Exception) -> DeltastoreError:
        """A failed step's exception as an error of the tree, naming the store."""
        return self.backend.translate(self.url, self.store.retry, what, exc)

    def missing_root_error(self) -> ConfigError:
        """The error for a remote root whose bucket does not exist (or is not visible)."""
        bucket = self.root.lstrip("/").split("/", 1)[0]
        return ConfigError(
            f"bucket {bucket!r} of {self.url} does not exist or is not visible with these "
            f"credentials; create it, or check the URL and {self.backend.endpoint_hint()}"
        )

    def check_exclusive_create(self) -> bool:
        """Whether create-only writes are exclusive on this backend, probed once (kept as the
        store's ``supports_exclusive_create``): a probe object under ``_claims/`` is written
        twice, create-only, and the second write must fail. Where it does not, concurrent
        writers of one version could both commit: a warning says so. Raises
        :class:`ConfigError` if the bucket does not exist, :class:`StoreError` if access is
        denied.
        """
        if self.store.supports_exclusive_create is not None:
            return self.store.supports_exclusive_create
        token = uuid.uuid4().hex
        path = posixpath.join(self.root, CLAIMS_DIR, f"{PROBE_PREFIX}{token}")
        try:
            self.create_or_read(path, json.dumps({"probe": True, "token": token}).encode())
            try:
                self.create_only(path, b"second")
                exclusive = False
            except FileExistsError:
                exclusive = True
        except FileNotFoundError:
            raise self.missing_root_error() from None
        finally:
            with contextlib.suppress(Exception):
                self.remove(path)
        if not exclusive:
            message = (
                f"{self.url}: create-only writes are NOT exclusive on this backend (a second "
                "create-only write of a probe object succeeded); two concurrent publishers "
                "could both commit one version. Run exactly one publisher per store"
            )
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        self.store.supports_exclusive_create = exclusive
        return exclusive

    def version_path(self, version: int) -> str:
        return posixpath.join(self.root, version_dir_name(version))

    def version_url(self, version: int) -> str:
        """URL of a version's directory (what hooks receive)."""
        if self.backend.is_local:
            return self.version_path(version)
        return posixpath.join(self.url, version_dir_name(version))

    def file_path(self, version: int, name: str) -> str:
        return posixpath.join(self.version_path(version), name)

    def claim_path(self, version: int) -> str:
        return posixpath.join(self.root, CLAIMS_DIR, version_dir_name(version) + CLAIM_SUFFIX)

    def abort_path(self, version: int) -> str:
        """Path of a version's tombstone (written by prune to fence or unpublish it)."""
        return posixpath.join(self.root, CLAIMS_DIR, version_dir_name(version) + ABORT_SUFFIX)

    def successor_path(self, base: int, generation: int) -> str:
        """Path of the ``generation``-th successor object of version ``base`` (0: the base)."""
        name = f"weight_v{base:06d}{SUCCESSOR_SUFFIX}{generation}"
        return posixpath.join(self.root, CLAIMS_DIR, name)

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

    def exists(self, path: str) -> bool:
        return bool(self._guard(f"checking {path}", lambda: self.fs.exists(path)))

    def read_optional(self, path: str) -> bytes | None:
        """The bytes of ``path``, or None when it does not exist."""
        try:
            return bytes(self._guard(f"reading {path}", lambda: self.fs.cat_file(path)))
        except FileNotFoundError:
            return None

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete ``path`` (a file, or a directory with ``recursive``); absent is fine."""
        with contextlib.suppress(FileNotFoundError):
            self._guard(f"deleting {path}", lambda: self.fs.rm(path, recursive=recursive))

    def write_file(self, version: int, name: str, data: bytes | memoryview) -> None:
        """Write one whole non-index file of a claimed version (retried as a whole)."""
        if name == INDEX_NAME:
            raise StoreError(f"{name} is written only by commit()")
        self.backend.write_file(self.file_path(version, name), data, self._guard)

    @contextlib.contextmanager
    def open_write(self, version: int, name: str) -> Iterator[BinaryIO]:
        """A writable stream for one non-index file of a claimed, uncommitted version.

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
            with self.backend.open_write(path, self.store.block_size, self._guard) as fh:
                yield fh
                body_done = True
        except (FileNotFoundError, DeltastoreError):
            raise
        except Exception as exc:
            if not body_done:
                raise
            raise self.translate(f"uploading {path}", exc) from exc

    def prepare_commit(self, version: int) -> None:
        """Before the index write: make the version's directory and file names durable (an
        empty delta has no shard, so its directory may not exist yet)."""
        self.backend.make_durable(self.version_path(version))

    def finish_commit(self, version: int) -> None:
        """After a commit stands: make it durable and visible to this client."""
        self.backend.make_durable(self.root)
        self.fs.invalidate_cache(self.version_path(version))

"""``VersionStore``: published versions on any fsspec filesystem.

The store moves opaque bytes: it knows version directories, indexes and byte ranges, never
codecs. Versions are written only through :class:`~deltastore.storage.writer.VersionWriter`
(:meth:`VersionStore.begin`), whose module docstring is the commit protocol. Here:

* **Listing.** Versions are listed by their indexes (one recursive listing); shards without an
  index, and versions with a tombstone, are invisible, and :meth:`VersionStore.index` agrees.
* **Refresh.** Remote stores are opened without fsspec's listing cache (another host's commit
  is then visible at once); :meth:`VersionStore.refresh` still drops any cache a caller turned
  on, and runs the pre-read hook.
* **Retries.** Each idempotent step (a read, a listing, a whole create-only write with its
  read-back) is retried as a unit under one deadline for transient errors; permanent errors
  fail at once as :class:`StoreError` / :class:`ConfigError` naming the URL and what to check.
  An explicitly configured endpoint that refuses the first connection fails at once.
* **Backends.** What differs between a local directory, ``memory://`` and an object store
  is one :class:`~deltastore.storage.backends.Backend` object.
* **Halves.** The protocol objects and file writes are
  :class:`~deltastore.storage.objects.StoreObjects`, the reads
  :class:`~deltastore.storage.reads.FileReads`; both are base classes of the store.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec

from deltastore.errors import (
    ConfigError,
    DeltastoreError,
    FormatError,
    VersionNotFoundError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.progress import ProgressCallback
from deltastore.storage.backends import REMOTE_PROTOCOLS, Backend, make_backend
from deltastore.storage.listing import StoreListing, parse_listing
from deltastore.storage.objects import StoreObjects, new_token
from deltastore.storage.reads import FileReads
from deltastore.storage.retry import RetryPolicy
from deltastore.storage.writer import (
    VersionWriter,
    begin_next_version,
    begin_version,
    probe_exclusive_create,
)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from deltastore.storage.prune import PruneReport

log = logging.getLogger("deltastore.storage")

T = TypeVar("T")

DEFAULT_BLOCK_SIZE = 8 * 1024**2
"""Bytes buffered per open remote stream: one upload part, or one read-ahead block."""
MAX_INDEX_BYTES = 64 * 1024**2
"""Largest index a store reads (a 100k-tensor model's index is a few MiB)."""

PostWriteHook = Callable[[str], None]
"""``post_write(version_dir_url)``: runs once a version's files are written."""
PreReadHook = Callable[[str, int], None]
"""``pre_read(store_url, version)``: runs before a version is read."""


class VersionStore(StoreObjects, FileReads):
    """Published versions under one root URL (a local path, ``memory://``, ``s3://``, ``gs://``).

    ``storage_options`` go to fsspec; for ``s3://`` and ``gs://`` the store adds
    ``use_listings_cache=False`` unless the caller sets it, so a reader sees other hosts'
    commits without a refresh. ``post_write`` and ``pre_read`` are optional hook callables (see
    :data:`PostWriteHook`, :data:`PreReadHook`). ``block_size`` bounds the bytes buffered per
    open remote stream (default 8 MiB; at least 5 MiB on S3, a multiple of 256 KiB on GCS).
    Raises :class:`ConfigError` if the URL's protocol has no installed fsspec implementation
    or an option is invalid. No request is sent until the store is used.
    """

    retry: RetryPolicy = RetryPolicy()
    max_index_bytes: int = MAX_INDEX_BYTES
    """Largest index this store reads (default 64 MiB); a larger one is a FormatError."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        post_write: PostWriteHook | None = None,
        pre_read: PreReadHook | None = None,
        retry: RetryPolicy | None = None,
        block_size: int | None = None,
    ) -> None:
        url = os.fspath(url)
        if not url:
            raise ConfigError("store URL is empty; pass a directory, memory://, s3:// or gs:// URL")
        self.storage_options = dict(storage_options or {})
        protocol = fsspec.core.split_protocol(url)[0]
        self._fs_url = url
        self._fs_options = dict(self.storage_options)
        if protocol in REMOTE_PROTOCOLS:
            self._fs_options.setdefault("use_listings_cache", False)
        self._fs_pid = -1
        self._fs: AbstractFileSystem | None = None
        if protocol in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
            # gcsfs's bucket-type probe fails on an emulator and warns on every command; it
            # reads this switch once, when gcsfs is imported (below).
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        try:
            # Only the class: creating the filesystem may send requests or read credentials,
            # which happens at first use (see ``fs``).
            fs_class = fsspec.get_filesystem_class(protocol or "file")
            root = fs_class._strip_protocol(url)
        except (ImportError, ValueError, TypeError) as exc:
            raise self._open_failed(url, protocol, exc) from None
        protocols = fs_class.protocol
        protocols = protocols if isinstance(protocols, tuple) else (protocols,)
        self.backend: Backend = make_backend(protocols, lambda: self.fs, self.storage_options)
        """How this kind of filesystem writes (see :mod:`deltastore.storage.backends`)."""
        self.is_local = self.backend.is_local
        self.is_memory = self.backend.is_memory
        self.is_remote = self.backend.is_remote
        self._reached = not self.is_remote
        if self.is_local:
            root = os.path.abspath(root)
        self.root = root.rstrip("/") or "/"
        self.url = self.backend.display_url(protocols[0], self.root)
        self.post_write = post_write
        self.pre_read = pre_read
        if retry is not None:
            self.retry = retry
        self.block_size = self.backend.check_block_size(block_size or DEFAULT_BLOCK_SIZE)
        self.supports_exclusive_create = self.backend.exclusive_create
        """Whether create-only writes are exclusive here; None until probed (first write)."""

    @staticmethod
    def _open_failed(url: str, protocol: str | None, exc: Exception) -> ConfigError:
        extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(protocol or "", "")
        hint = f"; install deltastore[{extra}]" if extra and isinstance(exc, ImportError) else ""
        return ConfigError(f"cannot open store {url!r}: {exc}{hint}")

    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec filesystem, created at first use (a bad credential file or option is a
        :class:`ConfigError` then); re-opened in a forked child (clients do not survive a
        fork)."""
        if self._fs is None or self._fs_pid != os.getpid():
            try:
                self._fs, _ = fsspec.core.url_to_fs(self._fs_url, **self._fs_options)
            except Exception as exc:
                protocol = fsspec.core.split_protocol(self._fs_url)[0]
                raise self._open_failed(self._fs_url, protocol, exc) from None
            self._fs_pid = os.getpid()
        return self._fs

    def __repr__(self) -> str:
        return f"VersionStore({self.url!r})"

    # ------------------------------------------------------------------ paths
    def version_path(self, version: int) -> str:
        """Path (inside the filesystem) of a version's directory."""
        return posixpath.join(self.root, version_dir_name(version))

    def version_url(self, version: int) -> str:
        """URL of a version's directory (what hooks receive)."""
        if self.backend.is_local:
            return self.version_path(version)
        return posixpath.join(self.url, version_dir_name(version))

    def file_path(self, version: int, name: str) -> str:
        return posixpath.join(self.version_path(version), name)

    # ----------------------------------------------------------------- errors
    def _guard(self, what: str, fn: Callable[[], T]) -> T:
        """Run one idempotent step with retries; translate what is left to the error tree.

        ``FileNotFoundError`` and ``FileExistsError`` pass through: callers give them meaning.
        """
        if not self._reached:
            self.backend.check_reachable(self.url)
            self._reached = True
        try:
            return self.retry.call(what, fn)
        except (FileNotFoundError, FileExistsError, DeltastoreError):
            raise
        except Exception as exc:
            raise self._translate(what, exc) from exc

    def missing_root_error(self) -> ConfigError:
        """The error for a remote root whose bucket does not exist (or is not visible)."""
        bucket = self.root.lstrip("/").split("/", 1)[0]
        return ConfigError(
            f"bucket {bucket!r} of {self.url} does not exist or is not visible with these "
            f"credentials; create it, or check the URL and {self.backend.endpoint_hint()}"
        )

    # ---------------------------------------------------------------- reading
    def refresh(self, version: int | None = None) -> None:
        """Make versions committed by other hosts visible.

        Drops fsspec's listing caches (all of them: invalidating a path does not invalidate its
        children) and, when ``version`` is given, runs the pre-read hook for it.
        """
        self.fs.invalidate_cache()
        if self.pre_read is not None and version is not None and version > 0:
            self.pre_read(self.url, version)

    def listing(self) -> StoreListing:
        """List everything under the root once (see :class:`StoreListing`).

        Raises :class:`ConfigError` when the bucket of a remote store does not exist.
        """

        def find() -> dict[str, dict[str, Any]]:
            found = self.fs.find(self.root, detail=True)
            return dict(found) if isinstance(found, dict) else {}

        try:
            found = self._guard(f"listing {self.url}", find)
        except FileNotFoundError:
            if self.backend.is_remote:
                raise self.missing_root_error() from None
            found = {}
        return parse_listing(found, self.root)

    def versions(self) -> list[int]:
        """Committed versions, ascending. Directories without an index are not versions, nor
        are versions fenced or unpublished by prune."""
        return self.listing().committed

    def latest(self) -> int:
        """The newest committed version, or 0 when nothing is published."""
        versions = self.versions()
        return versions[-1] if versions else 0

    def index(self, version: int) -> VersionIndex:
        """The parsed index of a committed version.

        Raises :class:`VersionNotFoundError` if it is not committed, :class:`FormatError` if
        the index is malformed.
        """
        return VersionIndex.from_json(
            self.index_bytes(version),
            version=version,
            source=f"{self.url}/{version_dir_name(version)}/{INDEX_NAME}",
        )

    def index_bytes(self, version: int) -> bytes:
        """The raw index file of a committed version (for mirroring it byte for byte).

        Raises :class:`VersionNotFoundError` if it is not committed (no index, or a
        tombstone), :class:`FormatError` if it is larger than :attr:`max_index_bytes`.
        """
        path = self.file_path(version, INDEX_NAME)
        missing = VersionNotFoundError(
            f"weight_v{version:06d} is not committed in {self.url} (its index is missing or "
            "it was pruned); list committed versions with `deltastore ls`"
        )
        try:
            # A ranged read bounds the bytes held whatever the object's size.
            data = self._guard(
                f"reading {path}",
                lambda: self.fs.cat_file(path, start=0, end=self.max_index_bytes + 1),
            )
        except FileNotFoundError:
            raise missing from None
        if len(data) > self.max_index_bytes:
            raise FormatError(
                f"the index of weight_v{version:06d} in {self.url} is larger than the "
                f"{self.max_index_bytes} byte limit on indexes; it is corrupt or not a "
                "deltastore index"
            )
        if self.is_fenced(version):
            raise missing
        return bytes(data)

    # ---------------------------------------------------------------- writing
    def check_exclusive_create(self) -> bool:
        """Probe once whether create-only writes are exclusive on this backend (see
        :func:`~deltastore.storage.writer.probe_exclusive_create`)."""
        if self.supports_exclusive_create is None:
            self.supports_exclusive_create = probe_exclusive_create(self)
        return self.supports_exclusive_create

    # ------------------------------------------------------------ transaction
    def begin(self, version: int, *, token: str | None = None) -> VersionWriter[VersionStore]:
        """Claim ``version`` and return its :class:`VersionWriter`.

        ``token`` (default: a new one) lets a writer that crashed resume its own claim.
        Raises :class:`VersionConflictError` if the version is committed, fenced or claimed by
        another writer.
        """
        return begin_version(self, version, token or new_token())

    def begin_next(self, after: int, *, max_skip: int = 64) -> VersionWriter[VersionStore]:
        """Claim the first claimable version above ``after`` (a resumed or new stream).

        Versions claimed by another writer (live or crashed: a store cannot tell) and fenced
        versions are skipped: their numbers are never reused. Skipping is safe because a
        delta's commit must also take its base's one successor object, so two writers
        extending one version never both commit. Raises :class:`VersionConflictError` when a
        version above ``after`` is already committed (another writer moved on: resume from
        it) or ``max_skip`` versions in a row are taken.
        """
        return begin_next_version(self, after, new_token(), max_skip)

    def join(self, version: int, token: str) -> VersionWriter[VersionStore]:
        """A writer for the files of ``version``, claimed by another rank with ``token`` (a
        collective publish); its :meth:`VersionWriter.commit` is refused."""
        return VersionWriter(self, version, token, claimant=False)

    def after_write(self, version: int) -> None:
        """Run the post-write hook for a version whose files are all written."""
        if self.post_write is not None:
            self.post_write(self.version_url(version))

    # ----------------------------------------------------- deprecated writers
    def claim(self, version: int, token: str) -> None:
        """Deprecated: use :meth:`begin` (kept while the publisher moves over)."""
        self.begin(version, token=token)

    def commit(self, version: int, index: VersionIndex) -> None:
        """Deprecated: use :meth:`VersionWriter.commit` (kept while the publisher moves over)."""
        if index.version != version or not index.commit_token:
            raise ConfigError("commit() needs the index of this version with a commit_token")
        VersionWriter(self, version, index.commit_token).commit(index)

    def abort(self, version: int) -> None:
        """Deprecated: use :meth:`VersionWriter.abort` (kept while the publisher moves over)."""
        VersionWriter(self, version, "").abort()

    # ------------------------------------------------------------------ prune
    def prune(
        self,
        keep: int,
        *,
        grace_s: float = 3600.0,
        dry_run: bool = False,
        progress: ProgressCallback | None = None,
    ) -> PruneReport:
        """Remove old versions and garbage; see :func:`deltastore.storage.prune.prune`."""
        from deltastore.storage.prune import prune

        return prune(self, keep=keep, grace_s=grace_s, dry_run=dry_run, progress=progress)

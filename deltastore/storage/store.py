"""``VersionStore``: published versions on any fsspec filesystem.

The store moves opaque bytes: it knows version directories, indexes and byte ranges, never
codecs. Versions are written only through :class:`~deltastore.storage.writer.VersionWriter`
(:meth:`VersionStore.begin`), whose module docstring is the commit protocol, and listed by
their indexes (shards without one, and versions with a tombstone, are invisible). Remote
stores are opened without fsspec's listing cache, so another host's commit is visible at once.
What differs between kinds of store is one :class:`~deltastore.storage.backends.Backend`.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import fsspec

from deltastore.errors import (
    ConfigError,
    DeltastoreError,
    FormatError,
    VersionNotFoundError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.format.packed import unpack_header
from deltastore.format.safetensors_io import SafetensorsHeader, header_length, parse_header
from deltastore.progress import ProgressCallback
from deltastore.storage.backends import REMOTE_PROTOCOLS, Backend, RetryPolicy, make_backend
from deltastore.storage.listing import StoreListing, no_store_error, parse_listing
from deltastore.storage.streams import DownloadSink, feed
from deltastore.storage.writer import (
    StoreObjects,
    VersionWriter,
    begin_version,
    new_token,
)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from deltastore.storage.prune import PruneReport


T = TypeVar("T")

DEFAULT_BLOCK_SIZE = 8 * 1024**2  # buffered per open remote stream: one part or read-ahead
HEADER_GUESS = 64 * 1024  # bytes a shard-header read asks for at once (prefix and header)

PostWriteHook = Callable[[str], None]
"""``post_write(version_dir_url)``: runs once a version's files are written."""
PreReadHook = Callable[[str, int], None]
"""``pre_read(store_url, version)``: runs before a version is read."""


class VersionStore:
    """Published versions under one root URL (a local path, ``memory://``, ``s3://``, ``gs://``).

    ``storage_options`` go to fsspec (with ``use_listings_cache=False`` on S3 and GCS unless
    set). ``block_size`` is the part, chunk or read-ahead of an open remote stream (at least
    5 MiB on S3, a multiple of 256 KiB on GCS); an S3 upload holds up to three parts. Raises
    :class:`ConfigError` if the URL's protocol has no installed fsspec implementation or an
    option is invalid. No request is sent until first use.
    """

    retry: RetryPolicy = RetryPolicy()
    max_index_bytes: int = 64 * 1024**2
    """Largest index this store reads (a 100k-tensor model's is a few MiB); larger: FormatError."""

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
        self._backend: Backend = make_backend(protocols, lambda: self.fs, self.storage_options)
        self.is_local = self._backend.is_local
        self._reached = not self._backend.is_remote
        if self.is_local:
            root = os.path.abspath(root)
        self.root = root.rstrip("/") or "/"
        self.url = self._backend.display_url(protocols[0], self.root)
        self.post_write = post_write
        self.pre_read = pre_read
        if retry is not None:
            self.retry = retry
        self.block_size = self._backend.check_block_size(block_size or DEFAULT_BLOCK_SIZE)
        self.supports_exclusive_create = self._backend.exclusive_create  # None: not probed yet
        self._objects = StoreObjects(self, self._backend, self._guard)

    @staticmethod
    def _open_failed(url: str, protocol: str | None, exc: Exception) -> ConfigError:
        extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(protocol or "", "")
        missing = extra and isinstance(exc, ImportError)
        hint = f"; pip install 'deltastore[{extra}]'" if missing else ""
        return ConfigError(f"cannot open store {url!r}: {exc}{hint}")

    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec filesystem, created at first use (a bad option is a :class:`ConfigError`
        then); re-opened in a forked child (clients do not survive a fork)."""
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

    def _guard(self, what: str, fn: Callable[[], T]) -> T:
        """Run one idempotent step with retries; translate what is left to the error tree
        (``FileNotFoundError`` and ``FileExistsError`` pass through: callers give them meaning)."""
        if not self._reached:
            self._backend.check_reachable(self.url)
            self._reached = True
        try:
            return self.retry.call(what, fn)
        except (FileNotFoundError, FileExistsError, DeltastoreError):
            raise
        except Exception as exc:
            raise self._objects.translate(what, exc) from exc

    def _file_step(self, what: str, version: int, name: str, fn: Callable[[str], T]) -> T:
        """``fn(path)`` on a file of a version as one guarded step; a missing file (pruned,
        even mid-read) is a :class:`VersionNotFoundError`."""
        path = self._objects.file_path(version, name)
        try:
            return self._guard(f"{what} {path}", lambda: fn(path))
        except FileNotFoundError:
            raise VersionNotFoundError(
                f"{name} of weight_v{version:06d} is missing in {self.url}: the version was "
                "pruned (pull again to re-resolve) or is corrupt"
            ) from None

    def refresh(self, version: int | None = None) -> None:
        """Make versions committed by other hosts visible: drop fsspec's listing caches (all of
        them: invalidating a path does not invalidate its children) and, for ``version``, run
        the pre-read hook."""
        self.fs.invalidate_cache()
        if self.pre_read is not None and version is not None and version > 0:
            self.pre_read(self.url, version)

    def listing(self) -> StoreListing:
        """Everything under the root, from one listing; ConfigError for a missing bucket."""

        def find() -> dict[str, dict[str, Any]]:
            found = self.fs.find(self.root, detail=True)
            return dict(found) if isinstance(found, dict) else {}

        try:
            found = self._guard("listing", find)  # translate() names the URL once
        except FileNotFoundError:
            if self._backend.is_remote:
                raise self._objects.missing_root_error() from None
            found = {}
        return parse_listing(found, self.root)

    def versions(self) -> list[int]:
        """Committed versions (with an index and no tombstone), ascending."""
        return self.listing().committed

    def latest(self) -> int:
        """The newest committed version, or 0."""
        return max(self.versions(), default=0)

    def index(self, version: int) -> VersionIndex:
        """The parsed index of a committed version (see :meth:`index_bytes`)."""
        return VersionIndex.from_json(
            self.index_bytes(version),
            version=version,
            source=f"{self.url}/{version_dir_name(version)}/{INDEX_NAME}",
        )

    def index_bytes(self, version: int) -> bytes:
        """The raw index file of a committed version; :class:`VersionNotFoundError` if it is
        not committed (no index, or a tombstone), :class:`FormatError` if it is too large."""
        path = self._objects.file_path(version, INDEX_NAME)
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
        if self._objects.is_fenced(version):
            raise missing
        return bytes(data)

    def begin(
        self,
        version: int | None = None,
        *,
        after: int | None = None,
        token: str | None = None,
        max_skip: int = 64,
    ) -> VersionWriter:
        """Claim ``version`` (or, with ``after``, the first claimable version above it) and
        return its :class:`VersionWriter`; ``token`` lets a writer that crashed resume its own
        claim. With ``after``, versions claimed by another writer (live or crashed: a store
        cannot tell) or fenced are skipped for good, which is safe because a delta's commit
        must also take its base's one successor object. :class:`VersionConflictError` if
        ``version`` is taken, or a later one committed, or ``max_skip`` in a row are taken."""
        return begin_version(self._objects, version, after, token or new_token(), max_skip)

    def join(self, version: int, token: str) -> VersionWriter:
        """A writer for the files of ``version``, claimed by another rank with ``token`` (a
        collective publish); its :meth:`VersionWriter.commit` is refused."""
        return VersionWriter(self._objects, version, token, claimant=False)

    def file_size(self, version: int, name: str) -> int:
        """Size in bytes of a file of a version, asked of the store (never a cached listing)."""
        return int(self._file_step("stat", version, name, lambda p: self.fs.info(p))["size"])

    def read_range(self, version: int, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file of a version (one ranged request);
        :class:`VersionNotFoundError` if it vanished (pruned mid-read: re-resolve the version),
        :class:`FormatError` if it is shorter than ``end``."""
        if end <= start:
            # An empty range: asked of S3 it would read the whole object (an invalid Range).
            if end < start:
                raise FormatError(f"read_range({name!r}, {start}, {end}): end before start")
            return b""
        data = self._file_step(
            f"reading [{start}:{end}] of",
            version,
            name,
            lambda path: self.fs.cat_file(path, start=start, end=end),
        )
        if len(data) != end - start:
            raise FormatError(
                f"{name} of weight_v{version:06d} is truncated: asked bytes {start}..{end}, got "
                f"{len(data)}"
            )
        return bytes(data)

    def read_shard_header(self, version: int, name: str) -> SafetensorsHeader:
        """Parse a shard's safetensors header with ranged reads (no data is read); a packed delta
        shard's comes back with one entry and digest per tensor, as a plain one's."""
        source = f"{self.url}/{version_dir_name(version)}/{name}"
        size = self.file_size(version, name)
        # One read covers the length prefix and a header of up to 64 KiB (most shards'); a
        # longer header takes a second read for the rest.
        head = self.read_range(version, name, 0, min(HEADER_GUESS, size))
        length = header_length(head[:8], source=source)
        if 8 + length > size:
            raise FormatError(f"{source} is truncated inside its {length}-byte header")
        if 8 + length > len(head):
            head += self.read_range(version, name, len(head), 8 + length)
        header = parse_header(head[8 : 8 + length], file_size=size, source=source)
        return unpack_header(header, source=source)

    def download(self, version: int, name: str, dst: str, sink: DownloadSink | None = None) -> int:
        """Copy a file of a version to the local path ``dst`` (not fsynced); its size. ``sink``
        sees every byte in order as it is written: one streamed GET on S3; gcsfs has no
        streamed read, so ``fs.get_file`` downloads and the sink reads the copy back. A retry
        rewrites ``dst`` whole and restarts the sink."""

        def attempt(path: str) -> int:
            if sink is not None:
                sink.restart()
            blocks = self._backend.read_blocks(path, self.block_size)
            if blocks is None:  # no streamed read: the sink reads the downloaded copy back
                self.fs.get_file(path, dst)
                if sink is None:
                    return os.path.getsize(dst)
                with open(dst, "rb") as fh:
                    return feed(sink, iter(lambda: fh.read(self.block_size), b""))
            with contextlib.closing(blocks), open(dst, "wb") as out:
                return feed(sink, blocks, out)

        return self._file_step("downloading", version, name, attempt)

    def open_read(self, version: int, name: str) -> AbstractContextManager[BinaryIO]:
        """A readable binary stream of a file of a version (read-ahead of ``block_size``)."""
        kwargs = self._backend.read_options(self.block_size)
        return self._file_step("opening", version, name, lambda p: self.fs.open(p, "rb", **kwargs))

    def list_files(self, version: int) -> list[str]:
        """Plain file names inside a version's directory."""
        path = self._objects.version_path(version)
        try:
            entries = self._guard(f"listing {path}", lambda: self.fs.ls(path, detail=True))
        except FileNotFoundError:
            return []
        return sorted(
            posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file"
        )

    def prune(
        self,
        keep: int,
        *,
        grace_s: float = 3600.0,
        dry_run: bool = False,
        progress: ProgressCallback | None = None,
    ) -> PruneReport:
        """Keep the newest ``keep`` committed versions and their chains, unpublish the rest and
        delete the data past ``grace_s`` (see :mod:`deltastore.storage.prune`); ``dry_run``
        changes nothing. ``progress`` gets phase ``prune``: the listed bytes of the files
        removed (a dry run reports nothing); if it raises, the next run finishes the job.
        :class:`ConfigError` for ``keep < 1`` or a negative grace."""
        from deltastore.storage.prune import prune

        return prune(self._objects, keep, grace_s, dry_run, progress)


def require_store(store: VersionStore, listing: StoreListing | None = None) -> None:
    """Raise :class:`ConfigError` when nothing under ``store``'s root was written by a
    publisher (a mistyped path, or a model directory passed for a store)."""
    listing = store.listing() if listing is None else listing
    if not listing.holds_nothing:
        return
    root = store.root.rstrip("/")
    checkpoint = store.fs.glob(f"{root}/*.safetensors") if store.fs.exists(root) else []
    if checkpoint:
        raise ConfigError(
            f"{store.url} holds a checkpoint ({len(checkpoint)} .safetensors file(s)) but no "
            "published versions: it is a model directory, not a store; pass the URL that "
            "`deltastore publish --store` wrote weight_v*/ into"
        )
    raise no_store_error(store.url)


def store_objects(store: VersionStore) -> StoreObjects:
    """The commit protocol's objects of ``store``, for the conformance suite, fault tests and
    tools that inspect the protocol; writers go through :meth:`VersionStore.begin`."""
    return store._objects

"""``VersionStore``: published versions on any fsspec filesystem.

The store moves opaque bytes: it knows version directories, indexes and byte ranges, never
codecs. Its protocols (ARCHITECTURE.md, OBJECT_STORES.md):

* **Commit.** A create-only claim ``_claims/weight_vNNNNNN.json`` first, so a second writer of
  the same version never touches the winner's shards; then the shards; then the index,
  create-only and carrying a unique commit token. The index's existence is the commit. On
  ``FileExistsError`` the writer reads the index back: its own token means the acknowledgement
  was lost and the commit stands, another token is a :class:`VersionConflictError`.
* **Fencing.** ``prune`` fences a stale uncommitted version with a create-only abort marker
  ``_claims/weight_vNNNNNN.abort``. :meth:`VersionStore.commit` checks, before and after
  writing the index, that the marker is absent and that the claim still holds its token, and
  withdraws its index otherwise: of a zombie writer and a pruner, one of the two always sees
  the other's write, so a fenced version is never left committed.
* **Listing.** Versions are listed by their indexes (one recursive listing); shards without an
  index, and versions with an abort marker, are invisible.
* **Refresh.** Remote stores are opened without fsspec's listing cache (another host's commit
  is then visible at once); :meth:`VersionStore.refresh` still drops any cache a caller turned
  on, and runs the pre-read hook.
* **Retries.** Each idempotent step (a read, a listing, a whole create-only write with its
  read-back) is retried as a unit under one deadline for transient errors; permanent errors
  fail at once as :class:`StoreError` / :class:`ConfigError` naming the URL and what to check.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import json
import logging
import os
import posixpath
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import fsspec

from deltastore.errors import (
    ConfigError,
    DeltastoreError,
    FormatError,
    StoreError,
    TransientStoreError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, parse_version_dir, version_dir_name
from deltastore.format.safetensors_io import SafetensorsHeader, header_length, parse_header
from deltastore.storage.durable import create_new_file, fsync_path
from deltastore.storage.retry import RetryPolicy, is_transient
from deltastore.storage.writer import VersionWriter, claim_body, json_field

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from deltastore.storage.prune import PruneReport

log = logging.getLogger("deltastore.storage")

T = TypeVar("T")

CLAIMS_DIR = "_claims"
CLAIM_SUFFIX = ".json"
ABORT_SUFFIX = ".abort"
SUCCESSOR_SUFFIX = ".successor-"
PROBE_PREFIX = "_probe-"
DEFAULT_BLOCK_SIZE = 8 * 1024**2
"""Bytes buffered per open remote stream: one upload part, or one read-ahead block."""
_S3_MIN_PART = 5 * 1024**2
_GCS_CHUNK = 256 * 1024
MAX_INDEX_BYTES = 64 * 1024**2
"""Largest index a store reads (a 100k-tensor model's index is a few MiB)."""
_REMOTE_PROTOCOLS = {"s3", "s3a", "gs", "gcs"}

PostWriteHook = Callable[[str], None]
"""``post_write(version_dir_url)``: runs once a version's files are written."""
PreReadHook = Callable[[str, int], None]
"""``pre_read(store_url, version)``: runs before a version is read."""

_memory_lock = threading.Lock()


def new_token() -> str:
    """A unique commit/claim token."""
    return uuid.uuid4().hex


def modified_time(info: dict[str, Any]) -> float | None:
    """Modification time (POSIX seconds) from an fsspec info dict of any backend, if any."""
    for key in ("mtime", "LastModified", "updated", "created", "timeCreated"):
        value = info.get(key)
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, _dt.datetime):
            return value.timestamp()
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return _dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


@dataclass(frozen=True)
class FileEntry:
    """One object of a store listing."""

    size: int
    mtime: float | None
    """Modification time in POSIX seconds (the server's clock on object stores)."""


@dataclass(frozen=True)
class StoreListing:
    """Everything under a store's root, from one recursive listing."""

    indexes: frozenset[int]
    """Versions whose index exists (committed, unless also aborted)."""
    aborted: dict[int, FileEntry]
    """Versions with an abort marker (fenced or unpublished by prune)."""
    claims: dict[int, FileEntry]
    files: dict[int, dict[str, FileEntry]]
    """Version → file name → entry, for every file inside a version directory."""
    other: dict[str, FileEntry] = field(default_factory=dict)
    """Store-internal leftovers under ``_claims/`` (probes, partial temp files): path → entry."""

    @property
    def committed(self) -> list[int]:
        """Committed versions, ascending."""
        return sorted(v for v in self.indexes if v not in self.aborted)


class VersionStore:
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
        self.is_remote = protocol in _REMOTE_PROTOCOLS
        self._fs_url = url
        self._fs_options = dict(self.storage_options)
        if self.is_remote:
            self._fs_options.setdefault("use_listings_cache", False)
        self._fs_pid = -1
        self._fs: AbstractFileSystem | None = None
        try:
            fs, root = fsspec.core.url_to_fs(url, **self._fs_options)
        except (ImportError, ValueError, TypeError) as exc:
            extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(protocol or "", "")
            missing = extra and isinstance(exc, ImportError)
            hint = f"; install deltastore[{extra}]" if missing else ""
            raise ConfigError(f"cannot open store {url!r}: {exc}{hint}") from None
        self._fs, self._fs_pid = fs, os.getpid()
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self.is_local = "file" in protocols or "local" in protocols
        self.is_memory = "memory" in protocols
        if self.is_local:
            root = os.path.abspath(root)
        self.root = root.rstrip("/") or "/"
        self.url = self.root if self.is_local else f"{protocols[0]}://{self.root.lstrip('/')}"
        self.post_write = post_write
        self.pre_read = pre_read
        if retry is not None:
            self.retry = retry
        self.block_size = self._check_block_size(block_size or DEFAULT_BLOCK_SIZE, protocols)
        self.supports_exclusive_create: bool | None = (
            True if (self.is_local or self.is_memory) else None
        )
        """Whether create-only writes are exclusive here; None until probed (first write)."""

    def _check_block_size(self, size: int, protocols: tuple[str, ...]) -> int:
        if "s3" in protocols and size < _S3_MIN_PART:
            raise ConfigError(f"block_size {size} is below S3's 5 MiB minimum part size")
        if "gs" in protocols and size % _GCS_CHUNK:
            raise ConfigError(f"block_size {size} is not a multiple of 256 KiB, as GCS requires")
        return size

    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec filesystem; re-opened in a forked child (clients do not survive a fork)."""
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs, _ = fsspec.core.url_to_fs(self._fs_url, **self._fs_options)
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
        if self.is_local:
            return self.version_path(version)
        return posixpath.join(self.url, version_dir_name(version))

    def file_path(self, version: int, name: str) -> str:
        return posixpath.join(self.version_path(version), name)

    def claim_path(self, version: int) -> str:
        """Path of a version's claim object."""
        return posixpath.join(self.root, CLAIMS_DIR, version_dir_name(version) + CLAIM_SUFFIX)

    def abort_path(self, version: int) -> str:
        """Path of a version's abort marker (written by prune to fence or unpublish it)."""
        return posixpath.join(self.root, CLAIMS_DIR, version_dir_name(version) + ABORT_SUFFIX)

    # ----------------------------------------------------------------- errors
    def _endpoint_hint(self) -> str:
        options = self.storage_options
        client = options.get("client_kwargs") or {}
        endpoint = (
            options.get("endpoint_url")
            or (client.get("endpoint_url") if isinstance(client, dict) else None)
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or os.environ.get("STORAGE_EMULATOR_HOST")
        )
        return f"endpoint {endpoint}" if endpoint else "the default endpoint"

    def _credential_hint(self) -> str:
        if self.url.startswith("s3"):
            return "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or storage options"
        if self.url.startswith("gs"):
            return "GOOGLE_APPLICATION_CREDENTIALS or the 'token' storage option"
        return "file permissions"

    def _translate(self, what: str, exc: Exception) -> DeltastoreError:
        """Map a backend error to the error tree, naming the URL and what to check."""
        text = str(exc)
        if isinstance(exc, PermissionError) or "Forbidden" in text or "AccessDenied" in text:
            return StoreError(
                f"{what}: access denied on {self.url} ({exc}); check the credentials "
                f"({self._credential_hint()}) and that they may read and write this prefix"
            )
        if is_transient(exc):
            return TransientStoreError(
                f"{what}: {self.url} kept failing with transient errors (last: {exc}) through "
                f"{self.retry.attempts} attempts within {self.retry.deadline_s:.0f} s; check "
                f"{self._endpoint_hint()} and the network, then retry"
            )
        return StoreError(
            f"{what} on {self.url} failed: {type(exc).__name__}: {exc}; check the URL, the "
            f"storage options and {self._endpoint_hint()}"
        )

    def _guard(self, what: str, fn: Callable[[], T]) -> T:
        """Run one idempotent step with retries; translate what is left to the error tree.

        ``FileNotFoundError`` and ``FileExistsError`` pass through: callers give them meaning.
        """
        try:
            return self.retry.call(what, fn)
        except (FileNotFoundError, FileExistsError, DeltastoreError):
            raise
        except Exception as exc:
            raise self._translate(what, exc) from exc

    def _missing_root(self) -> ConfigError:
        bucket = self.root.lstrip("/").split("/", 1)[0]
        return ConfigError(
            f"bucket {bucket!r} of {self.url} does not exist or is not visible with these "
            f"credentials; create it, or check the URL and {self._endpoint_hint()}"
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
            if self.is_remote:
                raise self._missing_root() from None
            found = {}
        prefix = self.root.rstrip("/") + "/"
        indexes: set[int] = set()
        aborted: dict[int, FileEntry] = {}
        claims: dict[int, FileEntry] = {}
        files: dict[int, dict[str, FileEntry]] = {}
        other: dict[str, FileEntry] = {}
        for path, info in found.items():
            if info.get("type", "file") != "file":
                continue
            path = path if path.startswith(prefix) else "/" + path.lstrip("/")
            if not path.startswith(prefix):
                continue
            rel = path[len(prefix) :]
            entry = FileEntry(int(info.get("size") or 0), modified_time(info))
            top, _, rest = rel.partition("/")
            if top == CLAIMS_DIR:
                if rest.endswith(".lock") or SUCCESSOR_SUFFIX in rest:
                    continue  # a local mirror's lock file, or a successor: never garbage
                version = None
                for suffix, bucket in ((CLAIM_SUFFIX, claims), (ABORT_SUFFIX, aborted)):
                    if rest.endswith(suffix) and "/" not in rest:
                        version = parse_version_dir(rest[: -len(suffix)])
                        if version is not None:
                            bucket[version] = entry
                            break
                if version is None:
                    other[path] = entry
                continue
            version = parse_version_dir(top)
            if version is None or not rest or "/" in rest or version < 1:
                continue
            files.setdefault(version, {})[rest] = entry
            if rest == INDEX_NAME:
                indexes.add(version)
        return StoreListing(frozenset(indexes), aborted, claims, files, other)

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
        tombstone), :class:`FormatError` if it is larger than :data:`MAX_INDEX_BYTES`.
        """
        path = self.file_path(version, INDEX_NAME)
        missing = VersionNotFoundError(
            f"weight_v{version:06d} is not committed in {self.url} (its index is missing or "
            "it was pruned); list committed versions with `deltastore ls`"
        )
        try:
            # A ranged read bounds the bytes held whatever the object's size.
            data = self._guard(
                f"reading {path}", lambda: self.fs.cat_file(path, start=0, end=MAX_INDEX_BYTES + 1)
            )
        except FileNotFoundError:
            raise missing from None
        if len(data) > MAX_INDEX_BYTES:
            raise FormatError(
                f"the index of weight_v{version:06d} in {self.url} is larger than the "
                f"{MAX_INDEX_BYTES // 1024**2} MiB limit on indexes; it is corrupt or not a "
                "deltastore index"
            )
        if self.is_fenced(version):
            raise missing
        return bytes(data)

    def file_size(self, version: int, name: str) -> int:
        """Size in bytes of a file of a version, asked of the store (never a cached listing)."""
        path = self.file_path(version, name)
        try:
            info = self._guard(f"stat {path}", lambda: self.fs.info(path))
        except FileNotFoundError:
            raise VersionNotFoundError(
                f"{name} of weight_v{version:06d} is missing in {self.url}; the version was "
                "pruned or is corrupt"
            ) from None
        return int(info["size"])

    def read_range(self, version: int, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file of a version (one ranged request).

        Raises :class:`VersionNotFoundError` if the file vanished (pruned mid-read: the caller
        should re-resolve the version), :class:`FormatError` if it is shorter than ``end``.
        """
        if end <= start:
            # An empty range: asked of S3 it would read the whole object (an invalid Range).
            if end < start:
                raise FormatError(f"read_range({name!r}, {start}, {end}): end before start")
            return b""
        path = self.file_path(version, name)
        try:
            data = self._guard(
                f"reading {path}[{start}:{end}]",
                lambda: self.fs.cat_file(path, start=start, end=end),
            )
        except FileNotFoundError:
            raise VersionNotFoundError(
                f"{name} of weight_v{version:06d} vanished from {self.url} while being read; "
                "it was pruned: pull again to re-resolve"
            ) from None
        if len(data) != end - start:
            raise FormatError(
                f"{name} of weight_v{version:06d} is truncated: asked bytes {start}..{end}, got "
                f"{len(data)}"
            )
        return bytes(data)

    def read_shard_header(self, version: int, name: str) -> SafetensorsHeader:
        """Parse a shard's safetensors header with ranged reads (no data is read)."""
        source = f"{self.url}/{version_dir_name(version)}/{name}"
        size = self.file_size(version, name)
        length = header_length(self.read_range(version, name, 0, min(8, size)), source=source)
        if 8 + length > size:
            raise FormatError(f"{source} is truncated inside its {length}-byte header")
        return parse_header(
            self.read_range(version, name, 8, 8 + length), file_size=size, source=source
        )

    @contextlib.contextmanager
    def open_read(self, version: int, name: str) -> Iterator[BinaryIO]:
        """A readable binary stream of a file of a version (read-ahead of ``block_size``)."""
        path = self.file_path(version, name)
        kwargs: dict[str, Any] = {}
        if self.is_remote:
            # Plain read-ahead of one block: gcsfs's default prefetcher buffers far more.
            kwargs = {"block_size": self.block_size, "cache_type": "readahead"}
        try:
            fh = self._guard(f"opening {path}", lambda: self.fs.open(path, "rb", **kwargs))
        except FileNotFoundError:
            raise VersionNotFoundError(
                f"{name} of weight_v{version:06d} is missing in {self.url}"
            ) from None
        with fh:
            yield fh

    def list_files(self, version: int) -> list[str]:
        """Plain file names inside a version's directory."""
        path = self.version_path(version)
        try:
            entries = self._guard(f"listing {path}", lambda: self.fs.ls(path, detail=True))
        except FileNotFoundError:
            return []
        return sorted(
            posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file"
        )

    # ---------------------------------------------------------------- writing
    def _create_only(self, path: str, data: bytes) -> None:
        """Write ``path`` only if it does not exist; raises ``FileExistsError`` otherwise."""
        if self.is_local:
            create_new_file(path, data)
        elif self.is_memory:
            with _memory_lock:
                if self.fs.exists(path):
                    raise FileExistsError(path)
                self.fs.pipe_file(path, data)
        else:
            # S3 If-None-Match: *, GCS ifGenerationMatch=0 (a simple upload: keep it small).
            self.fs.pipe_file(path, data, mode="create")

    def create_or_read(self, path: str, data: bytes) -> bytes | None:
        """Create-only write of ``path``: None if written now, else the existing object's bytes
        (the caller decides whether it is its own, written earlier with a lost acknowledgement).
        Retried as one unit."""

        def attempt() -> bytes | None:
            try:
                self._create_only(path, data)
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

    def check_exclusive_create(self) -> bool:
        """Probe once whether create-only writes are exclusive on this backend.

        Writes a probe object under ``_claims/`` twice, create-only, and expects the second
        write to fail. Where it does not, concurrent writers of one version could both commit:
        a warning says so and :attr:`supports_exclusive_create` becomes False. Raises
        :class:`ConfigError` if the bucket does not exist, :class:`StoreError` if access is
        denied.
        """
        if self.supports_exclusive_create is not None:
            return self.supports_exclusive_create
        token = new_token()
        path = posixpath.join(self.root, CLAIMS_DIR, f"{PROBE_PREFIX}{token}")
        body = json.dumps({"probe": True, "token": token}).encode()
        try:
            self._create_with_token(path, body, token, "token")
            try:
                self._guard(f"probing {path}", lambda: self._create_only(path, b"second"))
                exclusive = False
            except FileExistsError:
                exclusive = True
        except FileNotFoundError:
            raise self._missing_root() from None
        finally:
            with contextlib.suppress(Exception):
                self.fs.rm(path)
        self.supports_exclusive_create = exclusive
        if not exclusive:
            message = (
                f"{self.url}: create-only writes are NOT exclusive on this backend (a second "
                "create-only write of a probe object succeeded); two concurrent publishers "
                "could both commit one version. Run exactly one publisher per store"
            )
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return exclusive

    def write_file(self, version: int, name: str, data: bytes | memoryview) -> None:
        """Write one whole file of a claimed, uncommitted version (retried as a whole)."""
        if self.is_local or self.is_memory:
            with self.open_write(version, name) as fh:
                fh.write(data)
            return
        if name == INDEX_NAME:
            raise StoreError(f"{name} is written only by commit()")
        path = self.file_path(version, name)
        payload = bytes(data)
        self._guard(f"writing {path}", lambda: self.fs.pipe_file(path, payload))

    @contextlib.contextmanager
    def open_write(self, version: int, name: str) -> Iterator[BinaryIO]:
        """A writable stream for one file of a claimed, uncommitted version.

        Locally the file is written to a sibling temp file, fsynced and renamed into place, so
        a crash never leaves a complete-looking partial file. Remotely at most ``block_size``
        bytes are buffered: larger files go up as a multipart (S3) or resumable (GCS) upload
        that completes on close; if the caller raises, the upload is abandoned, never completed.
        """
        if name == INDEX_NAME:
            raise StoreError(f"{name} is written only by commit()")
        path = self.file_path(version, name)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{new_token()}.partial"
            try:
                with open(tmp, "wb") as fh:
                    yield fh
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        elif self.is_memory:
            buffer = io.BytesIO()
            yield buffer
            self.fs.pipe_file(path, buffer.getvalue())
        else:
            remote = self._guard(
                f"opening {path} for writing",
                lambda: self.fs.open(path, "wb", block_size=self.block_size),
            )
            try:
                yield remote
            except BaseException:
                with contextlib.suppress(Exception):
                    remote.discard()
                remote.closed = True  # closing would complete the partial upload
                raise
            try:
                remote.close()
            except (FileNotFoundError, DeltastoreError):
                raise
            except Exception as exc:
                raise self._translate(f"uploading {path}", exc) from exc

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

    def is_fenced(self, version: int) -> bool:
        """Whether ``version`` carries a tombstone (fenced or unpublished by prune, or aborted
        after taking its base's successor): it is never visible nor claimed again."""
        return self.exists(self.abort_path(version))

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

    def successor_path(self, base: int, generation: int) -> str:
        """Path of the ``generation``-th successor object of version ``base`` (0: the base)."""
        name = f"weight_v{base:06d}{SUCCESSOR_SUFFIX}{generation}"
        return posixpath.join(self.root, CLAIMS_DIR, name)

    def prepare_commit(self, version: int) -> None:
        """Before the index write: locally, make the version's directory and names durable."""
        if self.is_local:
            # An empty delta (nothing changed) has no shard, so its directory may not exist yet.
            os.makedirs(self.version_path(version), exist_ok=True)
            fsync_path(self.version_path(version))

    def finish_commit(self, version: int) -> None:
        """After a commit stands: make it durable locally and visible to this client."""
        if self.is_local:
            fsync_path(self.root)
        self.fs.invalidate_cache(self.version_path(version))

    # ------------------------------------------------------------ transaction
    def _try_claim(self, version: int, token: str) -> str | None:
        """Take ``version``'s claim: None on success, else why not (``committed``,
        ``fenced``, ``claimed``)."""
        self.check_exclusive_create()
        if self.exists(self.file_path(version, INDEX_NAME)):
            return "fenced" if self.is_fenced(version) else "committed"
        if self.is_fenced(version):
            return "fenced"
        existing = self.create_or_read(self.claim_path(version), claim_body(version, token))
        if existing is None or json_field(existing, "token") == token:
            return None
        return "claimed"

    def _claim_refused(self, version: int, why: str) -> VersionConflictError:
        remedy = {
            "committed": "is already committed; publish the next version (or resume the stream)",
            "fenced": "is fenced by prune (a tombstone); publish the next version",
            "claimed": "is claimed by another writer; two publishers target one store (stop the "
            "other, or resume the stream with resume=True)",
        }[why]
        return VersionConflictError(f"weight_v{version:06d} in {self.url} {remedy}")

    def begin(self, version: int, *, token: str | None = None) -> VersionWriter:
        """Claim ``version`` and return its :class:`VersionWriter`.

        ``token`` (default: a new one) lets a writer that crashed resume its own claim.
        Raises :class:`VersionConflictError` if the version is committed, fenced or claimed by
        another writer.
        """
        token = token or new_token()
        why = self._try_claim(version, token)
        if why is not None:
            raise self._claim_refused(version, why)
        return VersionWriter(self, version, token)

    def begin_next(self, after: int, *, max_skip: int = 64) -> VersionWriter:
        """Claim the first claimable version above ``after`` (a resumed or new stream).

        Versions claimed by another writer (live or crashed: a store cannot tell) and fenced
        versions are skipped: their numbers are never reused. Skipping is safe because a
        delta's commit must also take its base's one successor object, so two writers
        extending one version never both commit. Raises :class:`VersionConflictError` when a
        version above ``after`` is already committed (another writer moved on: resume from
        it) or ``max_skip`` versions in a row are taken.
        """
        token = new_token()
        for version in range(after + 1, after + 1 + max_skip):
            why = self._try_claim(version, token)
            if why is None:
                return VersionWriter(self, version, token)
            if why == "committed":
                raise VersionConflictError(
                    f"weight_v{version:06d} in {self.url} is already committed above "
                    f"weight_v{after:06d}: another writer moved the store on; resume the stream "
                    "(resume=True) from the latest version"
                )
            log.warning(
                "weight_v%06d of %s is %s and not committed; skipping to the next version",
                version,
                self.url,
                why,
            )
        raise VersionConflictError(
            f"{max_skip} versions after weight_v{after:06d} in {self.url} are claimed or "
            "fenced; run `deltastore prune` to fence stale claims, then resume"
        )

    def join(self, version: int, token: str) -> VersionWriter:
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
    def prune(self, keep: int, *, grace_s: float = 3600.0, dry_run: bool = False) -> PruneReport:
        """Remove old versions and garbage; see :func:`deltastore.storage.prune.prune`."""
        from deltastore.storage.prune import prune

        return prune(self, keep=keep, grace_s=grace_s, dry_run=dry_run)

"""``VersionStore``: published versions on any fsspec filesystem.

The store moves opaque bytes: it knows version directories, indexes and byte ranges, never
codecs. Its protocols (ARCHITECTURE.md):

* **Commit.** A create-only claim ``_claims/weight_vNNNNNN.json`` first, so a second writer of
  the same version never touches the winner's shards; then the shards; then the index,
  create-only and carrying a unique commit token. The index's existence is the commit. On
  ``FileExistsError`` the writer reads the index back: its own token means the acknowledgement
  was lost and the commit stands, another token is a :class:`VersionConflictError`.
* **Listing.** Versions are listed by their indexes; shards without an index are invisible.
* **Refresh.** :meth:`VersionStore.refresh` drops fsspec's listing caches and runs the
  pre-read hook, so a reader sees versions other hosts committed.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import posixpath
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import fsspec

from deltastore.errors import (
    ConfigError,
    FormatError,
    StoreError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, parse_version_dir, version_dir_name
from deltastore.format.safetensors_io import SafetensorsHeader, header_length, parse_header
from deltastore.storage.retry import RetryPolicy

log = logging.getLogger("deltastore.storage")

CLAIMS_DIR = "_claims"
PostWriteHook = Callable[[str], None]
"""``post_write(version_dir_url)``: runs once a version's files are written."""
PreReadHook = Callable[[str, int], None]
"""``pre_read(store_url, version)``: runs before a version is read."""

_memory_lock = threading.Lock()


def new_token() -> str:
    """A unique commit/claim token."""
    return uuid.uuid4().hex


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class VersionStore:
    """Published versions under one root URL (a local path, ``memory://``, ``s3://``, ``gs://``).

    ``storage_options`` go to fsspec unchanged. ``post_write`` and ``pre_read`` are optional hook
    callables (see :data:`PostWriteHook`, :data:`PreReadHook`). Raises :class:`ConfigError` if
    the URL's protocol has no installed fsspec implementation.
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
    ) -> None:
        url = os.fspath(url)
        if not url:
            raise ConfigError("store URL is empty; pass a directory, memory://, s3:// or gs:// URL")
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                f"cannot open store {url!r}: {exc}. For s3:// install deltastore[s3], for gs:// "
                "install deltastore[gcs]"
            ) from None
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.is_local = "file" in protocols
        self.is_memory = "memory" in protocols
        if self.is_local:
            root = os.path.abspath(root)
        self.root = root.rstrip("/") or "/"
        self.url = self.root if self.is_local else f"{protocols[0]}://{self.root.lstrip('/')}"
        self.post_write = post_write
        self.pre_read = pre_read
        if retry is not None:
            self.retry = retry

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

    def _claim_path(self, version: int) -> str:
        return posixpath.join(self.root, CLAIMS_DIR, version_dir_name(version) + ".json")

    # ---------------------------------------------------------------- reading
    def refresh(self, version: int | None = None) -> None:
        """Make versions committed by other hosts visible.

        Drops fsspec's listing caches (all of them: invalidating a path does not invalidate its
        children) and, when ``version`` is given, runs the pre-read hook for it.
        """
        self.fs.invalidate_cache()
        if self.pre_read is not None and version is not None and version > 0:
            self.pre_read(self.url, version)

    def versions(self) -> list[int]:
        """Committed versions, ascending. Directories without an index are not versions."""

        def list_indexes() -> list[str]:
            if not self.fs.exists(self.root):
                return []
            return list(self.fs.glob(posixpath.join(self.root, "weight_v*", INDEX_NAME)))

        found = self.retry.call(f"listing {self.url}", list_indexes)
        versions = []
        for path in found:
            number = parse_version_dir(posixpath.dirname(path))
            if number is not None and number > 0:
                versions.append(number)
        return sorted(set(versions))

    def latest(self) -> int:
        """The newest committed version, or 0 when nothing is published."""
        versions = self.versions()
        return versions[-1] if versions else 0

    def index(self, version: int) -> VersionIndex:
        """The parsed index of a committed version.

        Raises :class:`VersionNotFoundError` if it is not committed, :class:`FormatError` if
        the index is malformed.
        """
        path = self.file_path(version, INDEX_NAME)
        data = self._read_bytes(path, what=f"index of {version_dir_name(version)}", version=version)
        return VersionIndex.from_json(
            data, version=version, source=f"{self.url}/{version_dir_name(version)}/{INDEX_NAME}"
        )

    def _read_bytes(self, path: str, *, what: str, version: int | None = None) -> bytes:
        try:
            return self.retry.call(f"reading {path}", lambda: self.fs.cat_file(path))
        except FileNotFoundError:
            if version is not None:
                raise VersionNotFoundError(
                    f"weight_v{version:06d} is not committed in {self.url} ({what} missing); "
                    "list committed versions with `deltastore ls`"
                ) from None
            raise StoreError(f"{path} is missing in {self.url}") from None

    def file_size(self, version: int, name: str) -> int:
        path = self.file_path(version, name)
        try:
            info = self.retry.call(f"stat {path}", lambda: self.fs.info(path))
        except FileNotFoundError:
            raise VersionNotFoundError(
                f"{name} of weight_v{version:06d} is missing in {self.url}; the version was "
                "pruned or is corrupt"
            ) from None
        return int(info["size"])

    def read_range(self, version: int, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file of a version (one ranged request)."""
        path = self.file_path(version, name)
        try:
            data = self.retry.call(
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
        """A readable binary stream of a file of a version."""
        path = self.file_path(version, name)
        try:
            with self.fs.open(path, "rb") as fh:
                yield fh
        except FileNotFoundError:
            raise VersionNotFoundError(
                f"{name} of weight_v{version:06d} is missing in {self.url}"
            ) from None

    def list_files(self, version: int) -> list[str]:
        """Plain file names inside a version's directory."""
        path = self.version_path(version)
        entries = self.retry.call(f"listing {path}", lambda: self.fs.ls(path, detail=True))
        return sorted(
            posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file"
        )

    # ---------------------------------------------------------------- writing
    def _create_only(self, path: str, data: bytes) -> None:
        """Write ``path`` only if it does not exist; raises ``FileExistsError`` otherwise."""
        if self.is_local:
            # fsspec's local create mode checks, then writes: it races. A finished sibling
            # temp file linked into place is both exclusive and complete.
            directory = os.path.dirname(path)
            os.makedirs(directory, exist_ok=True)
            tmp = f"{path}.{new_token()}.partial"
            with open(tmp, "xb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, path)
            finally:
                os.unlink(tmp)
            _fsync_dir(directory)
        elif self.is_memory:
            with _memory_lock:
                if self.fs.exists(path):
                    raise FileExistsError(path)
                self.fs.pipe_file(path, data)
        else:
            self.fs.pipe_file(path, data, mode="create")

    def _create_with_token(
        self, path: str, data: bytes, token: str, read_token: Callable[[bytes], str | None]
    ) -> bool:
        """Create-only write; True if ours stands (written now or earlier with a lost ack)."""

        def attempt() -> bool:
            try:
                self._create_only(path, data)
                return True
            except FileExistsError:
                self.fs.invalidate_cache(posixpath.dirname(path))
                try:
                    existing = self.fs.cat_file(path)
                except FileNotFoundError:
                    raise StoreError(
                        f"{path} was reported as existing but cannot be read; retry"
                    ) from None
                return read_token(existing) == token

        return self.retry.call(f"create-only write of {path}", attempt)

    def claim(self, version: int, token: str) -> None:
        """Claim a version before writing any of its files.

        Raises :class:`VersionConflictError` if the version is committed or claimed by another
        writer (e.g. a zombie trainer and its replacement).
        """
        if self.fs.exists(self.file_path(version, INDEX_NAME)):
            raise VersionConflictError(
                f"weight_v{version:06d} is already committed in {self.url}; publish the next "
                "version instead (or resume the stream)"
            )
        body = json.dumps({"version": version, "token": token}).encode()

        def read_token(data: bytes) -> str | None:
            with contextlib.suppress(ValueError, AttributeError):
                return json.loads(data).get("token")
            return None

        if not self._create_with_token(self._claim_path(version), body, token, read_token):
            raise VersionConflictError(
                f"weight_v{version:06d} in {self.url} is claimed by another writer; two "
                "publishers target one store (stop the other, or resume the stream)"
            )

    def write_file(self, version: int, name: str, data: bytes | memoryview) -> None:
        """Write one whole file of a claimed, uncommitted version."""
        with self.open_write(version, name) as fh:
            fh.write(data)

    @contextlib.contextmanager
    def open_write(self, version: int, name: str) -> Iterator[BinaryIO]:
        """A writable stream for one file of a claimed, uncommitted version.

        Locally the file is written to a sibling temp file, fsynced and renamed into place, so
        a crash never leaves a complete-looking partial file. Remotely the upload completes on
        close (multipart above the filesystem's block size).
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
            with self.fs.open(path, "wb") as fh:
                yield fh

    def commit(self, version: int, index: VersionIndex) -> None:
        """Publish a version by creating its index (create-only), once its shards are written.

        The index must carry a ``commit_token``. Raises :class:`VersionConflictError` if
        another writer committed this version first.
        """
        if index.version != version or not index.commit_token:
            raise ConfigError("commit() needs the index of this version with a commit_token")
        for shard in index.shards():
            if not self.fs.exists(self.file_path(version, shard)):
                raise StoreError(
                    f"cannot commit weight_v{version:06d}: shard {shard} is not written"
                )
        path = self.file_path(version, INDEX_NAME)

        def read_token(data: bytes) -> str | None:
            with contextlib.suppress(ValueError, AttributeError):
                return json.loads(data).get("metadata", {}).get("commit_token")
            return None

        if self.is_local:
            # An empty delta (nothing changed) has no shard, so its directory may not exist yet.
            os.makedirs(self.version_path(version), exist_ok=True)
            # The shards were fsynced when written; make their names durable with the index.
            _fsync_dir(self.version_path(version))
        if not self._create_with_token(path, index.to_json(), index.commit_token, read_token):
            raise VersionConflictError(
                f"weight_v{version:06d} was committed by another writer in {self.url}; this "
                "writer's version was not published"
            )
        if self.is_local:
            _fsync_dir(self.root)
        self.fs.invalidate_cache(self.version_path(version))

    def after_write(self, version: int) -> None:
        """Run the post-write hook for a version whose files are all written."""
        if self.post_write is not None:
            self.post_write(self.version_url(version))

    def abort(self, version: int) -> None:
        """Remove an uncommitted version's files and claim (best effort, never a commit)."""
        if self.fs.exists(self.file_path(version, INDEX_NAME)):
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.version_path(version), recursive=True)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._claim_path(version))

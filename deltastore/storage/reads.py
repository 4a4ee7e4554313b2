"""Reading the files of a version: sizes, byte ranges, shard headers, streams.

:class:`FileReads` is the reading half of :class:`~deltastore.storage.store.VersionStore`
(a base class, so the store's public API stays one object); it needs only the store's paths,
filesystem, backend and retried call.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, BinaryIO, Protocol, TypeVar

from deltastore.errors import FormatError, VersionNotFoundError
from deltastore.format.names import version_dir_name
from deltastore.format.packed import unpack_header
from deltastore.format.safetensors_io import SafetensorsHeader, header_length, parse_header

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from deltastore.storage.backends import Backend

T = TypeVar("T")

_HEADER_GUESS = 64 * 1024
"""Bytes a shard-header read asks for at once (the 8-byte length prefix and the header)."""


class FileReads:
    """Reads of a version's files; see :class:`~deltastore.storage.store.VersionStore`."""

    url: str
    block_size: int
    backend: Backend

    @property
    def fs(self) -> AbstractFileSystem:
        raise NotImplementedError

    def file_path(self, version: int, name: str) -> str:
        raise NotImplementedError

    def version_path(self, version: int) -> str:
        raise NotImplementedError

    def _guard(self, what: str, fn: Callable[[], T]) -> T:
        raise NotImplementedError

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
        """Parse a shard's safetensors header with ranged reads (no data is read); a packed delta
        shard's comes back with one entry and digest per tensor, as a plain one's."""
        source = f"{self.url}/{version_dir_name(version)}/{name}"
        size = self.file_size(version, name)
        # One read covers the length prefix and a header of up to 64 KiB (most shards'); a
        # longer header takes a second read for the rest.
        head = self.read_range(version, name, 0, min(_HEADER_GUESS, size))
        length = header_length(head[:8], source=source)
        if 8 + length > size:
            raise FormatError(f"{source} is truncated inside its {length}-byte header")
        if 8 + length > len(head):
            head += self.read_range(version, name, len(head), 8 + length)
        header = parse_header(head[8 : 8 + length], file_size=size, source=source)
        return unpack_header(header, source=source)

    def download(self, version: int, name: str, dst: str, sink: DownloadSink | None = None) -> int:
        """Copy a file of a version to the local path ``dst`` (not fsynced) and return its size
        in bytes; ``sink`` sees every byte, in order, as it is written.

        One streamed GET on S3 (the next block is read while this one is written); gcsfs has
        no streamed read, so there ``fs.get_file`` downloads and the sink reads the copy back.
        A retry rewrites ``dst`` whole and restarts the sink. Raises
        :class:`VersionNotFoundError` if the file is missing (pruned).
        """
        path = self.file_path(version, name)

        def attempt() -> int:
            if sink is not None:
                sink.restart()
            blocks = self.backend.read_blocks(path, self.block_size)
            if blocks is None:
                self.fs.get_file(path, dst)
                return _read_back(dst, sink, self.block_size)
            size = 0
            with contextlib.closing(blocks), open(dst, "wb") as out:
                for data in blocks:
                    out.write(data)
                    if sink is not None:
                        sink.update(data)
                    size += len(data)
            return size

        try:
            return self._guard(f"downloading {path}", attempt)
        except FileNotFoundError:
            raise VersionNotFoundError(
                f"{name} of weight_v{version:06d} is missing in {self.url}"
            ) from None

    @contextlib.contextmanager
    def open_read(self, version: int, name: str) -> Iterator[BinaryIO]:
        """A readable binary stream of a file of a version (read-ahead of ``block_size``)."""
        path = self.file_path(version, name)
        kwargs = self.backend.read_options(self.block_size)
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


class DownloadSink(Protocol):
    """What :meth:`FileReads.download` feeds a file's bytes to as they arrive."""

    def restart(self) -> None:
        """Forget what was fed: the file comes again from its first byte (a retry)."""

    def update(self, data: bytes) -> None:
        """The file's next bytes."""


def _read_back(path: str, sink: DownloadSink | None, block_size: int) -> int:
    """Feed a downloaded local file to ``sink``; its size."""
    if sink is None:
        return os.path.getsize(path)
    size = 0
    with open(path, "rb") as fh:
        while data := fh.read(block_size):
            sink.update(data)
            size += len(data)
    return size

"""Streamed checks of a shard as its bytes pass by: the header, each tensor's digest, the file.

``codecs`` computes a digest of a tensor held in memory; replication must never hold a shard
(or a tensor of several GB) in memory and sits below ``codecs`` in the layering, so it keeps
incremental hashers for the three reference checksums here. They produce exactly the hex
strings ``deltastore.codecs`` writes (a test checks it).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Protocol

import blake3
import xxhash

from deltastore.errors import FormatError, IntegrityError
from deltastore.format.packed import unpack_header
from deltastore.format.safetensors_io import (
    SafetensorsHeader,
    TensorEntry,
    header_length,
    parse_header,
)


class Hasher(Protocol):
    """An incremental hash: ``update`` with consecutive pieces, then ``hexdigest``."""

    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


class _Adler32:
    """adler32 as ``%08x``, fed piece by piece."""

    def __init__(self) -> None:
        self.value = 1

    def update(self, data: bytes | memoryview, /) -> None:
        self.value = zlib.adler32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


HASHERS: dict[str, Callable[[], Hasher]] = {
    "xxh3-128": xxhash.xxh3_128,
    "blake3": blake3.blake3,
    "adler32": _Adler32,
}
"""Checksum name (as an index's ``checksum_format`` names it) → new incremental hasher."""


def new_file_hasher() -> Hasher:
    """The whole-file digest that compares a copy with what was read from its source."""
    return xxhash.xxh3_128()


class ShardChecker:
    """Follows a shard's bytes in file order and checks them as they pass.

    Feed consecutive pieces with :meth:`feed` (never more than the header held at once), then
    call :meth:`finish`. It parses the safetensors header; when ``checksum`` names a reference
    algorithm and ``check_digests`` is set, it requires a well-formed digest for every tensor in
    the header's metadata, and with ``hash_tensors`` (a full version: a tensor's bytes are its
    value; a delta's digests describe the tensor after applying, which only an engine holds)
    hashes each tensor's bytes and compares. ``source`` names the shard in errors.
    Raises :class:`FormatError` for a malformed header and :class:`IntegrityError` for bytes
    that do not match their digest.
    """

    def __init__(
        self,
        source: str,
        size: int,
        checksum: str | None,
        *,
        check_digests: bool,
        hash_tensors: bool,
    ) -> None:
        self.source = source
        self.size = size
        self.check_digests = check_digests
        self.hash_tensors = hash_tensors
        self.algorithm = checksum if checksum in HASHERS else None
        self.offset = 0
        self.header: SafetensorsHeader | None = None
        self.checked = 0
        """Tensors whose digest was checked."""
        self._head = bytearray()
        self._pending: list[TensorEntry] = []
        self._next = 0
        self._current: Hasher | None = None

    def feed(self, piece: bytes | memoryview) -> None:
        """The next ``len(piece)`` bytes of the shard."""
        view = memoryview(piece).cast("B")
        start = self.offset
        self.offset += len(view)
        pos = 0
        while self.header is None and pos < len(view):
            need = self._head_needed() - len(self._head)
            taken = view[pos : pos + need]
            self._head += taken
            pos += len(taken)
            if len(self._head) > 8 and len(self._head) == self._head_needed():
                self._parse_head()
        if self.header is not None and self._next < len(self._pending):
            self._hash(view, start)

    def _head_needed(self) -> int:
        if len(self._head) < 8:
            return 8
        return 8 + header_length(bytes(self._head[:8]), source=self.source)

    def _parse_head(self) -> None:
        length = header_length(bytes(self._head[:8]), source=self.source)
        if len(self._head) < 8 + length:
            return
        self.header = unpack_header(
            parse_header(
                bytes(self._head[8 : 8 + length]), file_size=self.size, source=self.source
            ),
            source=self.source,
        )
        self._head = bytearray()
        if not self.check_digests or self.algorithm is None:
            return
        width = len(HASHERS[self.algorithm]().hexdigest())
        for entry in self.header.tensors.values():
            digest = self.header.metadata.get(entry.name, "")
            if len(digest) != width or digest.strip("0123456789abcdef"):
                raise FormatError(
                    f"{self.source}: tensor {entry.name!r} has no valid {self.algorithm} digest "
                    "in its shard metadata; the source's copy is corrupt or foreign"
                )
        if not self.hash_tensors:
            return
        for entry in sorted(self.header.tensors.values(), key=lambda t: t.start):
            if entry.nbytes:
                self._pending.append(entry)
            else:
                self._check(entry, HASHERS[self.algorithm]().hexdigest())

    def _hash(self, view: memoryview, start: int) -> None:
        end = start + len(view)
        while self._next < len(self._pending):
            entry = self._pending[self._next]
            if entry.start >= end:
                return
            hasher = self._current or HASHERS[self.algorithm or ""]()
            lo, hi = max(entry.start, start), min(entry.end, end)
            hasher.update(view[lo - start : hi - start])
            if entry.end > end:
                self._current = hasher
                return
            self._check(entry, hasher.hexdigest())
            self._current = None
            self._next += 1

    def _check(self, entry: TensorEntry, got: str) -> None:
        assert self.header is not None
        want = self.header.metadata.get(entry.name)
        if want is None:
            return
        if got != want:
            raise IntegrityError(
                f"{self.source}: tensor {entry.name!r} does not match its {self.algorithm} "
                f"digest (recorded {want}, read {got}); the source's copy is corrupt, "
                "republish that version before replicating it"
            )
        self.checked += 1

    def finish(self) -> SafetensorsHeader:
        """Check that the whole file passed and every tensor was checked; returns the header."""
        if self.header is None or self.offset != self.size:
            raise FormatError(
                f"{self.source}: read {self.offset} bytes of {self.size}, header "
                f"{'parsed' if self.header else 'incomplete'}; the file is truncated"
            )
        if self._next < len(self._pending):
            name = self._pending[self._next].name
            raise FormatError(f"{self.source}: tensor {name!r} is cut short")
        return self.header

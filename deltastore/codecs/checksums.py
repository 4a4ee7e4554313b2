"""The reference checksums: ``xxh3-128``, ``blake3`` and ``adler32``."""

from __future__ import annotations

import zlib

import blake3
import xxhash

from deltastore.codecs.base import ByteArray, Checksum, Hasher


class Xxh3Checksum(Checksum):
    """xxh3-128 as 32 hex characters: the widest fast non-cryptographic digest (default)."""

    name = "xxh3-128"
    hex_length = 32

    def hexdigest(self, data: ByteArray | bytes | memoryview) -> str:
        return xxhash.xxh3_128_hexdigest(memoryview(data).cast("B"))

    def hasher(self) -> Hasher:
        return xxhash.xxh3_128()


class Blake3Checksum(Checksum):
    """blake3 (32-byte) as 64 hex characters: cryptographic, for untrusted storage."""

    name = "blake3"
    hex_length = 64

    def hexdigest(self, data: ByteArray | bytes | memoryview) -> str:
        return blake3.blake3(memoryview(data).cast("B")).hexdigest()

    def hasher(self) -> Hasher:
        return blake3.blake3()


class Adler32Checksum(Checksum):
    """adler32 as ``%08x``: weak, for interoperability with systems that expect it."""

    name = "adler32"
    hex_length = 8

    def hexdigest(self, data: ByteArray | bytes | memoryview) -> str:
        hasher = _Adler32()
        hasher.update(memoryview(data))
        return hasher.hexdigest()

    def hasher(self) -> Hasher:
        return _Adler32()


class _Adler32:
    """adler32 fed piece by piece (zlib carries the running value)."""

    def __init__(self) -> None:
        self._value = 1

    def update(self, data: bytes | memoryview, /) -> None:
        view = memoryview(data).cast("B")
        step = 1 << 30  # zlib takes at most UINT_MAX bytes per call on some builds: slices
        for offset in range(0, len(view), step):
            self._value = zlib.adler32(view[offset : offset + step], self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"

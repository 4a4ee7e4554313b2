"""Bytes in, bytes out: delta encodings, zstd framing and checksums, looked up by name."""

from __future__ import annotations

from deltastore.codecs.base import (
    ByteArray,
    Checksum,
    Digest,
    EncodedDelta,
    Encoding,
    FramedDelta,
    Hasher,
    XorChanges,
)
from deltastore.codecs.checksums import Adler32Checksum, Blake3Checksum, Xxh3Checksum
from deltastore.codecs.compression import COMPRESSION_NAME, compress, decompress
from deltastore.codecs.encodings import REMOVED_ENCODINGS, OverwriteEncoding, XorEncoding
from deltastore.codecs.sparse import AutoEncoding, CompactSparseEncoding, apply_changes, warm_up
from deltastore.codecs.sparse_format import element_size, itemsize_of_dtype
from deltastore.errors import ConfigError

ENCODINGS: dict[str, Encoding] = {
    e.name: e for e in (XorEncoding(), OverwriteEncoding(), CompactSparseEncoding(), AutoEncoding())
}
CHECKSUMS: dict[str, Checksum] = {
    c.name: c for c in (Xxh3Checksum(), Blake3Checksum(), Adler32Checksum())
}


def register_encoding(encoding: Encoding) -> None:
    """Make ``encoding`` known by its ``name`` to publishers and pulls in this process.

    Raises :class:`ConfigError` when another encoding already has that name.
    """
    known = ENCODINGS.get(encoding.name)
    if known is not None and known is not encoding:
        raise ConfigError(f"an encoding named {encoding.name!r} is already registered")
    ENCODINGS[encoding.name] = encoding


def get_encoding(name: str) -> Encoding:
    """The encoding registered as ``name``; :class:`ConfigError` lists the known ones, or says
    what to do for a removed one."""
    try:
        return ENCODINGS[name]
    except KeyError:
        if name in REMOVED_ENCODINGS:
            raise ConfigError(f"delta encoding {name!r}: {REMOVED_ENCODINGS[name]}") from None
        raise ConfigError(
            f"unknown delta encoding {name!r}; known encodings: {', '.join(sorted(ENCODINGS))}"
        ) from None


def get_checksum(name: str) -> Checksum:
    """The checksum registered as ``name``; :class:`ConfigError` lists the known ones."""
    try:
        return CHECKSUMS[name]
    except KeyError:
        raise ConfigError(
            f"unknown checksum {name!r}; known checksums: {', '.join(sorted(CHECKSUMS))}"
        ) from None


def check_compression(name: str | None) -> None:
    """Refuse a compression format other than the reference's zstd."""
    if name != COMPRESSION_NAME:
        raise ConfigError(
            f"unknown compression format {name!r}; known compression formats: {COMPRESSION_NAME}"
        )


__all__ = [
    "CHECKSUMS",
    "COMPRESSION_NAME",
    "ENCODINGS",
    "AutoEncoding",
    "ByteArray",
    "Checksum",
    "CompactSparseEncoding",
    "Digest",
    "EncodedDelta",
    "Encoding",
    "FramedDelta",
    "Hasher",
    "XorChanges",
    "apply_changes",
    "check_compression",
    "compress",
    "decompress",
    "element_size",
    "get_checksum",
    "get_encoding",
    "itemsize_of_dtype",
    "register_encoding",
    "warm_up",
]

"""zstd framing of delta payloads: one frame per tensor, level 1, content size recorded.

Compressor and decompressor objects are reused per thread (they are not thread-safe). A frame's
declared content size is checked against the largest payload the tensor allows *before* any
output is allocated, so a hostile frame cannot make a reader allocate unbounded memory.
"""

from __future__ import annotations

import threading

import zstandard

from deltastore.errors import FormatError

COMPRESSION_NAME = "zstd"
ZSTD_LEVEL = 1

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    comp = getattr(_local, "compressor", None)
    if comp is None:
        comp = _local.compressor = zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, write_content_size=True
        )
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


def compress(raw: bytes | memoryview) -> bytes:
    """One zstd frame (level 1) with the content size in its header."""
    return _compressor().compress(raw)


def frame_content_size(frame: bytes | memoryview, *, what: str) -> int:
    """The content size a frame declares; raises :class:`FormatError` if absent or unreadable."""
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what} is not a zstd frame ({exc})") from None
    if size < 0:
        raise FormatError(f"{what} is a zstd frame without a recorded content size; refusing it")
    return int(size)


def decompress(
    frame: bytes | memoryview, *, max_size: int, exact_size: int | None = None, what: str
) -> bytes:
    """Decompress one frame whose declared size must be ≤ ``max_size`` (and = ``exact_size``)."""
    declared = frame_content_size(frame, what=what)
    if exact_size is not None and declared != exact_size:
        raise FormatError(
            f"{what} declares {declared} bytes, the tensor needs exactly {exact_size}; the "
            "delta was made for another checkpoint or is corrupt"
        )
    if declared > max_size:
        raise FormatError(
            f"{what} declares {declared} bytes, more than the {max_size} a payload for this "
            "tensor can hold; refusing to allocate it"
        )
    try:
        out = _decompressor().decompress(frame, max_output_size=max(declared, 1))
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what} does not decompress: {exc}") from None
    if len(out) != declared:
        raise FormatError(f"{what} decompressed to {len(out)} bytes, it declared {declared}")
    return out

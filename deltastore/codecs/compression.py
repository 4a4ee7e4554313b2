"""zstd framing of delta payloads: one frame per tensor, level 1, content size recorded.

Compressor and decompressor objects are reused per thread (they are not thread-safe). A frame's
declared content size is checked against the largest payload the tensor allows *before* any
output is allocated, so a hostile frame cannot make a reader allocate unbounded memory.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import zstandard

from deltastore.errors import FormatError


@dataclass(frozen=True)
class PayloadBatch:
    """Decompressed payloads of several tensors, back to back in one buffer."""

    data: npt.NDArray[np.uint8]
    """Every payload's bytes, in order."""
    offsets: npt.NDArray[np.int64]
    """Payload ``i`` is ``data[offsets[i] : offsets[i + 1]]`` (one more offset than payloads)."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> memoryview:
        return memoryview(self.data[int(self.offsets[i]) : int(self.offsets[i + 1])])


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


def decompress_many(
    frames: Sequence[bytes | memoryview],
    max_sizes: Sequence[int],
    exact: bool,
    what: Callable[[int], str],
) -> PayloadBatch:
    """Decompress many frames into one buffer, each as :func:`decompress` would (frame ``i``
    at most ``max_sizes[i]`` bytes, exactly that many when ``exact``; every declared size
    checked before anything is allocated, a refusal worded with ``what(i)``), in one call that
    releases the GIL once (``multi_decompress_to_buffer``, where the backend has it)."""
    declared = []
    for i, frame in enumerate(frames):
        try:
            size = zstandard.frame_content_size(frame)
        except zstandard.ZstdError:
            size = -1
        if size < 0 or size > max_sizes[i] or (exact and size != max_sizes[i]):
            # Worded (and raised) the way a single frame is.
            decompress(
                frame,
                max_size=max_sizes[i],
                exact_size=max_sizes[i] if exact else None,
                what=what(i),
            )
        declared.append(size)
    offsets = np.array([0, *itertools.accumulate(declared)], np.int64)
    many = getattr(_decompressor(), "multi_decompress_to_buffer", None)
    joined: bytes | None = None
    # One frame (a large tensor is a batch of its own) is decompressed alone: joining would
    # copy it.
    if many is not None and len(frames) > 1 and min(declared) > 0:
        try:
            sizes = np.array(declared, np.uint64).tobytes()
            out = many(list(frames), decompressed_sizes=sizes)
            joined = b"".join(out)  # each segment is bytes-like
        except zstandard.ZstdError:
            joined = None  # found and worded frame by frame below
    if joined is None:
        joined = b"".join(
            [
                decompress(frame, max_size=declared[i], exact_size=declared[i], what=what(i))
                for i, frame in enumerate(frames)
            ]
        )
    return PayloadBatch(np.frombuffer(joined, np.uint8), offsets)

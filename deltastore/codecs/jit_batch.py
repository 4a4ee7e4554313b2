"""numba kernel encoding a whole batch of tensors with ``sparse-v2`` in one call: imported only
by :mod:`deltastore.codecs.jit`.

Inside the encode pool a tensor encoded alone makes about five calls that release the GIL (the
kernel, the zstd frame, numpy's views and counts); each release hands the GIL to another
thread, and getting it back costs far more than the call (measured on 8,000 tensors of 64 KB
with two workers: 220-330 us a tensor inside the pool against ~40 us alone). This kernel takes
a batch (addresses of each tensor's old and new bytes, so no per-tensor Python object crosses
into numba) and, without the GIL, writes every payload already in its zstd frame, the changed
byte counts and the changes as positions and XOR values, each into one buffer.

The zstd frame is written by hand: a sparse-v2 payload is near its entropy, so zstd-1 stores it
as raw blocks anyway, and the frame here is the one zstd writes then (single segment, content
size, raw blocks of at most 128 KiB, no checksum). Any zstd reader decompresses it unchanged.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from deltastore.codecs.jit_kernels import _write
from deltastore.codecs.steps import MARK

U64 = np.uint64
BLOCK = 128 * 1024
"""Largest zstd block (bytes of content)."""
FRAMED = 0
"""Kind of a tensor whose bytes in the batch are its whole zstd frame."""
CONTENT = 1
"""Kind of a tensor whose bytes are its (tagged) payload, for the caller to compress."""
DENSE = 2
"""Kind of a tensor whose sparse-v2 payload is over the dense ratio: nothing is written."""
HEADER = 4 + 1 + 8
"""Most bytes of a frame before its first block: magic, descriptor, content size."""


def _pointer_of(typingctx, address):  # type: ignore[no-untyped-def]
    """The integer ``address`` as a ``void*`` (what :func:`numba.carray` takes)."""
    signature = types.voidptr(types.int64)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return signature, codegen


_pointer: Any = intrinsic(_pointer_of)
"""Called in kernels as ``_pointer(address)`` (numba passes the typing context itself)."""


@numba.njit(cache=True, nogil=True)
def _one(old_at, new_at, nbytes, size):  # type: ignore[no-untyped-def]
    """(payload, positions, XOR values as uint64) of one tensor of ``size``-byte elements."""
    whole = nbytes // 8
    old_words = numba.carray(_pointer(old_at), whole, np.uint64)
    new_words = numba.carray(_pointer(new_at), whole, np.uint64)
    count = nbytes // size
    if size == 8:
        payload, positions, xored = _write(
            old_words, new_words, numba.carray(_pointer(old_at), count, np.uint64),
            numba.carray(_pointer(new_at), count, np.uint64), 64, MARK | 3, nbytes,
        )  # fmt: skip
        return payload, positions, xored.astype(np.uint64)
    if size == 4:
        payload, positions, xored = _write(
            old_words, new_words, numba.carray(_pointer(old_at), count, np.uint32),
            numba.carray(_pointer(new_at), count, np.uint32), 32, MARK | 2, nbytes,
        )  # fmt: skip
        return payload, positions, xored.astype(np.uint64)
    if size == 2:
        payload, positions, xored = _write(
            old_words, new_words, numba.carray(_pointer(old_at), count, np.uint16),
            numba.carray(_pointer(new_at), count, np.uint16), 16, MARK | 1, nbytes,
        )  # fmt: skip
        return payload, positions, xored.astype(np.uint64)
    payload, positions, xored = _write(
        old_words, new_words, numba.carray(_pointer(old_at), count, np.uint8),
        numba.carray(_pointer(new_at), count, np.uint8), 8, MARK, nbytes,
    )  # fmt: skip
    return payload, positions, xored.astype(np.uint64)


@numba.njit(cache=True, nogil=True, inline="always")
def _frame_header(out, at, size):  # type: ignore[no-untyped-def]
    """zstd's frame header for ``size`` bytes of content (as zstd-1 writes it)."""
    out[at : at + 4] = np.array([0x28, 0xB5, 0x2F, 0xFD], np.uint8)
    if size < 256:
        code, width, stored = 0, 1, size
    elif size < 65536 + 256:
        code, width, stored = 1, 2, size - 256
    elif size < 0xFFFFFFFF:
        code, width, stored = 2, 4, size
    else:
        code, width, stored = 3, 8, size
    out[at + 4] = np.uint8((code << 6) | 0x20)  # single segment, no checksum, no dictionary
    for i in range(width):
        out[at + 5 + i] = np.uint8((stored >> (8 * i)) & 0xFF)
    return at + 5 + width


@numba.njit(cache=True, nogil=True)
def _framed(payload, tag):  # type: ignore[no-untyped-def]
    """``payload`` (after the byte ``tag`` when it is ≥ 0) in a zstd frame of raw blocks."""
    size = payload.size + (1 if tag >= 0 else 0)
    blocks = max(1, (size + BLOCK - 1) // BLOCK)
    out = np.empty(HEADER + 3 * blocks + size, np.uint8)
    at = _frame_header(out, 0, size)
    done = 0
    for b in range(blocks):
        length = min(BLOCK, size - done)
        last = 1 if b == blocks - 1 else 0
        word = last | (length << 3)  # block type 0: raw
        out[at], out[at + 1], out[at + 2] = word & 0xFF, (word >> 8) & 0xFF, word >> 16
        at += 3
        start, end = done, done + length
        if start == 0 and tag >= 0:
            out[at] = tag
            at += 1
            start = 1
        shift = 1 if tag >= 0 else 0
        out[at : at + end - start] = payload[start - shift : end - shift]
        at += end - start
        done += length
    return out[:at]


@numba.njit(cache=True, nogil=True)
def _changed_bytes(xored):  # type: ignore[no-untyped-def]
    changed = 0
    for value in xored:
        while value:
            changed += (value & U64(0xFF)) != U64(0)
            value >>= U64(8)
    return changed


@numba.njit(cache=True, nogil=True)
def _compressible(payload):  # type: ignore[no-untyped-def]
    """True when zstd might store ``payload`` in fewer bytes than it has: its byte entropy plus
    half a byte per distinct byte value (about what a Huffman table costs) is under 103 % of
    it. Calibrated on sparse-v2 payloads: ±1-ulp steps come out at 117-120 % (zstd stores them
    raw), skewed steps zstd shrinks by 3-9 % at 96-100 %."""
    counts = np.zeros(256, np.int64)
    for byte in payload:
        counts[byte] += 1
    bits = 0.0
    distinct = 0
    for count in counts:
        if count:
            bits += count * np.log2(payload.size / count)
            distinct += 1
    return bits / 8 + distinct / 2 < 1.03 * payload.size


@numba.njit(cache=True, nogil=True)
def _encode_batch(old_at, new_at, nbytes, sizes, tag, dense_ratio):  # type: ignore[no-untyped-def]
    """Every tensor of the batch: see :func:`encode_batch` (returns its arrays)."""
    # long because the two passes (encode each, then pack the batch's buffers) share the
    # per-tensor lists; apart they would pass five lists between two kernels.
    n = nbytes.size
    frames = numba.typed.List()
    positions = numba.typed.List()
    values = numba.typed.List()
    changed = np.zeros(n, np.int64)
    kinds = np.zeros(n, np.int8)
    for i in range(n):
        payload, where, xored = _one(old_at[i], new_at[i], nbytes[i], sizes[i])
        changed[i] = _changed_bytes(xored)
        if not changed[i]:
            frames.append(np.empty(0, np.uint8))
        elif dense_ratio and payload.size * dense_ratio > nbytes[i]:
            kinds[i] = DENSE
            frames.append(np.empty(0, np.uint8))
        elif _compressible(payload):
            kinds[i] = CONTENT
            content = np.empty(payload.size + (1 if tag >= 0 else 0), np.uint8)
            content[content.size - payload.size :] = payload
            if tag >= 0:
                content[0] = tag
            frames.append(content)
        else:
            frames.append(_framed(payload, tag))
        positions.append(where)
        values.append(xored)
    frame_at = np.zeros(n + 1, np.int64)
    change_at = np.zeros(n + 1, np.int64)
    value_at = np.zeros(n + 1, np.int64)
    for i in range(n):
        frame_at[i + 1] = frame_at[i] + frames[i].size
        change_at[i + 1] = change_at[i] + positions[i].size
        # Each tensor's values start 8-byte aligned, so the caller views them in their dtype.
        value_at[i + 1] = value_at[i] + (positions[i].size * sizes[i] + 7) // 8 * 8
    frame_bytes = np.empty(frame_at[n], np.uint8)
    all_positions = np.empty(change_at[n], np.int64)
    value_bytes = np.empty(value_at[n], np.uint8)
    for i in range(n):
        frame_bytes[frame_at[i] : frame_at[i + 1]] = frames[i]
        all_positions[change_at[i] : change_at[i + 1]] = positions[i]
        at = value_at[i]
        for value in values[i]:  # little-endian, ``sizes[i]`` bytes each
            for byte in range(sizes[i]):
                value_bytes[at] = np.uint8((value >> U64(8 * byte)) & U64(0xFF))
                at += 1
    return frame_bytes, frame_at, changed, kinds, all_positions, change_at, value_bytes, value_at


def encode_batch(
    old_at: np.ndarray,
    new_at: np.ndarray,
    nbytes: np.ndarray,
    sizes: np.ndarray,
    *,
    tag: int,
    dense_ratio: int,
) -> tuple[np.ndarray, ...]:
    """sparse-v2 payloads of a batch, each in its zstd frame, in one call without the GIL.

    Inputs are int64 arrays, one entry a tensor: the addresses of its old and new bytes (the
    caller keeps both alive), its size in bytes and its element size (1, 2, 4 or 8, dividing
    the size). ``tag`` ≥ 0 goes before each payload (``auto``'s tag byte).

    Returns (bytes, their offsets [n+1], changed bytes [n], kinds [n], positions of every
    change, their offsets [n+1], XOR values (little-endian, element-sized), their byte offsets
    [n+1], each tensor's 8-byte aligned). A changed tensor's bytes are its
    zstd frame (kind :data:`FRAMED`), or its payload where zstd might shrink it (:data:`CONTENT`:
    the caller compresses it), or nothing where the payload is over ``1/dense_ratio`` of the
    tensor (:data:`DENSE`: the caller compares the other encodings; 0 never marks one).
    """
    result: tuple[np.ndarray, ...] = _encode_batch(
        old_at, new_at, nbytes, sizes, np.int64(tag), np.int64(dense_ratio)
    )
    return result

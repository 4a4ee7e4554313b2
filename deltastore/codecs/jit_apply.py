"""numba kernels applying a batch of ``sparse-v2`` (or ``auto``) payloads in one call.

Imported only by :mod:`deltastore.codecs.jit`. A pull applies thousands of small tensors; one
compiled call per tensor still leaves a handful of Python calls around each, and every call
that releases the GIL has to take it back from the other apply threads. Here one call (that
releases the GIL once) applies a whole batch: per payload, the header and every stream are
read and checked first (the checks of :meth:`~deltastore.codecs.sparse2.CompactSparseEncoding.
decode`), into two buffers of positions and steps allocated once per batch, and only a payload
that passes is applied straight into the target. (Reading the streams a second time while
writing the target, with no buffers, measured twice as slow: the compiler cannot keep the
payload's bytes in registers across stores into another uint8 array.) The first payload that
does not fit stops the batch with its index; the caller words the error (by running the numpy
path on a copy) so both paths refuse with the same message. Elements are read and written byte
by byte, little-endian, so a target at any offset of a file works. Fields are read through a
64-bit window per field, not bit by bit.
"""

from __future__ import annotations

import numba
import numpy as np

from deltastore.codecs.jit_kernels import (
    _bit_length,
    _next_position,
    _ones_to_the_end,
    _read_varint,
)
from deltastore.codecs.steps import MARK, TAG_COMPACT, TAG_XOR

U64 = np.uint64
APPLIED = 0
"""Every payload from ``first`` on was applied."""
REFUSED = 1
"""The payload at the returned index does not fit its tensor (nothing of that tensor written)."""


@numba.njit(cache=True, nogil=True)
def _header(raw, nbytes):  # type: ignore[no-untyped-def]
    """(ok, itemsize, count, k, width, offset of the remainders), as ``sparse2``'s checks."""
    if raw.size == 0 or (raw[0] & 0xFC) != MARK:
        return False, 1, 0, 0, 0, 0
    itemsize = 1 << (raw[0] & 3)
    declared, at, ok = _read_varint(raw, 1)
    if not ok:
        return False, 1, 0, 0, 0, 0
    counted, at, ok = _read_varint(raw, at)
    if not ok or declared != U64(nbytes):
        return False, 1, 0, 0, 0, 0
    if nbytes % itemsize or counted > U64(nbytes // itemsize):
        return False, 1, 0, 0, 0, 0
    count = np.int64(counted)
    if count == 0:
        return at == raw.size, itemsize, 0, 0, 0, at
    if at + 2 > raw.size:
        return False, 1, 0, 0, 0, 0
    k = np.int64(raw[at])
    width = np.int64(raw[at + 1])
    nelements = nbytes // itemsize
    if k > min(63, _bit_length(U64(nelements)) + 1) or width > itemsize * 8:
        return False, 1, 0, 0, 0, 0
    at += 2
    if at + (count * k + 7) // 8 + (count * width + 7) // 8 > raw.size:
        return False, 1, 0, 0, 0, 0
    return True, itemsize, count, k, width, at


@numba.njit(cache=True, nogil=True, inline="always")
def _window(raw, bit):  # type: ignore[no-untyped-def]
    """The bits from bit offset ``bit`` on, MSB first, in a u64 whose first 57 are valid (zeros
    past the buffer's end): one load per byte instead of a loop per field."""
    at = bit >> 3
    window = U64(0)
    if at + 8 <= raw.size:
        for i in range(8):
            window = (window << U64(8)) | U64(raw[at + i])
    else:
        for i in range(8):
            window <<= U64(8)
            if at + i < raw.size:
                window |= U64(raw[at + i])
    return window << U64(bit & 7)


@numba.njit(cache=True, nogil=True, inline="always")
def _get(raw, bit, width):  # type: ignore[no-untyped-def]
    """(the ``width``-bit field (≤ 64) at bit offset ``bit``, MSB first; the offset after it),
    as ``jit_kernels._get`` (the caller has checked the field lies inside ``raw``)."""
    if width == 0:
        return U64(0), bit
    if width <= 56:
        return _window(raw, bit) >> U64(64 - width), bit + width
    high = _window(raw, bit) >> U64(96 - width)  # the first width - 32 bits
    low = _window(raw, bit + width - 32) >> U64(32)
    return (high << U64(32)) | low, bit + width


@numba.njit(cache=True, nogil=True, inline="always")
def _quotient(raw, bit, end):  # type: ignore[no-untyped-def]
    """(one bits from ``bit`` up to the next zero, the offset after that zero, ok): not ok when
    the stream (``end`` bits) ends first."""
    quotient = 0
    while True:
        valid = min(57, end - bit)
        if valid <= 0:
            return quotient, bit, False
        window = _window(raw, bit)
        ones = 0
        while ones < valid and (window >> U64(63 - ones)) & U64(1):
            ones += 1
        if ones < valid:
            return quotient + ones, bit + ones + 1, True
        quotient += ones
        bit += ones


@numba.njit(cache=True, nogil=True, inline="always")
def _step(current, field, mask):  # type: ignore[no-untyped-def]
    """The other side of the pair ``field`` codes, from ``current`` (``_apply_steps``)."""
    magnitude = (field >> U64(1)) + U64(1)
    lowest = magnitude & (~magnitude + U64(1))
    if ((current & lowest) != 0) == ((field & U64(1)) != 0):
        return (current + magnitude) & mask
    return (current - magnitude) & mask


@numba.njit(cache=True, nogil=True)
def _decode_into(  # type: ignore[no-untyped-def]
    raw, at, count, k, width, itemsize, nelements, positions, fields
):
    """Read the streams into ``positions[:count]`` and ``fields[:count]``; False when the
    patches are not ascending below ``count`` or the gaps do not give ascending positions
    inside ``nelements`` with fewer than 8 padding bits, all ones (``jit_kernels._decode``)."""
    field_bit = (at + (count * k + 7) // 8) * 8
    for j in range(count):
        fields[j], field_bit = _get(raw, field_bit, width)
    declared, patch_at, ok = _read_varint(raw, (field_bit + 7) // 8)
    bits = itemsize * 8
    if not ok or declared > U64(count) or (width == bits and declared):
        return False
    patches = np.int64(declared)
    index_width = _bit_length(U64(count - 1))
    if patch_at + (patches * (index_width + bits - width) + 7) // 8 > raw.size:
        return False
    bit = patch_at * 8
    previous = np.int64(-1)
    for _ in range(patches):
        index, bit = _get(raw, bit, index_width)
        high, bit = _get(raw, bit, bits - width)
        if np.int64(index) <= previous or index >= U64(count):
            return False
        previous = np.int64(index)
        fields[previous] |= high << U64(width)
    end = raw.size * 8
    bit = (bit + 7) // 8 * 8
    low_bit = at * 8
    position = -1
    for j in range(count):
        low, low_bit = _get(raw, low_bit, k)
        quotient, bit, ok = _quotient(raw, bit, end)
        if not ok:
            return False
        position, ok = _next_position(position, quotient, low, k, nelements)
        if not ok:
            return False
        positions[j] = position
    return _ones_to_the_end(raw, bit, end)


@numba.njit(cache=True, nogil=True)
def _apply_steps(target, start, itemsize, positions, fields, count):  # type: ignore[no-untyped-def]
    """Move each element ``positions[j]`` of the tensor at byte ``start`` by its step."""
    mask = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - itemsize * 8)
    for j in range(count):
        byte = start + positions[j] * itemsize
        current = U64(0)
        for b in range(itemsize):
            current |= U64(target[byte + b]) << U64(8 * b)
        moved = _step(current, fields[j], mask)
        for b in range(itemsize):
            target[byte + b] = np.uint8((moved >> U64(8 * b)) & U64(0xFF))


@numba.njit(cache=True, nogil=True)
def _apply_batch(target, starts, sizes, data, offsets, first, tagged):  # type: ignore[no-untyped-def]
    """(index, status) after applying payloads ``first``.. in order (see the module's notes)."""
    positions = np.empty(0, np.int64)
    fields = np.empty(0, np.uint64)
    for i in range(first, starts.size):
        raw = data[offsets[i] : offsets[i + 1]]
        if tagged:
            if raw.size == 0:
                return i, REFUSED
            tag = raw[0]
            raw = raw[1:]
            if tag == TAG_XOR:
                if raw.size != sizes[i]:
                    return i, REFUSED
                start = starts[i]
                for b in range(raw.size):
                    target[start + b] ^= raw[b]
                continue
            if tag != TAG_COMPACT:
                return i, REFUSED
        ok, itemsize, count, k, width, at = _header(raw, sizes[i])
        if not ok:
            return i, REFUSED
        if count == 0:  # (the header check refused any bytes after it)
            continue
        if positions.size < count:  # buffers reused across the batch, grown as needed
            positions = np.empty(max(count, 2 * positions.size), np.int64)
            fields = np.empty(positions.size, np.uint64)
        nelements = sizes[i] // itemsize
        if not _decode_into(raw, at, count, k, width, itemsize, nelements, positions, fields):
            return i, REFUSED
        _apply_steps(target, starts[i], itemsize, positions, fields, count)
    return starts.size, APPLIED


def apply_batch(
    target: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    data: np.ndarray,
    offsets: np.ndarray,
    first: int,
    tagged: bool,
) -> tuple[int, int]:
    """(index, status): payloads ``data[offsets[i]:offsets[i+1]]`` from ``first`` on applied to
    ``target[starts[i]:starts[i]+sizes[i]]`` in order until one is refused (:data:`REFUSED`);
    (count, :data:`APPLIED`) when all were.
    ``tagged``: the payloads are ``auto``'s (a tag byte first)."""
    index, status = _apply_batch(target, starts, sizes, data, offsets, first, tagged)
    return int(index), int(status)

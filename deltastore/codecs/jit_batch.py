"""numba kernels applying a batch of ``sparse-v2`` (or ``auto``) payloads in one call.

Imported only by :mod:`deltastore.codecs.jit`. A pull applies thousands of small tensors; one
compiled call per tensor still leaves a handful of Python calls around each, and every call
that releases the GIL has to take it back from the other apply threads. Here one call (that
releases the GIL once) applies a whole batch: per payload, every field of the header and of
each stream is checked first (the same checks, in the same order, as
:meth:`~deltastore.codecs.sparse2.CompactSparseEncoding.decode`), and only a payload that
passes is applied, its steps read again from the streams and written straight into the
target (no arrays of positions or steps). The first payload that does not fit stops the batch
with its index; the caller words the error (by running the numpy path on a copy) so both paths
refuse with the same message. Elements are read and written byte by byte, little-endian, so a
target at any offset of a file works.
"""

from __future__ import annotations

import numba
import numpy as np

from deltastore.codecs.jit_kernels import _bit_length, _get, _leading_ones, _read_varint

U64 = np.uint64
MARK = 0x20
APPLIED = 0
"""Every payload from ``first`` on was applied."""
REFUSED = 1
"""The payload at the returned index does not fit its tensor (nothing of that tensor written)."""
ELSEWHERE = 2
"""The payload at the returned index is of an encoding these kernels do not apply (``auto``'s
``sparse-v1``): the caller applies it, then goes on from the next index."""
TAG_XOR = 0
TAG_SPARSE = 1
TAG_COMPACT = 2


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
def _quotient(raw, bit, end):  # type: ignore[no-untyped-def]
    """(one bits from ``bit`` up to the next zero, the offset after that zero, ok)."""
    quotient = 0
    while True:
        if bit >= end:
            return quotient, bit, False
        ones = _leading_ones(raw[bit >> 3], bit & 7)
        quotient += ones
        bit += ones
        if bit & 7 or ones == 0:  # stopped at a zero bit inside the byte
            if bit >= end:
                return quotient, bit, False
            return quotient, bit + 1, True


@numba.njit(cache=True, nogil=True)
def _streams(raw, at, count, k, width, itemsize, nelements):  # type: ignore[no-untyped-def]
    """(ok, offset of the patch stream, patches, offset of the unary stream): the patches are
    ascending below ``count``, and the gaps give ascending positions inside ``nelements`` with
    fewer than 8 padding bits, all ones (``jit_kernels._decode`` and ``_unary``'s checks)."""
    fields_at = at + (count * k + 7) // 8
    declared, patch_at, ok = _read_varint(raw, fields_at + (count * width + 7) // 8)
    bits = itemsize * 8
    if not ok or declared > U64(count) or (width == bits and declared):
        return False, 0, 0, 0
    patches = np.int64(declared)
    index_width = _bit_length(U64(count - 1))
    if patch_at + (patches * (index_width + bits - width) + 7) // 8 > raw.size:
        return False, 0, 0, 0
    bit = patch_at * 8
    previous = np.int64(-1)
    for _ in range(patches):
        index, bit = _get(raw, bit, index_width)
        _, bit = _get(raw, bit, bits - width)
        if np.int64(index) <= previous or index >= U64(count):
            return False, 0, 0, 0
        previous = np.int64(index)
    unary_at = (bit + 7) // 8
    end = raw.size * 8
    bit = unary_at * 8
    low_bit = at * 8
    position = -1
    for _ in range(count):
        low, low_bit = _get(raw, low_bit, k)
        quotient, bit, ok = _quotient(raw, bit, end)
        if not ok or quotient >> (63 - k) or quotient << k >= nelements:
            return False, 0, 0, 0
        gap = (quotient << k) | np.int64(low)
        if gap >= nelements - position - 1:
            return False, 0, 0, 0
        position += gap + 1
    if end - bit >= 8:
        return False, 0, 0, 0
    while bit < end:
        if not (raw[bit >> 3] >> (7 - (bit & 7))) & 1:
            return False, 0, 0, 0
        bit += 1
    return True, patch_at, patches, unary_at


@numba.njit(cache=True, nogil=True, inline="always")
def _step(current, field, mask):  # type: ignore[no-untyped-def]
    """The other side of the pair ``field`` codes, from ``current`` (``_apply_steps``)."""
    magnitude = (field >> U64(1)) + U64(1)
    lowest = magnitude & (~magnitude + U64(1))
    if ((current & lowest) != 0) == ((field & U64(1)) != 0):
        return (current + magnitude) & mask
    return (current - magnitude) & mask


@numba.njit(cache=True, nogil=True)
def _apply_checked(  # type: ignore[no-untyped-def]
    target, start, raw, at, count, k, width, itemsize, patch_at, patches, unary_at
):
    """Apply the steps of a payload :func:`_streams` accepted to the tensor at ``start``."""
    bits = itemsize * 8
    mask = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - bits)
    index_width = _bit_length(U64(count - 1))
    low_bit = at * 8
    field_bit = (at + (count * k + 7) // 8) * 8
    patch_bit = patch_at * 8
    next_patch = np.int64(count)  # the index of the next patched field (count: none left)
    high = U64(0)
    if patches:
        index, patch_bit = _get(raw, patch_bit, index_width)
        high, patch_bit = _get(raw, patch_bit, bits - width)
        next_patch = np.int64(index)
    left = patches
    bit = unary_at * 8
    end = raw.size * 8
    position = -1
    for j in range(count):
        low, low_bit = _get(raw, low_bit, k)
        field, field_bit = _get(raw, field_bit, width)
        if j == next_patch:
            field |= high << U64(width)
            left -= 1
            next_patch = np.int64(count)
            if left:
                index, patch_bit = _get(raw, patch_bit, index_width)
                high, patch_bit = _get(raw, patch_bit, bits - width)
                next_patch = np.int64(index)
        quotient, bit, _ = _quotient(raw, bit, end)
        position += ((quotient << k) | np.int64(low)) + 1
        byte = start + position * itemsize
        current = U64(0)
        for b in range(itemsize):
            current |= U64(target[byte + b]) << U64(8 * b)
        moved = _step(current, field, mask)
        for b in range(itemsize):
            target[byte + b] = np.uint8((moved >> U64(8 * b)) & U64(0xFF))


@numba.njit(cache=True, nogil=True)
def _apply_compact(target, start, nbytes, raw):  # type: ignore[no-untyped-def]
    """Check one sparse-v2 payload whole, then apply it; False (target untouched) if refused."""
    ok, itemsize, count, k, width, at = _header(raw, nbytes)
    if not ok:
        return False
    if count == 0:
        return True
    nelements = nbytes // itemsize
    ok, patch_at, patches, unary_at = _streams(raw, at, count, k, width, itemsize, nelements)
    if not ok:
        return False
    _apply_checked(target, start, raw, at, count, k, width, itemsize, patch_at, patches, unary_at)
    return True


@numba.njit(cache=True, nogil=True)
def _apply_batch(target, starts, sizes, data, offsets, first, tagged):  # type: ignore[no-untyped-def]
    """(index, status) after applying payloads ``first``.. in order (see the module's notes)."""
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
            if tag == TAG_SPARSE:
                return i, ELSEWHERE
            if tag != TAG_COMPACT:
                return i, REFUSED
        if not _apply_compact(target, starts[i], sizes[i], raw):
            return i, REFUSED
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
    ``target[starts[i]:starts[i]+sizes[i]]`` in order until one is refused (:data:`REFUSED`)
    or is not sparse-v2 or xor (:data:`ELSEWHERE`); (count, :data:`APPLIED`) when all were.
    ``tagged``: the payloads are ``auto``'s (a tag byte first)."""
    index, status = _apply_batch(target, starts, sizes, data, offsets, first, tagged)
    return int(index), int(status)

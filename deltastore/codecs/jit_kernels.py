"""numba kernels of ``sparse-v2``: imported only by :mod:`deltastore.codecs.jit`.

One compiled call per tensor: it finds the changed elements (:mod:`deltastore.codecs.
jit_changes`), codes their steps, chooses ``k`` and ``w`` exactly as
the numpy path does (:mod:`deltastore.codecs.steps`, :func:`~deltastore.codecs.kernels.
rice_parameter`) and writes the payload. Both release the GIL, so pool threads encode in
parallel. Decoding reads every stream into arrays and checks it before the target is touched,
then applies the steps in one loop. Arithmetic is on uint64 throughout (numba turns mixed
signed and unsigned integers into floats).
"""

from __future__ import annotations

import numba
import numpy as np

from deltastore.codecs.base import ByteArray, XorChanges
from deltastore.codecs.jit_changes import _changes
from deltastore.codecs.kernels import ELEMENT_DTYPES, LOG2
from deltastore.codecs.steps import MARK

U64 = np.uint64


@numba.njit(cache=True, nogil=True, inline="always")
def _bit_length(value):  # type: ignore[no-untyped-def]
    length = 0
    while value:
        value >>= U64(1)
        length += 1
    return length


@numba.njit(cache=True, nogil=True, inline="always")
def _put(out, at, acc, held, value, width):  # type: ignore[no-untyped-def]
    """Append the low ``width`` (≤ 32) bits of ``value``, MSB first; whole bytes go out."""
    acc = (acc << U64(width)) | value
    held += width
    while held >= 8:
        held -= 8
        out[at] = np.uint8((acc >> U64(held)) & U64(0xFF))
        at += 1
    return at, acc, held


@numba.njit(cache=True, nogil=True, inline="always")
def _put_wide(out, at, acc, held, value, width):  # type: ignore[no-untyped-def]
    if width > 32:
        at, acc, held = _put(out, at, acc, held, value >> U64(32), width - 32)
        return _put(out, at, acc, held, value & U64(0xFFFFFFFF), 32)
    return _put(out, at, acc, held, value, width)


@numba.njit(cache=True, nogil=True, inline="always")
def _flush(out, at, acc, held, ones):  # type: ignore[no-untyped-def]
    """Pad the last partial byte with zeros (or ones) and write it."""
    if held:
        pad = U64((1 << (8 - held)) - 1) if ones else U64(0)
        at, acc, held = _put(out, at, acc, held, pad, 8 - held)
    return at


@numba.njit(cache=True, nogil=True, inline="always")
def _varint(out, at, value):  # type: ignore[no-untyped-def]
    while value >= 0x80:
        out[at] = np.uint8((value & 0x7F) | 0x80)
        value >>= 7
        at += 1
    out[at] = np.uint8(value)
    return at + 1


@numba.njit(cache=True, nogil=True)
def _rice_k(positions):  # type: ignore[no-untyped-def]
    count = positions.size
    total = positions[count - 1] + 1 - count
    low = max(_bit_length(U64(int(total / count * 0.6931))) - 1, 0)
    high = min(low + 1, 63)
    low_cost = count * low
    high_cost = count * high
    previous = -1
    for i in range(count):
        gap = positions[i] - previous - 1
        previous = positions[i]
        low_cost += gap >> low
        high_cost += gap >> high
    return low if low_cost <= high_cost else high


@numba.njit(cache=True, nogil=True)
def _width(fields, bits):  # type: ignore[no-untyped-def]
    """As :func:`deltastore.codecs.steps.field_width`."""
    histogram = np.zeros(65, np.int64)
    for f in fields:
        histogram[_bit_length(f)] += 1
    count = fields.size
    index_width = _bit_length(U64(count - 1))
    best, best_cost, narrower = 0, 0, 0
    for w in range(bits + 1):
        narrower += histogram[w]
        cost = count * w + (count - narrower) * (index_width + bits - w)
        if w == 0 or cost < best_cost:  # the narrowest wins a tie
            best, best_cost = w, cost
    return best


@numba.njit(cache=True, nogil=True)
def _write(old_words, new_words, old, new, bits, mark, nbytes):  # type: ignore[no-untyped-def]
    """The whole payload (see :mod:`deltastore.codecs.sparse2`), positions and XOR values."""
    positions, xored, fields = _changes(old_words, new_words, old, new, bits)
    count = positions.size
    head = np.empty(21, np.uint8)
    head[0] = mark
    head_size = _varint(head, _varint(head, 1, nbytes), count)
    if count == 0:
        return head[:head_size].copy(), positions, xored
    k = _rice_k(positions)
    width = _width(fields, bits)
    index_width = _bit_length(U64(count - 1))
    patches = 0
    for f in fields:
        patches += _bit_length(f) > width
    unary_bits = count
    previous = -1
    for i in range(count):
        unary_bits += (positions[i] - previous - 1) >> k
        previous = positions[i]
    size = head_size + 2 + (count * k + 7) // 8 + (count * width + 7) // 8 + 10
    size += (patches * (index_width + bits - width) + 7) // 8 + (unary_bits + 7) // 8
    out = np.empty(size, np.uint8)
    out[:head_size] = head[:head_size]
    out[head_size] = k
    out[head_size + 1] = width
    at, acc, held = head_size + 2, U64(0), 0
    remainder = U64((1 << k) - 1)
    previous = -1
    for i in range(count):
        gap = U64(positions[i] - previous - 1)
        previous = positions[i]
        at, acc, held = _put_wide(out, at, acc, held, gap & remainder, k)
    at = _flush(out, at, acc, held, False)
    held = 0
    low = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - width) if width else U64(0)
    for f in fields:
        at, acc, held = _put_wide(out, at, acc, held, f & low, width)
    at = _flush(out, at, acc, held, False)
    held = 0
    at = _varint(out, at, patches)
    if patches:
        for j in range(count):
            if _bit_length(fields[j]) > width:
                at, acc, held = _put_wide(out, at, acc, held, U64(j), index_width)
                at, acc, held = _put_wide(out, at, acc, held, fields[j] >> U64(width), bits - width)
        at = _flush(out, at, acc, held, False)
        held = 0
    previous = -1
    for i in range(count):
        quotient = (positions[i] - previous - 1) >> k
        previous = positions[i]
        while quotient >= 32:
            at, acc, held = _put(out, at, acc, held, U64(0xFFFFFFFF), 32)
            quotient -= 32
        at, acc, held = _put(out, at, acc, held, U64(((1 << quotient) - 1) << 1), quotient + 1)
    at = _flush(out, at, acc, held, True)
    return out[:at], positions, xored


@numba.njit(cache=True, nogil=True, inline="always")
def _get(raw, bit, width):  # type: ignore[no-untyped-def]
    """(the ``width``-bit field at bit offset ``bit``, MSB first; the offset after it)."""
    value = U64(0)
    while width > 0:
        room = 8 - (bit & 7)
        take = min(room, width)
        part = (U64(raw[bit >> 3]) >> U64(room - take)) & U64((1 << take) - 1)
        value = (value << U64(take)) | part
        bit += take
        width -= take
    return value, bit


@numba.njit(cache=True, nogil=True, inline="always")
def _leading_ones(byte, skip):  # type: ignore[no-untyped-def]
    """One bits at the top of ``byte`` after its first ``skip`` bits, up to the first zero."""
    ones = 0
    for shift in range(7 - skip, -1, -1):
        if not (byte >> shift) & 1:
            break
        ones += 1
    return ones


@numba.njit(cache=True, nogil=True, inline="always")
def _next_position(previous, quotient, low, k, nelements):  # type: ignore[no-untyped-def]
    """(the position a gap of ``quotient`` << k | ``low`` leads to after ``previous``, ok): not
    ok when the gap overflows 63 bits or the position is not below ``nelements``."""
    if quotient >> (63 - k) or quotient << k >= nelements:
        return previous, False
    gap = (quotient << k) | np.int64(low)
    if gap >= nelements - previous - 1:
        return previous, False
    return previous + gap + 1, True


@numba.njit(cache=True, nogil=True, inline="always")
def _ones_to_the_end(raw, bit, end):  # type: ignore[no-untyped-def]
    """True when the bits from ``bit`` to ``end`` are fewer than 8 and all ones (the padding
    after a unary stream)."""
    if end - bit >= 8:
        return False
    while bit < end:
        if not (raw[bit >> 3] >> (7 - (bit & 7))) & 1:
            return False
        bit += 1
    return True


@numba.njit(cache=True, nogil=True)
def _unary(raw, bit, count, k, low, positions, nelements):  # type: ignore[no-untyped-def]
    """Positions from the unary stream at ``bit`` and the remainders in ``low``; False when the
    stream is not exactly ``count`` codes and < 8 one bits, or a position is out of order."""
    end = raw.size * 8
    previous = -1
    for j in range(count):
        quotient = 0
        while True:
            if bit >= end:
                return False
            ones = _leading_ones(raw[bit >> 3], bit & 7)
            quotient += ones
            bit += ones
            if bit & 7 or ones == 0:  # stopped at a zero bit inside the byte
                if bit >= end:
                    return False
                bit += 1
                break
        previous, ok = _next_position(previous, quotient, low[j], k, nelements)
        if not ok:
            return False
        positions[j] = previous
    return _ones_to_the_end(raw, bit, end)


@numba.njit(cache=True, nogil=True, inline="always")
def _read_varint(raw, at):  # type: ignore[no-untyped-def]
    """(value, offset after it, ok) of the LEB128 at ``at``, as ``steps.read_varint``: not ok
    when truncated or over 64 bits."""
    value = U64(0)
    shift = 0
    while at < raw.size and shift < 64:
        byte = U64(raw[at])
        if shift == 63 and (byte & U64(0x7F)) > U64(1):
            return value, at, False
        value |= (byte & U64(0x7F)) << U64(shift)
        at += 1
        if not byte & U64(0x80):
            return value, at, True
        shift += 7
    return value, at, False


@numba.njit(cache=True, nogil=True)
def _decode(raw, at, count, k, width, itemsize, nelements):  # type: ignore[no-untyped-def]
    """(status, positions, fields): status 0 when valid, 1 when the patches are truncated or
    out of order, 2 when the positions are not a valid ascending set inside the tensor."""
    positions = np.empty(count, np.int64)
    fields = np.empty(count, np.uint64)
    bit = at * 8
    for j in range(count):
        fields[j], bit = _get(raw, bit, k)  # the gaps' remainders, for now
    bit = (bit + 7) // 8 * 8
    steps = np.empty(count, np.uint64)
    for j in range(count):
        steps[j], bit = _get(raw, bit, width)
    at = (bit + 7) // 8
    declared, at, ok = _read_varint(raw, at)
    bits = itemsize * 8
    if not ok or declared > U64(count) or (width == bits and declared):
        return 1, positions, steps
    patches = np.int64(declared)
    index_width = _bit_length(U64(count - 1))
    if at + (patches * (index_width + bits - width) + 7) // 8 > raw.size:
        return 1, positions, steps
    bit = at * 8
    previous = np.int64(-1)
    for _ in range(patches):
        index, bit = _get(raw, bit, index_width)
        high, bit = _get(raw, bit, bits - width)
        if np.int64(index) <= previous or index >= U64(count):
            return 1, positions, steps
        previous = np.int64(index)
        steps[previous] |= high << U64(width)
    at = (bit + 7) // 8
    if not _unary(raw, at * 8, count, k, fields, positions, nelements):
        return 2, positions, steps
    return 0, positions, steps


@numba.njit(cache=True, nogil=True)
def _apply_steps(elements, positions, steps, bits):  # type: ignore[no-untyped-def]
    mask = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - bits)
    for j in range(positions.size):
        current = U64(elements[positions[j]])
        magnitude = (steps[j] >> U64(1)) + U64(1)
        lowest = magnitude & (~magnitude + U64(1))
        if ((current & lowest) != 0) == ((steps[j] & U64(1)) != 0):
            elements[positions[j]] = (current + magnitude) & mask
        else:
            elements[positions[j]] = (current - magnitude) & mask


@numba.njit(cache=True, nogil=True)
def _xor_at(elements, positions, values):  # type: ignore[no-untyped-def]
    for j in range(positions.size):
        if positions[j] < 0 or positions[j] >= elements.size:
            return False
    for j in range(positions.size):
        elements[positions[j]] ^= values[j]
    return True


def xor_at(elements: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    """``elements[positions] ^= values`` in one pass without the GIL: numpy's fancy-index
    update gathers, then scatters, with a cache miss each time on a large cold tensor (the
    publisher's snapshot advance of a 522 MB step, 1.1 million changes: 33-46 ms in numpy,
    11-23 ms here, two threads). Raises IndexError for a position outside ``elements``."""
    if not _xor_at(elements, positions, values):
        raise IndexError(f"a position is outside the {elements.size} elements")


def decode(
    raw: ByteArray, at: int, count: int, k: int, width: int, itemsize: int, nelements: int
) -> tuple[int, np.ndarray, np.ndarray]:
    """(status, positions, step fields as uint64) of the streams from byte ``at`` on (the
    header is the caller's to check); status 0 when they are valid, 1 when the patches are
    truncated or out of order, 2 when the positions are not ascending inside ``nelements``."""
    status, positions, steps = _decode(raw, at, count, k, width, itemsize, nelements)
    return int(status), positions, steps


def apply_steps(elements: np.ndarray, positions: np.ndarray, steps: np.ndarray) -> None:
    """Move ``elements[positions]`` (either side of each pair) to the other side, in place."""
    _apply_steps(elements, positions, steps, elements.dtype.itemsize * 8)


def encode(old: ByteArray, new: ByteArray, itemsize: int) -> tuple[memoryview | bytes, XorChanges]:
    """The sparse-v2 payload turning ``old`` into ``new`` (byte for byte what the numpy path
    writes) and the changes as positions and XOR values."""
    dtype = ELEMENT_DTYPES[itemsize]
    whole = old.size // 8 * 8
    out, positions, xored = _write(
        old[:whole].view(np.uint64),
        new[:whole].view(np.uint64),
        old.view(dtype),
        new.view(dtype),
        itemsize * 8,
        MARK | LOG2[itemsize],
        old.size,
    )
    return memoryview(out), XorChanges(positions, xored)

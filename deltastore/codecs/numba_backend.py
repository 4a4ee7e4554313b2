"""The numba backend of ``sparse-v2`` (the ``fast`` extra; the format is
:mod:`~deltastore.codecs.sparse_format`): every compiled kernel, in one module, so numba's
on-disk cache (keyed on a kernel's own file) never runs a kernel compiled against an older
version of one it calls. Imported only by :func:`deltastore.codecs.sparse.compiled_backend`.

One writer (a single tensor is a batch of one) and one decoder, each a batch in one call
without the GIL. Elements are read and written byte by byte, little-endian, so a tensor at any
offset of a file works; arithmetic is on uint64 (numba turns mixed signed and unsigned integers
into floats).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from deltastore.codecs.base import ByteArray, FramedDelta, XorChanges
from deltastore.codecs.compression import compress
from deltastore.codecs.sparse_format import (
    ELEMENT_DTYPES,
    LOG2,
    MARK,
    TAG_COMPACT,
    TAG_XOR,
    element_size,
)

U64 = np.uint64
BLOCK = 128 * 1024
"""Largest zstd block (bytes of content)."""
CONTENT = 1
"""Kind of a tensor whose bytes are its (tagged) payload, for the caller to compress (kind 0:
its whole zstd frame)."""
DENSE = 2
"""Kind of a tensor whose payload is over the dense ratio: nothing is written."""
HEADER = 4 + 1 + 8
"""Most bytes of a frame before its first block: magic, descriptor, content size."""


# ------------------------------------------------------------------ finding changes
@numba.njit(cache=True, nogil=True, inline="always")
def _record(out, j, i, a, b, bits):  # type: ignore[no-untyped-def]
    """Store element ``i`` (old ``a``, new ``b``, ``bits`` wide) as change ``j`` of ``out``
    (positions, XOR values, step fields)."""
    positions, xored, fields = out
    positions[j] = i
    xored[j] = a ^ b
    a64 = U64(a)
    b64 = U64(b)
    mask = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - bits)
    diff = (b64 - a64) & mask
    if diff > U64(1) << U64(bits - 1):
        magnitude = (a64 - b64) & mask
        low = b64
    else:
        magnitude = diff
        low = a64
    lowest = magnitude & (~magnitude + U64(1))
    flag = U64(1) if low & lowest else U64(0)
    fields[j] = ((magnitude - U64(1)) << U64(1)) | flag


def _trailing_zeros_of(typingctx, value):  # type: ignore[no-untyped-def]
    """Zero bits below the lowest one bit of ``value`` (one instruction: LLVM's cttz)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return value(value), codegen


def _pointer_of(typingctx, address):  # type: ignore[no-untyped-def]
    """The integer ``address`` as a ``void*`` (what :func:`numba.carray` takes)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(types.int64), codegen


# Called in kernels as ``_pointer(address)``: numba passes the typing context itself.
_trailing_zeros: Any = intrinsic(_trailing_zeros_of)
_pointer: Any = intrinsic(_pointer_of)


WORDS_PER_BLOCK = 32
"""8-byte words summarised by one bit mask (a uint32) of those that differ."""
BLOCKS_PER_CHUNK = 128
"""Blocks compared before their changes are recorded: 32 KB of each tensor, still in cache."""


@numba.njit(cache=True, nogil=True, inline="always")
def _lanes(x, bits):  # type: ignore[no-untyped-def]
    """The lowest bit of each ``bits``-wide lane of ``x`` that is not zero, the others clear.
    Folding right by 1, 2, 4, ... (``bits`` - 1 in all) never carries into a lower lane."""
    x |= x >> U64(1)
    x |= x >> U64(2)
    x |= x >> U64(4)
    if bits >= 16:
        x |= x >> U64(8)
    if bits >= 32:
        x |= x >> U64(16)
    if bits >= 64:
        x |= x >> U64(32)
    if bits == 8:
        return x & U64(0x0101010101010101)
    if bits == 16:
        return x & U64(0x0001000100010001)
    if bits == 32:
        return x & U64(0x0000000100000001)
    return x & U64(1)


@numba.njit(cache=True, nogil=True)
def _block_masks(old_words, new_words, first, last, masks):  # type: ignore[no-untyped-def]
    """Fill ``masks`` with the differing-word masks of blocks ``first``..``last``; returns how
    many words differ. The fixed-size compare loop compiles to vector instructions."""
    one = np.uint32(1)
    for block in range(first, last):
        base = block * WORDS_PER_BLOCK
        # An OR of the XORs first: a reduction that compiles to wide vector instructions, so
        # a block with no change (most of them in a sparse step) costs a memory read.
        differs = U64(0)
        for k in range(WORDS_PER_BLOCK):
            differs |= old_words[base + k] ^ new_words[base + k]
        mask = np.uint32(0)
        if differs:
            for k in range(WORDS_PER_BLOCK):
                mask |= np.uint32(old_words[base + k] != new_words[base + k]) << np.uint32(k)
        masks[block - first] = mask
    differing = 0
    for block in range(last - first):
        mask = masks[block]
        while mask:
            differing += 1
            mask &= mask - one
    return differing


@numba.njit(cache=True, nogil=True)
def _record_blocks(old_words, new_words, old, new, bits, masks, first, last, out, j):  # type: ignore[no-untyped-def]
    """Record every changed element of blocks ``first``..``last`` from ``j`` on in ``out``
    (positions, XOR values, step fields); returns the next free index. Set bits are visited
    with cttz, so an unchanged word or element costs no (mispredicted) branch."""
    per_word = 64 // bits
    for block in range(first, last):
        words = masks[block - first]
        while words:
            w = block * WORDS_PER_BLOCK + _trailing_zeros(words)
            words &= words - np.uint32(1)
            lanes = _lanes(old_words[w] ^ new_words[w], bits)
            while lanes:
                i = w * per_word + _trailing_zeros(lanes) // bits
                lanes &= lanes - U64(1)
                _record(out, j, i, old[i], new[i], bits)
                j += 1
    return j


@numba.njit(cache=True, nogil=True)
def _grown(out, used, capacity):  # type: ignore[no-untyped-def]
    """``out``'s three arrays with room for ``capacity`` changes, the first ``used`` kept."""
    positions, xored, fields = out
    wider = (
        np.empty(capacity, np.int64),
        np.empty(capacity, xored.dtype),
        np.empty(capacity, np.uint64),
    )
    wider[0][:used] = positions[:used]
    wider[1][:used] = xored[:used]
    wider[2][:used] = fields[:used]
    return wider


@numba.njit(cache=True, nogil=True)
def _changes(old_words, new_words, old, new, bits):  # type: ignore[no-untyped-def]
    """Positions, XOR values and step fields of the changed elements, in one pass over both
    tensors: each 32 KB chunk is compared as 8-byte words (masks of the differing ones), then
    its changes are recorded while it is still in cache (reading the tensors twice, count
    then record, missed the cache on every changed block)."""
    per_word = 64 // bits
    blocks = old_words.size // WORDS_PER_BLOCK
    capacity = max(256, old.size // 64)
    out = _grown(
        (np.empty(0, np.int64), np.empty(0, old.dtype), np.empty(0, np.uint64)), 0, capacity
    )
    masks = np.empty(BLOCKS_PER_CHUNK, np.uint32)
    j = 0
    for first in range(0, blocks, BLOCKS_PER_CHUNK):
        last = min(first + BLOCKS_PER_CHUNK, blocks)
        needed = j + _block_masks(old_words, new_words, first, last, masks) * per_word
        if needed > capacity:  # doubled, but never past one change per element left
            at_most = j + old.size - first * WORDS_PER_BLOCK * per_word
            capacity = min(max(2 * capacity, needed), at_most)
            out = _grown(out, j, capacity)
        j = _record_blocks(old_words, new_words, old, new, bits, masks, first, last, out, j)
    start = blocks * WORDS_PER_BLOCK * per_word  # the last elements, under a block
    if j + old.size - start > capacity:
        capacity = j + old.size - start
        out = _grown(out, j, capacity)
    for i in range(start, old.size):
        if old[i] != new[i]:
            _record(out, j, i, old[i], new[i], bits)
            j += 1
    positions, xored, fields = out
    return positions[:j], xored[:j], fields[:j]


# ------------------------------------------------------------------ writing a payload
@numba.njit(cache=True, nogil=True, inline="always")
def _bit_length(value):  # type: ignore[no-untyped-def]
    length = 0
    while value:
        value >>= U64(1)
        length += 1
    return length


@numba.njit(cache=True, nogil=True, inline="always")
def _put(out, at, acc, held, value, width):  # type: ignore[no-untyped-def]
    """Append the low ``width`` (≤ 64) bits of ``value``, MSB first; whole bytes go out. At
    most 32 bits go into the accumulator at a time, so it never overflows."""
    while True:
        piece = min(width, 32)
        width -= piece
        acc = (acc << U64(piece)) | ((value >> U64(width)) & (U64(0xFFFFFFFF) >> U64(32 - piece)))
        held += piece
        while held >= 8:
            held -= 8
            out[at] = np.uint8((acc >> U64(held)) & U64(0xFF))
            at += 1
        if width <= 0:
            return at, acc, held


@numba.njit(cache=True, nogil=True, inline="always")
def _flush(out, at, acc, held, ones):  # type: ignore[no-untyped-def]
    """Pad the last partial byte with zeros (or ones) and write it."""
    if not held:
        return at, acc, held
    pad = U64((1 << (8 - held)) - 1) if ones else U64(0)
    return _put(out, at, acc, held, pad, 8 - held)


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
    """As :func:`deltastore.codecs.numpy_backend.field_widths`, for one tensor."""
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
def _write(old_at, new_at, nbytes, element, bits, mark, tag):  # type: ignore[no-untyped-def]
    """(payload after the byte ``tag`` where it is ≥ 0, positions, XOR values as uint64) of the
    tensor at ``old_at`` / ``new_at`` read as ``element`` ints (a numpy integer type: one
    compiled copy per element size)."""
    positions, xored, fields = _changes(
        numba.carray(_pointer(old_at), nbytes // 8, np.uint64),
        numba.carray(_pointer(new_at), nbytes // 8, np.uint64),
        numba.carray(_pointer(old_at), nbytes // (bits // 8), element),
        numba.carray(_pointer(new_at), nbytes // (bits // 8), element),
        bits,
    )
    return _payload(positions, fields, nbytes, bits, mark, tag), positions, xored.astype(np.uint64)


@numba.njit(cache=True, nogil=True)
def _payload(positions, fields, nbytes, bits, mark, tag):  # type: ignore[no-untyped-def]
    """The payload (after the byte ``tag`` where it is ≥ 0) of a tensor's changed elements:
    ascending ``positions`` and their step ``fields``."""
    count = positions.size
    first = 1 if tag >= 0 else 0
    head = np.empty(22, np.uint8)
    head[0] = max(tag, 0)
    head[first] = mark
    head_size = _varint(head, _varint(head, first + 1, nbytes), count)
    if count == 0:
        return head[:head_size].copy()
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
    previous = -1
    for i in range(count):
        gap = U64(positions[i] - previous - 1)
        previous = positions[i]
        at, acc, held = _put(out, at, acc, held, gap, k)
    at, acc, held = _flush(out, at, acc, held, False)
    for f in fields:
        at, acc, held = _put(out, at, acc, held, f, width)
    at, acc, held = _flush(out, at, acc, held, False)
    at = _varint(out, at, patches)
    if patches:
        for j in range(count):
            if _bit_length(fields[j]) > width:
                at, acc, held = _put(out, at, acc, held, U64(j), index_width)
                at, acc, held = _put(out, at, acc, held, fields[j] >> U64(width), bits - width)
        at, acc, held = _flush(out, at, acc, held, False)
    previous = -1
    for i in range(count):
        quotient = (positions[i] - previous - 1) >> k
        previous = positions[i]
        while quotient >= 32:
            at, acc, held = _put(out, at, acc, held, U64(0xFFFFFFFF), 32)
            quotient -= 32
        at, acc, held = _put(out, at, acc, held, U64(((1 << quotient) - 1) << 1), quotient + 1)
    at, acc, held = _flush(out, at, acc, held, True)
    return out[:at]


@numba.njit(cache=True, nogil=True)
def _one(old_at, new_at, nbytes, size, tag):  # type: ignore[no-untyped-def]
    """:func:`_write` of one tensor of ``size``-byte elements: the one writer of a single tensor
    and of a batch's."""
    if size == 8:
        return _write(old_at, new_at, nbytes, np.uint64, 64, MARK | 3, tag)
    if size == 4:
        return _write(old_at, new_at, nbytes, np.uint32, 32, MARK | 2, tag)
    if size == 2:
        return _write(old_at, new_at, nbytes, np.uint16, 16, MARK | 1, tag)
    return _write(old_at, new_at, nbytes, np.uint8, 8, MARK, tag)


@numba.njit(cache=True, nogil=True, inline="always")
def _read_varint(raw, at):  # type: ignore[no-untyped-def]
    """(value, offset after it, ok) of the LEB128 at ``at``, as ``sparse_format.read_varint``:
    not ok when truncated or over 64 bits."""
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
def _xor_at(elements, positions, values):  # type: ignore[no-untyped-def]
    for j in range(positions.size):
        if positions[j] < 0 or positions[j] >= elements.size:
            return False
    for j in range(positions.size):
        elements[positions[j]] ^= values[j]
    return True


# ------------------------------------------------------------------ a batch
@numba.njit(cache=True, nogil=True)
def _framed(content):  # type: ignore[no-untyped-def]
    """``content`` in the zstd frame zstd-1 writes for it where it does not compress (single
    segment, content size, raw blocks, no checksum): a payload is near its entropy."""
    size = content.size
    blocks = max(1, (size + BLOCK - 1) // BLOCK)
    out = np.empty(HEADER + 3 * blocks + size, np.uint8)
    out[:4] = np.array([0x28, 0xB5, 0x2F, 0xFD], np.uint8)
    if size < 256:
        code, width, stored = 0, 1, size
    elif size < 65536 + 256:
        code, width, stored = 1, 2, size - 256
    elif size < 0xFFFFFFFF:
        code, width, stored = 2, 4, size
    else:
        code, width, stored = 3, 8, size
    out[4] = np.uint8((code << 6) | 0x20)  # single segment, no checksum, no dictionary
    for i in range(width):
        out[5 + i] = np.uint8((stored >> (8 * i)) & 0xFF)
    at = 5 + width
    for b in range(blocks):
        start = b * BLOCK
        length = min(BLOCK, size - start)
        word = (1 if b == blocks - 1 else 0) | (length << 3)  # block type 0: raw
        out[at], out[at + 1], out[at + 2] = word & 0xFF, (word >> 8) & 0xFF, word >> 16
        out[at + 3 : at + 3 + length] = content[start : start + length]
        at += 3 + length
    return out[:at]


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
    """Every tensor of the batch: the arrays :func:`encode_framed` reads."""
    # long because the two passes (encode each, then pack the batch's buffers) share the
    # per-tensor lists; apart they would pass five lists between two kernels.
    n = nbytes.size
    frames = numba.typed.List()
    positions = numba.typed.List()
    values = numba.typed.List()
    changed = np.zeros(n, np.int64)
    kinds = np.zeros(n, np.int8)
    for i in range(n):
        content, where, xored = _one(old_at[i], new_at[i], nbytes[i], sizes[i], tag)
        payload = content[1:] if tag >= 0 else content
        for value in xored:  # changed bytes
            while value:
                changed[i] += (value & U64(0xFF)) != U64(0)
                value >>= U64(8)
        if not changed[i]:
            frames.append(np.empty(0, np.uint8))
        elif dense_ratio and payload.size * dense_ratio > nbytes[i]:
            kinds[i] = DENSE
            frames.append(np.empty(0, np.uint8))
        elif _compressible(payload):
            kinds[i] = CONTENT
            frames.append(content)
        else:
            frames.append(_framed(content))
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


# ------------------------------------------------------------------ decoding and applying
@numba.njit(cache=True, nogil=True)
def _header(raw, nbytes):  # type: ignore[no-untyped-def]
    """(ok, itemsize, count, k, width, offset of the remainders): the checks of
    :func:`~deltastore.codecs.sparse_format.read_header`."""
    if raw.size == 0 or (raw[0] & 0xFC) != MARK:
        return False, 1, 0, 0, 0, 0
    itemsize = 1 << (raw[0] & 3)
    declared, at, ok = _read_varint(raw, 1)
    counted, at, ok_too = _read_varint(raw, at)  # (read from anywhere when the first is not ok)
    if not (ok and ok_too) or declared != U64(nbytes) or nbytes % itemsize:
        return False, 1, 0, 0, 0, 0
    if counted > U64(nbytes // itemsize):
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
    (the caller has checked the field lies inside ``raw``)."""
    if width == 0:
        return U64(0), bit
    if width <= 56:
        return _window(raw, bit) >> U64(64 - width), bit + width
    high = _window(raw, bit) >> U64(96 - width)  # the first width - 32 bits
    low = _window(raw, bit + width - 32) >> U64(32)
    return (high << U64(32)) | low, bit + width


@numba.njit(cache=True, nogil=True)
def _decode_into(  # type: ignore[no-untyped-def]
    raw, at, count, k, width, itemsize, nelements, positions, fields
):
    """Read the streams into ``positions[:count]`` and ``fields[:count]``; 1 (refused) when the
    patches are not ascending below ``count`` or the gaps do not give ascending positions
    inside ``nelements`` with fewer than 8 padding bits, all ones, else 0."""
    field_bit = (at + (count * k + 7) // 8) * 8
    for j in range(count):
        fields[j], field_bit = _get(raw, field_bit, width)
    declared, patch_at, ok = _read_varint(raw, (field_bit + 7) // 8)
    bits = itemsize * 8
    if not ok or declared > U64(count) or (width == bits and declared):
        return 1
    patches = np.int64(declared)
    index_width = _bit_length(U64(count - 1))
    if patch_at + (patches * (index_width + bits - width) + 7) // 8 > raw.size:
        return 1
    bit = patch_at * 8
    previous = np.int64(-1)
    for _ in range(patches):
        index, bit = _get(raw, bit, index_width)
        high, bit = _get(raw, bit, bits - width)
        if np.int64(index) <= previous or index >= U64(count):
            return 1
        previous = np.int64(index)
        fields[previous] |= high << U64(width)
    end = raw.size * 8
    bit = (bit + 7) // 8 * 8
    low_bit = at * 8
    position = -1
    for j in range(count):
        low, low_bit = _get(raw, low_bit, k)
        quotient = 0  # the one bits up to the next zero, a window's 57 valid bits at a time
        while True:
            valid = min(57, end - bit)
            if valid <= 0:  # the stream ends first
                return 1
            window = _window(raw, bit)
            ones = 0
            while ones < valid and (window >> U64(63 - ones)) & U64(1):
                ones += 1
            quotient += ones
            bit += ones
            if ones < valid:
                bit += 1  # the zero
                break
        # Refused: a gap over 63 bits, or one that leads past the last element.
        if quotient >> (63 - k) or quotient << k >= nelements:
            return 1
        gap = (quotient << k) | np.int64(low)
        if gap >= nelements - position - 1:
            return 1
        position += gap + 1
        positions[j] = position
    if end - bit >= 8:  # the unary stream's padding: fewer than 8 bits, all ones
        return 1
    for b in range(bit, end):
        if not (raw[b >> 3] >> (7 - (b & 7))) & 1:
            return 1
    return 0


@numba.njit(cache=True, nogil=True)
def _apply_steps(target, start, itemsize, positions, fields, count):  # type: ignore[no-untyped-def]
    """Move each element ``positions[j]`` of the tensor at byte ``start`` by its step."""
    for j in range(count):
        byte = start + positions[j] * itemsize
        current = U64(0)
        for b in range(itemsize):
            current |= U64(target[byte + b]) << U64(8 * b)
        magnitude = (fields[j] >> U64(1)) + U64(1)
        lowest = magnitude & (~magnitude + U64(1))
        if ((current & lowest) != 0) == ((fields[j] & U64(1)) != 0):
            current += magnitude  # wraps modulo 2**64: the element's own bytes are right
        else:
            current -= magnitude
        for b in range(itemsize):
            target[byte + b] = np.uint8((current >> U64(8 * b)) & U64(0xFF))


@numba.njit(cache=True, nogil=True)
def apply_batch(target, starts, sizes, data, offsets, tagged):  # type: ignore[no-untyped-def]
    """Apply payloads ``data[offsets[i] : offsets[i + 1]]`` to ``target[starts[i] : starts[i]
    + sizes[i]]`` in order (``tagged``: ``auto``'s, a tag byte first): (index, 1) of the first
    that does not fit, nothing of it written; (count, 0) when all were applied."""
    positions = np.empty(0, np.int64)
    fields = np.empty(0, np.uint64)
    for i in range(starts.size):
        raw = data[offsets[i] : offsets[i + 1]]
        if tagged:
            if raw.size == 0:
                return i, 1
            tag = raw[0]
            raw = raw[1:]
            if tag == TAG_XOR:
                if raw.size != sizes[i]:
                    return i, 1
                start = starts[i]
                for b in range(raw.size):
                    target[start + b] ^= raw[b]
                continue
            if tag != TAG_COMPACT:
                return i, 1
        ok, itemsize, count, k, width, at = _header(raw, sizes[i])
        if not ok:
            return i, 1
        if count == 0:  # (the header check refused any bytes after it)
            continue
        if positions.size < count:  # buffers reused across the batch, grown as needed
            positions = np.empty(max(count, 2 * positions.size), np.int64)
            fields = np.empty(positions.size, np.uint64)
        nelements = sizes[i] // itemsize
        if _decode_into(raw, at, count, k, width, itemsize, nelements, positions, fields):
            return i, 1
        _apply_steps(target, starts[i], itemsize, positions, fields, count)
    return starts.size, 0


# ------------------------------------------------------------------ the backend's interface
def encode(old: ByteArray, new: ByteArray, itemsize: int) -> tuple[memoryview, XorChanges]:
    """The payload turning ``old`` into ``new`` (``itemsize`` one ``element_size`` gives) and
    the changes: a batch's writer on one tensor (``old`` and ``new`` are held for the call)."""
    out, positions, xored = _one(old.ctypes.data, new.ctypes.data, old.size, itemsize, -1)
    return memoryview(out), XorChanges(positions, xored.astype(ELEMENT_DTYPES[itemsize]))


def encode_framed(
    olds: Sequence[ByteArray],
    news: Sequence[ByteArray],
    itemsizes: Sequence[int],
    tag: int,
    dense_ratio: int,
) -> list[FramedDelta | None]:
    """Each tensor's payload (after the byte ``tag`` where it is ≥ 0) in its zstd frame, in one
    call without the GIL; None for one whose payload is over ``1/dense_ratio`` of its tensor
    (0: never), to encode alone. Inputs are contiguous and of equal sizes."""
    old_at = np.array([old.ctypes.data for old in olds], dtype=np.int64)
    new_at = np.array([new.ctypes.data for new in news], dtype=np.int64)
    sizes = [element_size(old.size, s) for old, s in zip(olds, itemsizes, strict=True)]
    nbytes = np.array([old.size for old in olds], dtype=np.int64)
    out = _encode_batch(old_at, new_at, nbytes, np.array(sizes, np.int64), tag, dense_ratio)
    frame_bytes, frame_at, changed, kinds, positions, change_at, value_bytes, value_at = out
    frame_at, changed, kinds = frame_at.tolist(), changed.tolist(), kinds.tolist()
    change_at, value_at = change_at.tolist(), value_at.tolist()
    framed: list[FramedDelta | None] = []
    for i, size in enumerate(sizes):
        if not changed[i] or kinds[i] == DENSE:  # None: encoded again alone
            framed.append(FramedDelta(b"", 0) if not changed[i] else None)
            continue
        raw = frame_bytes[frame_at[i] : frame_at[i + 1]]
        frame = compress(raw) if kinds[i] == CONTENT else raw.tobytes()
        count = change_at[i + 1] - change_at[i]
        values = value_bytes[value_at[i] : value_at[i] + count * size].view(ELEMENT_DTYPES[size])
        changes = XorChanges(positions[change_at[i] : change_at[i + 1]], values)
        framed.append(FramedDelta(frame, changed[i], changes))
    return framed


def encode_changes(
    nbytes: int, positions: np.ndarray, fields: np.ndarray, itemsize: int
) -> memoryview:
    """The payload of a tensor of ``nbytes`` (``itemsize``-byte elements) whose changed
    elements are at ascending ``positions``, with step ``fields`` (uint64): the writer without
    the search for changes (they were found elsewhere)."""
    mark = MARK | LOG2[itemsize]
    return memoryview(_payload(positions, fields, nbytes, 8 * itemsize, mark, -1))


def xor_at(elements: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    """``elements[positions] ^= values`` in one pass without the GIL: numpy's fancy-index
    update gathers, then scatters, with a cache miss each time on a large cold tensor. Raises
    IndexError for a position outside ``elements``."""
    if not _xor_at(elements, positions, values):
        raise IndexError(f"a position is outside the {elements.size} elements")

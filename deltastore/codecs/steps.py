"""numpy kernels of ``sparse-v2``: symmetric step fields, their width, varints, bit streams.

A changed element holds ``old`` and ``new`` (unsigned ints of ``B = 8 * itemsize`` bits). Its
step is coded so that either side gives back the other (applying a payload twice reverts, like
``xor``)::

    d = (new - old) mod 2**B
    if d <= 2**(B-1): m = d,          lo = old     # the pair is {lo, lo + m}
    else:             m = 2**B - d,   lo = new
    field = (m - 1) << 1 | bit t of lo,   t = the lowest set bit of m

Adding ``m`` flips bit ``t``, so a reader holding ``x`` (either side) takes ``x + m`` when bit
``t`` of ``x`` equals the field's low bit and ``x - m`` otherwise. A ±1-ulp step (what an Adam
step does to most bf16 weights) is the field 0 or 1: one bit, where its XOR (1, 3, 7, ...)
carries about two.

Fields are packed ``w`` bits each; with ``w < B`` the all-ones field ``2**w - 1`` is an escape
whose field follows, whole, in the escape stream. ``w`` is the width with the fewest bits in
all (ties: the narrower), computed exactly from the bit lengths of ``field + 1``.
"""

from __future__ import annotations

import numpy as np

from deltastore.codecs.base import ByteArray
from deltastore.codecs.kernels import ELEMENT_DTYPES, _fields_to_bits


def step_fields(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """The step field of each changed element (``before != after``, same unsigned dtype)."""
    bits = before.dtype.itemsize * 8
    diff = after - before  # wraps modulo 2**B
    backwards = diff > before.dtype.type(1 << (bits - 1))
    magnitude = np.where(backwards, before - after, diff)
    low = np.where(backwards, after, before)
    lowest = magnitude & (~magnitude + before.dtype.type(1))
    flag = (low & lowest) != 0
    return ((magnitude - before.dtype.type(1)) << before.dtype.type(1)) | flag


def apply_steps(current: np.ndarray, fields: np.ndarray) -> np.ndarray:
    """The other side of each pair: ``current`` (either side) moved by its step ``fields``."""
    dtype = current.dtype.type
    magnitude = (fields >> dtype(1)) + dtype(1)
    lowest = magnitude & (~magnitude + dtype(1))
    at_low = ((current & lowest) != 0) == ((fields & dtype(1)) != 0)
    return np.where(at_low, current + magnitude, current - magnitude)


def bit_lengths_plus_one(fields: np.ndarray) -> np.ndarray:
    """``bit_length(field + 1)`` of each field, exact (65 where a 64-bit field is all ones)."""
    if fields.dtype.itemsize < 8:
        return np.frexp(fields.astype(np.float64) + 1.0)[1]
    plus = fields + np.uint64(1)
    high = plus >> np.uint64(32)
    lengths = np.where(
        high != 0,
        np.frexp(high.astype(np.float64))[1] + 32,
        np.frexp((plus & np.uint64(0xFFFFFFFF)).astype(np.float64))[1],
    )
    return np.where(plus == 0, 65, lengths)


def field_width(fields: np.ndarray, bits: int) -> int:
    """The field width ``w`` (0..bits) that codes ``fields`` in the fewest bits, escapes
    included (each costs ``w`` plus ``bits``); the narrowest on ties."""
    histogram = np.bincount(bit_lengths_plus_one(fields), minlength=66)
    # escapes(w) = fields whose field + 1 needs more than w bits
    escapes = fields.size - np.cumsum(histogram)[: bits + 1]
    costs = fields.size * np.arange(bits + 1) + escapes * bits
    costs[bits] = fields.size * bits  # at full width nothing escapes
    return int(np.argmin(costs))


def pack_fields(fields: np.ndarray, width: int, bits: int) -> tuple[ByteArray, ByteArray]:
    """(packed ``width``-bit fields, escape stream of whole little-endian fields)."""
    wide = fields.astype(np.uint64)
    if width < bits:
        escape = np.uint64((1 << width) - 1)
        escaped = wide >= escape
        packed = _fields_to_bits(np.where(escaped, escape, wide), width)
        return packed, fields[escaped].astype(fields.dtype.newbyteorder("<")).view(np.uint8)
    return _fields_to_bits(wide, width), np.zeros(0, dtype=np.uint8)


def unpack_fields(fields: np.ndarray, escapes: ByteArray, width: int, itemsize: int) -> np.ndarray:
    """Fields (uint64) from the unpacked ``width``-bit fields (updated in place) and the escape
    stream, which holds exactly one whole ``itemsize``-byte field per escape."""
    if width < itemsize * 8:
        escaped = np.flatnonzero(fields == np.uint64((1 << width) - 1))
        fields[escaped] = escapes.view(ELEMENT_DTYPES[itemsize])
    return fields


def varint(value: int) -> bytes:
    """LEB128: 7 bits a byte, least significant first, high bit set on all but the last."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(raw: ByteArray, offset: int) -> tuple[int, int] | None:
    """(value, offset after it) of the LEB128 at ``offset``; None if truncated or over 64 bits."""
    value = shift = 0
    while offset < raw.size and shift < 64:
        byte = int(raw[offset])
        value |= (byte & 0x7F) << shift
        offset += 1
        if not byte & 0x80:
            return (value, offset) if value < 1 << 64 else None
        shift += 7
    return None


def unary_stream(quotients: np.ndarray) -> ByteArray:
    """Per quotient ``q``: ``q`` one bits then a zero, MSB first, padded with ones to a byte."""
    ends = np.cumsum(quotients.view(np.int64) + 1) - 1
    total = (int(ends[-1]) + 8) // 8 * 8
    bits = np.ones(total, dtype=np.uint8)
    bits[ends] = 0
    return np.packbits(bits)


def read_unary(stream: ByteArray, count: int) -> np.ndarray | None:
    """Quotients (int64) of :func:`unary_stream`; None unless it holds exactly ``count`` codes
    and fewer than 8 padding bits, all ones."""
    ends = np.flatnonzero(np.unpackbits(stream) == 0)
    if ends.size != count or stream.size * 8 - int(ends[-1]) - 1 >= 8:
        return None
    return np.diff(ends, prepend=np.int64(-1)) - 1

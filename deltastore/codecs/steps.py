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

Fields are packed ``w`` bits each (their low bits); a field wider than ``w`` is patched: its
index among the fields and its high ``B - w`` bits follow in a patch stream. ``w`` is the width
with the fewest bits in all (ties: the narrower), computed exactly from the fields' bit lengths,
so a step of ±1 ulp costs one bit and a rare wide step costs its index and high bits.
"""

from __future__ import annotations

import numpy as np

from deltastore.codecs.base import ByteArray
from deltastore.codecs.kernels import ELEMENT_DTYPES, LOG2, _fields_to_bits

MARK = 0x20
"""High bits of a sparse-v2 payload's byte 0 (its low bits: ``LOG2`` of the element size): a
payload that does not carry them is not one."""
TAG_XOR = 0
"""``auto``'s tag byte before an ``xor`` payload."""
TAG_SPARSE_V1 = 1
"""``auto``'s tag byte of the removed ``sparse-v1``: refused with what to do."""
TAG_COMPACT = 2
"""``auto``'s tag byte before a ``sparse-v2`` payload."""


def changed_in_words(
    old: ByteArray, new: ByteArray, itemsize: int
) -> tuple[np.ndarray, np.ndarray]:
    """As :func:`deltastore.codecs.kernels.changed_elements` in fewer numpy calls, for a tensor
    that fits in cache (no chunks): positions (int64) and XOR values of the changed elements."""
    dtype = ELEMENT_DTYPES[itemsize]
    whole = old.size // 8 * 8
    old_words, new_words = old[:whole].view(np.uint64), new[:whole].view(np.uint64)
    words = np.flatnonzero(old_words != new_words)  # on bools: 2-3 times faster than on words
    values = (old_words[words] ^ new_words[words]).view(dtype)
    inside = np.flatnonzero(values)
    shift = LOG2[8 // itemsize]
    positions = (words[inside >> shift] << shift) | (inside & ((1 << shift) - 1))
    if whole == old.size:
        return positions, values[inside]
    tail = np.bitwise_xor(old[whole:].view(dtype), new[whole:].view(dtype))
    last = np.flatnonzero(tail)
    return (
        np.concatenate((positions, last + whole // itemsize)),
        np.concatenate((values[inside], tail[last])),
    )


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
    if int(fields.max()) <= 1:  # ±1 steps only (m = 1, t = 0): fewer numpy calls
        up = (current & dtype(1)) == fields
        return np.where(up, current + dtype(1), current - dtype(1))
    magnitude = (fields >> dtype(1)) + dtype(1)
    lowest = magnitude & (~magnitude + dtype(1))
    at_low = ((current & lowest) != 0) == ((fields & dtype(1)) != 0)
    return np.where(at_low, current + magnitude, current - magnitude)


def bit_lengths(fields: np.ndarray) -> np.ndarray:
    """``bit_length(field)`` of each field, exact for every width up to 64 bits."""
    if fields.dtype.itemsize < 8:
        return np.frexp(fields.astype(np.float64))[1]
    wide = fields.astype(np.uint64, copy=False)
    high = wide >> np.uint64(32)
    return np.where(
        high != 0,
        np.frexp(high.astype(np.float64))[1] + 32,
        np.frexp((wide & np.uint64(0xFFFFFFFF)).astype(np.float64))[1],
    )


def index_bits(count: int) -> int:
    """Bits of a patch's index among ``count`` fields."""
    return (count - 1).bit_length()


def field_width(fields: np.ndarray, bits: int) -> int:
    """The width ``w`` (0..bits) that codes ``fields`` in the fewest bits, patches included
    (each costs its index and ``bits - w`` high bits); the narrowest on ties."""
    if int(fields.max()) <= 1:  # ±1-ulp steps only: w is 0 or 1, two numpy calls
        ones = int(np.count_nonzero(fields))
        return 0 if ones * (index_bits(fields.size) + bits) <= fields.size else 1
    histogram = np.bincount(bit_lengths(fields), minlength=bits + 1)
    widths = np.arange(bits + 1)
    patches = fields.size - np.cumsum(histogram)[: bits + 1]  # fields wider than w
    costs = fields.size * widths + patches * (index_bits(fields.size) + bits - widths)
    return int(np.argmin(costs))


def _bit_rows(values: np.ndarray, k: int) -> ByteArray:
    """The low ``k`` bits of each value (uint64) as a (count, k) array of bits, MSB first."""
    big_endian = values.astype(">u8")
    return np.unpackbits(big_endian.view(np.uint8).reshape(-1, 8), axis=1)[:, 64 - k :]


def _row_values(rows: ByteArray) -> np.ndarray:
    """Inverse of :func:`_bit_rows`: uint64 values of (count, k) bit rows."""
    padded = np.zeros((rows.shape[0], 64), dtype=np.uint8)
    padded[:, 64 - rows.shape[1] :] = rows
    return np.packbits(padded, axis=1).reshape(-1).view(">u8").astype(np.uint64)


def pack_fields(fields: np.ndarray, width: int, bits: int) -> bytes:
    """Low ``width`` bits of every field (zero-padded to a byte), the patch count as a varint,
    then per patch (a field wider than ``width``) its index and its ``bits - width`` high bits,
    back to back (zero-padded to a byte)."""
    if width <= 1 and not int(fields.max()) >> width:  # no patch: one bit per field, or none
        return (np.packbits(fields.astype(np.uint8)).tobytes() if width else b"") + b"\x00"
    wide = fields.astype(np.uint64)
    low = _fields_to_bits(wide, width).tobytes() if width else b""
    if width == bits:
        return low + b"\x00"
    patched = np.flatnonzero(wide >> np.uint64(width))
    rows = np.concatenate(
        (
            _bit_rows(patched.astype(np.uint64), index_bits(wide.size)),
            _bit_rows(wide[patched] >> np.uint64(width), bits - width),
        ),
        axis=1,
    )
    return low + varint(patched.size) + np.packbits(rows.reshape(-1)).tobytes()


def read_patches(
    raw: ByteArray, at: int, count: int, width: int, bits: int
) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(patch indices, high parts (uint64), offset after them) of the patch varint and stream
    at ``at``; None when truncated, or the indices are not ascending below ``count``."""
    counted = read_varint(raw, at)
    if counted is None or counted[0] > count or (width == bits and counted[0]):
        return None
    patches, at = counted
    if not patches:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64), at
    index_width = index_bits(count)
    end = at + (patches * (index_width + bits - width) + 7) // 8
    if end > raw.size:
        return None
    flat = np.unpackbits(raw[at:end], count=patches * (index_width + bits - width))
    rows = flat.reshape(patches, index_width + bits - width)
    indices = _row_values(rows[:, :index_width])
    if patches and (int(indices[-1]) >= count or not bool(np.all(indices[1:] > indices[:-1]))):
        return None
    return indices.astype(np.int64), _row_values(rows[:, index_width:]), end


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
    quotients = np.empty(count, dtype=np.int64)  # ends[i] - ends[i-1] - 1, ends[-1] = -1
    quotients[0] = ends[0]
    np.subtract(ends[1:], ends[:-1], out=quotients[1:])
    quotients[1:] -= 1
    return quotients

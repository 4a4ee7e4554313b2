"""The ``sparse-v2`` format, written once: its constants and its header, for the two backends
(:mod:`~deltastore.codecs.numpy_backend`, :mod:`~deltastore.codecs.numba_backend`) that write
the same bytes and accept and refuse the same payloads. Layout (bit streams MSB first)::

    byte 0      0x20 | log2(itemsize)      itemsize: element size, 1, 2, 4 or 8 bytes
    varint      nbytes                     the tensor's size in bytes
    varint      count                      changed elements
    (only when count > 0:)
    byte        k                          Rice parameter of the gaps (≤ 63)
    byte        w                          width of a step field (0 .. 8*itemsize)
    ceil(count*k/8) bytes                  remainders: per gap, its low k bits (zero-padded)
    ceil(count*w/8) bytes                  step fields: the low w bits of each (zero-padded)
    varint      patches                    fields wider than w (0 when w = 8*itemsize)
    ceil(patches*(i+8*itemsize-w)/8) bytes per patch: its index among the fields (i =
                                           bit_length(count - 1) bits, ascending) and the
                                           field's high 8*itemsize - w bits (zero-padded)
    the rest                               unary: per gap, gap >> k one bits then a zero;
                                           padded with one bits to a byte (< 8 of them)

Varints are LEB128. Element ``i`` is bytes ``[i*itemsize, (i+1)*itemsize)``, ``gap = position
- previous - 1`` (the first counts from -1). ``k`` is, of the two next to log2(mean gap * ln 2),
the one that codes the gaps in fewer bits. A changed element holds ``old`` and ``new``
(unsigned ints of ``B = 8 * itemsize`` bits); its step field codes the pair so that either side
gives back the other (applying a payload twice reverts, like ``xor``)::

    d = (new - old) mod 2**B
    if d <= 2**(B-1): m = d,          lo = old     # the pair is {lo, lo + m}
    else:             m = 2**B - d,   lo = new
    field = (m - 1) << 1 | bit t of lo,   t = the lowest set bit of m

Adding ``m`` flips bit ``t``, so a reader holding ``x`` (either side) takes ``x + m`` when bit
``t`` of ``x`` equals the field's low bit and ``x - m`` otherwise. A ±1-ulp step (what an Adam
step does to most bf16 weights) is the field 0 or 1: one bit, where its XOR carries about two.
``w`` is the width with the fewest bits in all, patches included (ties: the narrower). ``k`` and
``w`` are computed exactly, so both backends write the same bytes. A tensor of a size that is
not 1, 2, 4 or 8 bytes an element is coded byte by byte. Positions are u64.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from deltastore.codecs.base import ByteArray
from deltastore.errors import FormatError

NAME = "sparse-v2"
MARK = 0x20
"""High bits of a payload's byte 0 (its low bits: ``LOG2`` of the element size)."""
TAG_XOR = 0
"""``auto``'s tag byte before an ``xor`` payload."""
TAG_SPARSE_V1 = 1
"""``auto``'s tag byte of the removed ``sparse-v1``: refused with what to do."""
TAG_COMPACT = 2
"""``auto``'s tag byte before a ``sparse-v2`` payload."""
ELEMENT_DTYPES: dict[int, np.dtype] = {s: np.dtype(f"<u{s}") for s in (1, 2, 4, 8)}
"""Unsigned little-endian element types by size in bytes: the widths the format knows."""
LOG2 = {1: 0, 2: 1, 4: 2, 8: 3}
SAFETENSORS_ITEMSIZES: dict[str, int] = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64", "C64"), 8),
}
"""Element size in bytes of each safetensors dtype string (what a checkpoint header names)."""

Positions = npt.NDArray[np.int64]


def element_size(nbytes: int, itemsize: int) -> int:
    """The element size to code a tensor of ``nbytes`` bytes with: ``itemsize`` where it is one
    of 1, 2, 4, 8 bytes and divides the tensor, else 1 (the dtype-blind fallback)."""
    if itemsize in ELEMENT_DTYPES and nbytes % itemsize == 0:
        return itemsize
    return 1


def itemsize_of_dtype(dtype: str) -> int:
    """Element size in bytes of a safetensors dtype string; 1 (dtype-blind) for one not known
    here, which the sparse encoding accepts."""
    return SAFETENSORS_ITEMSIZES.get(dtype, 1)


def max_payload_size(nbytes: int) -> int:
    # At most one change per byte: 23 header and varint bytes; per change a remainder ≤ 64
    # bits, a field ≤ 64, a patch ≤ 128, unary ≤ sum(gaps) + count ≤ 2 * nbytes bits.
    return 32 + nbytes * 8 + nbytes * 24 + nbytes // 4 + 1


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


def read_header(raw: ByteArray, nbytes: int, what: str) -> tuple[int, int, int, int, int]:
    """(itemsize, count, k, w, offset of the remainders) of a payload, checked against the
    local ``nbytes``: :class:`FormatError` naming ``what`` for one that does not fit. The
    compiled decoder makes the same checks in its own module (numba keys its cache on a
    kernel's own file, so it cannot call this one)."""
    if not raw.size or raw[0] & 0xFC != MARK:
        raise FormatError(f"{what} does not start with a {NAME} header; it is corrupt")
    itemsize = 1 << int(raw[0] & 3)
    declared = read_varint(raw, 1)
    counted = None if declared is None else read_varint(raw, declared[1])
    if declared is None or counted is None:
        raise FormatError(f"{what} is truncated inside its header; it is corrupt")
    if declared[0] != nbytes:
        raise FormatError(
            f"{what} was made for a {declared[0]}-byte tensor, the local one has {nbytes}; "
            "the delta was made for another checkpoint"
        )
    count, offset = counted
    if nbytes % itemsize or count > nbytes // itemsize:
        raise FormatError(
            f"{what} declares {count} changes of {itemsize}-byte elements for "
            f"{nbytes} bytes; it is corrupt"
        )
    if not count:
        if offset != raw.size:
            raise FormatError(f"{what} has {raw.size - offset} bytes after an empty change")
        return itemsize, 0, 0, 0, offset
    if offset + 2 > raw.size:
        raise FormatError(f"{what} is truncated inside its header; it is corrupt")
    k, width = int(raw[offset]), int(raw[offset + 1])
    if k > min(63, (nbytes // itemsize).bit_length() + 1) or width > itemsize * 8:
        raise FormatError(f"{what} declares k={k}, w={width}; it is corrupt")
    offset += 2
    patches_at = offset + (count * k + 7) // 8 + (count * width + 7) // 8
    if patches_at > raw.size:
        raise FormatError(f"{what} is truncated: {raw.size} bytes, {patches_at} needed")
    return itemsize, count, k, width, offset

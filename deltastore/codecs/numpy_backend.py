"""The numpy backend of ``sparse-v2`` (the format is :mod:`~deltastore.codecs.sparse_format`):
no compiled code, the same bytes as :mod:`~deltastore.codecs.numba_backend`, one tensor at a
time (a batch is a loop). The tensor is compared as little-endian u64 words in chunks that stay
in cache (a mask of differing words, only those split into elements), and its streams are packed
whole with ``np.packbits``.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from deltastore.codecs.base import ByteArray, XorChanges
from deltastore.codecs.sparse_format import (
    ELEMENT_DTYPES,
    LOG2,
    MARK,
    Positions,
    read_varint,
    varint,
)
from deltastore.errors import FormatError

Ints = npt.NDArray[np.int64]
CHUNK_WORDS = 1 << 18
"""Words compared per step (2 MiB of each input): the mask and gathers stay in cache."""
PACK_IN_WORDS = 512
"""From this many values on, :func:`fields_to_bits` packs them a group to a 64-bit word."""


# ------------------------------------------------------------------ finding changes
def changed_elements(
    old: ByteArray, new: ByteArray, itemsize: int
) -> tuple[Positions, np.ndarray, np.ndarray]:
    """Indices (int64, ascending) of the ``itemsize``-byte elements that differ, the old value
    and ``old XOR new`` of each (unsigned, little-endian), compared in chunks of words."""
    whole = old.size // 8 * 8
    old_words, new_words = old[:whole].view(np.uint64), new[:whole].view(np.uint64)
    found = []
    for start in range(0, old_words.size, CHUNK_WORDS):
        old_chunk = old_words[start : start + CHUNK_WORDS]
        new_chunk = new_words[start : start + CHUNK_WORDS]
        words = np.flatnonzero(old_chunk != new_chunk)  # on bools: 2-3 times faster than on words
        at = words + start if start else words
        found.append(split_words(at, old_chunk[words], new_chunk[words], itemsize))
    if whole < old.size or not found:  # the last < 8 bytes, still a whole number of elements
        dtype = ELEMENT_DTYPES[itemsize]
        before = old[whole:].view(dtype)
        tail = np.bitwise_xor(before, new[whole:].view(dtype))
        inside = np.flatnonzero(tail)
        found.append((inside + whole // itemsize, before[inside], tail[inside]))
    if len(found) == 1:
        return found[0]
    return tuple(np.concatenate(part) for part in zip(*found, strict=True))  # type: ignore[return-value]


def split_words(
    words: Ints, old_words: np.ndarray, new_words: np.ndarray, itemsize: int
) -> tuple[Positions, np.ndarray, np.ndarray]:
    """(positions, old values, XOR values) of the changed ``itemsize``-byte elements inside the
    differing u64 ``words`` (their indices, and their old and new values)."""
    dtype = ELEMENT_DTYPES[itemsize]
    values = (old_words ^ new_words).view(dtype)
    inside = np.flatnonzero(values)
    # Shifts, not // and %: numpy's integer division was a fifth of the chunk loop's time.
    shift = LOG2[8 // itemsize]  # elements per word: 2**shift
    positions = (words[inside >> shift] << shift) | (inside & ((1 << shift) - 1))
    return positions, old_words.view(dtype)[inside], values[inside]


def encode_gaps(positions: Positions) -> npt.NDArray[np.uint64]:
    """``gap - 1`` between consecutive ascending positions (the first counts from -1), as
    uint64."""
    gaps = np.empty(positions.size, dtype=np.int64)
    if positions.size:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps.view(np.uint64)


def decode_gaps(gaps: np.ndarray, nelements: int) -> Positions | None:
    """Positions from ``encode_gaps`` output; None unless they strictly increase below
    ``nelements`` (a corrupt stream can neither wrap around nor address outside the tensor)."""
    if not gaps.size:
        return np.zeros(0, dtype=np.int64)
    steps = gaps.astype(np.uint64) + np.uint64(1)
    positions = np.cumsum(steps, dtype=np.uint64) - np.uint64(1)
    # A step of 0 means the stored gap wrapped (2**64 - 1 + 1); a decrease means the sum did.
    if not bool(np.all(steps)) or int(positions[-1]) >= nelements:
        return None
    if positions.size > 1 and not bool(np.all(positions[1:] > positions[:-1])):
        return None
    return positions.astype(np.int64)


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


def moved(current: np.ndarray, fields: np.ndarray) -> np.ndarray:
    """The other side of each pair: ``current`` (either side) moved by its step ``fields``."""
    dtype = current.dtype.type
    if int(fields.max()) <= 1:  # ±1 steps only (m = 1, t = 0): fewer numpy calls
        up = (current & dtype(1)) == fields
        return np.where(up, current + dtype(1), current - dtype(1))
    magnitude = (fields >> dtype(1)) + dtype(1)
    lowest = magnitude & (~magnitude + dtype(1))
    at_low = ((current & lowest) != 0) == ((fields & dtype(1)) != 0)
    return np.where(at_low, current + magnitude, current - magnitude)


# ------------------------------------------------------------------ k and w, per tensor
def bit_length(values: np.ndarray) -> Ints:
    """``int.bit_length`` of each value (unsigned, or int64 ≥ 0), exact up to 64 bits."""
    if values.dtype.itemsize < 8 or values.dtype == np.int64:
        return np.frexp(values.astype(np.float64))[1].astype(np.int64)
    wide = values.astype(np.uint64, copy=False)
    high = wide >> np.uint64(32)
    return np.where(
        high != 0,
        np.frexp(high.astype(np.float64))[1] + 32,
        np.frexp((wide & np.uint64(0xFFFFFFFF)).astype(np.float64))[1],
    ).astype(np.int64)


def rice_parameter(gaps: npt.NDArray[np.uint64]) -> int:
    """The Rice parameter ``k`` of the gaps: of the two next to log2(mean * ln 2) (the optimum
    for geometric gaps), the one that codes them in fewer bits."""
    total = int(gaps.sum(dtype=np.uint64))
    low = max(int(total / gaps.size * 0.6931).bit_length() - 1, 0)
    high = min(low + 1, 63)
    low_cost = int((gaps >> np.uint64(low)).sum(dtype=np.uint64)) + gaps.size * low
    high_cost = int((gaps >> np.uint64(high)).sum(dtype=np.uint64)) + gaps.size * high
    return low if low_cost <= high_cost else high


def field_width(fields: np.ndarray, bits: int) -> int:
    """The width ``w`` (0..bits) that codes the step ``fields`` in the fewest bits, patches
    included (each costs its index and ``bits - w`` high bits); the narrowest on ties."""
    index_bits = (fields.size - 1).bit_length()
    if int(fields.max()) <= 1:  # ±1-ulp steps only: w is 0 or 1, two numpy calls
        ones = int(np.count_nonzero(fields))
        return 0 if ones * (index_bits + bits) <= fields.size else 1
    histogram = np.bincount(bit_length(fields), minlength=bits + 1)
    widths = np.arange(bits + 1)
    patches = fields.size - np.cumsum(histogram)[: bits + 1]  # fields wider than w
    costs = fields.size * widths + patches * (index_bits + bits - widths)
    return int(np.argmin(costs))


# ------------------------------------------------------------------ one tensor's streams
def _field_bits(k: int) -> int:
    """Bits of the smallest unsigned integer type that holds ``k`` bits."""
    return next(b for b in (8, 16, 32, 64) if k <= b)


def fields_to_bits(values: np.ndarray, k: int) -> ByteArray:
    """The low ``k`` bits of each value, MSB first, packed back to back into bytes."""
    group = 8 // math.gcd(k, 8)  # values whose k bits fill whole bytes
    if values.size >= PACK_IN_WORDS and group > 1 and group * k <= 64:
        return _packed_in_words(values, k, group)
    per_value = _field_bits(k)
    big_endian = values.astype(f">u{per_value // 8}")  # keeps the low bits
    bits = np.unpackbits(big_endian.view(np.uint8).reshape(-1, per_value // 8), axis=1)
    return np.packbits(bits[:, per_value - k :].reshape(-1))


def _packed_in_words(values: np.ndarray, k: int, group: int) -> ByteArray:
    """:func:`fields_to_bits` by ORing each ``group`` of values into one 64-bit word, whose
    top ``group * k / 8`` bytes are theirs: a few passes over the values instead of spreading
    every bit into its own byte."""
    rows = -(-values.size // group)
    padded = np.zeros(rows * group, dtype=np.int64)
    padded[: values.size] = values.astype(np.int64, copy=False) & ((1 << k) - 1)
    columns = padded.reshape(rows, group)
    words = columns[:, 0] << (64 - k)
    for j in range(1, group):
        words |= columns[:, j] << (64 - k * (j + 1))
    row_bytes = group * k // 8
    packed = words.astype(">i8").view(np.uint8).reshape(rows, 8)[:, :row_bytes].reshape(-1)
    return np.ascontiguousarray(packed[: (values.size * k + 7) // 8])  # one byte a row: strided


def bits_to_fields(packed: ByteArray, k: int, count: int) -> np.ndarray:
    """Inverse of :func:`fields_to_bits`: ``count`` values of ``k`` bits, as uint64."""
    per_value = _field_bits(k)
    bits = np.zeros((count, per_value), dtype=np.uint8)
    bits[:, per_value - k :] = np.unpackbits(packed, count=count * k).reshape(count, k)
    fields = np.packbits(bits, axis=1).reshape(-1).view(f">u{per_value // 8}")
    return fields.astype(np.uint64)


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
    low = fields_to_bits(wide, width).tobytes() if width else b""
    if width == bits:
        return low + b"\x00"
    patched = np.flatnonzero(wide >> np.uint64(width))
    rows = np.concatenate(
        (
            _bit_rows(patched.astype(np.uint64), (wide.size - 1).bit_length()),
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
    index_width = (count - 1).bit_length()
    end = at + (patches * (index_width + bits - width) + 7) // 8
    if end > raw.size:
        return None
    flat = np.unpackbits(raw[at:end], count=patches * (index_width + bits - width))
    rows = flat.reshape(patches, index_width + bits - width)
    indices = _row_values(rows[:, :index_width])
    if patches and (int(indices[-1]) >= count or not bool(np.all(indices[1:] > indices[:-1]))):
        return None
    return indices.astype(np.int64), _row_values(rows[:, index_width:]), end


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


def encode(old: ByteArray, new: ByteArray, itemsize: int) -> tuple[bytes, XorChanges]:
    """The payload turning ``old`` into ``new`` (``itemsize``-byte elements) and the changes."""
    positions, before, xored = changed_elements(old, new, itemsize)
    count = positions.size
    head = bytes((MARK | LOG2[itemsize],)) + varint(old.size) + varint(count)
    if not count:
        return head, XorChanges(positions, xored)
    gaps = encode_gaps(positions)
    k = rice_parameter(gaps)
    fields = step_fields(before, before ^ xored)
    width = field_width(fields, itemsize * 8)
    parts = (
        head,
        bytes((k, width)),
        fields_to_bits(gaps, k).data,
        pack_fields(fields, width, itemsize * 8),
        unary_stream(gaps >> np.uint64(k)).data,
    )
    return b"".join(parts), XorChanges(positions, xored)


def decode(
    raw: ByteArray, header: tuple[int, int, int, int, int], nbytes: int, what: str
) -> tuple[Positions, np.ndarray]:
    """(positions, step fields as uint64) of the streams after the ``header``
    :func:`~deltastore.codecs.sparse_format.read_header` read; :class:`FormatError` naming
    ``what`` for streams that do not fit the ``nbytes``-byte tensor."""
    itemsize, count, k, width, at = header
    fields_at = at + (count * k + 7) // 8
    patches_at = fields_at + (count * width + 7) // 8
    if width == 1:  # the usual ±1-ulp steps: one bit each, two numpy calls
        fields = np.unpackbits(raw[fields_at:patches_at], count=count).astype(np.uint64)
    else:
        fields = bits_to_fields(raw[fields_at:patches_at], width, count)
    patches = read_patches(raw, patches_at, count, width, itemsize * 8)
    if patches is None:
        raise FormatError(f"{what} has patched steps that are truncated or out of order")
    indices, high, unary_at = patches
    fields[indices] |= high << np.uint64(width)
    quotients = read_unary(raw[unary_at:], count)
    positions = None
    if quotients is not None and not int(quotients.max()) >> (63 - k):
        gaps = quotients.astype(np.uint64) << np.uint64(k)
        if k:
            gaps |= bits_to_fields(raw[at:fields_at], k, count)
        positions = decode_gaps(gaps, nbytes // itemsize)
    if positions is None:
        raise FormatError(
            f"{what} has positions that are not ascending inside its {nbytes // itemsize} "
            "elements; it is corrupt"
        )
    return positions, fields


def apply_steps(target: ByteArray, itemsize: int, positions: Positions, fields: np.ndarray) -> None:
    """Move the ``itemsize``-byte elements ``positions`` of ``target`` by their steps."""
    elements = target.view(ELEMENT_DTYPES[itemsize])
    elements[positions] = moved(elements[positions], fields.astype(elements.dtype))


def xor_at(elements: np.ndarray, positions: Positions, values: np.ndarray) -> None:
    """``elements[positions] ^= values`` (numpy raises IndexError for a position outside)."""
    elements[positions] ^= values

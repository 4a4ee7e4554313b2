"""The numpy backend of ``sparse-v2`` (the format is :mod:`~deltastore.codecs.sparse_format`):
no compiled code, the same bytes as :mod:`~deltastore.codecs.numba_backend`, one tensor at a
time, except a batch's small tensors, which :func:`encode_framed` codes in one pass of numpy
calls per element size (the fixed cost of some forty calls a tensor is what a small tensor's
encode costs). The tensor is compared as little-endian u64 words in chunks that stay
in cache (a mask of differing words, only those split into elements), and its streams are packed
whole with ``np.packbits``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from deltastore.codecs.base import ByteArray, FramedDelta, XorChanges
from deltastore.codecs.compression import compress
from deltastore.codecs.sparse_format import (
    ELEMENT_DTYPES,
    LOG2,
    MARK,
    Positions,
    element_size,
    read_varint,
    varint,
)
from deltastore.errors import FormatError

Ints = npt.NDArray[np.int64]
CHUNK_WORDS = 1 << 18
"""Words compared per step (2 MiB of each input): the mask and gathers stay in cache."""
GROUP_BYTES = 4 * 1024**2
"""Tensors coded in one pass hold at most this many bytes."""
GROUP_CHANGES = 1 << 17
"""A group with more changed elements than this (a dense step) is coded in parts: the pass holds
about 160 bytes per change for a moment (its index arrays and the writer's byte values)."""
ALONE_BYTES = 128 * 1024
"""A tensor over this size is encoded alone: the batch pass costs more per change than the
per-tensor layout and saves the fixed cost of its numpy calls, which a large tensor does not
need saved."""
PIECE_BITS = 25
""":class:`ByteWriter` writes a field in pieces of at most this many bits: a piece at any bit
offset then fits a 32-bit window of four bytes."""
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


# ------------------------------------------------------------------ per tensor of a batch
def segment_sums(values: np.ndarray, firsts: Ints, counts: Ints) -> np.ndarray:
    """Per segment (``counts`` elements each, the non-empty ones starting at ``firsts``), the
    sum of its ``values``; 0 for an empty segment."""
    sums = np.zeros(counts.size, dtype=values.dtype)
    if firsts.size:
        sums[counts > 0] = np.add.reduceat(values, firsts)
    return sums


def rice_parameters(gaps: np.ndarray, firsts: Ints, counts: Ints) -> Ints:
    """The Rice parameter ``k`` of each segment's gaps (``counts`` each, the non-empty ones
    starting at ``firsts``): of the two next to log2(mean * ln 2) (the optimum for geometric
    gaps), the one that codes them in fewer bits."""
    totals = segment_sums(gaps, firsts, counts)
    safe = np.maximum(counts, 1)
    mean = np.trunc(totals.astype(np.float64) / safe * 0.6931).astype(np.int64)
    low = np.maximum(bit_length(mean) - 1, 0)
    high = np.minimum(low + 1, 63)
    costs = []
    for k in (low, high):
        shifted = gaps >> np.repeat(k, counts)
        costs.append(segment_sums(shifted, firsts, counts).astype(np.int64) + counts * k)
    return np.where(costs[0] <= costs[1], low, high)


def field_widths(fields: np.ndarray, tensor_of: Ints, counts: Ints, bits: int) -> Ints:
    """The width ``w`` (0..bits) that codes each segment's step ``fields`` (``tensor_of``: the
    segment of each) in the fewest bits, patches included (each costs its index and ``bits -
    w`` high bits); the narrowest on ties."""
    index_bits = bit_length(np.maximum(counts - 1, 0))
    if not fields.size or int(fields.max()) <= 1:  # ±1-ulp steps only: w is 0 or 1
        ones = np.bincount(tensor_of, weights=fields, minlength=counts.size).astype(np.int64)
        return np.where(ones * (index_bits + bits) <= counts, 0, 1).astype(np.int64)
    histogram = np.bincount(
        tensor_of * (bits + 1) + bit_length(fields), minlength=counts.size * (bits + 1)
    ).reshape(counts.size, bits + 1)
    widths = np.arange(bits + 1)
    patches = counts[:, None] - np.cumsum(histogram, axis=1)
    costs = counts[:, None] * widths + patches * (index_bits[:, None] + bits - widths)
    return np.argmin(costs, axis=1).astype(np.int64)


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


def varint_lengths(values: Ints) -> Ints:
    """Bytes of the LEB128 varint of each value (≥ 0, below 2**53)."""
    return np.maximum((bit_length(values) + 6) // 7, 1)


class ByteWriter:
    """Byte values to add at byte indices, summed into one buffer by :meth:`build`."""

    def __init__(self) -> None:
        self._indices: list[Ints] = []
        self._values: list[np.ndarray] = []

    def put(self, at: Ints, values: np.ndarray) -> None:
        """Add ``values`` (each -255..255) to the bytes at ``at``."""
        self._indices.append(at)
        self._values.append(values)

    def bits(self, bit_at: Ints, values: np.ndarray, widths: Ints) -> None:
        """Each value's low ``widths[i]`` bits (≤ 64), MSB first, from bit ``bit_at[i]`` of the
        buffer (bit 0 is the high bit of byte 0)."""
        if values.dtype != np.int64:  # int64 values are taken as they are (never negative)
            values = values.astype(np.uint64, copy=False)
        top = int(widths.max(initial=0))
        if top <= PIECE_BITS:  # one piece each: Rice remainders and step fields, nearly always
            self._window(bit_at, values.view(np.int64) & ((1 << widths) - 1), widths, top)
            return
        for low in range(0, top, PIECE_BITS):
            piece_bits = np.clip(widths - low, 0, PIECE_BITS)
            piece = (values >> values.dtype.type(low)).view(np.int64) & ((1 << piece_bits) - 1)
            # The piece's high bit, MSB first (an empty piece writes zeros at the field's start).
            at = bit_at + np.maximum(widths - low - piece_bits, 0)
            self._window(at, piece, piece_bits, int(piece_bits.max(initial=0)))

    def _window(self, at: Ints, piece: Ints, piece_bits: Ints, top: int) -> None:
        """Pieces of at most ``top`` ≤ 25 bits at bit offsets ``at``: each spans at most
        four bytes (int64 arithmetic: numpy's is faster on it than on uint64)."""
        span = (top + 7 + 7) // 8
        window = piece << (8 * span - piece_bits - (at & 7))
        first = at >> 3
        for byte in range(span):
            self.put(first + byte, (window >> (8 * (span - 1 - byte))) & 255)

    def varints(self, at: Ints, values: Ints, lengths: Ints) -> None:
        """The LEB128 varint of each value (``lengths`` from :func:`varint_lengths`) from byte
        ``at[i]``."""
        for byte in range(int(lengths.max(initial=0))):
            more = lengths > byte
            seven = (values[more] >> (7 * byte)) & 0x7F
            self.put(at[more] + byte, seven | np.where(lengths[more] > byte + 1, 0x80, 0))

    def unary(self, at: Ints, lengths: Ints, zero_bits: Ints) -> None:
        """Regions of one bits (``lengths[i]`` bytes from byte ``at[i]``) with a zero at each
        bit of ``zero_bits`` (inside a region)."""
        total = int(lengths.sum())
        region_start = np.repeat(at - (np.cumsum(lengths) - lengths), lengths)
        self.put(region_start + np.arange(total), np.full(total, 255))
        self.put(zero_bits >> 3, -(128 >> (zero_bits & 7)))

    def build(self, size: int) -> ByteArray:
        """The ``size`` bytes written."""
        if not self._indices:
            return np.zeros(size, dtype=np.uint8)
        indices = np.concatenate(self._indices)
        values = np.concatenate([v.astype(np.float64, copy=False) for v in self._values])
        summed = np.bincount(indices, weights=values, minlength=size)
        return summed[:size].astype(np.uint8)


def groups(
    olds: Sequence[ByteArray], itemsizes: Sequence[int]
) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """([(element size, indices of tensors coded in one pass)], indices left to the per-tensor
    encoder: sizes that are not whole 8-byte words, and large tensors)."""
    by_size: dict[int, list[list[int]]] = {}
    held: dict[int, int] = {}
    alone: list[int] = []
    for index, (old, itemsize) in enumerate(zip(olds, itemsizes, strict=True)):
        if old.size % 8 or old.size > ALONE_BYTES:
            alone.append(index)
            continue
        size = element_size(old.size, itemsize)
        chunks = by_size.setdefault(size, [[]])
        if chunks[-1] and held[size] + old.size > GROUP_BYTES:
            chunks.append([])
            held[size] = 0
        chunks[-1].append(index)
        held[size] = held.get(size, 0) + old.size
    return [(size, chunk) for size, chunks in by_size.items() for chunk in chunks], alone


_masks = threading.local()


def _mask(size: int) -> npt.NDArray[np.bool_]:
    """This thread's mask of ``size`` entries, kept between calls: allocated and freed per
    group, glibc handed its pages back and faulted them in again each time."""
    mask = getattr(_masks, "mask", None)
    if mask is None or mask.size < size:
        mask = _masks.mask = np.empty(max(size, GROUP_BYTES // 8), dtype=bool)
    return mask[:size]


def _changed_words(olds: Sequence[ByteArray], news: Sequence[ByteArray]) -> tuple[Ints, Ints]:
    """(indices of the 8-byte words that differ, counted over the tensors end to end; each
    tensor's first word there) of tensors of whole 8-byte words.

    Each tensor is compared where it lies, into one mask: copying the tensors end to end first
    cost as much again as the compare, and its buffer a page fault per 4 KB in a new thread."""
    word_at = np.zeros(len(olds) + 1, dtype=np.int64)
    np.cumsum([old.size // 8 for old in olds], out=word_at[1:])
    at = word_at.tolist()
    differs = _mask(at[-1])
    for i, (old, new) in enumerate(zip(olds, news, strict=True)):
        np.not_equal(old.view(np.uint64), new.view(np.uint64), out=differs[at[i] : at[i + 1]])
    return np.flatnonzero(differs), word_at


def _changes(
    olds: Sequence[ByteArray],
    news: Sequence[ByteArray],
    itemsize: int,
    words: Ints,
    word_at: Ints,
) -> tuple[Ints, np.ndarray, np.ndarray, Ints]:
    """(positions of the changed elements, counted over the tensors end to end; their old
    values; their XOR values; each tensor's first element) from the :func:`_changed_words`."""
    at = word_at.tolist()
    bounds = np.searchsorted(words, word_at).tolist()
    old_parts, new_parts = [], []
    for i, (old, new) in enumerate(zip(olds, news, strict=True)):
        if bounds[i] < bounds[i + 1]:
            inside_tensor = words[bounds[i] : bounds[i + 1]] - at[i]
            old_parts.append(old.view(np.uint64)[inside_tensor])
            new_parts.append(new.view(np.uint64)[inside_tensor])
    old_words = np.concatenate(old_parts) if old_parts else np.zeros(0, np.uint64)
    new_words = np.concatenate(new_parts) if new_parts else np.zeros(0, np.uint64)
    positions, before, xored = split_words(words, old_words, new_words, itemsize)
    return positions, before, xored, word_at << LOG2[8 // itemsize]


@dataclass(frozen=True)
class _Streams:
    """What a group's payloads hold besides their headers, per tensor and per change."""

    counts: Ints
    firsts: Ints
    """Index of each changed tensor's first change."""
    k: Ints
    widths: Ints
    gaps: np.ndarray
    fields: np.ndarray
    tensor_of: Ints
    ordinals: Ints
    """Each change's index among its tensor's changes."""


def _layout(streams: _Streams, nbytes: Ints, itemsize: int) -> tuple[ByteWriter, Ints]:
    """Every payload of the group written into one :class:`ByteWriter`, each after the one
    before; returns it and the payloads' byte offsets (one more than tensors)."""
    # long because each section's offset follows from the one before it, for all tensors
    s = streams
    bits = 8 * itemsize
    # int64 where the fields fit (numpy is faster on it than on uint64).
    wide = s.fields.astype(np.int64 if itemsize < 8 else np.uint64)
    tensor_widths = s.widths[s.tensor_of]
    shifts = tensor_widths.astype(wide.dtype)
    patched = np.flatnonzero((wide >> shifts) * (tensor_widths < bits))
    patches = np.bincount(s.tensor_of[patched], minlength=s.counts.size).astype(np.int64)
    index_bits = bit_length(np.maximum(s.counts - 1, 0))
    quotients = s.gaps >> s.k[s.tensor_of]
    ends = np.cumsum(quotients + 1) - 1  # each unary code's zero bit, over all tensors
    unary_bits = segment_sums(quotients + 1, s.firsts, s.counts)
    size_lengths, count_lengths = varint_lengths(nbytes), varint_lengths(s.counts)
    patch_lengths = varint_lengths(patches)
    head = 1 + size_lengths + count_lengths + 2
    sections = [
        head,
        (s.counts * s.k + 7) // 8,
        (s.counts * s.widths + 7) // 8,
        patch_lengths,
        (patches * (index_bits + bits - s.widths) + 7) // 8,
        (unary_bits + 7) // 8,
    ]
    lengths = np.where(s.counts > 0, sum(sections), 0)
    at = np.zeros(s.counts.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=at[1:])
    starts = [at[:-1]]
    for section in sections[:-1]:
        starts.append(starts[-1] + section)
    head_at, remainder_at, field_at, varint_at, patch_at, unary_at = starts
    writer = ByteWriter()
    changed = np.flatnonzero(s.counts)
    writer.put(head_at[changed], np.full(changed.size, MARK | LOG2[itemsize]))
    writer.varints(head_at[changed] + 1, nbytes[changed], size_lengths[changed])
    count_at = head_at + 1 + size_lengths
    writer.varints(count_at[changed], s.counts[changed], count_lengths[changed])
    writer.put(count_at[changed] + count_lengths[changed], s.k[changed])
    writer.put(count_at[changed] + count_lengths[changed] + 1, s.widths[changed])
    k_of = s.k[s.tensor_of]
    writer.bits(8 * remainder_at[s.tensor_of] + s.ordinals * k_of, s.gaps, k_of)
    writer.bits(8 * field_at[s.tensor_of] + s.ordinals * tensor_widths, wide, tensor_widths)
    writer.varints(varint_at[changed], patches[changed], patch_lengths[changed])
    if patched.size:
        owner = s.tensor_of[patched]
        row_bits = index_bits + bits - s.widths
        first_patch = np.cumsum(patches) - patches
        row_at = (
            8 * patch_at[owner] + (np.arange(patched.size) - first_patch[owner]) * row_bits[owner]
        )
        writer.bits(row_at, s.ordinals[patched], index_bits[owner])
        high = wide[patched] >> shifts[patched]
        writer.bits(row_at + index_bits[owner], high, bits - tensor_widths[patched])
    unary_before = np.cumsum(unary_bits) - unary_bits
    writer.unary(
        unary_at, sections[-1], 8 * unary_at[s.tensor_of] + ends - unary_before[s.tensor_of]
    )
    return writer, at


def encode_group(
    olds: Sequence[ByteArray], news: Sequence[ByteArray], itemsize: int
) -> list[tuple[bytes, int, XorChanges] | None]:
    """The sparse-v2 payload of each tensor (whole 8-byte words, all coded with ``itemsize``
    -byte elements), None for an unchanged one."""
    bits = 8 * itemsize
    words, word_at = _changed_words(olds, news)
    if words.size * (8 // itemsize) > GROUP_CHANGES and len(olds) > 1:
        # Maybe a dense group: halved (by changed words) so the pass's memory stays bounded.
        word_bounds = np.searchsorted(words, word_at[1:])
        half = min(max(int(np.searchsorted(word_bounds, words.size // 2)) + 1, 1), len(olds) - 1)
        del words
        return encode_group(olds[:half], news[:half], itemsize) + encode_group(
            olds[half:], news[half:], itemsize
        )
    positions, before, xored, starts = _changes(olds, news, itemsize, words, word_at)
    bounds = np.searchsorted(positions, starts)
    counts = np.diff(bounds)
    firsts = bounds[:-1][counts > 0]
    tensor_of = np.repeat(np.arange(len(olds)), counts)
    local = positions - starts[:-1][tensor_of]
    gaps = encode_gaps(local).view(np.int64)
    gaps[firsts] = local[firsts]  # each tensor's first counts from -1
    fields = step_fields(before, before ^ xored)
    streams = _Streams(
        counts=counts,
        firsts=firsts,
        k=rice_parameters(gaps, firsts, counts),
        widths=field_widths(fields, tensor_of, counts, bits),
        gaps=gaps,
        fields=fields,
        tensor_of=tensor_of,
        ordinals=np.arange(positions.size) - np.repeat(bounds[:-1], counts),
    )
    nbytes = np.array([old.size for old in olds], dtype=np.int64)
    writer, at = _layout(streams, nbytes, itemsize)
    payloads = writer.build(int(at[-1])).tobytes()
    changed_bytes = segment_sums(
        np.count_nonzero(xored.view(np.uint8).reshape(-1, itemsize), axis=1), firsts, counts
    ).tolist()
    at_list, bounds_list = at.tolist(), bounds.tolist()
    out: list[tuple[bytes, int, XorChanges] | None] = []
    for i, count in enumerate(counts.tolist()):
        if not count:
            out.append(None)
            continue
        lo, hi = bounds_list[i], bounds_list[i + 1]
        changes = XorChanges(local[lo:hi], xored[lo:hi])
        out.append((payloads[at_list[i] : at_list[i + 1]], changed_bytes[i], changes))
    return out


UNCHANGED = FramedDelta(b"", 0)


def encode_framed(
    olds: Sequence[ByteArray],
    news: Sequence[ByteArray],
    itemsizes: Sequence[int],
    *,
    tag: int,
    dense_ratio: int,
) -> list[FramedDelta | None]:
    """As the numba backend's ``encode_framed``, but only each element size's small tensors, in
    one pass of numpy calls (:func:`encode_group`); None for the others (large, not whole words)."""
    framed: list[FramedDelta | None] = [None] * len(olds)
    chunks, _ = groups(olds, itemsizes)
    prefix = bytes((tag,)) if tag >= 0 else b""
    for size, indices in chunks:
        payloads = encode_group([olds[i] for i in indices], [news[i] for i in indices], size)
        for i, encoded in zip(indices, payloads, strict=True):
            if encoded is None:
                framed[i] = UNCHANGED
            elif not dense_ratio or len(encoded[0]) * dense_ratio <= olds[i].size:
                framed[i] = FramedDelta(compress(prefix + encoded[0]), encoded[1], encoded[2])
    return framed

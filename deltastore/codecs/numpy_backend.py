"""The numpy backend of ``sparse-v2`` (the format is :mod:`~deltastore.codecs.sparse_format`):
no compiled code, the same bytes as :mod:`~deltastore.codecs.numba_backend`. One writer,
:func:`encode_group`, codes a group of tensors of one element size in one pass of numpy calls
(the fixed cost of a call is what a small tensor's encode costs); a single tensor is a group of
one, whose streams are packed whole with ``np.packbits``. One decoder, :func:`decode`.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence

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
    read_header,
    read_varint,
    varint,
)
from deltastore.errors import FormatError

Ints = npt.NDArray[np.int64]
CHUNK_WORDS = 1 << 18
"""Words compared before their changes are gathered (2 MiB of each input): still in cache."""
GROUP_BYTES = 4 * 1024**2
"""Tensors coded in one pass hold at most this many bytes."""
GROUP_CHANGES = 1 << 17
"""A group with more changed elements than this (a dense step) is coded in parts: the pass holds
about 160 bytes per change for a moment (its index arrays and the writer's byte values)."""
ALONE_BYTES = 128 * 1024
"""A tensor over this size is a group of its own: packing whole streams costs less per change
than :class:`ByteWriter`'s windows, and a large tensor needs no numpy call saved."""
PIECE_BITS = 25
""":class:`ByteWriter` writes a field in pieces of at most this many bits: a piece at any bit
offset then fits a 32-bit window of four bytes."""
PACK_IN_WORDS = 512
"""From this many values on, :func:`fields_to_bits` packs them a group to a 64-bit word."""


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


# ------------------------------------------------------------------ k and w of each tensor
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


def per_change(values: np.ndarray, tensor_of: Ints) -> np.ndarray:
    """Per-tensor ``values`` (the last axis) for each change, ``tensor_of`` the tensor of each;
    a group of one's as they are, to broadcast: numpy shifts by one amount many times faster
    than by an array of them."""
    return values if values.shape[-1] == 1 else values[..., tensor_of]


def segment_sums(values: np.ndarray, bounds: Ints) -> Ints:
    """Per segment ``values[..., bounds[i] : bounds[i + 1]]`` (ascending bounds, one more than
    segments), the sum of its values (int64)."""
    if bounds.size == 2:  # a group of one
        return values.sum(axis=-1, keepdims=True, dtype=np.int64)
    counts = bounds[1:] - bounds[:-1]
    sums = np.zeros((*values.shape[:-1], counts.size), dtype=np.int64)
    if values.shape[-1]:
        sums[..., counts > 0] = np.add.reduceat(values, bounds[:-1][counts > 0], axis=-1)
    return sums


def rice_parameters(gaps: np.ndarray, bounds: Ints, tensor_of: Ints) -> Ints:
    """The Rice parameter ``k`` of each tensor's gaps (``gaps[bounds[i] : bounds[i + 1]]``,
    ``tensor_of``: the tensor of each): of the two next to log2(mean * ln 2) (the optimum for
    geometric gaps), the one that codes them in fewer bits."""
    counts = bounds[1:] - bounds[:-1]
    mean = np.trunc(segment_sums(gaps, bounds) / np.maximum(counts, 1) * 0.6931).astype(np.int64)
    low = np.maximum(bit_length(mean) - 1, 0)
    high = np.minimum(low + 1, 63)
    low_cost, high_cost = (
        segment_sums(gaps >> per_change(k, tensor_of), bounds) + counts * k for k in (low, high)
    )
    return np.where(low_cost <= high_cost, low, high)


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


# ------------------------------------------------------------------ bit streams
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


def _row_values(rows: ByteArray) -> np.ndarray:
    """uint64 values of (count, k ≤ 64) rows of bits, MSB first."""
    per_value = _field_bits(rows.shape[1])
    padded = np.zeros((rows.shape[0], per_value), dtype=np.uint8)
    padded[:, per_value - rows.shape[1] :] = rows
    values = np.packbits(padded, axis=1).reshape(-1).view(f">u{per_value // 8}")
    return values.astype(np.uint64)


def bits_to_fields(packed: ByteArray, k: int, count: int) -> np.ndarray:
    """Inverse of :func:`fields_to_bits`: ``count`` values of ``k`` bits, as uint64."""
    return _row_values(np.unpackbits(packed, count=count * k).reshape(count, k))


# ------------------------------------------------------------------ decoding
def decode(raw: ByteArray, nbytes: int, what: str) -> tuple[Positions, np.ndarray, int]:
    """(positions, step fields as uint64, itemsize) of a payload, every bound checked;
    :class:`FormatError` naming ``what`` for one that does not fit the ``nbytes``-byte tensor."""
    itemsize, count, k, width, at = read_header(raw, nbytes, what)
    if not count:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64), itemsize
    fields_at = at + (count * k + 7) // 8
    patches_at = fields_at + (count * width + 7) // 8
    if width == 1:  # the usual ±1-ulp steps: one bit each, two numpy calls
        fields = np.unpackbits(raw[fields_at:patches_at], count=count).astype(np.uint64)
    else:
        fields = bits_to_fields(raw[fields_at:patches_at], width, count)
    patched = f"{what} has patched steps that are truncated or out of order"
    counted = read_varint(raw, patches_at)
    if counted is None:
        raise FormatError(patched)
    patches, unary_at = counted
    index_width = (count - 1).bit_length()
    row_bits = index_width + itemsize * 8 - width
    end = unary_at + (patches * row_bits + 7) // 8
    if patches > count or (row_bits == index_width and patches) or end > raw.size:
        raise FormatError(patched)
    if patches:
        rows = np.unpackbits(raw[unary_at:end], count=patches * row_bits).reshape(patches, -1)
        indices = _row_values(rows[:, :index_width])
        if int(indices[-1]) >= count or not bool(np.all(indices[1:] > indices[:-1])):
            raise FormatError(patched)
        fields[indices.astype(np.int64)] |= _row_values(rows[:, index_width:]) << np.uint64(width)
        unary_at = end
    # The unary stream: exactly ``count`` codes, then fewer than 8 padding bits (all ones).
    ends = np.flatnonzero(np.unpackbits(raw[unary_at:]) == 0)
    positions = None
    nelements = nbytes // itemsize
    if ends.size == count and (raw.size - unary_at) * 8 - int(ends[-1]) - 1 < 8:
        quotients = np.empty(count, dtype=np.int64)  # ends[i] - ends[i-1] - 1, ends[-1] = -1
        quotients[0] = ends[0]
        np.subtract(ends[1:], ends[:-1], out=quotients[1:])
        quotients[1:] -= 1
        del ends  # its memory is reused for the gaps: freed, a big decode is 4 % faster
        if not int(quotients.max()) >> (63 - k):
            gaps = quotients.astype(np.uint64) << np.uint64(k)
            if k:
                gaps |= bits_to_fields(raw[at:fields_at], k, count)
            positions = decode_gaps(gaps, nelements)
    if positions is None:
        raise FormatError(
            f"{what} has positions that are not ascending inside its {nelements} elements; it "
            "is corrupt"
        )
    return positions, fields, itemsize


def apply(target: ByteArray, raw: ByteArray, what: str) -> None:
    """Apply the payload ``raw`` to ``target`` in place, as :func:`decode` checks it first."""
    positions, fields, itemsize = decode(raw, target.size, what)
    if positions.size:
        elements = target.view(ELEMENT_DTYPES[itemsize])
        elements[positions] = moved(elements[positions], fields.astype(elements.dtype))


def xor_at(elements: np.ndarray, positions: Positions, values: np.ndarray) -> None:
    """``elements[positions] ^= values`` (numpy raises IndexError for a position outside)."""
    elements[positions] ^= values


# ------------------------------------------------------------------ writing a group
class ByteWriter:
    """Byte values to add at byte indices, summed into one buffer by :meth:`build`, and whole
    byte runs copied in after."""

    def __init__(self) -> None:
        self._indices: list[Ints] = []
        self._values: list[np.ndarray] = []
        self._runs: list[tuple[int, ByteArray]] = []

    def put(self, at: Ints, values: np.ndarray) -> None:
        """Add ``values`` (each -255..255) to the bytes at ``at``."""
        self._indices.append(at)
        self._values.append(values)

    def streams(
        self, at: Ints, values: np.ndarray, widths: Ints, tensor_of: Ints, ordinals: Ints
    ) -> None:
        """Each tensor's ``values`` (one a change: its tensor, its index there), ``widths[t]``
        bits each, back to back from byte ``at[t]``. A group of one packs its run whole."""
        if at.size == 1:
            if widths[0] and values.size:
                self._runs.append((int(at[0]), fields_to_bits(values, int(widths[0]))))
            return
        width_of = widths[tensor_of]
        self.bits(8 * at[tensor_of] + ordinals * width_of, values, width_of)

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

    def unary(self, at: Ints, lengths: Ints, zero_bits: Ints) -> None:
        """Regions of one bits (``lengths[i]`` bytes from byte ``at[i]``) with a zero at each
        bit of ``zero_bits`` (inside a region)."""
        if at.size == 1:  # one region, packed whole
            bits = np.ones(8 * int(lengths[0]), dtype=np.uint8)
            bits[zero_bits - 8 * int(at[0])] = 0
            self._runs.append((int(at[0]), np.packbits(bits)))
            return
        total = int(lengths.sum())
        region_start = np.repeat(at - (np.cumsum(lengths) - lengths), lengths)
        self.put(region_start + np.arange(total), np.full(total, 255))
        self.put(zero_bits >> 3, -(128 >> (zero_bits & 7)))

    def build(self, size: int) -> ByteArray:
        """The ``size`` bytes written."""
        if self._indices:
            indices = np.concatenate(self._indices)
            values = np.concatenate([v.astype(np.float64, copy=False) for v in self._values])
            out = np.bincount(indices, weights=values, minlength=size)[:size].astype(np.uint8)
        else:
            out = np.zeros(size, dtype=np.uint8)
        for at, run in self._runs:
            out[at : at + run.size] = run
        return out


def groups(olds: Sequence[ByteArray], itemsizes: Sequence[int]) -> list[tuple[int, list[int]]]:
    """[(element size, indices of the tensors coded in one pass)]: a tensor over
    :data:`ALONE_BYTES` alone, the others by element size, :data:`GROUP_BYTES` at most each."""
    by_size: dict[int, list[list[int]]] = {}
    held: dict[int, int] = {}
    out: list[tuple[int, list[int]]] = []
    for index, (old, itemsize) in enumerate(zip(olds, itemsizes, strict=True)):
        size = element_size(old.size, itemsize)
        if old.size > ALONE_BYTES:
            out.append((size, [index]))
            continue
        chunks = by_size.setdefault(size, [[]])
        if chunks[-1] and held[size] + old.size > GROUP_BYTES:
            chunks.append([])
            held[size] = 0
        chunks[-1].append(index)
        held[size] = held.get(size, 0) + old.size
    return out + [(size, chunk) for size, chunks in by_size.items() for chunk in chunks]


_masks = threading.local()


def _words(data: ByteArray) -> npt.NDArray[np.uint64]:
    """``data`` as u64 words, a last partial word padded with zeros (copied only then)."""
    if data.size % 8:
        data = np.concatenate((data, np.zeros(-data.size % 8, dtype=np.uint8)))
    return data.view(np.uint64)


def _changes(
    old_bytes: Sequence[ByteArray], new_bytes: Sequence[ByteArray], itemsize: int
) -> tuple[Ints, np.ndarray, np.ndarray, Ints]:
    """(positions of the changed elements, counted over the tensors' words end to end; their
    old values; their XOR values; each tensor's first element, one more than tensors).

    The tensors are compared where they lie into one mask of :data:`CHUNK_WORDS`, its
    differing words gathered whenever it fills, while they are still in cache: copying the
    tensors end to end first cost as much again as the compare, and a mask allocated per call
    a page fault per 4 KB."""
    olds, news = [_words(o) for o in old_bytes], [_words(n) for n in new_bytes]
    dtype = ELEMENT_DTYPES[itemsize]
    shift = LOG2[8 // itemsize]  # elements per word: 2**shift
    mask = getattr(_masks, "mask", None)
    if mask is None:
        mask = _masks.mask = np.empty(CHUNK_WORDS, dtype=bool)
    word_at = np.zeros(len(olds) + 1, dtype=np.int64)
    np.cumsum([old.size for old in olds], out=word_at[1:])
    at = word_at.tolist()
    found: list[tuple[Ints, np.ndarray, np.ndarray]] = []  # (positions, old, XOR) of each
    pieces: list[tuple[int, int, int]] = []  # (tensor, its first word, where in the mask)

    def gather(filled: int) -> None:
        words = mask[:filled].nonzero()[0]
        bounds = np.searchsorted(words, [p[2] for p in pieces] + [filled]).tolist()
        parts: list[list[np.ndarray]] = [[], [], []]  # global word indices, old and new words
        for (i, first, offset), lo, hi in zip(pieces, bounds, bounds[1:], strict=False):
            if lo < hi:
                inside = words[lo:hi] + (first - offset)
                parts[0].append(inside + at[i])
                parts[1].append(olds[i][inside])
                parts[2].append(news[i][inside])
        pieces.clear()
        if parts[0]:
            indices, old_words, new_words = (
                part[0] if len(part) == 1 else np.concatenate(part) for part in parts
            )
            values = (old_words ^ new_words).view(dtype)
            inside = values.nonzero()[0]
            # Shifts, not // and %: numpy's integer division was a fifth of the chunk loop's time.
            positions = (indices[inside >> shift] << shift) | (inside & ((1 << shift) - 1))
            found.append((positions, old_words.view(dtype)[inside], values[inside]))

    filled = 0
    for i, (old, new) in enumerate(zip(olds, news, strict=True)):
        for first in range(0, old.size, CHUNK_WORDS):
            size = min(CHUNK_WORDS, old.size - first)
            if filled + size > CHUNK_WORDS:
                gather(filled)
                filled = 0
            chunk = slice(first, first + size)
            np.not_equal(old[chunk], new[chunk], out=mask[filled : filled + size])
            pieces.append((i, first, filled))
            filled += size
    gather(filled)
    if not found:
        found.append((np.zeros(0, np.int64), np.zeros(0, dtype), np.zeros(0, dtype)))
    positions, before, xored = (
        found[0] if len(found) == 1 else (np.concatenate(part) for part in zip(*found, strict=True))
    )
    return positions, before, xored, word_at << shift


def _layout(
    gaps: np.ndarray, fields: np.ndarray, k: Ints, widths: Ints, bounds: Ints, tensor_of: Ints
) -> tuple[ByteWriter, Ints, Ints, list[int]]:
    """The bodies of the group's payloads (their streams: a payload without its header and
    patch count) written into one :class:`ByteWriter`, each after the one before; returns it,
    the bodies' byte offsets (one more than tensors), each one's patch rows' offset and each
    one's patch count. Tensor ``t``'s changes are ``bounds[t] : bounds[t + 1]``."""
    counts = bounds[1:] - bounds[:-1]
    ordinals = np.arange(gaps.size) - np.repeat(bounds[:-1], counts)  # index in its tensor
    bits = 8 * fields.dtype.itemsize
    # int64 where the fields fit (numpy is faster on it than on uint64).
    wide = fields.astype(np.int64 if bits < 64 else np.uint64)
    tensor_widths = per_change(widths, tensor_of)
    shifts = tensor_widths.astype(wide.dtype)
    patched = ((wide >> shifts) * (tensor_widths < bits)).nonzero()[0]
    patches = np.bincount(tensor_of[patched], minlength=counts.size).astype(np.int64)
    index_bits = bit_length(np.maximum(counts - 1, 0))
    quotients = gaps >> per_change(k, tensor_of)
    zeros = np.cumsum(quotients + 1) - 1  # each unary code's zero bit, over all tensors
    unary_bits = segment_sums(quotients + 1, bounds)
    section_bits = (counts * k, counts * widths, patches * (index_bits + bits - widths))
    sections = (np.array((*section_bits, unary_bits)) + 7) // 8
    ends = np.cumsum(sections.T)  # each tensor's four sections, one after the other
    remainder_at, field_at, patch_at, unary_at = (ends - sections.T.ravel()).reshape(-1, 4).T
    at = np.append(remainder_at, ends[-1])
    writer = ByteWriter()
    writer.streams(remainder_at, gaps, k, tensor_of, ordinals)
    writer.streams(field_at, wide, widths, tensor_of, ordinals)
    if patched.size:
        owner = tensor_of[patched]
        row_bits = index_bits + bits - widths
        first_patch = np.cumsum(patches) - patches
        row_at = (
            8 * patch_at[owner] + (np.arange(patched.size) - first_patch[owner]) * row_bits[owner]
        )
        writer.bits(row_at, ordinals[patched], index_bits[owner])
        high = wide[patched] >> widths[owner].astype(wide.dtype)
        writer.bits(row_at + index_bits[owner], high, bits - widths[owner])
    unary_before = np.cumsum(unary_bits) - unary_bits
    writer.unary(unary_at, sections[-1], per_change(8 * unary_at - unary_before, tensor_of) + zeros)
    return writer, at, patch_at, patches.tolist()


def encode_group(
    olds: Sequence[ByteArray], news: Sequence[ByteArray], itemsize: int
) -> list[tuple[bytes, int, XorChanges]]:
    """(sparse-v2 payload, changed bytes, changes) of each tensor, all coded with
    ``itemsize``-byte elements."""
    positions, before, xored, starts = _changes(olds, news, itemsize)
    if positions.size > GROUP_CHANGES and len(olds) > 1:
        # A dense group: halved (by changes) so the pass's memory stays bounded.
        bounds = np.searchsorted(positions, starts[1:])
        half = min(max(int(np.searchsorted(bounds, positions.size // 2)) + 1, 1), len(olds) - 1)
        del positions, before, xored
        return encode_group(olds[:half], news[:half], itemsize) + (
            encode_group(olds[half:], news[half:], itemsize)
        )
    return code_changes([old.size for old in olds], positions, before, xored, starts, itemsize)


def code_changes(
    nbytes: Sequence[int],
    positions: Ints,
    before: np.ndarray,
    xored: np.ndarray,
    starts: Ints,
    itemsize: int,
) -> list[tuple[bytes, int, XorChanges]]:
    """(sparse-v2 payload, changed bytes, changes) of each of a group's tensors (``nbytes``
    each) from its changed elements, wherever they were found: ``positions`` ascending and
    counted over the tensors end to end (tensor ``t``'s first element is ``starts[t]``, one more
    start than tensors), their old and their XOR values as ``itemsize``-byte unsigned ints."""
    bounds = np.searchsorted(positions, starts)
    counts = bounds[1:] - bounds[:-1]
    firsts = bounds[:-1][counts > 0]
    tensor_of = np.repeat(np.arange(len(nbytes)), counts)
    local = positions - per_change(starts[:-1], tensor_of)
    gaps = encode_gaps(local).view(np.int64)
    gaps[firsts] = local[firsts]  # each tensor's first counts from -1
    fields = step_fields(before, before ^ xored)
    k = rice_parameters(gaps, bounds, tensor_of)
    widths = field_widths(fields, tensor_of, counts, 8 * itemsize)
    writer, at, patch_at, patches = _layout(gaps, fields, k, widths, bounds, tensor_of)
    bodies = writer.build(int(at[-1])).tobytes()
    changed_bytes = segment_sums(xored.view(np.uint8) != 0, bounds * itemsize).tolist()
    at_list, patch_list, bounds_list = at.tolist(), patch_at.tolist(), bounds.tolist()
    k_list, width_list = k.tolist(), widths.tolist()
    mark = bytes((MARK | LOG2[itemsize],))
    out = []
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds_list)):
        # The header and patch count in Python: fewer calls than numpy's varints for a group.
        parts = [mark, varint(nbytes[i]), varint(hi - lo)]
        if hi > lo:
            parts += [bytes((k_list[i], width_list[i])), bodies[at_list[i] : patch_list[i]]]
            parts += [varint(patches[i]), bodies[patch_list[i] : at_list[i + 1]]]
        out.append((b"".join(parts), changed_bytes[i], XorChanges(local[lo:hi], xored[lo:hi])))
    return out


def encode(old: ByteArray, new: ByteArray, itemsize: int) -> tuple[bytes, XorChanges]:
    """The payload turning ``old`` into ``new`` (``itemsize``-byte elements) and the changes:
    a group of one."""
    ((payload, _, changes),) = encode_group([old], [new], itemsize)
    return payload, changes


def encode_framed(
    olds: Sequence[ByteArray],
    news: Sequence[ByteArray],
    itemsizes: Sequence[int],
    tag: int,
    dense_ratio: int,
) -> list[FramedDelta | None]:
    """As the numba backend's ``encode_framed``: each tensor's payload (after the byte ``tag``
    where it is ≥ 0) in its zstd frame, the tensors in :func:`groups`; None for one whose
    payload is over ``1/dense_ratio`` of its tensor (0: never), to encode alone."""
    framed: list[FramedDelta | None] = [None] * len(olds)
    prefix = bytes((tag,)) if tag >= 0 else b""
    for size, indices in groups(olds, itemsizes):
        encoded = encode_group([olds[i] for i in indices], [news[i] for i in indices], size)
        for i, (payload, changed, changes) in zip(indices, encoded, strict=True):
            if not changed:
                framed[i] = FramedDelta(b"", 0)
            elif not dense_ratio or len(payload) * dense_ratio <= olds[i].size:
                framed[i] = FramedDelta(compress(prefix + payload), changed, changes)
    return framed

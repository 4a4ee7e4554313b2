"""Many payloads' bytes written at once with numpy: bit fields, varints and unary codes.

Each write adds byte values at byte indices; :meth:`ByteWriter.build` sums them all with one
``np.bincount``. Writes never set the same bit twice (the caller lays every field out on its own
bits), so a sum is the OR of the bits. That turns "write a field of ``w`` bits at bit offset
``b``", for thousands of fields of different widths in different payloads, into a few array
operations, where packing bits one stream at a time took several numpy calls per stream and
payload.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from deltastore.codecs.base import ByteArray

Ints = npt.NDArray[np.int64]

PIECE_BITS = 25
"""A field is written in pieces of at most this many bits: a piece at any bit offset then fits a
32-bit window of four bytes."""


def bit_length(values: Ints) -> Ints:
    """``int.bit_length`` of non-negative int64 values below 2**53 (frexp is exact there)."""
    return np.frexp(values.astype(np.float64))[1].astype(np.int64)


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

"""``sparse-v1``: deltastore's own sparse encoding (Rice-coded positions + XOR planes).

A reference reader does not know the name and refuses the version; deltastore reads it. The
store wraps the payload in one zstd-1 frame per tensor like every encoding's; the values inside
are already zstd-1 compressed, and the positions are Rice-coded (near their entropy), so that
outer frame finds nothing to squeeze and costs little (the payload is small). All integers are
little-endian::

    offset  size                 field
    0       3                    magic b"DSS"
    3       1                    itemsize: element size in bytes (1, 2, 4 or 8)
    4       1                    k: Rice parameter of the gaps (bits kept verbatim)
    5       1                    value coding: 0 = old XOR new, byte planes, one zstd-1 frame
    6       8                    nbytes: the tensor's size in bytes
    14      8                    count: number of changed elements
    22      8                    unary_bits: length of the unary stream in bits
    30      8                    values_len: size of the values frame in bytes
    38      ceil(unary_bits/8)   unary stream: per gap, (gap >> k) one bits then a zero bit
    ..      ceil(count*k/8)      remainder stream: per gap, its low k bits
    ..      values_len           zstd-1 frame of the value planes: byte 0 of every changed
                                 element's XOR, then byte 1, ... (count*itemsize bytes)

Bit streams are MSB first, zero-padded to a byte. Element ``i`` is bytes
``[i*itemsize, (i+1)*itemsize)``; ``gap = position - previous position - 1`` with the first
previous position -1. At 0.4 % density a Rice code spends about 9.5 bits per gap (the entropy
of such gaps is about 9.4), where zstd-1 over u16 gap planes spends 10.5. Byte planes put the
XOR bytes that look alike together (the high bytes of ±1-ulp changes are nearly all zero).
Positions are u64, so tensors over 4 GiB are fine.

Applying XORs the values in, so applying twice reverts (like ``xor``): not idempotent.
"""

from __future__ import annotations

import struct

import numpy as np

from deltastore.codecs.base import ByteArray, EncodedDelta, Encoding, XorChanges
from deltastore.codecs.compression import compress, decompress
from deltastore.codecs.kernels import (
    ELEMENT_DTYPES,
    changed_elements,
    decode_gaps,
    element_size,
    encode_gaps,
    from_planes,
    rice_decode,
    rice_encode,
    rice_parameter,
    to_planes,
)
from deltastore.errors import FormatError

MAGIC = b"DSS"
HEADER = struct.Struct("<3sBBBQQQQ")
VALUES_XOR = 0


def _bounded_k(nelements: int) -> int:
    """The largest Rice parameter a payload may use: gaps are below ``nelements``."""
    return min(63, nelements.bit_length() + 1)


class SparseXorEncoding(Encoding):
    """Rice-coded gaps between changed elements and their XOR values as zstd'd byte planes."""

    name = "sparse-v1"
    idempotent = False
    checks_before_writing = True
    """Every bound of a payload is checked before the target is written."""
    self_inverse = True
    """Values are XORed in: applying a payload to its own result restores the bytes."""
    foldable = False
    """Two payloads do not combine into one without decoding both."""
    exact_payload_size = False
    """The payload's size depends on how many elements changed."""

    def encode(self, old: ByteArray, new: ByteArray, *, itemsize: int = 1) -> EncodedDelta:
        """Payload turning ``old`` into ``new``; ``itemsize`` is the tensor's element size in
        bytes (an odd size, or one that does not divide the tensor, falls back to bytes)."""
        size = element_size(old.size, itemsize)
        positions, values = changed_elements(old, new, size)
        gaps = encode_gaps(positions)
        k = rice_parameter(gaps)
        unary, unary_bits, remainders = rice_encode(gaps, k)
        frame = compress(memoryview(to_planes(values))) if values.size else b""
        header = HEADER.pack(
            MAGIC, size, k, VALUES_XOR, old.size, values.size, unary_bits, len(frame)
        )
        payload = b"".join((header, unary.data, remainders.data, frame))
        return EncodedDelta(
            payload,
            int(np.count_nonzero(values.view(np.uint8))),
            XorChanges(positions, values),
        )

    def max_payload_size(self, nbytes: int) -> int:
        # At most one change per byte; the unary stream holds at most sum(gaps) + count ≤ 2n
        # bits; remainders at most the largest k per change; the values frame a zstd bound.
        k = _bounded_k(nbytes)
        return HEADER.size + nbytes // 4 + 1 + (nbytes * k + 7) // 8 + nbytes + nbytes // 128 + 512

    def decode(
        self, payload: bytes | memoryview, nbytes: int, *, tensor: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """(element positions as int64, XOR values) of a payload, every bound checked first."""
        raw = np.frombuffer(payload, dtype=np.uint8)
        what = f"sparse-v1 payload of tensor {tensor!r}"
        if raw.size < HEADER.size:
            raise FormatError(
                f"{what} is truncated: {raw.size} bytes, the header alone has {HEADER.size}"
            )
        magic, itemsize, k, coding, declared, count, unary_bits, values_len = HEADER.unpack_from(
            raw
        )
        if magic != MAGIC or coding != VALUES_XOR:
            raise FormatError(f"{what} does not start with a sparse-v1 header; it is corrupt")
        if declared != nbytes:
            raise FormatError(
                f"{what} was made for a {declared}-byte tensor, the local one has {nbytes}; "
                "the delta was made for another checkpoint"
            )
        if itemsize not in ELEMENT_DTYPES or nbytes % itemsize:
            raise FormatError(f"{what} declares element size {itemsize} for {nbytes} bytes")
        nelements = nbytes // itemsize
        if k > _bounded_k(nelements) or count > nelements or unary_bits > 2 * nelements + count:
            raise FormatError(
                f"{what} declares {count} changes in {unary_bits} unary bits with k={k} for "
                f"{nelements} elements; it is corrupt"
            )
        unary_end = HEADER.size + (unary_bits + 7) // 8
        values_start = unary_end + (count * k + 7) // 8
        if raw.size != values_start + values_len or bool(count) != bool(values_len):
            raise FormatError(
                f"{what} declares {count} changed elements but holds {raw.size} bytes "
                f"(expected {values_start + values_len})"
            )
        gaps = rice_decode(
            raw[HEADER.size : unary_end], unary_bits, raw[unary_end:values_start], k, count
        )
        positions = None if gaps is None else decode_gaps(gaps, nelements)
        if positions is None:
            raise FormatError(
                f"{what} has positions that are not ascending inside its {nelements} elements; "
                "it is corrupt"
            )
        values = np.zeros(0, dtype=np.uint8)
        if count:
            values = np.frombuffer(
                decompress(
                    raw[values_start:].data,
                    max_size=count * itemsize,
                    exact_size=count * itemsize,
                    what=f"values of {what}",
                ),
                dtype=np.uint8,
            )
        return positions, from_planes(values, itemsize)

    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        positions, values = self.decode(payload, target.size, tensor=tensor)
        if positions.size:
            elements = target.view(values.dtype)
            elements[positions] ^= values

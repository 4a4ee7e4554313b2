"""``sparse-v1``: deltastore's own sparse encoding (positions of changed elements + XOR planes).

A reference reader does not know the name and refuses the version; deltastore reads it. The
payload is raw (the store wraps it in one zstd-1 frame per tensor like every encoding), all
integers little-endian::

    offset  size            field
    0       3               magic b"DSS"
    3       1               itemsize: element size in bytes (1, 2, 4 or 8)
    4       1               width: bytes per position gap (1, 2, 4 or 8)
    5       1               value coding: 0 = old XOR new
    6       8               nbytes: the tensor's size in bytes
    14      8               count: number of changed elements
    22      count*width     gap planes: byte j of every (gap - 1), for j = 0..width-1
    ..      count*itemsize  value planes: byte k of every changed element's XOR, k = 0..itemsize-1

Element ``i`` of the tensor is bytes ``[i*itemsize, (i+1)*itemsize)``; positions are element
indices, ascending; the first gap counts from -1. Byte planes group the bytes that look alike
(the high bytes of small gaps and of ±1-ulp XORs are nearly all zero), which is what lets
zstd-1 shrink them. Positions are u64 at most, so tensors over 4 GiB are fine.

Applying XORs the values in, so applying twice reverts (like ``xor``): not idempotent.
"""

from __future__ import annotations

import struct

import numpy as np

from deltastore.codecs.base import ByteArray, EncodedDelta, Encoding
from deltastore.codecs.kernels import (
    ELEMENT_DTYPES,
    changed_elements,
    decode_gaps,
    element_size,
    encode_gaps,
    from_planes,
    to_planes,
)
from deltastore.errors import FormatError

MAGIC = b"DSS"
HEADER = struct.Struct("<3sBBBQQ")
VALUES_XOR = 0


def _narrowest_width(largest: int) -> int:
    return next((w for w in (1, 2, 4) if largest < 1 << (8 * w)), 8)


class SparseXorEncoding(Encoding):
    """Gap-coded positions of changed elements and their XOR values as byte planes."""

    name = "sparse-v1"
    idempotent = False
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
        header = HEADER.pack(MAGIC, size, gaps.dtype.itemsize, VALUES_XOR, old.size, values.size)
        payload = np.empty(HEADER.size + gaps.nbytes + values.nbytes, dtype=np.uint8)
        payload[: HEADER.size] = np.frombuffer(header, dtype=np.uint8)
        payload[HEADER.size : HEADER.size + gaps.nbytes] = to_planes(gaps)
        payload[HEADER.size + gaps.nbytes :] = to_planes(values)
        changed = int(np.count_nonzero(values.view(np.uint8)))
        return EncodedDelta(memoryview(payload), changed)

    def max_payload_size(self, nbytes: int) -> int:
        # At most one changed element per byte, each gap narrower than the tensor is long.
        return HEADER.size + nbytes * (1 + _narrowest_width(max(nbytes - 1, 0)))

    def decode(
        self, payload: bytes | memoryview, nbytes: int, *, tensor: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """(element positions as int64, XOR values) of a payload, every bound checked first."""
        raw = np.frombuffer(payload, dtype=np.uint8)
        what = f"sparse-v1 payload of tensor {tensor!r}"
        if raw.size < HEADER.size:
            raise FormatError(f"{what} is truncated: {raw.size} bytes, the header alone has 22")
        magic, itemsize, width, coding, declared, count = HEADER.unpack_from(raw)
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
        if width not in ELEMENT_DTYPES or width > _narrowest_width(max(nelements - 1, 0)):
            raise FormatError(f"{what} declares {width}-byte gaps for {nelements} elements")
        if count > nelements or raw.size != HEADER.size + count * (width + itemsize):
            raise FormatError(
                f"{what} declares {count} changed elements of {nelements} but holds "
                f"{raw.size} bytes (expected {HEADER.size + count * (width + itemsize)})"
            )
        gaps_end = HEADER.size + count * width
        positions = decode_gaps(from_planes(raw[HEADER.size : gaps_end], width), nelements)
        if positions is None:
            raise FormatError(
                f"{what} has positions that are not ascending inside its {nelements} elements; "
                "it is corrupt"
            )
        return positions, from_planes(raw[gaps_end:], itemsize)

    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        positions, values = self.decode(payload, target.size, tensor=tensor)
        if positions.size:
            elements = target.view(values.dtype)
            elements[positions] ^= values

"""The reference encodings, ``xor`` and ``overwrite``, and the encodings removed since."""

from __future__ import annotations

import struct

import numpy as np

from deltastore.codecs.base import ByteArray, EncodedDelta, Encoding
from deltastore.errors import ConfigError, FormatError

_U32_LIMIT = 2**32
REMOVED_ENCODINGS = {
    "sparse-v1": (
        "sparse-v1 was removed (sparse-v2 replaced it); have the trainer publish a full "
        "version (publish(..., full=True) or `deltastore publish --full`) and pull that"
    ),
}
"""What to do about a version written with an encoding this deltastore no longer reads."""


class XorEncoding(Encoding):
    """``new XOR old``: smallest on the wire, fastest to apply, but applying twice reverts."""

    name = "xor"
    idempotent = False
    checks_before_writing = True
    self_inverse = True
    foldable = True
    exact_payload_size = True
    reference_format = True

    def encode(self, old: ByteArray, new: ByteArray, *, itemsize: int = 1) -> EncodedDelta:
        delta = np.bitwise_xor(old, new)
        return EncodedDelta(memoryview(delta), int(np.count_nonzero(delta)))

    def max_payload_size(self, nbytes: int) -> int:
        return nbytes

    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        delta = np.frombuffer(payload, dtype=np.uint8)
        if delta.size != target.size:
            raise FormatError(
                f"xor payload of tensor {tensor!r} has {delta.size} bytes, the tensor has "
                f"{target.size}; the delta is corrupt or was made for another checkpoint"
            )
        np.bitwise_xor(target, delta, out=target)

    def fold(self, folded: ByteArray, later: bytes | memoryview, *, tensor: str) -> ByteArray:
        self.apply(folded, later, tensor=tensor)  # XORs of the same size combine by XOR
        return folded


class OverwriteEncoding(Encoding):
    """``u32 count ‖ u32 positions[count] ‖ u8 values[count]``: idempotent, larger, ≤ 4 GiB."""

    name = "overwrite"
    idempotent = True
    reference_format = True
    checks_before_writing = True

    def check_size(self, nbytes: int, *, tensor: str) -> None:
        # u32 positions address bytes 0..2**32-1, and the u32 count must hold the number of
        # changed bytes, which can be the whole tensor: 2**32 bytes is already one too many.
        if nbytes >= _U32_LIMIT:
            raise ConfigError(
                f"tensor {tensor!r} has {nbytes} bytes: the overwrite encoding's u32 byte "
                "positions and count cannot describe a tensor of 4 GiB or more; publish it "
                "with encoding='xor'"
            )

    def encode(self, old: ByteArray, new: ByteArray, *, itemsize: int = 1) -> EncodedDelta:
        self.check_size(old.size, tensor="?")
        positions = np.flatnonzero(old != new).astype("<u4")
        values = new[positions]
        payload = struct.pack("<I", positions.size) + positions.tobytes() + values.tobytes()
        return EncodedDelta(payload, int(positions.size))

    def max_payload_size(self, nbytes: int) -> int:
        return 4 + 5 * nbytes

    def decode(
        self, payload: bytes | memoryview, nbytes: int, *, tensor: str
    ) -> tuple[ByteArray, ByteArray]:
        """Split a payload into (positions, values), checking every bound first."""
        raw = np.frombuffer(payload, dtype=np.uint8)
        if raw.size < 4:
            raise FormatError(f"overwrite payload of tensor {tensor!r} is truncated")
        (count,) = struct.unpack_from("<I", raw[:4].tobytes())
        if raw.size != 4 + 5 * count:
            raise FormatError(
                f"overwrite payload of tensor {tensor!r} declares {count} positions but holds "
                f"{raw.size} bytes (expected {4 + 5 * count})"
            )
        positions = raw[4 : 4 + 4 * count].view("<u4")
        values = raw[4 + 4 * count :]
        if count and int(positions.max()) >= nbytes:
            raise FormatError(
                f"overwrite payload of tensor {tensor!r} writes byte {int(positions.max())} of a "
                f"{nbytes}-byte tensor; the delta is corrupt or was made for another checkpoint"
            )
        return positions, values

    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        positions, values = self.decode(payload, target.size, tensor=tensor)
        target[positions] = values

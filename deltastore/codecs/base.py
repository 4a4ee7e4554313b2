"""The codec contract: encodings and checksums work on raw bytes, never on stores or files.

An :class:`Encoding` turns a tensor's old and new bytes into a payload and applies a payload to
bytes in place. A :class:`Checksum` turns bytes into the reference hex digest. Both operate on
1-D ``uint8`` numpy arrays (the raw little-endian storage bytes of a tensor), so every dtype is
handled the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

ByteArray = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class EncodedDelta:
    """An encoded (not yet compressed) delta payload."""

    payload: bytes | memoryview
    changed_bytes: int
    """How many bytes of the tensor differ between old and new."""


class Encoding(ABC):
    """A byte-level, dtype-blind delta encoding."""

    name: ClassVar[str]
    idempotent: ClassVar[bool]
    """True when applying the same payload twice gives the same bytes as applying it once."""

    def check_size(self, nbytes: int, *, tensor: str) -> None:  # noqa: B027 - optional hook
        """Raise :class:`ConfigError` if this encoding cannot represent a tensor of this size."""

    @abstractmethod
    def encode(self, old: ByteArray, new: ByteArray) -> EncodedDelta:
        """Payload that turns ``old`` into ``new`` (both 1-D uint8 of equal length)."""

    @abstractmethod
    def max_payload_size(self, nbytes: int) -> int:
        """Largest valid decompressed payload for a tensor of ``nbytes`` bytes."""

    @abstractmethod
    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        """Apply ``payload`` to the writable 1-D uint8 ``target`` in place.

        Raises :class:`FormatError` (naming ``tensor``) if the payload does not fit the target.
        """


class Checksum(ABC):
    """A digest of a tensor's full bytes, in the reference hex form."""

    name: ClassVar[str]
    hex_length: ClassVar[int]

    @abstractmethod
    def hexdigest(self, data: ByteArray | bytes | memoryview) -> str:
        """Lower-case hex digest of ``data``."""

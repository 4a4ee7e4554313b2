"""The codec contract: encodings and checksums work on raw bytes, never on stores or files:
1-D ``uint8`` numpy arrays (a tensor's little-endian storage bytes), so every dtype is handled
the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from deltastore.codecs.compression import PayloadBatch, compress
from deltastore.errors import FormatError

ByteArray = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class EncodedDelta:
    """An encoded (not yet compressed) delta payload."""

    payload: bytes | memoryview
    changed_bytes: int
    """How many bytes of the tensor differ between old and new."""
    xor_changes: XorChanges | None = None
    """The change as element positions and XOR values, where the encoding found them anyway
    (sparse encodings): the publisher applies these to its snapshot instead of the payload."""


@dataclass(frozen=True)
class XorChanges:
    """Changed elements of a tensor: ``elements[positions] ^= values`` turns old into new
    (:func:`deltastore.codecs.apply_changes` does it)."""

    positions: npt.NDArray[np.int64]
    """Ascending element indices."""
    values: np.ndarray
    """``old XOR new`` of each, as unsigned little-endian ints of the element size."""

    @property
    def nbytes(self) -> int:
        return int(self.positions.nbytes + self.values.nbytes)


@dataclass(frozen=True)
class FramedDelta:
    """One tensor's delta as the store keeps it: the payload's zstd frame (empty where nothing
    changed); ``changed_bytes`` and ``xor_changes`` as in :class:`EncodedDelta`."""

    frame: bytes
    changed_bytes: int
    xor_changes: XorChanges | None = None


class Encoding(ABC):
    """A byte-level delta encoding; it declares its semantics as class attributes, so callers
    (the pull side, repair) ask the encoding instead of comparing names."""

    name: ClassVar[str]
    idempotent: ClassVar[bool]
    """Applying the same payload twice gives the bytes of applying it once."""
    self_inverse: ClassVar[bool] = False
    """Applying a payload to its own result gives back the original bytes (so a written tensor
    is put back by applying its payloads again, newest first)."""
    foldable: ClassVar[bool] = False
    """:meth:`fold` combines the payloads of consecutive versions into one, applied once."""
    exact_payload_size: ClassVar[bool] = False
    """A decompressed payload always has exactly the tensor's byte size (so a frame declaring
    any other size is refused before it is decompressed)."""
    reference_format: ClassVar[bool] = False
    """Reference readers know the encoding, so its delta shards keep their layout (one entry
    per tensor); shards of any other encoding are packed."""
    checks_before_writing: ClassVar[bool] = False
    """:meth:`apply` refuses a payload that does not fit before it writes a byte of the target
    (so a self-inverse one may be applied straight into the target and put back)."""
    applies_in_batches: ClassVar[bool] = False
    """:meth:`apply_batch` takes fewer calls than one per payload (so a caller should hand many
    small payloads over together); False when it is :meth:`apply` in a loop."""

    def check_size(self, nbytes: int, *, tensor: str) -> None:  # noqa: B027 - optional hook
        """Raise :class:`ConfigError` if this encoding cannot represent a tensor of this size."""

    @abstractmethod
    def encode(self, old: ByteArray, new: ByteArray, *, itemsize: int = 1) -> EncodedDelta:
        """Payload that turns ``old`` into ``new`` (both 1-D uint8 of equal length); ``itemsize``
        is the tensor's element size in bytes (byte-level encodings ignore it)."""

    def encode_framed(
        self, olds: Sequence[ByteArray], news: Sequence[ByteArray], itemsizes: Sequence[int]
    ) -> list[FramedDelta]:
        """Each tensor's delta of a batch, its payload in a zstd frame (level 1, content size;
        what the store writes), an empty frame for an unchanged tensor: frames that decompress
        to the payloads :meth:`encode` gives (an override may encode the batch in one call)."""
        framed = []
        for old, new, itemsize in zip(olds, news, itemsizes, strict=True):
            delta = self.encode(old, new, itemsize=itemsize)
            frame = compress(delta.payload) if delta.changed_bytes else b""
            framed.append(FramedDelta(frame, delta.changed_bytes, delta.xor_changes))
        return framed

    def encode_changes(
        self, old: ByteArray, changes: XorChanges, *, itemsize: int = 1
    ) -> FramedDelta:
        """:meth:`encode_framed` of one tensor whose new bytes are ``old`` with ``changes``
        XORed in: a diff found elsewhere (on the trainer's device), the same frame contents as
        from the new bytes. This default builds those bytes; an override codes the changes."""
        new = old.copy()
        if changes.positions.size:
            new.view(changes.values.dtype)[changes.positions] ^= changes.values
        (framed,) = self.encode_framed([old], [new], [itemsize])
        return framed

    @abstractmethod
    def max_payload_size(self, nbytes: int) -> int:
        """Largest valid decompressed payload for a tensor of ``nbytes`` bytes."""

    @abstractmethod
    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        """Apply ``payload`` to the writable 1-D uint8 ``target`` in place; :class:`FormatError`
        (naming ``tensor``) if the payload does not fit the target."""

    def apply_batch(
        self,
        target: ByteArray,
        starts: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        payloads: PayloadBatch,
        names: Sequence[str],
    ) -> tuple[int, FormatError | None]:
        """Apply ``payloads[i]`` to ``target[starts[i] : starts[i] + sizes[i]]`` in order, in
        place, stopping at the first that does not fit: (how many were applied, the
        :class:`FormatError` naming ``names[i]`` of the one refused, or None), so the caller
        records the applied ones before it raises. An override may apply them in one call."""
        for i, name in enumerate(names):
            view = target[int(starts[i]) : int(starts[i]) + int(sizes[i])]
            try:
                self.apply(view, payloads[i], tensor=name)
            except FormatError as exc:
                return i, exc
        return len(names), None

    def fold(self, folded: ByteArray, later: bytes | memoryview, *, tensor: str) -> ByteArray:
        """One payload equal to applying ``folded`` (a writable array the caller owns, which may
        be updated in place and returned) and then ``later``, only if ``foldable``; raises
        :class:`FormatError` (naming ``tensor``) if the payloads disagree."""
        raise NotImplementedError(f"encoding {self.name!r} is not foldable")


class Checksum(ABC):
    """A digest of a tensor's full bytes, in the reference hex form."""

    name: ClassVar[str]
    hex_length: ClassVar[int]

    @abstractmethod
    def hexdigest(self, data: ByteArray | bytes | memoryview) -> str:
        """Lower-case hex digest of ``data``."""

    def hasher(self) -> Hasher:
        """A digest fed piece by piece: ``update`` with consecutive slices, then ``hexdigest``
        equals :meth:`hexdigest` of their concatenation (this default keeps the pieces)."""
        return _KeptPieces(self)


class Hasher(Protocol):
    """An incremental digest (see :meth:`Checksum.hasher`)."""

    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


class _KeptPieces:
    def __init__(self, checksum: Checksum) -> None:
        self._checksum = checksum
        self._pieces = bytearray()

    def update(self, data: bytes | memoryview, /) -> None:
        self._pieces += data

    def hexdigest(self) -> str:
        return self._checksum.hexdigest(bytes(self._pieces))


@dataclass(frozen=True)
class Digest:
    """A digest of a tensor's full bytes, with the checksum algorithm that made it."""

    checksum: Checksum
    hex: str
    """Lower-case hex digest, ``checksum.hex_length`` characters."""

    def matches(self, data: ByteArray | bytes | memoryview) -> bool:
        return self.checksum.hexdigest(data) == self.hex

    @classmethod
    def of(cls, checksum: Checksum, data: ByteArray | bytes | memoryview) -> Digest:
        return cls(checksum, checksum.hexdigest(data))

"""Applying a tensor's run of payloads in memory, and putting a written tensor back.

Everything here asks the encoding what it allows (:class:`~deltastore.codecs.Encoding`'s
``foldable``, ``self_inverse``, ``exact_payload_size``); nothing compares encoding names, so a
new encoding needs no change here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from deltastore.codecs import ByteArray, Encoding, decompress, get_encoding
from deltastore.errors import FormatError
from deltastore.format.payload import PayloadRef
from deltastore.pull.result import ApplyStats
from deltastore.storage import VersionStore


def read_payloads(
    store: VersionStore, payloads: Sequence[PayloadRef], stats: ApplyStats | None
) -> list[bytes]:
    """The compressed frames of ``payloads``, one ranged read each."""
    frames = [store.read_range(p.version, p.shard, p.start, p.end) for p in payloads]
    if stats is not None:
        stats.add(payloads=len(frames), bytes_read=sum(len(f) for f in frames))
    return frames


def fold_apply(
    current: ByteArray,
    payloads: Sequence[PayloadRef],
    frames: Sequence[bytes | memoryview],
    name: str,
    *,
    in_place: bool = False,
) -> ByteArray:
    """``current`` with ``payloads`` applied in order, as a new array (``current`` untouched),
    or into ``current`` itself when ``in_place`` (see :func:`applies_in_place`).

    Consecutive payloads of one foldable encoding are folded into one and applied once.
    Raises :class:`FormatError` naming the version whose payload does not fit.
    """
    nbytes = current.size
    result = current if in_place else current.copy()
    folded: ByteArray | None = None
    owned = False  # whether `folded` is a private copy (a frame's bytes are read-only)
    folding: Encoding | None = None
    last_version = 0

    def apply_folded() -> None:
        nonlocal folded, folding
        if folded is not None and folding is not None:
            _apply(folding, result, folded, name, last_version)
        folded, folding = None, None

    for payload, frame in zip(payloads, frames, strict=True):
        encoding = get_encoding(payload.encoding)
        raw = decompress(  # its declared size checked before allocating
            frame,
            max_size=encoding.max_payload_size(nbytes),
            exact_size=nbytes if encoding.exact_payload_size else None,
            what=f"{payload.where} payload of tensor {name!r}",
        )
        if folding is not None and encoding is not folding:
            apply_folded()
        if not encoding.foldable:
            _apply(encoding, result, raw, name, payload.version)
            continue
        try:
            if folded is None:
                # One payload (the common case) is applied straight from its decompressed
                # bytes; a private copy is made only when a second one folds into it.
                folded, folding, owned = np.frombuffer(raw, dtype=np.uint8), encoding, False
            else:
                if not owned:
                    folded, owned = folded.copy(), True
                folded = encoding.fold(folded, raw, tensor=name)
        except FormatError as exc:
            raise FormatError(f"{payload.where}: {exc}") from None
        last_version = payload.version
    apply_folded()
    return result


def applies_in_place(payloads: Sequence[PayloadRef]) -> bool:
    """True when ``payloads`` may be applied straight into the tensor's mapped bytes: one
    encoding, foldable (every payload is decompressed, size-checked and folded before the
    tensor is touched) and self-inverse (applying them again puts the old bytes back)."""
    encodings = {get_encoding(p.encoding) for p in payloads}
    if len(encodings) != 1:
        return False
    (encoding,) = encodings
    return encoding.foldable and encoding.self_inverse


def batches_in_place(payloads: Sequence[PayloadRef]) -> bool:
    """True when a tensor's ``payloads`` may go into a batch applied straight into the map:
    one payload of a self-inverse encoding that checks a payload whole before it writes (a
    refused one leaves the tensor untouched, a written one that does not verify is put back
    by applying it again) and applies in batches (``xor`` does not: its payloads are the
    tensor's size, and joining them costs more than the calls it saves)."""
    if len(payloads) != 1:
        return False
    encoding = get_encoding(payloads[0].encoding)
    return encoding.self_inverse and encoding.checks_before_writing and encoding.applies_in_batches


def _apply(
    encoding: Encoding, target: ByteArray, raw: bytes | ByteArray, name: str, version: int
) -> None:
    try:
        encoding.apply(target, memoryview(raw), tensor=name)
    except FormatError as exc:
        raise FormatError(f"weight_v{version:06d}: {exc}") from None


@dataclass(frozen=True)
class UndoRecord:
    """What it takes to put one written tensor back to the bytes it held before.

    ``frames`` when every payload's encoding is self-inverse (small: the payloads are applied
    again, newest first); else the ``positions`` the write changes and their old ``values``.
    """

    payloads: tuple[PayloadRef, ...]
    frames: tuple[bytes | memoryview, ...] | None = None
    positions: npt.NDArray[np.intp] | None = None
    values: ByteArray | None = None

    @classmethod
    def of(
        cls,
        before: ByteArray,
        after: ByteArray,
        payloads: Sequence[PayloadRef],
        frames: Sequence[bytes | memoryview],
    ) -> UndoRecord:
        """The cheapest record that restores ``before`` from ``after``."""
        if all(get_encoding(p.encoding).self_inverse for p in payloads):
            return cls(tuple(payloads), frames=tuple(frames))
        positions = np.flatnonzero(before != after)
        return cls(tuple(payloads), positions=positions, values=before[positions].copy())

    def restore(self, view: ByteArray, name: str) -> None:
        """Write the old bytes back into ``view`` (the tensor as it was written)."""
        if self.frames is not None:
            view[:] = fold_apply(view, self.payloads[::-1], self.frames[::-1], name)
        else:
            assert self.positions is not None and self.values is not None
            view[self.positions] = self.values

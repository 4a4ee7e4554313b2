"""``auto``: per tensor, the smaller of ``xor`` and ``sparse-v2``, tagged.

The index names ``auto`` as the version's delta encoding (a reference reader refuses it, as it
does any name it does not know). Each tensor's payload starts with one tag byte saying which
encoding follows; the rest is that encoding's payload, unchanged::

    0x00 ‖ xor payload        (new XOR old, the tensor's full size)
    0x02 ‖ sparse-v2 payload  (see deltastore.codecs.sparse_format)

Tag 1 was the removed ``sparse-v1``: a payload carrying it is refused with what to do. So the
choice travels with the bytes it describes: no side table in the index or the shard metadata,
and a reader needs nothing but the payload. Every choice is self-inverse, so an ``auto`` payload
applied twice reverts, like ``xor``. A deltastore older than ``sparse-v2`` refuses tag 2 with a
message that says to upgrade.

The choice: sparse-v2 is encoded first (one pass over each input). When its payload is at most
1/16 of the tensor it is kept without trying anything else: at that density its bit-packed
streams are smaller than a zstd-1 frame of a XOR array of zero runs. Otherwise (a dense change,
rare in a training step) the XOR is compressed with the store's zstd-1 too and the smaller is
kept: such a tensor costs two extra passes. Building positions costs up to 24 bytes of memory
per changed element while a tensor is encoded (position, step field, XOR value; the compiled
encoder's growing buffers hold up to twice that for a moment).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from deltastore.codecs.base import ByteArray, EncodedDelta, Encoding, FramedDelta, PayloadBatch
from deltastore.codecs.compression import compress
from deltastore.codecs.encodings import REMOVED_ENCODINGS, XorEncoding
from deltastore.codecs.sparse import CompactSparseEncoding, apply_batch, encode_framed_batch
from deltastore.codecs.sparse_format import TAG_COMPACT, TAG_SPARSE_V1, TAG_XOR
from deltastore.errors import FormatError

SPARSE_WITHOUT_COMPARING = 16
"""A sparse-v2 payload at most 1/16 of the tensor is kept without trying the others."""


def _tagged(tag: int, payload: bytes | memoryview) -> memoryview:
    out = np.empty(1 + len(payload), dtype=np.uint8)
    out[0] = tag
    out[1:] = np.frombuffer(payload, dtype=np.uint8)
    return memoryview(out)


class AutoEncoding(Encoding):
    """Per tensor, whichever of ``xor`` and ``sparse-v2`` is smaller on the wire."""

    name = "auto"
    idempotent = False
    checks_before_writing = True
    """Every bound of a payload is checked before the target is written."""
    applies_in_batches = True
    """With numba, one compiled call per batch."""
    self_inverse = True
    """Values are XORed in: applying a payload to its own result restores the bytes."""
    foldable = False
    """Payloads of different encodings do not combine without decoding."""
    exact_payload_size = False
    """The payload's size depends on the choice and on how many elements changed."""

    def __init__(self, *, use_jit: bool | None = None) -> None:
        """``use_jit`` as for :class:`CompactSparseEncoding`."""
        self.xor = XorEncoding()
        self.compact = CompactSparseEncoding(use_jit=use_jit)

    def choose(
        self, old: ByteArray, new: ByteArray, *, itemsize: int = 1
    ) -> tuple[int, EncodedDelta]:
        """(tag, inner delta) of the smallest encoding for this tensor (see the module's notes)."""
        compact = self.compact.encode(old, new, itemsize=itemsize)
        if len(compact.payload) * SPARSE_WITHOUT_COMPARING <= old.size:
            return TAG_COMPACT, compact
        dense = self.xor.encode(old, new)
        if len(compact.payload) <= len(compress(dense.payload)):  # sparse-v2 on a tie
            return TAG_COMPACT, compact
        return TAG_XOR, dense

    def encode(self, old: ByteArray, new: ByteArray, *, itemsize: int = 1) -> EncodedDelta:
        """Tagged payload of the smaller encoding; ``itemsize`` as for ``sparse-v2``."""
        tag, inner = self.choose(old, new, itemsize=itemsize)
        return EncodedDelta(_tagged(tag, inner.payload), inner.changed_bytes, inner.xor_changes)

    def encode_framed(
        self, olds: Sequence[ByteArray], news: Sequence[ByteArray], itemsizes: Sequence[int]
    ) -> list[FramedDelta]:
        """As :meth:`Encoding.encode_framed`: where numba is available, a batch's sparse-v2
        payloads in one backend call, and only a tensor whose
        payload is over 1/16 of it encoded again alone to compare the others."""
        return encode_framed_batch(
            self,
            olds,
            news,
            itemsizes,
            use_jit=self.compact.use_jit,
            tag=TAG_COMPACT,
            dense_ratio=SPARSE_WITHOUT_COMPARING,
        )

    def max_payload_size(self, nbytes: int) -> int:
        return 1 + max(self.xor.max_payload_size(nbytes), self.compact.max_payload_size(nbytes))

    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        raw = memoryview(payload).cast("B")
        if not len(raw):
            raise FormatError(f"auto payload of tensor {tensor!r} is empty; it is corrupt")
        tag, inner = raw[0], raw[1:]
        if tag == TAG_COMPACT:
            self.compact.apply(target, inner, tensor=tensor)
        elif tag == TAG_XOR:
            self.xor.apply(target, inner, tensor=tensor)
        elif tag == TAG_SPARSE_V1:
            raise FormatError(
                f"auto payload of tensor {tensor!r} is coded with sparse-v1 (tag 1), which "
                f"deltastore no longer reads; {REMOVED_ENCODINGS['sparse-v1']}"
            )
        else:
            raise FormatError(
                f"auto payload of tensor {tensor!r} names encoding tag {tag}, which this "
                "deltastore does not know (0 = xor, 2 = sparse-v2); upgrade deltastore"
            )

    def apply_batch(
        self,
        target: ByteArray,
        starts: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        payloads: PayloadBatch,
        names: Sequence[str],
    ) -> tuple[int, FormatError | None]:
        """One compiled call for the whole batch where numba is installed; else one by one."""
        return apply_batch(
            self, self.compact.use_jit, target, starts, sizes, payloads, names, tagged=True
        )

"""``sparse-v2``: deltastore's compact sparse encoding (varint header, Rice gaps, ulp steps).

A header of a few bytes, so it suits small tensors as well as large ones. The store wraps every
payload in one zstd-1 frame as for any encoding; inside, nothing is compressed again (the
streams are near their entropy already, so the outer frame stores them as they are). A
reference reader does not know the name and refuses the version. Layout (bit streams MSB first)::

    byte 0      0x20 | log2(itemsize)      itemsize: element size, 1, 2, 4 or 8 bytes
    varint      nbytes                     the tensor's size in bytes
    varint      count                      changed elements
    (only when count > 0:)
    byte        k                          Rice parameter of the gaps (≤ 63)
    byte        w                          width of a step field (0 .. 8*itemsize)
    ceil(count*k/8) bytes                  remainders: per gap, its low k bits (zero-padded)
    ceil(count*w/8) bytes                  step fields: the low w bits of each (zero-padded)
    varint      patches                    fields wider than w (0 when w = 8*itemsize)
    ceil(patches*(i+8*itemsize-w)/8) bytes per patch: its index among the fields (i =
                                           bit_length(count - 1) bits, ascending) and the
                                           field's high 8*itemsize - w bits (zero-padded)
    the rest                               unary: per gap, gap >> k one bits then a zero;
                                           padded with one bits to a byte (< 8 of them)

Varints are LEB128. Element ``i`` is bytes ``[i*itemsize, (i+1)*itemsize)``, ``gap = position
- previous - 1`` (the first counts from -1). A step field codes the pair {old, new} so that
either side gives the other (see :mod:`deltastore.codecs.steps`): applying twice reverts, like
``xor``. A tensor of a size that is not 1, 2, 4 or 8 bytes an element is coded byte by byte.
Positions are u64: tensors over 4 GiB are fine.

At 0.4 % density of ±1-ulp bf16 steps a change costs about 10.5 bits (9.5 for its gap, one for
its step), where the reference's ``xor`` + zstd-1 spends about 26. Encoding uses a compiled
kernel when numba is installed (the ``fast`` extra; see :mod:`deltastore.codecs.jit`), numpy
otherwise; both write the same bytes, and decoding is numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from deltastore.codecs import jit
from deltastore.codecs.base import (
    ByteArray,
    EncodedDelta,
    Encoding,
    FramedDelta,
    PayloadBatch,
    XorChanges,
)
from deltastore.codecs.batch import encode_framed_batch
from deltastore.codecs.batch_apply import apply_compiled
from deltastore.codecs.kernels import (
    ELEMENT_DTYPES,
    LOG2,
    _bits_to_fields,
    _fields_to_bits,
    changed_elements,
    decode_gaps,
    element_size,
    encode_gaps,
    rice_parameter,
)
from deltastore.codecs.steps import (
    MARK,
    apply_steps,
    changed_in_words,
    field_width,
    pack_fields,
    read_patches,
    read_unary,
    read_varint,
    step_fields,
    unary_stream,
    varint,
)
from deltastore.errors import FormatError

NAME = "sparse-v2"
SMALL_BYTES = 2 * 1024**2
"""Tensors up to this size are compared in one step (fewer numpy calls); larger ones in
cache-sized chunks."""


def encode_numpy(old: ByteArray, new: ByteArray, itemsize: int) -> tuple[bytes, XorChanges]:
    """The sparse-v2 payload turning ``old`` into ``new``, built with numpy; the changes as
    positions and XOR values. ``itemsize`` must be one :func:`element_size` accepts."""
    if old.size <= SMALL_BYTES:
        positions, xored = changed_in_words(old, new, itemsize)
    else:
        positions, xored = changed_elements(old, new, itemsize)
    count = positions.size
    head = bytes((MARK | LOG2[itemsize],)) + varint(old.size) + varint(count)
    if not count:
        return head, XorChanges(positions, xored)
    gaps = encode_gaps(positions)
    k = rice_parameter(gaps)
    before = old.view(ELEMENT_DTYPES[itemsize])[positions]
    fields = step_fields(before, before ^ xored)
    width = field_width(fields, itemsize * 8)
    parts = (
        head,
        bytes((k, width)),
        _fields_to_bits(gaps, k).data,
        pack_fields(fields, width, itemsize * 8),
        unary_stream(gaps >> np.uint64(k)).data,
    )
    return b"".join(parts), XorChanges(positions, xored)


def _decode_numpy(
    raw: ByteArray, at: int, count: int, k: int, width: int, itemsize: int, nelements: int
) -> tuple[int, np.ndarray, np.ndarray]:
    """What :func:`deltastore.codecs.jit_kernels.decode` returns, with numpy: (status 0 valid,
    1 patches bad, 2 positions bad; positions; step fields as uint64)."""
    fields_at = at + (count * k + 7) // 8
    patches_at = fields_at + (count * width + 7) // 8
    none = np.zeros(0, np.int64)
    if width == 1:  # the usual ±1-ulp steps: one bit each, two numpy calls
        fields = np.unpackbits(raw[fields_at:patches_at], count=count).astype(np.uint64)
    else:
        fields = _bits_to_fields(raw[fields_at:patches_at], width, count)
    patches = read_patches(raw, patches_at, count, width, itemsize * 8)
    if patches is None:
        return 1, none, fields
    indices, high, unary_at = patches
    fields[indices] |= high << np.uint64(width)
    quotients = read_unary(raw[unary_at:], count)
    if quotients is None or int(quotients.max()) >> (63 - k):
        return 2, none, fields
    gaps = quotients.astype(np.uint64) << np.uint64(k)
    if k:
        gaps |= _bits_to_fields(raw[at:fields_at], k, count)
    positions = decode_gaps(gaps, nelements)
    return (2, none, fields) if positions is None else (0, positions, fields)


class CompactSparseEncoding(Encoding):
    """Rice-coded gaps and symmetric ulp steps, bit-packed, with a header of a few bytes."""

    name = NAME
    idempotent = False
    checks_before_writing = True
    """Every bound of a payload is checked before the target is written."""
    applies_in_batches = True
    """With numba, one compiled call per batch (:mod:`deltastore.codecs.jit_apply`)."""
    self_inverse = True
    """Either side of a step gives the other: applying a payload to its result reverts it."""
    foldable = False
    exact_payload_size = False

    def __init__(self, *, use_jit: bool | None = None) -> None:
        """``use_jit``: True needs numba, False is numpy only, None (default) uses numba when it
        is importable and ``DELTASTORE_NO_JIT`` is not set."""
        self.use_jit = use_jit

    def encode(self, old: ByteArray, new: ByteArray, *, itemsize: int = 1) -> EncodedDelta:
        """Payload turning ``old`` into ``new``; ``itemsize`` is the element size in bytes (one
        other than 1, 2, 4, 8, or one that does not divide the tensor, codes bytes)."""
        size = element_size(old.size, itemsize)
        compiled = jit.kernels(self.use_jit)
        if compiled is not None:
            payload, changes = compiled.encode(old, new, size)
        else:
            payload, changes = encode_numpy(old, new, size)
        changed = int(np.count_nonzero(changes.values.view(np.uint8))) if len(changes.values) else 0
        return EncodedDelta(payload, changed, changes)

    def encode_framed(
        self, olds: Sequence[ByteArray], news: Sequence[ByteArray], itemsizes: Sequence[int]
    ) -> list[FramedDelta]:
        """As :meth:`Encoding.encode_framed`, a batch in one compiled call where numba is
        available (:mod:`deltastore.codecs.batch`)."""
        return encode_framed_batch(
            self, olds, news, itemsizes, use_jit=self.use_jit, tag=-1, dense_ratio=0
        )

    def max_payload_size(self, nbytes: int) -> int:
        # At most one change per byte: 23 header and varint bytes; per change a remainder ≤ 64
        # bits, a field ≤ 64, a patch ≤ 128, unary ≤ sum(gaps) + count ≤ 2 * nbytes bits.
        return 32 + nbytes * 8 + nbytes * 24 + nbytes // 4 + 1

    def decode(
        self, payload: bytes | memoryview, nbytes: int, *, tensor: str
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """(positions as int64, step fields as uint64, itemsize) of a payload, every bound
        checked; raises :class:`FormatError` naming ``tensor`` for a corrupt one."""
        raw = np.frombuffer(payload, dtype=np.uint8)
        what = f"{NAME} payload of tensor {tensor!r}"
        itemsize, count, offset = self._header(raw, nbytes, what)
        if not count:
            if offset != raw.size:
                raise FormatError(f"{what} has {raw.size - offset} bytes after an empty change")
            return np.zeros(0, np.int64), np.zeros(0, np.uint64), itemsize
        if offset + 2 > raw.size:
            raise FormatError(f"{what} is truncated inside its header; it is corrupt")
        k, width = int(raw[offset]), int(raw[offset + 1])
        nelements = nbytes // itemsize
        if k > min(63, nelements.bit_length() + 1) or width > itemsize * 8:
            raise FormatError(f"{what} declares k={k}, w={width}; it is corrupt")
        offset += 2
        patches_at = offset + (count * k + 7) // 8 + (count * width + 7) // 8
        if patches_at > raw.size:
            raise FormatError(f"{what} is truncated: {raw.size} bytes, {patches_at} needed")
        compiled = jit.kernels(self.use_jit)
        if compiled is not None:
            status, positions, fields = compiled.decode(
                raw, offset, count, k, width, itemsize, nelements
            )
        else:
            status, positions, fields = _decode_numpy(
                raw, offset, count, k, width, itemsize, nelements
            )
        if status == 1:
            raise FormatError(f"{what} has patched steps that are truncated or out of order")
        if status:
            raise FormatError(
                f"{what} has positions that are not ascending inside its {nelements} elements; "
                "it is corrupt"
            )
        return positions, fields, itemsize

    @staticmethod
    def _header(raw: ByteArray, nbytes: int, what: str) -> tuple[int, int, int]:
        """(itemsize, count, offset after them), checked against the local ``nbytes``."""
        if not raw.size or raw[0] & 0xFC != MARK:
            raise FormatError(f"{what} does not start with a {NAME} header; it is corrupt")
        itemsize = 1 << int(raw[0] & 3)
        declared = read_varint(raw, 1)
        counted = None if declared is None else read_varint(raw, declared[1])
        if declared is None or counted is None:
            raise FormatError(f"{what} is truncated inside its header; it is corrupt")
        if declared[0] != nbytes:
            raise FormatError(
                f"{what} was made for a {declared[0]}-byte tensor, the local one has {nbytes}; "
                "the delta was made for another checkpoint"
            )
        if nbytes % itemsize or counted[0] > nbytes // itemsize:
            raise FormatError(
                f"{what} declares {counted[0]} changes of {itemsize}-byte elements for "
                f"{nbytes} bytes; it is corrupt"
            )
        return itemsize, counted[0], counted[1]

    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        positions, fields, itemsize = self.decode(payload, target.size, tensor=tensor)
        if not positions.size:
            return
        elements = target.view(ELEMENT_DTYPES[itemsize])
        compiled = jit.kernels(self.use_jit)
        if compiled is not None:
            compiled.apply_steps(elements, positions, fields)
        else:
            elements[positions] = apply_steps(elements[positions], fields.astype(elements.dtype))

    def apply_batch(
        self,
        target: ByteArray,
        starts: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        payloads: PayloadBatch,
        names: Sequence[str],
    ) -> tuple[int, FormatError | None]:
        """One compiled call for the whole batch where numba is installed (see
        :mod:`deltastore.codecs.jit_apply`); the base class's loop otherwise."""
        compiled = jit.apply_kernels(self.use_jit)
        if compiled is None:
            return super().apply_batch(target, starts, sizes, payloads, names)
        return apply_compiled(self, compiled, target, starts, sizes, payloads, names, tagged=False)

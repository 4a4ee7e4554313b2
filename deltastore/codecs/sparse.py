"""deltastore's own encodings (see docs/encodings.md): ``sparse-v2`` (the format is
:mod:`~deltastore.codecs.sparse_format`) and ``auto``, per tensor the smaller of ``xor`` and
``sparse-v2`` after a tag byte naming it; a reference reader refuses both. The kernels come
from :mod:`~deltastore.codecs.numba_backend` where numba is installed and ``DELTASTORE_NO_JIT``
is unset, else from :mod:`~deltastore.codecs.numpy_backend` (the same bytes), compiled on their
first use on a machine (or at :func:`warm_up`, never at import). Encoding holds up to 24 bytes
per changed element (position, step field, XOR value; the compiled encoder's growing buffers
twice that for a moment).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import numpy as np
import numpy.typing as npt

from deltastore.codecs import numpy_backend
from deltastore.codecs.base import ByteArray, EncodedDelta, Encoding, FramedDelta, XorChanges
from deltastore.codecs.compression import PayloadBatch, compress
from deltastore.codecs.encodings import REMOVED_ENCODINGS, XorEncoding
from deltastore.codecs.sparse_format import (
    ELEMENT_DTYPES,
    NAME,
    TAG_COMPACT,
    TAG_SPARSE_V1,
    TAG_XOR,
    element_size,
    max_payload_size,
)
from deltastore.errors import ConfigError, FormatError

NO_JIT_VARIABLE = "DELTASTORE_NO_JIT"
_lock = threading.Lock()
_compiled: list[Any] = []
"""The numba backend once imported (None without numba): empty before the first use."""
COMPILED_XOR_CHANGES = 256
"""Fewer changes than this are XORed in by numpy (a compiled call's fixed cost is more)."""
Ints = npt.NDArray[np.int64]
SPARSE_WITHOUT_COMPARING = 16
"""``auto`` keeps a sparse-v2 payload at most 1/16 of the tensor without trying the others (it
is then smaller than a zstd-1 frame of the XOR); otherwise the smaller of the two is kept."""
XOR = XorEncoding()


def compiled_backend(use_jit: bool | None) -> Any:
    """:mod:`~deltastore.codecs.numba_backend` (imported once per process), or None for numpy:
    ``use_jit`` False is numpy, True needs numba (:class:`ConfigError` without it), None takes
    numba when it is importable and ``DELTASTORE_NO_JIT`` is unset or ``0``."""
    if use_jit is False:
        return None
    if use_jit is None and os.environ.get(NO_JIT_VARIABLE, "0") not in ("", "0"):
        return None
    with _lock:
        if not _compiled:
            try:
                _compiled.append(importlib.import_module("deltastore.codecs.numba_backend"))
            except ImportError:
                _compiled.append(None)
    if _compiled[0] is None and use_jit:
        raise ConfigError(
            "the compiled sparse-v2 codec needs numba: pip install 'deltastore[fast]'"
        )
    return _compiled[0]


def warm_up(
    use_jit: bool | None = None, *, changes_only: bool = False, from_changes: bool = False
) -> bool:
    """Load (or compile, the first time on a machine) the compiled kernels now, for every
    element size, instead of at the first encode or decode; True when the compiled backend is
    in use. ``changes_only``: just the one :func:`apply_changes` uses (a publisher of the
    reference encodings needs no other). ``from_changes``: also the writer
    :meth:`~deltastore.codecs.Encoding.encode_changes` calls (``device_snapshot``'s; a few
    seconds more the first time on a machine). Cheap once done in a process."""
    if compiled_backend(use_jit) is None:
        return False
    for dtype in ELEMENT_DTYPES.values():
        count = COMPILED_XOR_CHANGES
        changes = XorChanges(np.arange(count, dtype=np.int64), np.ones(count, dtype))
        apply_changes(np.zeros(count * dtype.itemsize, np.uint8), changes)
    if changes_only:
        return True
    encoding = CompactSparseEncoding(use_jit=True)
    old = np.zeros(64, np.uint8)
    new = old.copy()
    new[::9] = 1
    for itemsize in ELEMENT_DTYPES:
        payload = bytes(encoding.encode(old, new, itemsize=itemsize).payload)
        encoding.apply(old.copy(), payload, tensor="")  # a batch of one, as a pull's
        encoding.encode_framed([old, old], [new, new], [itemsize, itemsize])
        if from_changes:
            changes = XorChanges(np.array([1], np.int64), np.ones(1, ELEMENT_DTYPES[itemsize]))
            encoding.encode_changes(old, changes, itemsize=itemsize)
    return True


def apply_changes(target: ByteArray, changes: XorChanges) -> None:
    """XOR ``changes`` into the writable 1-D uint8 ``target`` in place: compiled where numba
    is installed and there are enough of them to pay for a call."""
    if not changes.positions.size:
        return
    elements = target.view(changes.values.dtype)
    many = changes.positions.size >= COMPILED_XOR_CHANGES
    chosen = (compiled_backend(None) if many else None) or numpy_backend
    chosen.xor_at(elements, changes.positions, changes.values)


class _SparseFamily(Encoding):
    """What ``sparse-v2`` and ``auto`` share: their semantics, the backend, and a batch (of
    one, for a single tensor) in one compiled call."""

    idempotent = False
    checks_before_writing = True
    applies_in_batches = True
    self_inverse = True
    """Either side of a step gives the other, values are XORed in."""
    tag: ClassVar[int] = -1
    """The byte before each sparse-v2 payload (``auto``'s), -1 for none."""
    dense_ratio: ClassVar[int] = 0
    """A compiled batch's sparse-v2 payload over 1/dense_ratio of its tensor is encoded again
    alone (``auto`` compares the others there); 0: never."""

    def __init__(self, *, use_jit: bool | None = None) -> None:
        """``use_jit``: as for :func:`compiled_backend`."""
        self.use_jit = use_jit

    def apply_numpy(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        """:meth:`apply` by the numpy backend, worded for a payload that does not fit."""
        raw = np.frombuffer(payload, np.uint8)
        if self.tag >= 0:
            if not raw.size:
                raise FormatError(f"auto payload of tensor {tensor!r} is empty; it is corrupt")
            tag, raw = int(raw[0]), raw[1:]
            if tag == TAG_XOR:
                XOR.apply(target, raw.data, tensor=tensor)
                return
            if tag == TAG_SPARSE_V1:
                raise FormatError(
                    f"auto payload of tensor {tensor!r} is coded with sparse-v1 (tag 1), which "
                    f"deltastore no longer reads; {REMOVED_ENCODINGS['sparse-v1']}"
                )
            if tag != TAG_COMPACT:
                raise FormatError(
                    f"auto payload of tensor {tensor!r} names encoding tag {tag}, which this "
                    "deltastore does not know (0 = xor, 2 = sparse-v2); upgrade deltastore"
                )
        numpy_backend.apply(target, raw, f"{NAME} payload of tensor {tensor!r}")

    def encode_framed(
        self, olds: Sequence[ByteArray], news: Sequence[ByteArray], itemsizes: Sequence[int]
    ) -> list[FramedDelta]:
        """As :meth:`Encoding.encode_framed`: with numba, a batch in one call without the GIL;
        with numpy, in groups of one pass each; a tensor over ``dense_ratio`` encoded again
        alone."""
        contiguous = all(a.dtype == np.uint8 and a.flags.c_contiguous for a in (*olds, *news))
        if len(olds) < 2 or not contiguous:
            return super().encode_framed(olds, news, itemsizes)
        for index, (old, new) in enumerate(zip(olds, news, strict=True)):
            if old.size != new.size:  # the kernel reads both sizes from the old bytes
                raise ConfigError(
                    f"tensor {index} of the batch has {old.size} old bytes and {new.size} new "
                    "ones; pass both states of the same tensor"
                )
        backend = compiled_backend(self.use_jit) or numpy_backend
        framed = backend.encode_framed(olds, news, itemsizes, self.tag, self.dense_ratio)
        for i, delta in enumerate(framed):
            if delta is None:
                (framed[i],) = super().encode_framed(
                    olds[i : i + 1], news[i : i + 1], [itemsizes[i]]
                )
        return cast("list[FramedDelta]", framed)

    def encode_changes(
        self, old: ByteArray, changes: XorChanges, *, itemsize: int = 1
    ) -> FramedDelta:
        """As :meth:`Encoding.encode_changes`, coded from the changes: no pass over the
        tensor's unchanged bytes."""
        size = element_size(old.size, itemsize)
        positions, values = changes.positions, changes.values
        if values.dtype.itemsize != size:  # changes of another element size: from the bytes
            return super().encode_changes(old, changes, itemsize=itemsize)
        if not positions.size:
            return FramedDelta(b"", 0)
        before = old.view(ELEMENT_DTYPES[size])[positions]
        compiled = compiled_backend(self.use_jit)
        payload: bytes | memoryview
        if compiled is not None:
            fields = numpy_backend.step_fields(before, before ^ values).astype(np.uint64)
            payload = compiled.encode_changes(old.size, positions, fields, size)
            changed = int(np.count_nonzero(values.view(np.uint8)))
        else:
            starts = np.array([0, old.size // size], np.int64)
            ((payload, changed, _),) = numpy_backend.code_changes(
                [old.size], positions, before, values, starts, size
            )
        if self.tag < 0:
            return FramedDelta(compress(payload), changed, changes)
        if len(payload) * SPARSE_WITHOUT_COMPARING > old.size:  # as :meth:`AutoEncoding.choose`
            tagged = np.zeros(1 + old.size, np.uint8)
            tagged[0] = TAG_XOR
            tagged[1:].view(values.dtype)[positions] = values
            if len(payload) > len(compress(memoryview(tagged[1:]))):
                return FramedDelta(compress(memoryview(tagged)), changed, changes)
        return FramedDelta(compress(bytes((TAG_COMPACT,)) + payload), changed, changes)

    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        if compiled_backend(self.use_jit) is None:
            self.apply_numpy(target, payload, tensor=tensor)
            return
        raw = np.frombuffer(payload, np.uint8)
        batch = PayloadBatch(raw, np.array([0, raw.size], np.int64))
        sizes = np.array([target.size], np.int64)
        _, error = self.apply_batch(target, np.zeros(1, np.int64), sizes, batch, [tensor])
        if error is not None:
            raise error

    def apply_batch(
        self,
        target: ByteArray,
        starts: Ints,
        sizes: Ints,
        payloads: PayloadBatch,
        names: Sequence[str],
    ) -> tuple[int, FormatError | None]:
        """One compiled call for the whole batch where numba is installed; the base class's
        loop otherwise. A payload the kernel refuses is run through the numpy backend on a
        copy of its tensor, so the error is worded exactly as there (and nothing is written)."""
        compiled = compiled_backend(self.use_jit)
        if compiled is None:
            return super().apply_batch(target, starts, sizes, payloads, names)
        if len(starts) and (int(starts.min()) < 0 or int((starts + sizes).max()) > target.size):
            # The kernel does not check indexes: a tensor outside the target is the caller's bug.
            raise ValueError(f"a tensor of {list(names)[:3]}... lies outside the target's bytes")
        index, refused = compiled.apply_batch(
            target, starts, sizes, payloads.data, payloads.offsets, self.tag >= 0
        )
        if not refused:
            return index, None
        view = target[int(starts[index]) : int(starts[index]) + int(sizes[index])]
        try:
            self.apply_numpy(view.copy(), payloads[index], tensor=names[index])
        except FormatError as exc:
            return index, exc
        return index, FormatError(  # the two decoders disagree: refuse rather than apply
            f"{self.name} payload of tensor {names[index]!r} is refused by the compiled "
            "decoder; it is corrupt"
        )


class CompactSparseEncoding(_SparseFamily):
    """Rice-coded gaps and symmetric ulp steps, bit-packed, with a header of a few bytes."""

    name = NAME

    def encode(self, old: ByteArray, new: ByteArray, *, itemsize: int = 1) -> EncodedDelta:
        """Payload turning ``old`` into ``new``; ``itemsize`` is the element size in bytes (one
        other than 1, 2, 4, 8, or one that does not divide the tensor, codes bytes)."""
        if old.size != new.size:
            raise ConfigError(
                f"sparse-v2 encode got {old.size} old bytes and {new.size} new ones; pass both "
                "states of the same tensor"
            )
        # The compiled writer reads both through their addresses: one contiguous run each.
        old, new = np.ascontiguousarray(old), np.ascontiguousarray(new)
        size = element_size(old.size, itemsize)
        chosen = compiled_backend(self.use_jit) or numpy_backend
        payload, changes = chosen.encode(old, new, size)
        changed = int(np.count_nonzero(changes.values.view(np.uint8))) if len(changes.values) else 0
        return EncodedDelta(payload, changed, changes)

    def max_payload_size(self, nbytes: int) -> int:
        return max_payload_size(nbytes)

    def decode(
        self, payload: bytes | memoryview, nbytes: int, *, tensor: str
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """(positions as int64, step fields as uint64, itemsize) of a payload, every bound
        checked; raises :class:`FormatError` naming ``tensor`` for a corrupt one."""
        raw = np.frombuffer(payload, dtype=np.uint8)
        return numpy_backend.decode(raw, nbytes, f"{NAME} payload of tensor {tensor!r}")


class AutoEncoding(_SparseFamily):
    """Per tensor, whichever of ``xor`` and ``sparse-v2`` is smaller on the wire."""

    name = "auto"
    tag = TAG_COMPACT
    dense_ratio = SPARSE_WITHOUT_COMPARING

    def __init__(self, *, use_jit: bool | None = None) -> None:
        super().__init__(use_jit=use_jit)
        self.compact = CompactSparseEncoding(use_jit=use_jit)

    def choose(
        self, old: ByteArray, new: ByteArray, *, itemsize: int = 1
    ) -> tuple[int, EncodedDelta]:
        """(tag, inner delta) of the smallest encoding for this tensor (see the module's notes)."""
        compact = self.compact.encode(old, new, itemsize=itemsize)
        if len(compact.payload) * SPARSE_WITHOUT_COMPARING <= old.size:
            return TAG_COMPACT, compact
        dense = XOR.encode(old, new)
        if len(compact.payload) <= len(compress(dense.payload)):  # sparse-v2 on a tie
            return TAG_COMPACT, compact
        return TAG_XOR, dense

    def encode(self, old: ByteArray, new: ByteArray, *, itemsize: int = 1) -> EncodedDelta:
        """Tagged payload of the smaller encoding; ``itemsize`` as for ``sparse-v2``."""
        tag, inner = self.choose(old, new, itemsize=itemsize)
        out = np.empty(1 + len(inner.payload), dtype=np.uint8)
        out[0] = tag
        out[1:] = np.frombuffer(inner.payload, dtype=np.uint8)
        return EncodedDelta(memoryview(out), inner.changed_bytes, inner.xor_changes)

    def max_payload_size(self, nbytes: int) -> int:
        return 1 + max(XOR.max_payload_size(nbytes), self.compact.max_payload_size(nbytes))

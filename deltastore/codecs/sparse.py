"""``sparse-v2``: deltastore's compact sparse encoding (varint header, Rice gaps, ulp steps).

The format is :mod:`~deltastore.codecs.sparse_format`. The store wraps every payload in one
zstd-1 frame as for any encoding; inside, nothing is compressed again (the streams are near
their entropy already, so the outer frame stores them as they are). A reference reader does not
know the name and refuses the version.

The kernels come from one of two backends with the same interface and the same bytes:
:mod:`~deltastore.codecs.numba_backend` where numba is installed (``pip install
'deltastore[fast]'``) and ``DELTASTORE_NO_JIT`` is unset, :mod:`~deltastore.codecs.numpy_backend`
otherwise. The compiled kernels compile on their first use on a machine, then load from numba's
on-disk cache (``cache=True``, next to the module or in ``NUMBA_CACHE_DIR``); both happen at the
first encode or decode (or :func:`warm_up`), never at ``import deltastore``.

A publish of thousands of small tensors spends most of a tensor's time in the encode pool on
handing the GIL around, so :meth:`CompactSparseEncoding.encode_framed` hands a whole batch to
the backend (one compiled call, or one pass of numpy calls per element size), and a pull's
:meth:`~CompactSparseEncoding.apply_batch` applies a batch in one compiled call that checks each
payload whole before writing it.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from deltastore.codecs import numpy_backend
from deltastore.codecs.base import ByteArray, EncodedDelta, Encoding, FramedDelta, XorChanges
from deltastore.codecs.compression import PayloadBatch
from deltastore.codecs.sparse_format import (
    ELEMENT_DTYPES,
    NAME,
    PATCHES_BAD,
    SparseBackend,
    element_size,
    max_payload_size,
    read_header,
)
from deltastore.errors import ConfigError, FormatError

NO_JIT_VARIABLE = "DELTASTORE_NO_JIT"
_lock = threading.Lock()
_compiled: list[Any] = []
"""The numba backend once imported (None without numba): empty before the first use."""
COMPILED_XOR_CHANGES = 256
"""Fewer changes than this are XORed in by numpy (a compiled call's fixed cost is more)."""


def _numba() -> Any:
    """:mod:`~deltastore.codecs.numba_backend`, imported once per process; None without numba."""
    with _lock:
        if not _compiled:
            try:
                _compiled.append(importlib.import_module("deltastore.codecs.numba_backend"))
            except ImportError:
                _compiled.append(None)
        return _compiled[0]


def compiled_backend(use_jit: bool | None) -> SparseBackend | None:
    """The numba backend to use, or None for numpy: ``use_jit`` False is numpy, True needs
    numba (:class:`ConfigError` without it), None takes numba when it is importable and
    ``DELTASTORE_NO_JIT`` is unset or ``0``."""
    if use_jit is False:
        return None
    if use_jit is None and os.environ.get(NO_JIT_VARIABLE, "0") not in ("", "0"):
        return None
    module = _numba()
    if module is None and use_jit:
        raise ConfigError(
            "the compiled sparse-v2 codec needs numba: pip install 'deltastore[fast]'"
        )
    return cast("SparseBackend | None", module)


def backend(use_jit: bool | None) -> SparseBackend:
    """The backend :func:`compiled_backend` chooses, numpy where it gives None."""
    return compiled_backend(use_jit) or cast("SparseBackend", numpy_backend)


def warm_up(use_jit: bool | None = None, *, changes_only: bool = False) -> bool:
    """Load (or compile, the first time on a machine) the compiled kernels now, for every
    element size, instead of at the first encode or decode; True when the compiled backend is
    in use. ``changes_only``: just the one :func:`apply_changes` uses (a publisher of the
    reference encodings needs no other). Cheap once done in a process."""
    chosen = compiled_backend(use_jit)
    if chosen is None:
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
        payload = np.frombuffer(encoding.encode(old, new, itemsize=itemsize).payload, np.uint8)
        encoding.apply(old.copy(), memoryview(payload), tensor="")
        encoding.encode_framed([old, old], [new, new], [itemsize, itemsize])
        batch = PayloadBatch(payload, np.array([0, payload.size], np.int64))
        at, size = np.zeros(1, np.int64), np.array([old.size], np.int64)
        encoding.apply_batch(old.copy(), at, size, batch, [""])
    return True


def apply_changes(target: ByteArray, changes: XorChanges) -> None:
    """XOR ``changes`` into the writable 1-D uint8 ``target`` in place: compiled where numba
    is installed and there are enough of them to pay for a call."""
    if not changes.positions.size:
        return
    elements = target.view(changes.values.dtype)
    chosen = compiled_backend(None) if changes.positions.size >= COMPILED_XOR_CHANGES else None
    (chosen or cast("SparseBackend", numpy_backend)).xor_at(
        elements, changes.positions, changes.values
    )


class CompactSparseEncoding(Encoding):
    """Rice-coded gaps and symmetric ulp steps, bit-packed, with a header of a few bytes."""

    name = NAME
    idempotent = False
    checks_before_writing = True
    """Every bound of a payload is checked before the target is written."""
    applies_in_batches = True
    """With numba, one compiled call per batch."""
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
        if old.size != new.size:
            raise ConfigError(
                f"sparse-v2 encode got {old.size} old bytes and {new.size} new ones; pass both "
                "states of the same tensor"
            )
        # The compiled writer reads both through their addresses: one contiguous run each.
        old, new = np.ascontiguousarray(old), np.ascontiguousarray(new)
        size = element_size(old.size, itemsize)
        payload, changes = backend(self.use_jit).encode(old, new, size)
        changed = int(np.count_nonzero(changes.values.view(np.uint8))) if len(changes.values) else 0
        return EncodedDelta(payload, changed, changes)

    def encode_framed(
        self, olds: Sequence[ByteArray], news: Sequence[ByteArray], itemsizes: Sequence[int]
    ) -> list[FramedDelta]:
        """As :meth:`Encoding.encode_framed`, a batch in one backend call."""
        return encode_framed_batch(
            self, olds, news, itemsizes, use_jit=self.use_jit, tag=-1, dense_ratio=0
        )

    def max_payload_size(self, nbytes: int) -> int:
        return max_payload_size(nbytes)

    def decode(
        self, payload: bytes | memoryview, nbytes: int, *, tensor: str
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """(positions as int64, step fields as uint64, itemsize) of a payload, every bound
        checked; raises :class:`FormatError` naming ``tensor`` for a corrupt one."""
        raw = np.frombuffer(payload, dtype=np.uint8)
        what = f"{NAME} payload of tensor {tensor!r}"
        itemsize, count, k, width, offset = read_header(raw, nbytes, what)
        if not count:
            return np.zeros(0, np.int64), np.zeros(0, np.uint64), itemsize
        nelements = nbytes // itemsize
        status, positions, fields = backend(self.use_jit).decode(
            raw, offset, count, k, width, itemsize, nelements
        )
        if status == PATCHES_BAD:
            raise FormatError(f"{what} has patched steps that are truncated or out of order")
        if status:
            raise FormatError(
                f"{what} has positions that are not ascending inside its {nelements} elements; "
                "it is corrupt"
            )
        return positions, fields, itemsize

    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        positions, fields, itemsize = self.decode(payload, target.size, tensor=tensor)
        if positions.size:
            backend(self.use_jit).apply_steps(target, itemsize, positions, fields)

    def apply_batch(
        self,
        target: ByteArray,
        starts: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        payloads: PayloadBatch,
        names: Sequence[str],
    ) -> tuple[int, FormatError | None]:
        """One compiled call for the whole batch where numba is installed; the base class's
        loop otherwise."""
        return apply_batch(self, self.use_jit, target, starts, sizes, payloads, names, tagged=False)


def encode_framed_batch(
    encoding: Encoding,
    olds: Sequence[ByteArray],
    news: Sequence[ByteArray],
    itemsizes: Sequence[int],
    *,
    use_jit: bool | None,
    tag: int,
    dense_ratio: int,
) -> list[FramedDelta]:
    """:meth:`Encoding.encode_framed` of ``encoding`` (sparse-v2 payloads, after the byte
    ``tag`` where it is ≥ 0), a batch in one call of the backend ``use_jit`` chooses.

    A payload over ``1/dense_ratio`` of its tensor (0: never), and a tensor the backend's batch
    pass does not take, is encoded again by ``encoding.encode`` alone (``auto`` compares the
    other encodings there). Frames decompress to the payloads ``encoding.encode`` gives.
    """
    if len(olds) < 2 or not all(
        a.dtype == np.uint8 and a.flags.c_contiguous for a in (*olds, *news)
    ):
        return Encoding.encode_framed(encoding, olds, news, itemsizes)
    for index, (old, new) in enumerate(zip(olds, news, strict=True)):
        if old.size != new.size:  # both batch paths read both sizes from the old bytes
            raise ConfigError(
                f"tensor {index} of the batch has {old.size} old bytes and {new.size} new "
                "ones; pass both states of the same tensor"
            )
    framed = backend(use_jit).encode_framed(olds, news, itemsizes, tag=tag, dense_ratio=dense_ratio)
    for i, delta in enumerate(framed):
        if delta is None:  # dense, or not one the batch pass takes: alone
            (framed[i],) = Encoding.encode_framed(
                encoding, olds[i : i + 1], news[i : i + 1], itemsizes[i : i + 1]
            )
    return cast("list[FramedDelta]", framed)


def apply_batch(
    encoding: Encoding,
    use_jit: bool | None,
    target: ByteArray,
    starts: npt.NDArray[np.int64],
    sizes: npt.NDArray[np.int64],
    payloads: PayloadBatch,
    names: Sequence[str],
    *,
    tagged: bool,
) -> tuple[int, FormatError | None]:
    """As :meth:`Encoding.apply_batch` of ``encoding`` (``tagged``: ``auto``'s payloads), in
    one compiled call where numba is installed. A payload the kernel refuses is run through
    ``encoding.apply`` on a copy of its tensor, so the error is worded exactly as on the
    per-tensor path (and nothing is written)."""
    compiled = compiled_backend(use_jit)
    if compiled is None:
        return Encoding.apply_batch(encoding, target, starts, sizes, payloads, names)
    if len(starts) and (int(starts.min()) < 0 or int((starts + sizes).max()) > target.size):
        # The kernel does not check indexes: a tensor outside the target is the caller's bug.
        raise ValueError(f"a tensor of {list(names)[:3]}... lies outside the target's bytes")
    kernels = _numba()
    index, status = kernels.apply_batch(
        target, starts, sizes, payloads.data, payloads.offsets, 0, tagged
    )
    if status == kernels.APPLIED:
        return index, None
    view = target[int(starts[index]) : int(starts[index]) + int(sizes[index])]
    return index, refusal(encoding, view, payloads[index], names[index])


def refusal(encoding: Encoding, view: ByteArray, payload: memoryview, name: str) -> FormatError:
    """The error ``encoding.apply`` gives ``payload`` for the tensor ``view`` (run on a copy)."""
    try:
        encoding.apply(view.copy(), payload, tensor=name)
    except FormatError as exc:
        return exc
    return FormatError(  # the two decoders disagree: refuse rather than apply either way
        f"{encoding.name} payload of tensor {name!r} is refused by the compiled batch decoder; "
        "it is corrupt"
    )

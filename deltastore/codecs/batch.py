"""Encoding a batch of small tensors with one compiled call: the ``sparse-v2`` and ``auto``
encodings' :meth:`~deltastore.codecs.base.Encoding.encode_framed`.

A publish of thousands of small tensors spends most of a tensor's time inside the encode pool
on handing the GIL around: every call that releases it (the kernel, zstd, some numpy calls)
lets another thread in, and taking it back waits for that thread. Here a batch makes one
compiled call (:mod:`deltastore.codecs.jit_batch`) that writes every frame, so a tensor costs
a few Python operations that keep the GIL. Without numba, the tensors of each element size go
through one pass of numpy calls (:mod:`deltastore.codecs.batch_numpy`); a single tensor is
encoded as :meth:`Encoding.encode_framed` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deltastore.codecs import batch_numpy, jit
from deltastore.codecs.base import ByteArray, Encoding, FramedDelta, XorChanges
from deltastore.codecs.compression import compress
from deltastore.codecs.kernels import ELEMENT_DTYPES, element_size
from deltastore.errors import ConfigError

UNCHANGED = FramedDelta(b"", 0)


def _addresses(arrays: Sequence[ByteArray]) -> np.ndarray | None:
    """Each array's data address, or None when one is not a contiguous uint8 array."""
    addresses = []
    for array in arrays:
        if array.dtype != np.uint8 or not array.flags.c_contiguous:
            return None
        addresses.append(array.ctypes.data)
    return np.array(addresses, dtype=np.int64)


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
    ``tag`` where it is ≥ 0), compiled for the whole batch where numba is available.

    A payload over ``1/dense_ratio`` of its tensor (0: never) is encoded again by
    ``encoding.encode`` alone (``auto`` compares the other encodings there). Frames decompress
    to the payloads ``encoding.encode`` gives; most are byte for byte the frames zstd writes.
    """
    module = jit.batch_kernels(use_jit)
    old_at = new_at = None
    if len(olds) > 1:
        old_at, new_at = _addresses(olds), _addresses(news)
    if old_at is None or new_at is None:
        return Encoding.encode_framed(encoding, olds, news, itemsizes)
    for index, (old, new) in enumerate(zip(olds, news, strict=True)):
        if old.size != new.size:  # both batch paths read both sizes from the old bytes
            raise ConfigError(
                f"tensor {index} of the batch has {old.size} old bytes and {new.size} new "
                "ones; pass both states of the same tensor"
            )
    if module is None:
        return _numpy_batch(encoding, olds, news, itemsizes, tag=tag, dense_ratio=dense_ratio)
    sizes = [element_size(old.size, s) for old, s in zip(olds, itemsizes, strict=True)]
    nbytes = np.array([old.size for old in olds], dtype=np.int64)
    out = module.encode_batch(
        old_at, new_at, nbytes, np.array(sizes, dtype=np.int64), tag=tag, dense_ratio=dense_ratio
    )
    frame_bytes, frame_at, changed, kinds, positions, change_at, value_bytes, value_at = out
    frame_at, changed, kinds = frame_at.tolist(), changed.tolist(), kinds.tolist()
    change_at, value_at = change_at.tolist(), value_at.tolist()
    framed: list[FramedDelta] = []
    for i, size in enumerate(sizes):
        if not changed[i]:
            framed.append(UNCHANGED)
            continue
        if kinds[i] == module.DENSE:
            framed += Encoding.encode_framed(
                encoding, olds[i : i + 1], news[i : i + 1], itemsizes[i : i + 1]
            )
            continue
        raw = frame_bytes[frame_at[i] : frame_at[i + 1]]
        frame = compress(raw) if kinds[i] == module.CONTENT else raw.tobytes()
        count = change_at[i + 1] - change_at[i]
        values = value_bytes[value_at[i] : value_at[i] + count * size].view(ELEMENT_DTYPES[size])
        changes = XorChanges(positions[change_at[i] : change_at[i + 1]], values)
        framed.append(FramedDelta(frame, changed[i], changes))
    return framed


def _numpy_batch(
    encoding: Encoding,
    olds: Sequence[ByteArray],
    news: Sequence[ByteArray],
    itemsizes: Sequence[int],
    *,
    tag: int,
    dense_ratio: int,
) -> list[FramedDelta]:
    """:func:`encode_framed_batch` without numba: each element size's tensors in one pass of
    numpy calls (:func:`deltastore.codecs.batch_numpy.encode_group`), the rest one by one."""
    framed: list[FramedDelta | None] = [None] * len(olds)
    chunks, alone = batch_numpy.groups(olds, itemsizes)
    prefix = bytes((tag,)) if tag >= 0 else b""
    for size, indices in chunks:
        payloads = batch_numpy.encode_group(
            [olds[i] for i in indices], [news[i] for i in indices], size
        )
        for i, encoded in zip(indices, payloads, strict=True):
            if encoded is None:
                framed[i] = UNCHANGED
            elif dense_ratio and len(encoded.payload) * dense_ratio > olds[i].size:
                alone.append(i)  # dense: encoded again alone, where the others are compared
            else:
                frame = compress(prefix + encoded.payload)
                framed[i] = FramedDelta(frame, encoded.changed_bytes, encoded.changes)
    for i in alone:
        (framed[i],) = Encoding.encode_framed(
            encoding, olds[i : i + 1], news[i : i + 1], itemsizes[i : i + 1]
        )
    return [delta for delta in framed if delta is not None]

"""numba kernel finding the changed elements of a tensor: imported by
:mod:`deltastore.codecs.jit_kernels` (the ``sparse-v2`` coder), which numba compiles it into.

Both tensors are read once, a chunk at a time: 32 words of 8 bytes are compared at once into a
mask of those that differ (vector instructions), and each chunk's changes are recorded while it
is still in cache, visiting only the set bits. At 0.4 % density almost every 4 KiB page holds a
change, so the cost is reading both tensors: measured on the 522 MB bench model, cold, one
thread, 1.2-1.4x ``np.array_equal`` of the same bytes, where counting first and recording in a
second pass cost 1.6-2.0x (the second pass missed the cache on every changed block). The
buffers start at one change in 64 elements and double as needed (at most one per element),
so a dense change holds up to twice its final buffers for a moment.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

U64 = np.uint64


@numba.njit(cache=True, nogil=True, inline="always")
def _record(positions, xored, fields, j, i, a, b, mask, half):  # type: ignore[no-untyped-def]
    """Store element ``i`` (old ``a``, new ``b``) as change ``j``."""
    positions[j] = i
    xored[j] = a ^ b
    a64 = U64(a)
    b64 = U64(b)
    diff = (b64 - a64) & mask
    if diff > half:
        magnitude = (a64 - b64) & mask
        low = b64
    else:
        magnitude = diff
        low = a64
    lowest = magnitude & (~magnitude + U64(1))
    flag = U64(1) if low & lowest else U64(0)
    fields[j] = ((magnitude - U64(1)) << U64(1)) | flag


def _trailing_zeros_of(typingctx, value):  # type: ignore[no-untyped-def]
    """Zero bits below the lowest one bit of ``value`` (one instruction: LLVM's cttz)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return value(value), codegen


_trailing_zeros: Any = intrinsic(_trailing_zeros_of)

WORDS_PER_BLOCK = 32
"""8-byte words summarised by one bit mask (a uint32) of those that differ."""
BLOCKS_PER_CHUNK = 128
"""Blocks compared before their changes are recorded: 32 KB of each tensor, still in cache."""


@numba.njit(cache=True, nogil=True, inline="always")
def _lanes(x, bits):  # type: ignore[no-untyped-def]
    """The lowest bit of each ``bits``-wide lane of ``x`` that is not zero, the others clear.
    Folding right by 1, 2, 4, ... (``bits`` - 1 in all) never carries into a lower lane."""
    x |= x >> U64(1)
    x |= x >> U64(2)
    x |= x >> U64(4)
    if bits >= 16:
        x |= x >> U64(8)
    if bits >= 32:
        x |= x >> U64(16)
    if bits >= 64:
        x |= x >> U64(32)
    if bits == 8:
        return x & U64(0x0101010101010101)
    if bits == 16:
        return x & U64(0x0001000100010001)
    if bits == 32:
        return x & U64(0x0000000100000001)
    return x & U64(1)


@numba.njit(cache=True, nogil=True)
def _block_masks(old_words, new_words, first, last, masks):  # type: ignore[no-untyped-def]
    """Fill ``masks`` with the differing-word masks of blocks ``first``..``last``; returns how
    many words differ. The fixed-size compare loop compiles to vector instructions."""
    one = np.uint32(1)
    for block in range(first, last):
        base = block * WORDS_PER_BLOCK
        mask = np.uint32(0)
        for k in range(WORDS_PER_BLOCK):
            mask |= np.uint32(old_words[base + k] != new_words[base + k]) << np.uint32(k)
        masks[block - first] = mask
    differing = 0
    for block in range(last - first):
        mask = masks[block]
        while mask:
            differing += 1
            mask &= mask - one
    return differing


@numba.njit(cache=True, nogil=True)
def _record_blocks(old_words, new_words, old, new, bits, masks, first, last, out, j):  # type: ignore[no-untyped-def]
    """Record every changed element of blocks ``first``..``last`` from ``j`` on in ``out``
    (positions, XOR values, step fields); returns the next free index. Set bits are visited
    with cttz, so an unchanged word or element costs no (mispredicted) branch."""
    positions, xored, fields = out
    per_word = 64 // bits
    mask = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - bits)
    half = U64(1) << U64(bits - 1)
    for block in range(first, last):
        words = masks[block - first]
        while words:
            w = block * WORDS_PER_BLOCK + _trailing_zeros(words)
            words &= words - np.uint32(1)
            lanes = _lanes(old_words[w] ^ new_words[w], bits)
            while lanes:
                i = w * per_word + _trailing_zeros(lanes) // bits
                lanes &= lanes - U64(1)
                _record(positions, xored, fields, j, i, old[i], new[i], mask, half)
                j += 1
    return j


@numba.njit(cache=True, nogil=True)
def _grown(out, used, capacity):  # type: ignore[no-untyped-def]
    """``out``'s three arrays with room for ``capacity`` changes, the first ``used`` kept."""
    positions, xored, fields = out
    wider = (np.empty(capacity, np.int64), np.empty(capacity, xored.dtype),
             np.empty(capacity, np.uint64))  # fmt: skip
    wider[0][:used] = positions[:used]
    wider[1][:used] = xored[:used]
    wider[2][:used] = fields[:used]
    return wider


@numba.njit(cache=True, nogil=True)
def _changes(old_words, new_words, old, new, bits):  # type: ignore[no-untyped-def]
    """Positions, XOR values and step fields of the changed elements, in one pass over both
    tensors: each 32 KB chunk is compared as 8-byte words (masks of the differing ones), then
    its changes are recorded while it is still in cache. Reading the tensors twice (count,
    then record) cost 1.6-2.0x ``np.array_equal`` on a 522 MB model; this costs 1.2-1.4x."""
    per_word = 64 // bits
    blocks = old_words.size // WORDS_PER_BLOCK
    capacity = max(256, old.size // 64)
    out = (np.empty(capacity, np.int64), np.empty(capacity, old.dtype),
           np.empty(capacity, np.uint64))  # fmt: skip
    masks = np.empty(BLOCKS_PER_CHUNK, np.uint32)
    j = 0
    for first in range(0, blocks, BLOCKS_PER_CHUNK):
        last = min(first + BLOCKS_PER_CHUNK, blocks)
        needed = j + _block_masks(old_words, new_words, first, last, masks) * per_word
        if needed > capacity:  # doubled, but never past one change per element left
            at_most = j + old.size - first * WORDS_PER_BLOCK * per_word
            capacity = min(max(2 * capacity, needed), at_most)
            out = _grown(out, j, capacity)
        j = _record_blocks(old_words, new_words, old, new, bits, masks, first, last, out, j)
    start = blocks * WORDS_PER_BLOCK * per_word  # the last elements, under a block
    if j + old.size - start > capacity:
        capacity = j + old.size - start
        out = _grown(out, j, capacity)
    positions, xored, fields = out
    mask = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - bits)
    half = U64(1) << U64(bits - 1)
    for i in range(start, old.size):
        if old[i] != new[i]:
            _record(positions, xored, fields, j, i, old[i], new[i], mask, half)
            j += 1
    return positions[:j], xored[:j], fields[:j]

"""``sparse-v2`` payloads of a batch of small tensors in a few numpy calls (no numba).

Without the ``fast`` extra, a tensor of 64 KB cost about 245 us to encode one by one, most of
it in the fixed cost of some forty numpy calls on a few hundred changes each. Here the small
tensors of a batch that share an element size are taken as one: each is compared where it lies
into one mask, and every later step runs once for all of their changes: the gaps, each
tensor's Rice parameter and step width (per-tensor sums by ``np.add.reduceat``), and every
payload's bytes, written into one buffer by a :class:`~deltastore.codecs.byte_writer.ByteWriter`.
What is left per tensor is slicing its payload out. The payloads are byte for byte those of
:func:`deltastore.codecs.sparse2.encode_numpy`, which a property test checks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from deltastore.codecs.base import ByteArray, XorChanges
from deltastore.codecs.byte_writer import ByteWriter, bit_length, varint_lengths
from deltastore.codecs.kernels import ELEMENT_DTYPES, LOG2, element_size
from deltastore.codecs.steps import MARK, bit_lengths, step_fields

Ints = npt.NDArray[np.int64]


@dataclass(frozen=True)
class BatchPayload:
    """One tensor's sparse-v2 payload and its changes, as the per-tensor encoder gives them."""

    payload: bytes
    changed_bytes: int
    changes: XorChanges


GROUP_BYTES = 4 * 1024**2
"""Tensors coded in one pass hold at most this many bytes."""
GROUP_CHANGES = 1 << 17
"""A group with more changed elements than this (a dense step) is coded in parts: the pass holds
about 160 bytes per change for a moment (its index arrays and the writer's byte values), so a
part peaks near 20 MB besides what it returns (measured with tracemalloc: 4 MB of 1-byte
elements, all changed, held 670 MB in one part)."""
ALONE_BYTES = 128 * 1024
"""A tensor over this size is left to the per-tensor encoder. The pass here costs more per
change than that encoder (its streams are laid out for many payloads at once) and saves the
fixed cost of its numpy calls: at 0.4 % density, one thread, it was 5-6x faster on tensors of
8 KB and 1.2-1.7x on 64 KB, even on 256 KB, and 1.7-2.7x slower on 2 MB."""


def groups(
    olds: Sequence[ByteArray], itemsizes: Sequence[int]
) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """([(element size, indices of tensors coded in one pass)], indices left to the per-tensor
    encoder: sizes that are not whole 8-byte words, and large tensors)."""
    by_size: dict[int, list[list[int]]] = {}
    held: dict[int, int] = {}
    alone: list[int] = []
    for index, (old, itemsize) in enumerate(zip(olds, itemsizes, strict=True)):
        if old.size % 8 or old.size > ALONE_BYTES:
            alone.append(index)
            continue
        size = element_size(old.size, itemsize)
        chunks = by_size.setdefault(size, [[]])
        if chunks[-1] and held[size] + old.size > GROUP_BYTES:
            chunks.append([])
            held[size] = 0
        chunks[-1].append(index)
        held[size] = held.get(size, 0) + old.size
    return [(size, chunk) for size, chunks in by_size.items() for chunk in chunks], alone


def _segment_sums(values: np.ndarray, firsts: Ints, counts: Ints) -> np.ndarray:
    """Per segment (``counts`` elements each, the non-empty ones starting at ``firsts``), the
    sum of its ``values``; 0 for an empty segment."""
    sums = np.zeros(counts.size, dtype=values.dtype)
    if firsts.size:
        sums[counts > 0] = np.add.reduceat(values, firsts)
    return sums


def _rice_parameters(gaps: np.ndarray, firsts: Ints, counts: Ints) -> Ints:
    """:func:`deltastore.codecs.kernels.rice_parameter` of each segment's gaps."""
    totals = _segment_sums(gaps, firsts, counts)
    safe = np.maximum(counts, 1)
    mean = np.trunc(totals.astype(np.float64) / safe * 0.6931).astype(np.int64)
    low = np.maximum(bit_length(mean) - 1, 0)
    high = np.minimum(low + 1, 63)
    costs = []
    for k in (low, high):
        shifted = gaps >> np.repeat(k, counts)
        costs.append(_segment_sums(shifted, firsts, counts).astype(np.int64) + counts * k)
    return np.where(costs[0] <= costs[1], low, high)


def _field_widths(fields: np.ndarray, tensor_of: Ints, counts: Ints, bits: int) -> Ints:
    """:func:`deltastore.codecs.steps.field_width` of each segment's fields."""
    histogram = np.bincount(
        tensor_of * (bits + 1) + bit_lengths(fields), minlength=counts.size * (bits + 1)
    ).reshape(counts.size, bits + 1)
    widths = np.arange(bits + 1)
    patches = counts[:, None] - np.cumsum(histogram, axis=1)
    index_bits = bit_length(np.maximum(counts - 1, 0))
    costs = counts[:, None] * widths + patches * (index_bits[:, None] + bits - widths)
    return np.argmin(costs, axis=1).astype(np.int64)


_masks = threading.local()


def _mask(size: int) -> npt.NDArray[np.bool_]:
    """This thread's mask of ``size`` entries, kept between calls: allocated and freed per
    group, glibc handed its pages back and faulted them in again each time (a group took 1.3x
    as long)."""
    mask = getattr(_masks, "mask", None)
    if mask is None or mask.size < size:
        mask = _masks.mask = np.empty(max(size, GROUP_BYTES // 8), dtype=bool)
    return mask[:size]


def _changed_words(olds: Sequence[ByteArray], news: Sequence[ByteArray]) -> tuple[Ints, Ints]:
    """(indices of the 8-byte words that differ, counted over the tensors end to end; each
    tensor's first word there) of tensors of whole 8-byte words.

    Each tensor is compared where it lies, into one mask: copying the tensors end to end first
    cost as much again as the compare, and its buffer a page fault per 4 KB in a new thread."""
    word_at = np.zeros(len(olds) + 1, dtype=np.int64)
    np.cumsum([old.size // 8 for old in olds], out=word_at[1:])
    at = word_at.tolist()
    differs = _mask(at[-1])
    for i, (old, new) in enumerate(zip(olds, news, strict=True)):
        np.not_equal(old.view(np.uint64), new.view(np.uint64), out=differs[at[i] : at[i + 1]])
    return np.flatnonzero(differs), word_at


def _changes(
    olds: Sequence[ByteArray],
    news: Sequence[ByteArray],
    itemsize: int,
    words: Ints,
    word_at: Ints,
) -> tuple[Ints, np.ndarray, np.ndarray, Ints]:
    """(positions of the changed elements, counted over the tensors end to end; their old
    values; their XOR values; each tensor's first element) from the :func:`_changed_words`."""
    dtype = ELEMENT_DTYPES[itemsize]
    at = word_at.tolist()
    bounds = np.searchsorted(words, word_at).tolist()
    old_parts, new_parts = [], []
    for i, (old, new) in enumerate(zip(olds, news, strict=True)):
        if bounds[i] < bounds[i + 1]:
            inside_tensor = words[bounds[i] : bounds[i + 1]] - at[i]
            old_parts.append(old.view(np.uint64)[inside_tensor])
            new_parts.append(new.view(np.uint64)[inside_tensor])
    old_words = np.concatenate(old_parts) if old_parts else np.zeros(0, np.uint64)
    new_words = np.concatenate(new_parts) if new_parts else np.zeros(0, np.uint64)
    values = (old_words ^ new_words).view(dtype)
    inside = np.flatnonzero(values)
    shift = LOG2[8 // itemsize]  # elements per word: 2**shift
    positions = (words[inside >> shift] << shift) | (inside & ((1 << shift) - 1))
    return positions, old_words.view(dtype)[inside], values[inside], word_at << shift


@dataclass(frozen=True)
class _Streams:
    """What a group's payloads hold besides their headers, per tensor and per change."""

    counts: Ints
    firsts: Ints
    """Index of each changed tensor's first change."""
    k: Ints
    widths: Ints
    gaps: np.ndarray
    fields: np.ndarray
    tensor_of: Ints
    ordinals: Ints
    """Each change's index among its tensor's changes."""


def _layout(streams: _Streams, nbytes: Ints, itemsize: int) -> tuple[ByteWriter, Ints]:
    """Every payload of the group written into one :class:`ByteWriter`, each after the one
    before; returns it and the payloads' byte offsets (one more than tensors)."""
    # long because each section's offset follows from the one before it, for all tensors
    s = streams
    bits = 8 * itemsize
    # int64 where the fields fit (numpy is faster on it than on uint64).
    wide = s.fields.astype(np.int64 if itemsize < 8 else np.uint64)
    tensor_widths = s.widths[s.tensor_of]
    shifts = tensor_widths.astype(wide.dtype)
    patched = np.flatnonzero((wide >> shifts) * (tensor_widths < bits))
    patches = np.bincount(s.tensor_of[patched], minlength=s.counts.size).astype(np.int64)
    index_bits = bit_length(np.maximum(s.counts - 1, 0))
    quotients = s.gaps >> s.k[s.tensor_of]
    ends = np.cumsum(quotients + 1) - 1  # each unary code's zero bit, over all tensors
    unary_bits = _segment_sums(quotients + 1, s.firsts, s.counts)
    size_lengths, count_lengths = varint_lengths(nbytes), varint_lengths(s.counts)
    patch_lengths = varint_lengths(patches)
    head = 1 + size_lengths + count_lengths + 2
    sections = [
        head,
        (s.counts * s.k + 7) // 8,
        (s.counts * s.widths + 7) // 8,
        patch_lengths,
        (patches * (index_bits + bits - s.widths) + 7) // 8,
        (unary_bits + 7) // 8,
    ]
    lengths = np.where(s.counts > 0, sum(sections), 0)
    at = np.zeros(s.counts.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=at[1:])
    starts = [at[:-1]]
    for section in sections[:-1]:
        starts.append(starts[-1] + section)
    head_at, remainder_at, field_at, varint_at, patch_at, unary_at = starts
    writer = ByteWriter()
    changed = np.flatnonzero(s.counts)
    writer.put(head_at[changed], np.full(changed.size, MARK | LOG2[itemsize]))
    writer.varints(head_at[changed] + 1, nbytes[changed], size_lengths[changed])
    count_at = head_at + 1 + size_lengths
    writer.varints(count_at[changed], s.counts[changed], count_lengths[changed])
    writer.put(count_at[changed] + count_lengths[changed], s.k[changed])
    writer.put(count_at[changed] + count_lengths[changed] + 1, s.widths[changed])
    k_of = s.k[s.tensor_of]
    writer.bits(8 * remainder_at[s.tensor_of] + s.ordinals * k_of, s.gaps, k_of)
    writer.bits(8 * field_at[s.tensor_of] + s.ordinals * tensor_widths, wide, tensor_widths)
    writer.varints(varint_at[changed], patches[changed], patch_lengths[changed])
    if patched.size:
        owner = s.tensor_of[patched]
        row_bits = index_bits + bits - s.widths
        first_patch = np.cumsum(patches) - patches
        row_at = (
            8 * patch_at[owner] + (np.arange(patched.size) - first_patch[owner]) * row_bits[owner]
        )
        writer.bits(row_at, s.ordinals[patched], index_bits[owner])
        high = wide[patched] >> shifts[patched]
        writer.bits(row_at + index_bits[owner], high, bits - tensor_widths[patched])
    unary_before = np.cumsum(unary_bits) - unary_bits
    writer.unary(
        unary_at, sections[-1], 8 * unary_at[s.tensor_of] + ends - unary_before[s.tensor_of]
    )
    return writer, at


def encode_group(
    olds: Sequence[ByteArray], news: Sequence[ByteArray], itemsize: int
) -> list[BatchPayload | None]:
    """The sparse-v2 payload of each tensor (whole 8-byte words, all coded with ``itemsize``
    -byte elements), None for an unchanged one."""
    bits = 8 * itemsize
    words, word_at = _changed_words(olds, news)
    if words.size * (8 // itemsize) > GROUP_CHANGES and len(olds) > 1:
        # Maybe a dense group: halved (by changed words) so the pass's memory stays bounded.
        word_bounds = np.searchsorted(words, word_at[1:])
        half = min(max(int(np.searchsorted(word_bounds, words.size // 2)) + 1, 1), len(olds) - 1)
        del words
        return encode_group(olds[:half], news[:half], itemsize) + encode_group(
            olds[half:], news[half:], itemsize
        )
    positions, before, xored, starts = _changes(olds, news, itemsize, words, word_at)
    bounds = np.searchsorted(positions, starts)
    counts = np.diff(bounds)
    firsts = bounds[:-1][counts > 0]
    tensor_of = np.repeat(np.arange(len(olds)), counts)
    local = positions - starts[:-1][tensor_of]
    gaps = np.empty(positions.size, dtype=np.int64)
    if positions.size:
        gaps[0] = local[0]
        np.subtract(local[1:], local[:-1] + 1, out=gaps[1:])
        gaps[firsts] = local[firsts]
    fields = step_fields(before, before ^ xored)
    streams = _Streams(
        counts=counts,
        firsts=firsts,
        k=_rice_parameters(gaps, firsts, counts),
        widths=_field_widths(fields, tensor_of, counts, bits),
        gaps=gaps,
        fields=fields,
        tensor_of=tensor_of,
        ordinals=np.arange(positions.size) - np.repeat(bounds[:-1], counts),
    )
    nbytes = np.array([old.size for old in olds], dtype=np.int64)
    writer, at = _layout(streams, nbytes, itemsize)
    payloads = writer.build(int(at[-1])).tobytes()
    changed_bytes = _segment_sums(
        np.count_nonzero(xored.view(np.uint8).reshape(-1, itemsize), axis=1), firsts, counts
    ).tolist()
    at_list, bounds_list = at.tolist(), bounds.tolist()
    out: list[BatchPayload | None] = []
    for i, count in enumerate(counts.tolist()):
        if not count:
            out.append(None)
            continue
        lo, hi = bounds_list[i], bounds_list[i + 1]
        changes = XorChanges(local[lo:hi], xored[lo:hi])
        out.append(BatchPayload(payloads[at_list[i] : at_list[i + 1]], changed_bytes[i], changes))
    return out

"""The numpy writer (no numba): a group's sparse-v2 payloads in one pass of numpy calls.

A group's payloads must be byte for byte each tensor's as a group of one (whose streams are
packed whole) and the compiled encoder's, whatever the element size, size, density and step
spread (patched steps, 64-bit fields, patch rows wider than 64 bits); the bytes come from
:class:`ByteWriter`, checked here against bit strings built by hand.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs import numpy_backend
from deltastore.codecs.numpy_backend import (
    ALONE_BYTES,
    GROUP_BYTES,
    PACK_IN_WORDS,
    ByteWriter,
    encode_group,
    fields_to_bits,
    groups,
)
from deltastore.codecs.numpy_backend import encode as encode_numpy
from deltastore.codecs.sparse import AutoEncoding, CompactSparseEncoding
from deltastore.codecs.sparse_format import varint
from tests.codecs.test_batch import check_like_alone
from tests.codecs.test_sparse import DENSITIES, stepped
from tests.conftest import HAVE_NUMBA


@settings(max_examples=120, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 4, 8]),
    words=st.lists(st.sampled_from([0, 1, 2, 3, 17, 64, 500, 2048]), min_size=1, max_size=12),
    density=st.sampled_from(DENSITIES),
    spread=st.sampled_from([1, 3, 12, 64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_group_payloads_are_each_tensors_alone_and_the_compiled_encoders(
    itemsize: int, words: list[int], density: float, spread: int, seed: int
):
    rng = np.random.default_rng(seed)
    olds = [rng.integers(0, 256, size=8 * n, dtype=np.uint8) for n in words]
    news = [stepped(old, itemsize, density, seed + i, spread) for i, old in enumerate(olds)]
    compiled = CompactSparseEncoding(use_jit=True) if HAVE_NUMBA else None
    for old, new, got in zip(olds, news, encode_group(olds, news, itemsize), strict=True):
        payload, changes = encode_numpy(old, new, itemsize)
        if compiled is not None:
            assert bytes(compiled.encode(old, new, itemsize=itemsize).payload) == payload
        got_payload, changed_bytes, got_changes = got
        assert got_payload == payload
        assert changed_bytes == int(np.count_nonzero(old != new))
        assert np.array_equal(got_changes.positions, changes.positions)
        assert got_changes.values.dtype == changes.values.dtype
        assert np.array_equal(got_changes.values, changes.values)


def test_wide_patches_of_eight_byte_elements():
    """A 64-bit field with a patch row of index bits plus up to 64 high bits (over 64 bits in
    all: written as two fields), next to ±1 steps that make the width 1."""
    rng = np.random.default_rng(9)
    old = rng.integers(0, 256, size=8 * 4096, dtype=np.uint8)
    new = old.copy()
    elements = new.view("<u8")
    elements[::7] += np.uint64(1)
    elements[3::701] ^= np.uint64(0xF0F0_0000_0000_0001)
    payload, changes = encode_numpy(old, new, 8)
    width_at = 1 + len(varint(old.size)) + len(varint(changes.positions.size)) + 1
    assert payload[0] == 0x23 and payload[width_at] == 1  # ±1 steps: fields of one bit
    other = np.zeros(64, dtype=np.uint8)
    got, _ = encode_group([old, other], [new, other + 1], 8)  # the group's windows, not runs
    assert got[0] == payload


def bit_string(values: list[int], widths: list[int]) -> str:
    return "".join(
        format(v & ((1 << w) - 1), f"0{w}b") if w else "" for v, w in zip(values, widths)
    )


@settings(max_examples=200, deadline=None)
@given(
    fields=st.lists(
        st.integers(0, 64).flatmap(lambda w: st.tuples(st.integers(0, 2**64 - 1), st.just(w))),
        max_size=40,
    ),
    gap=st.integers(0, 13),
)
def test_writer_bits_match_a_hand_built_bit_string(fields: list[tuple[int, int]], gap: int):
    """Fields of 0..64 bits at any bit offset, MSB first, with unwritten bits between them."""
    values = [v for v, _ in fields]
    widths = [w for _, w in fields]
    starts, at = [], gap
    for w in widths:
        starts.append(at)
        at += w + gap
    writer = ByteWriter()
    writer.bits(
        np.array(starts, dtype=np.int64),
        np.array(values, dtype=np.uint64),
        np.array(widths, dtype=np.int64),
    )
    size = (at + 7) // 8
    expected = ["0"] * (8 * size)
    for start, v, w in zip(starts, values, widths, strict=True):
        expected[start : start + w] = bit_string([v], [w])
    got = writer.build(size)
    assert "".join(format(b, "08b") for b in got.tobytes()) == "".join(expected)


def test_writer_unary_regions_match_hand_built_bit_strings():
    rng = np.random.default_rng(2)
    runs = [rng.integers(0, 20, size=n) for n in (1, 5, 8, 33)]
    streams = ["".join("1" * int(q) + "0" for q in run) for run in runs]
    streams = [bits + "1" * (-len(bits) % 8) for bits in streams]  # padded with ones
    sizes = np.array([len(bits) // 8 for bits in streams], dtype=np.int64)
    starts = np.concatenate(([3], 3 + np.cumsum(sizes)[:-1])).astype(np.int64)
    zeros = [8 * start + np.cumsum(q + 1) - 1 for start, q in zip(starts, runs, strict=True)]
    for chosen in ([0, 1, 2, 3], [2]):  # several regions, and one (packed whole)
        writer = ByteWriter()
        writer.unary(starts[chosen], sizes[chosen], np.concatenate([zeros[i] for i in chosen]))
        built = writer.build(3 + int(sizes.sum()))
        expected = "0" * 24 + "".join(
            bits if i in chosen else "0" * len(bits) for i, bits in enumerate(streams)
        )
        assert "".join(format(b, "08b") for b in built.tobytes()) == expected


def test_groups_split_by_element_size_and_bytes():
    olds = [np.zeros(n, dtype=np.uint8) for n in (64, 9, ALONE_BYTES + 8, 64, ALONE_BYTES, 8)]
    olds += [np.zeros(ALONE_BYTES, dtype=np.uint8) for _ in range(GROUP_BYTES // ALONE_BYTES + 6)]
    itemsizes = [2, 2, 2, 4, 2, 3] + [2] * (len(olds) - 6)
    chunks = groups(olds, itemsizes)
    assert (2, [2]) in chunks  # over ALONE_BYTES: a group of its own
    assert (1, [1, 5]) in chunks  # element sizes that do not divide: coded byte by byte
    assert (4, [3]) in chunks
    two = [indices for size, indices in chunks if size == 2 and indices != [2]]
    assert sorted(i for chunk in two for i in chunk) == [0, 4, *range(6, len(olds))]
    assert len(two) == 2
    assert all(sum(olds[i].size for i in chunk) <= GROUP_BYTES for chunk in two)


@pytest.mark.parametrize("kind", [CompactSparseEncoding, AutoEncoding])
def test_numpy_batch_encodes_without_the_per_tensor_encoder(kind, monkeypatch):
    """Without numba a batch of small sparse tensors goes through one group pass: neither the
    encoding's per-tensor ``encode`` nor the per-tensor numpy encoder runs."""
    rng = np.random.default_rng(4)
    olds = [rng.integers(0, 256, size=65536, dtype=np.uint8) for _ in range(12)]
    news = [stepped(old, 2, 0.004, i, 1) for i, old in enumerate(olds)]
    encoding = kind(use_jit=False)
    expected = [encoding.encode(o, n, itemsize=2) for o, n in zip(olds, news, strict=True)]

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("encoded one tensor at a time")

    monkeypatch.setattr(encoding, "encode", refuse)
    monkeypatch.setattr("deltastore.codecs.numpy_backend.encode", refuse)
    framed = encoding.encode_framed(olds, news, [2] * len(olds))
    assert [f.changed_bytes for f in framed] == [e.changed_bytes for e in expected]
    assert [zstandard.ZstdDecompressor().decompress(f.frame) for f in framed] == [
        bytes(e.payload) for e in expected
    ]


def test_numpy_batch_with_a_large_and_an_odd_tensor_gives_what_each_alone_gives():
    rng = np.random.default_rng(6)
    olds = [
        rng.integers(0, 256, size=n, dtype=np.uint8) for n in (ALONE_BYTES + 64, 4096, 4097, 800)
    ]
    news = [stepped(old, 2, 0.01, i, 4) for i, old in enumerate(olds)]
    for kind in (CompactSparseEncoding, AutoEncoding):
        check_like_alone(kind(use_jit=False), olds, news, [2, 2, 2, 4])


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(0, 64),
    count=st.sampled_from([0, 1, 7, PACK_IN_WORDS - 1, PACK_IN_WORDS, PACK_IN_WORDS + 5, 3001]),
    seed=st.integers(0, 2**32 - 1),
)
def test_low_bits_packed_in_words_match_the_bit_by_bit_packing(k: int, count: int, seed: int):
    """``fields_to_bits`` packs large arrays a group of values to a 64-bit word (k = 1..7,
    10, 12, 20, 24, 28, 40, 44 ...): the same bytes as spreading every bit out."""
    values = np.random.default_rng(seed).integers(0, 2**64, size=count, dtype=np.uint64)
    expected = "".join(format(int(v) & ((1 << k) - 1), f"0{k}b") if k else "" for v in values)
    expected += "0" * (-len(expected) % 8)
    packed = fields_to_bits(values, k)
    assert "".join(format(b, "08b") for b in packed.tobytes()) == expected
    assert packed.flags.c_contiguous  # callers hand its memoryview to bytes.join


def test_a_dense_group_is_coded_in_parts_with_bounded_memory():
    """Every 1-byte element of 4 MB changed: the pass splits the group by changes, so it holds
    tens of MB at most (in one part it held about 670 MB), and the payloads do not change."""
    rng = np.random.default_rng(8)
    olds = [rng.integers(0, 256, size=ALONE_BYTES, dtype=np.uint8) for _ in range(32)]
    news = [(old + 1).astype(np.uint8) for old in olds]
    tracemalloc.start()
    try:
        payloads = encode_group(olds, news, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kept = sum(len(p[0]) + p[2].nbytes for p in payloads)
    assert peak - kept < 64 * 1024**2
    for i in (0, 17, 31):
        assert payloads[i][0] == encode_numpy(olds[i], news[i], 1)[0]


def test_group_split_points_keep_every_payload(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(numpy_backend, "GROUP_CHANGES", 50)
    rng = np.random.default_rng(10)
    olds = [rng.integers(0, 256, size=8 * n, dtype=np.uint8) for n in (3, 400, 0, 90, 1, 257)]
    news = [stepped(old, 2, 0.2, i, 3) for i, old in enumerate(olds)]
    for old, new, got in zip(olds, news, encode_group(olds, news, 2), strict=True):
        payload, changes = encode_numpy(old, new, 2)
        assert got[0] == payload and (got[1] == 0) == (not changes.positions.size)

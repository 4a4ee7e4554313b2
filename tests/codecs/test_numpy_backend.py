"""The numpy backend (no numba): wide patches, a batch of mixed tensors, the packing of low bits
in words, each against the bytes of the other backend or of a hand-built bit string."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs.numpy_backend import PACK_IN_WORDS, fields_to_bits
from deltastore.codecs.numpy_backend import encode as encode_numpy
from deltastore.codecs.sparse import AutoEncoding, CompactSparseEncoding
from deltastore.codecs.sparse_format import varint
from tests.codecs.test_batch import check_like_alone
from tests.codecs.test_sparse import stepped


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
    assert bytes(CompactSparseEncoding().encode(old, new, itemsize=8).payload) == payload


def test_numpy_batch_with_a_large_and_an_odd_tensor_gives_what_each_alone_gives():
    rng = np.random.default_rng(6)
    olds = [
        rng.integers(0, 256, size=n, dtype=np.uint8) for n in (128 * 1024 + 64, 4096, 4097, 800)
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

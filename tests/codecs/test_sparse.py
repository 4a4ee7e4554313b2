"""sparse-v1 and auto: bit-exact round trips over element sizes, sizes and densities.

Each case goes the whole way a payload travels: encode, one zstd-1 frame, decompress bounded by
the encoding's ``max_payload_size``, apply in place. The expected bytes are the new bytes
themselves; applying the payload a second time must give the old bytes back (both encodings
XOR their values in).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs import compress, decompress, get_encoding
from deltastore.codecs.kernels import (
    _CHUNK_WORDS,
    decode_gaps,
    encode_gaps,
    itemsize_of_dtype,
    rice_decode,
    rice_encode,
    rice_parameter,
    to_planes,
)
from deltastore.codecs.smallest import TAG_COMPACT, TAG_SPARSE, TAG_XOR, AutoEncoding
from deltastore.codecs.sparse import HEADER, SparseXorEncoding
from deltastore.codecs.sparse2 import CompactSparseEncoding
from deltastore.publish.snapshot import tensor_bytes

NEW_ENCODINGS = ["sparse-v1", "auto"]
DENSITIES = [0.0, 0.001, 0.004, 0.05, 0.3, 0.9, 1.0]
TORCH_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def roundtrip(name: str, old: np.ndarray, new: np.ndarray, itemsize: int) -> bytes:
    """The payload after encode → frame → bounded decompress; asserts apply and re-apply."""
    encoding = get_encoding(name)
    delta = encoding.encode(old, new, itemsize=itemsize)  # type: ignore[call-arg]
    assert delta.changed_bytes == int(np.count_nonzero(old != new))
    assert len(delta.payload) <= encoding.max_payload_size(old.size)
    restored = decompress(
        compress(delta.payload), max_size=encoding.max_payload_size(old.size), what="frame"
    )
    target = old.copy()
    encoding.apply(target, restored, tensor="t")
    assert target.tobytes() == new.tobytes()
    encoding.apply(target, restored, tensor="t")
    assert target.tobytes() == old.tobytes()
    return restored


def changed_copy(old: np.ndarray, itemsize: int, density: float, seed: int) -> np.ndarray:
    """``old`` with about ``density`` of its elements given other random bytes."""
    rng = np.random.default_rng(seed)
    new = old.copy()
    cells = new.reshape(-1, itemsize) if old.size % itemsize == 0 else new.reshape(-1, 1)
    picked = rng.random(cells.shape[0]) < density
    cells[picked] ^= rng.integers(1, 256, size=cells[picked].shape, dtype=np.uint8)
    return new


@pytest.mark.parametrize("name", NEW_ENCODINGS)
@settings(max_examples=120, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 3, 4, 8, 6]),
    elements=st.sampled_from([0, 1, 2, 3, 7, 8, 9, 63, 257, 1001, 4099]),
    density=st.sampled_from(DENSITIES),
    seed=st.integers(0, 2**32 - 1),
    tail=st.integers(0, 1),
)
def test_roundtrip_over_element_sizes_sizes_and_densities(
    name: str, itemsize: int, elements: int, density: float, seed: int, tail: int
):
    """Odd element sizes (3, 6) and sizes that are not a whole number of elements (tail=1)
    fall back to bytes; every combination round-trips."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, size=elements * itemsize + tail, dtype=np.uint8)
    new = changed_copy(old, itemsize, density, seed + 1)
    roundtrip(name, old, new, itemsize)


@pytest.mark.parametrize("name", NEW_ENCODINGS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_torch_views_with_their_element_size(name: str, dtype: torch.dtype, layout: str):
    """Tensors of every dtype, also as transposed and sliced views, go through the publisher's
    ``tensor_bytes`` and round-trip with their own element size."""
    generator = torch.Generator().manual_seed(7)
    parent = torch.randn((34, 17), generator=generator).to(dtype)
    stepped = (torch.randn((34, 17), generator=generator) * 0.001).to(dtype)
    changed = torch.where(torch.rand((34, 17), generator=generator) < 0.05, stepped, parent)
    views = {
        "contiguous": lambda t: t,
        "transposed": lambda t: t.transpose(0, 1),
        "sliced": lambda t: t[::3, 1:],
    }
    old = tensor_bytes("t", views[layout](parent))
    new = tensor_bytes("t", views[layout](changed))
    roundtrip(name, old, new, parent.element_size())


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_changes_across_chunk_boundaries_and_the_tail(itemsize: int):
    """Changes right at the kernel's chunk edges and in the last, partial word are found."""
    partial_word = (8 - itemsize) % 8  # whole elements that do not fill a last word
    nbytes = 2 * _CHUNK_WORDS * 8 + 24 + partial_word
    old = np.random.default_rng(3).integers(0, 256, size=nbytes, dtype=np.uint8)
    new = old.copy()
    edge = _CHUNK_WORDS * 8
    for byte in (0, edge - 1, edge, 2 * edge - 1, 2 * edge, nbytes - 1):
        new[byte] ^= 0x5A
    payload = roundtrip("sparse-v1", old, new, itemsize)
    positions, _ = SparseXorEncoding().decode(payload, nbytes, tensor="t")
    expected = sorted(
        {b // itemsize for b in (0, edge - 1, edge, 2 * edge - 1, 2 * edge, nbytes - 1)}
    )
    assert positions.tolist() == expected


def test_element_size_is_recorded_and_odd_sizes_fall_back_to_bytes():
    old = np.zeros(24, dtype=np.uint8)
    new = old.copy()
    new[5] = 1
    for asked, recorded in [(2, 2), (4, 4), (8, 8), (3, 1), (16, 1), (1, 1)]:
        payload = bytes(SparseXorEncoding().encode(old, new, itemsize=asked).payload)
        assert HEADER.unpack_from(payload)[1] == recorded
    odd = np.zeros(9, dtype=np.uint8)
    payload = bytes(SparseXorEncoding().encode(odd, odd, itemsize=2).payload)
    assert HEADER.unpack_from(payload)[1] == 1


def _read_rice(unary: bytes, nbits: int, remainders: bytes, k: int, count: int) -> list[int]:
    """A plain bit-by-bit reader of the documented streams (independent of the kernels)."""
    ubits = "".join(f"{b:08b}" for b in unary)[:nbits]
    quotients = [len(run) for run in ubits.split("0")[:-1]]
    rbits = "".join(f"{b:08b}" for b in remainders)
    return [
        (q << k) | int(rbits[i * k : (i + 1) * k] or "0", 2)
        for i, q in enumerate(quotients[:count])
    ]


def test_payload_layout():
    """Header, unary stream, remainder stream, values frame, exactly as the docs describe."""
    old = np.zeros(2000, dtype=np.uint8)
    new = old.copy()
    new.view("<u2")[[3, 300, 301]] = [0x0102, 0x0304, 0x0506]
    payload = bytes(SparseXorEncoding().encode(old, new, itemsize=2).payload)
    magic, itemsize, k, coding, nbytes, count, unary_bits, values_len = HEADER.unpack_from(payload)
    assert (magic, itemsize, coding, nbytes, count) == (b"DSS", 2, 0, 2000, 3)
    unary_end = HEADER.size + (unary_bits + 7) // 8
    values_start = unary_end + (3 * k + 7) // 8
    assert len(payload) == values_start + values_len
    gaps = _read_rice(
        payload[HEADER.size : unary_end], unary_bits, payload[unary_end:values_start], k, 3
    )
    assert gaps == [3, 296, 0]
    planes = zstandard.ZstdDecompressor().decompress(payload[values_start:])
    assert planes == bytes([0x02, 0x04, 0x06, 0x01, 0x03, 0x05])


@settings(max_examples=80, deadline=None)
@given(gaps=st.lists(st.integers(0, 2**40), max_size=40), skew=st.booleans())
def test_gap_coding_takes_positions_past_4_gib(gaps: list[int], skew: bool):
    """Positions are u64: gaps beyond 2**32 Rice-code and decode back exactly, whatever k."""
    if skew:
        gaps = [*gaps, *([0] * 50)]  # mostly small gaps with a few huge ones
    positions = np.cumsum(np.array(gaps, dtype=np.int64) + 1) - 1
    coded = encode_gaps(positions)
    assert coded.tolist() == gaps
    k = rice_parameter(coded)
    unary, nbits, remainders = rice_encode(coded, k)
    assert nbits <= 2 * len(gaps) + sum(g >> k for g in gaps)
    back = rice_decode(unary, nbits, remainders, k, len(gaps))
    assert back is not None and back.tolist() == gaps
    assert _read_rice(unary.tobytes(), nbits, remainders.tobytes(), k, len(gaps)) == gaps
    decoded = decode_gaps(back, int(positions[-1]) + 1 if gaps else 0)
    assert decoded is not None and decoded.tolist() == positions.tolist()


def craft(nbytes: int, itemsize: int, positions: list[int], values: np.ndarray) -> bytes:
    """A sparse-v1 payload built from its parts with the kernels (no tensor needed)."""
    gaps = encode_gaps(np.array(positions, dtype=np.int64))
    k = rice_parameter(gaps)
    unary, nbits, remainders = rice_encode(gaps, k)
    frame = compress(memoryview(to_planes(values))) if values.size else b""
    header = HEADER.pack(b"DSS", itemsize, k, 0, nbytes, len(positions), nbits, len(frame))
    return header + unary.tobytes() + remainders.tobytes() + frame


def test_header_of_a_tensor_over_4_gib_without_allocating_it():
    """A crafted payload for a 6 GiB tensor with changes past 2**32 decodes to u64 positions;
    only the header's declared size is compared with the tensor's, nothing that large exists."""
    nbytes = 6 << 30
    positions = [5, 2**32 + 11, nbytes - 1]
    payload = craft(nbytes, 1, positions, np.array([1, 2, 3], dtype=np.uint8))
    decoded, got = SparseXorEncoding().decode(payload, nbytes, tensor="big")
    assert decoded.tolist() == positions and got.tolist() == [1, 2, 3]
    assert len(payload) < SparseXorEncoding().max_payload_size(nbytes)


def test_a_real_tensor_over_4_gib_round_trips():
    """4 GiB + 8 bytes of zero pages (calloc: untouched pages take no memory) with changes on
    both sides of byte 2**32."""
    nbytes = (1 << 32) + 8
    old = np.zeros(nbytes, dtype=np.uint8)
    new = np.zeros(nbytes, dtype=np.uint8)
    for byte in (17, (1 << 32) - 1, (1 << 32) + 5):
        new[byte] = 0x81
    delta = SparseXorEncoding().encode(old, new, itemsize=1)
    positions, _ = SparseXorEncoding().decode(delta.payload, nbytes, tensor="big")
    assert positions.tolist() == [17, (1 << 32) - 1, (1 << 32) + 5]
    old[[17, (1 << 32) - 1, (1 << 32) + 5]] = [1, 2, 3]  # apply XORs onto what is there
    SparseXorEncoding().apply(old, delta.payload, tensor="big")
    assert old[[17, (1 << 32) - 1, (1 << 32) + 5]].tolist() == [0x80, 0x83, 0x82]


def test_auto_keeps_a_dense_tensor_as_xor_and_a_sparse_one_as_sparse():
    rng = np.random.default_rng(11)
    old = rng.integers(0, 256, size=1 << 16, dtype=np.uint8)
    auto = AutoEncoding()
    dense = rng.integers(0, 256, size=old.size, dtype=np.uint8)
    assert auto.choose(old, dense, itemsize=2)[0] == TAG_XOR
    assert bytes(auto.encode(old, dense, itemsize=2).payload)[0] == TAG_XOR
    sparse = changed_copy(old, 2, 0.004, 12)
    assert auto.choose(old, sparse, itemsize=2)[0] == TAG_COMPACT
    # In between, it keeps whichever is smallest (sparse-v1 and sparse-v2 as their payloads).
    for density in (0.2, 0.3, 0.5):
        middle = changed_copy(old, 2, density, 13)
        tag, _ = auto.choose(old, middle, itemsize=2)
        sizes = {
            TAG_COMPACT: len(CompactSparseEncoding().encode(old, middle, itemsize=2).payload),
            TAG_SPARSE: len(SparseXorEncoding().encode(old, middle, itemsize=2).payload),
            TAG_XOR: len(compress(np.bitwise_xor(old, middle))),
        }
        assert tag == min(sizes, key=sizes.__getitem__)


def test_itemsize_of_safetensors_dtypes():
    """The publisher's element size comes from the base checkpoint's dtype string."""
    assert [itemsize_of_dtype(d) for d in ("BF16", "F32", "F8_E4M3", "BOOL", "I64")] == [
        2,
        4,
        1,
        1,
        8,
    ]
    assert itemsize_of_dtype("NEW_DTYPE") == 1  # dtype-blind fallback

"""auto: bit-exact round trips over element sizes, sizes and densities, its choice, its
refusals; and the removed sparse-v1 refused with what to do.

Each case goes the whole way a payload travels: encode, one zstd-1 frame, decompress bounded by
the encoding's ``max_payload_size``, apply in place. The expected bytes are the new bytes
themselves; applying the payload a second time must give the old bytes back (``auto`` XORs or
steps its values in).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs import ENCODINGS, compress, decompress, get_encoding
from deltastore.codecs.numpy_backend import decode_gaps, encode_gaps
from deltastore.codecs.sparse import AutoEncoding, CompactSparseEncoding
from deltastore.codecs.sparse_format import TAG_COMPACT, TAG_SPARSE_V1, TAG_XOR, itemsize_of_dtype
from deltastore.errors import ConfigError, DeltastoreError, FormatError
from deltastore.publish.snapshot import tensor_bytes

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


@settings(max_examples=120, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 3, 4, 8, 6]),
    elements=st.sampled_from([0, 1, 2, 3, 7, 8, 9, 63, 257, 1001, 4099]),
    density=st.sampled_from(DENSITIES),
    seed=st.integers(0, 2**32 - 1),
    tail=st.integers(0, 1),
)
def test_roundtrip_over_element_sizes_sizes_and_densities(
    itemsize: int, elements: int, density: float, seed: int, tail: int
):
    """Odd element sizes (3, 6) and sizes that are not a whole number of elements (tail=1)
    fall back to bytes; every combination round-trips."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, size=elements * itemsize + tail, dtype=np.uint8)
    new = changed_copy(old, itemsize, density, seed + 1)
    roundtrip("auto", old, new, itemsize)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_torch_views_with_their_element_size(dtype: torch.dtype, layout: str):
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
    roundtrip("auto", old, new, parent.element_size())


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_changes_across_chunk_boundaries_and_the_tail(itemsize: int):
    """Changes right at the kernel's chunk edges and in the last, partial word are found."""
    edge = 1 << 21  # a multiple of the compiled finder's 32 KB chunks
    partial_word = (8 - itemsize) % 8  # whole elements that do not fill a last word
    nbytes = 2 * edge + 24 + partial_word
    old = np.random.default_rng(3).integers(0, 256, size=nbytes, dtype=np.uint8)
    new = old.copy()
    for byte in (0, edge - 1, edge, 2 * edge - 1, 2 * edge, nbytes - 1):
        new[byte] ^= 0x5A
    payload = roundtrip("sparse-v2", old, new, itemsize)
    positions, _, _ = CompactSparseEncoding().decode(payload, nbytes, tensor="t")
    expected = sorted(
        {b // itemsize for b in (0, edge - 1, edge, 2 * edge - 1, 2 * edge, nbytes - 1)}
    )
    assert positions.tolist() == expected


@settings(max_examples=80, deadline=None)
@given(gaps=st.lists(st.integers(0, 2**40), max_size=40), skew=st.booleans())
def test_gap_coding_takes_positions_past_4_gib(gaps: list[int], skew: bool):
    """Positions are u64: gaps beyond 2**32 code and decode back exactly."""
    if skew:
        gaps = [*gaps, *([0] * 50)]  # mostly small gaps with a few huge ones
    positions = np.cumsum(np.array(gaps, dtype=np.int64) + 1) - 1
    coded = encode_gaps(positions)
    assert coded.tolist() == gaps
    decoded = decode_gaps(coded, int(positions[-1]) + 1 if gaps else 0)
    assert decoded is not None and decoded.tolist() == positions.tolist()


def test_auto_keeps_a_dense_tensor_as_xor_and_a_sparse_one_as_sparse():
    rng = np.random.default_rng(11)
    old = rng.integers(0, 256, size=1 << 16, dtype=np.uint8)
    auto = AutoEncoding()
    dense = rng.integers(0, 256, size=old.size, dtype=np.uint8)
    assert auto.choose(old, dense, itemsize=2)[0] == TAG_XOR
    assert bytes(auto.encode(old, dense, itemsize=2).payload)[0] == TAG_XOR
    sparse = changed_copy(old, 2, 0.004, 12)
    assert auto.choose(old, sparse, itemsize=2)[0] == TAG_COMPACT
    # In between, it keeps whichever is smaller (sparse-v2 as its payload, xor as its frame).
    for density in (0.2, 0.3, 0.5):
        middle = changed_copy(old, 2, density, 13)
        tag, _ = auto.choose(old, middle, itemsize=2)
        sizes = {
            TAG_COMPACT: len(CompactSparseEncoding().encode(old, middle, itemsize=2).payload),
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


def _payload(nbytes: int = 64, itemsize: int = 2, changed: tuple[int, ...] = (1, 5, 30)) -> bytes:
    old = np.zeros(nbytes, dtype=np.uint8)
    new = old.copy()
    new.view(f"<u{itemsize}")[list(changed)] = 7
    return bytes(CompactSparseEncoding().encode(old, new, itemsize=itemsize).payload)


def _apply_error(payload: bytes, nbytes: int = 64, name: str = "auto") -> str:
    target = np.zeros(nbytes, dtype=np.uint8)
    with pytest.raises(FormatError) as info:
        get_encoding(name).apply(target, payload, tensor="model.layers.3.mlp.up_proj.weight")
    message = str(info.value)
    assert "model.layers.3.mlp.up_proj.weight" in message
    assert not target.any(), "a refused payload must not have written anything"
    return message


def test_auto_refuses_empty_payloads_and_unknown_tags():
    assert "empty" in _apply_error(b"")
    assert "tag 7" in _apply_error(b"\x07" + _payload())
    # the inner payload is checked by its own encoding, still naming the tensor
    assert "another checkpoint" in _apply_error(b"\x00" + bytes(63))
    assert "truncated" in _apply_error(b"\x02\x21")


def test_a_removed_sparse_v1_is_refused_with_what_to_do():
    """sparse-v1 is gone: asking for it (a publisher's setting, a version's index) is a
    ConfigError that says what to do, and an auto payload tagged with it a FormatError naming
    the tensor, with nothing written."""
    with pytest.raises(ConfigError, match=r"sparse-v1.*removed.*full=True") as info:
        get_encoding("sparse-v1")
    assert isinstance(info.value, DeltastoreError) and "sparse-v1" not in ENCODINGS
    message = _apply_error(bytes([TAG_SPARSE_V1]) + b"DSS" + bytes(40))
    assert "sparse-v1" in message and "publish a full version" in message


def test_a_frame_declaring_more_than_the_bound_is_refused_before_allocating():
    """The store's zstd frame declares its content size; it is held against max_payload_size."""
    encoding = ENCODINGS["auto"]
    bound = encoding.max_payload_size(1000)
    frame = struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", bound + 1)
    with pytest.raises(FormatError, match="refusing to allocate"):
        decompress(frame + b"\x01\0\0", max_size=bound, what="payload of tensor 't'")
    real = compress(b"\x02" + _payload(nbytes=1000, itemsize=4, changed=tuple(range(250))))
    assert len(decompress(real, max_size=bound, what="t")) <= bound


def test_auto_declares_its_semantics():
    encoding = ENCODINGS["auto"]
    assert encoding.idempotent is False  # XOR or steps values in: twice reverts
    assert encoding.self_inverse is True
    assert encoding.name == "auto"

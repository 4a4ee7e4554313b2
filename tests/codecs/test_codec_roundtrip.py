"""Property tests: tensor bytes → encode → zstd → decompress → apply gives the new bytes back.

Every encoding x checksum is run over the dtypes the reference must carry byte-blindly (bf16,
fp16, fp32, float8, int8, uint8, bool), shapes including 0-d, empty and 1-element, and
non-contiguous views (transposed, sliced), which go through the publisher's ``tensor_bytes``.
The expected bytes of a view are derived independently of torch, from the parent's raw bytes
with numpy (byte views of non-contiguous tensors read the wrong bytes).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import blake3
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs import (
    CHECKSUMS,
    ENCODINGS,
    compress,
    decompress,
    get_checksum,
    get_encoding,
)
from deltastore.codecs.compression import frame_content_size
from deltastore.publish.snapshot import tensor_bytes

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.int8,
    torch.uint8,
    torch.bool,
]
LAYOUTS = ["contiguous", "transposed", "sliced"]


def reference_digest(name: str, data: bytes) -> str:
    """The reference hex forms, computed with the digest libraries directly."""
    if name == "xxh3-128":
        return xxhash.xxh3_128_hexdigest(data)
    if name == "blake3":
        return blake3.blake3(data).hexdigest()
    if name == "adler32":
        return f"{zlib.adler32(data):08x}"
    raise AssertionError(name)


@dataclass(frozen=True)
class Case:
    """One old/new pair of tensor views and the row-major bytes they must serialise to."""

    dtype: torch.dtype
    layout: str
    old: torch.Tensor
    new: torch.Tensor
    old_expected: bytes
    new_expected: bytes


def _view(parent_raw: np.ndarray, parent_shape: tuple[int, ...], dtype: torch.dtype, layout: str):
    """(torch view, its expected row-major bytes) for a parent given as raw uint8 bytes.

    The expected bytes come from numpy on a (*parent_shape, itemsize) byte array, so they do
    not depend on how torch makes a view contiguous.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    flat = (
        torch.frombuffer(bytearray(parent_raw.tobytes()), dtype=torch.uint8)
        if parent_raw.size
        else torch.empty(0, dtype=torch.uint8)
    )
    parent = flat.view(dtype).reshape(parent_shape)
    cells = parent_raw.reshape((*parent_shape, itemsize))
    if layout == "transposed":
        view = parent.transpose(-1, -2)
        expected = np.swapaxes(cells, -2, -3)
    elif layout == "sliced":
        view = parent[::2]
        expected = cells[::2]
    else:
        view, expected = parent, cells
    return view, np.ascontiguousarray(expected).tobytes()


@st.composite
def cases(draw: st.DrawFn) -> Case:
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    min_dims = {"contiguous": 0, "transposed": 2, "sliced": 1}[layout]
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=min_dims, max_size=3)))
    if layout == "sliced":
        # The slice [::2] of a parent twice as long (plus one) keeps every other row.
        shape = (2 * shape[0] + draw(st.integers(0, 1)), *shape[1:])
    itemsize = torch.empty(0, dtype=dtype).element_size()
    size = int(np.prod(shape, dtype=np.int64)) * itemsize
    old_raw = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=np.uint8)
    new_raw = old_raw.copy()
    if size:
        changes = draw(
            st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 255)), max_size=size)
        )
        for pos, value in changes:
            new_raw[pos] = value
    if dtype == torch.bool:  # a bool byte is 0 or 1
        old_raw, new_raw = (old_raw & 1).astype(np.uint8), (new_raw & 1).astype(np.uint8)
    old, old_expected = _view(old_raw, shape, dtype, layout)
    new, new_expected = _view(new_raw, shape, dtype, layout)
    return Case(dtype, layout, old, new, old_expected, new_expected)


@pytest.mark.parametrize("checksum_name", sorted(CHECKSUMS))
@pytest.mark.parametrize("encoding_name", sorted(ENCODINGS))
@settings(max_examples=100, deadline=None)
@given(case=cases())
def test_encode_compress_apply_roundtrip(encoding_name: str, checksum_name: str, case: Case):
    encoding = get_encoding(encoding_name)
    checksum = get_checksum(checksum_name)
    old = tensor_bytes("t", case.old)
    new = tensor_bytes("t", case.new)
    assert old.dtype == np.uint8 and old.ndim == 1
    assert old.tobytes() == case.old_expected
    assert new.tobytes() == case.new_expected

    delta = encoding.encode(old, new)
    differing = int(np.count_nonzero(old != new))
    assert delta.changed_bytes == differing
    payload = bytes(delta.payload)
    frame = compress(payload)
    assert frame_content_size(frame, what="frame") == len(payload)
    assert len(payload) <= encoding.max_payload_size(old.size)
    exact = old.size if encoding_name == "xor" else None
    restored = decompress(
        frame, max_size=encoding.max_payload_size(old.size), exact_size=exact, what="frame"
    )
    assert restored == payload

    target = old.copy()
    encoding.apply(target, restored, tensor="t")
    assert target.tobytes() == case.new_expected

    digest = checksum.hexdigest(target)
    assert digest == reference_digest(checksum_name, case.new_expected)
    assert len(digest) == checksum.hex_length

    # Re-applying: overwrite is idempotent; xor is an involution and reverts.
    encoding.apply(target, restored, tensor="t")
    expected_again = case.new_expected if encoding.idempotent else case.old_expected
    assert target.tobytes() == expected_again


@settings(max_examples=40, deadline=None)
@given(
    data=st.binary(max_size=64),
    layout=st.sampled_from(["contiguous", "reversed", "strided", "big-endian"]),
)
def test_tensor_bytes_of_numpy_arrays(data: bytes, layout: str):
    """numpy inputs give little-endian row-major bytes whatever their strides or byte order."""
    base = np.frombuffer(data[: len(data) // 4 * 4], dtype="<f4")
    if layout == "reversed":
        array, expected = base[::-1], base[::-1].copy()
    elif layout == "strided":
        array, expected = base[::2], base[::2].copy()
    elif layout == "big-endian":
        array, expected = base.astype(">f4"), base
    else:
        array, expected = base, base
    assert tensor_bytes("t", array).tobytes() == expected.tobytes()

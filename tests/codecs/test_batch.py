"""Batch encoding (``Encoding.encode_framed``): one compiled call for a pool task's tensors.

The batch must give what encoding each tensor alone gives: frames that decompress to the same
payloads (byte for byte the frames zstd writes for ±1-ulp steps), the same changed byte counts
and the same changes in element form; the payloads round-trip through every decoder; and with
numba a batch calls no per-tensor encoder for sparse tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs import apply_changes, compress, decompress
from deltastore.codecs.base import Encoding
from deltastore.codecs.sparse import AutoEncoding, CompactSparseEncoding
from tests.codecs.test_sparse import stepped
from tests.conftest import HAVE_NUMBA

needs_numba = pytest.mark.skipif(not HAVE_NUMBA, reason="no numba")
KINDS = {"sparse-v2": CompactSparseEncoding, "auto": AutoEncoding}


def batch_of(seed: int, count: int, *, density: float, spread: int = 1) -> tuple[list, list, list]:
    """``count`` tensors of mixed sizes and element sizes (some unchanged, some not whole
    elements or words) and their stepped versions."""
    rng = np.random.default_rng(seed)
    olds, news, itemsizes = [], [], []
    for i in range(count):
        itemsize = int(rng.choice([1, 2, 3, 4, 8]))
        size = int(rng.choice([0, 1, 7, 8, 9, 100, 4096, 65536])) * itemsize + int(i % 5 == 0)
        old = rng.integers(0, 256, size=size, dtype=np.uint8)
        new = old.copy() if i % 7 == 3 else stepped(old, itemsize, density, seed + i, spread)
        olds.append(old)
        news.append(new)
        itemsizes.append(itemsize)
    return olds, news, itemsizes


def check_like_alone(encoding: Encoding, olds: list, news: list, itemsizes: list) -> int:
    """Asserts the batch gives what each tensor alone gives; returns frames equal to zstd's."""
    framed = encoding.encode_framed(olds, news, itemsizes)
    assert len(framed) == len(olds)
    same_as_zstd = 0
    for old, new, itemsize, got in zip(olds, news, itemsizes, framed, strict=True):
        alone = encoding.encode(old, new, itemsize=itemsize)
        assert got.changed_bytes == alone.changed_bytes == int(np.count_nonzero(old != new))
        if not alone.changed_bytes:
            continue
        limit = encoding.max_payload_size(old.size)
        payload = decompress(got.frame, max_size=limit, what="batch frame")
        assert payload == bytes(alone.payload)
        same_as_zstd += got.frame == compress(alone.payload)
        target = old.copy()
        encoding.apply(target, payload, tensor="t")
        assert target.tobytes() == new.tobytes()
        encoding.apply(target, payload, tensor="t")  # self-inverse: back to the old bytes
        assert target.tobytes() == old.tobytes()
        if alone.xor_changes is None:
            assert got.xor_changes is None
            continue
        assert got.xor_changes is not None
        assert np.array_equal(got.xor_changes.positions, alone.xor_changes.positions)
        assert got.xor_changes.values.dtype == alone.xor_changes.values.dtype
        assert np.array_equal(got.xor_changes.values, alone.xor_changes.values)
        snapshot = old.copy()
        apply_changes(snapshot, got.xor_changes)
        assert snapshot.tobytes() == new.tobytes()
    return same_as_zstd


@pytest.mark.parametrize("use_jit", [False, pytest.param(True, marks=needs_numba)])
@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    count=st.integers(1, 24),
    density=st.sampled_from([0.0, 0.002, 0.05, 0.5, 1.0]),
    spread=st.sampled_from([1, 12]),
)
def test_batch_gives_what_each_tensor_alone_gives(
    kind: str, use_jit: bool, seed: int, count: int, density: float, spread: int
):
    """Mixed sizes, element sizes and densities (auto's dense tensors take the other
    encodings), on the compiled batch and on numpy's tensor-by-tensor loop."""
    encoding = KINDS[kind](use_jit=use_jit)
    check_like_alone(encoding, *batch_of(seed, count, density=density, spread=spread))


@needs_numba
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_ulp_steps_frame_byte_for_byte_as_zstd_and_numpy(kind: str):
    """±1-ulp bf16 steps (a training step): the hand-written frames are the bytes zstd-1
    writes, so the compiled batch and numpy's loop publish identical frames."""
    olds, news, itemsizes = [], [], []
    rng = np.random.default_rng(5)
    for i in range(40):
        old = rng.integers(0, 256, size=2 * int(rng.choice([256, 4096, 32768])), dtype=np.uint8)
        olds.append(old)
        news.append(stepped(old, 2, 0.004, i, 1))
        itemsizes.append(2)
    compiled = KINDS[kind](use_jit=True)
    changed = sum(bool(np.any(old != new)) for old, new in zip(olds, news, strict=True))
    assert check_like_alone(compiled, olds, news, itemsizes) == changed > 30
    numpy_frames = KINDS[kind](use_jit=False).encode_framed(olds, news, itemsizes)
    compiled_frames = compiled.encode_framed(olds, news, itemsizes)
    assert [f.frame for f in compiled_frames] == [f.frame for f in numpy_frames]


@needs_numba
def test_large_payload_spans_several_raw_blocks():
    """A payload over zstd's 128 KiB block is split into raw blocks any zstd reader takes."""
    rng = np.random.default_rng(1)
    old = rng.integers(0, 256, size=3_000_000, dtype=np.uint8)
    new = stepped(old, 2, 0.3, 2, 1)
    small_old = rng.integers(0, 256, size=64, dtype=np.uint8)
    encoding = CompactSparseEncoding(use_jit=True)
    framed = encoding.encode_framed([old, small_old], [new, small_old ^ 1], [2, 2])
    payload = bytes(encoding.encode(old, new, itemsize=2).payload)
    blocks = -(-len(payload) // (128 * 1024))
    assert blocks > 2
    assert len(framed[0].frame) == 4 + 1 + 4 + 3 * blocks + len(payload)  # raw blocks
    assert zstandard.frame_content_size(framed[0].frame) == len(payload)
    assert zstandard.ZstdDecompressor().decompress(framed[0].frame) == payload
    check_like_alone(encoding, [old, small_old], [new, small_old ^ 1], [2, 2])


@needs_numba
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_compiled_batch_encodes_sparse_tensors_without_the_per_tensor_encoder(
    kind: str, monkeypatch: pytest.MonkeyPatch
):
    """One compiled call for the batch: neither the encoding's own per-tensor ``encode`` nor
    zstd runs for a sparse tensor (each of those released the GIL in the encode pool)."""
    rng = np.random.default_rng(3)
    olds = [rng.integers(0, 256, size=65536, dtype=np.uint8) for _ in range(16)]
    news = [stepped(old, 2, 0.004, i, 1) for i, old in enumerate(olds)]
    itemsizes = [2] * len(olds)
    expected = [KINDS[kind](use_jit=True).encode(o, n, itemsize=2) for o, n in zip(olds, news)]
    encoding = KINDS[kind](use_jit=True)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("encoded one tensor at a time")

    monkeypatch.setattr(encoding, "encode", refuse)
    monkeypatch.setattr("deltastore.codecs.numba_backend.compress", refuse)
    framed = encoding.encode_framed(olds, news, itemsizes)
    assert [f.changed_bytes for f in framed] == [e.changed_bytes for e in expected]
    assert [zstandard.ZstdDecompressor().decompress(f.frame) for f in framed] == [
        bytes(e.payload) for e in expected
    ]

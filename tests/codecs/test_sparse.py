"""sparse-v2: bit-exact round trips, the numpy and numba encoders writing the same bytes, the
documented layout, and corrupt payloads refused.

Each round trip goes the way a payload travels (encode, one zstd-1 frame, decompress bounded by
``max_payload_size``, apply in place) and applies the payload a second time, which must give
the old bytes back (sparse-v2 is self-inverse).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs import apply_changes, compress, decompress, sparse
from deltastore.codecs.sparse import CompactSparseEncoding
from deltastore.errors import ConfigError, FormatError
from deltastore.publish.snapshot import tensor_bytes
from tests.conftest import HAVE_NUMBA

PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(not HAVE_NUMBA, reason="no numba"))]
NUMPY = CompactSparseEncoding(use_jit=False)
DECODERS = [NUMPY, *([CompactSparseEncoding(use_jit=True)] if HAVE_NUMBA else [])]
"""Both decoders accept, apply and refuse the same payloads."""
DENSITIES = [0.0, 0.001, 0.004, 0.05, 0.3, 0.9, 1.0]


def encode_both(old: np.ndarray, new: np.ndarray, itemsize: int) -> bytes:
    """The numpy payload; where numba is installed, asserts the compiled one is identical."""
    payload = bytes(NUMPY.encode(old, new, itemsize=itemsize).payload)
    if HAVE_NUMBA:
        compiled = CompactSparseEncoding(use_jit=True).encode(old, new, itemsize=itemsize)
        assert bytes(compiled.payload) == payload
    return payload


def roundtrip(old: np.ndarray, new: np.ndarray, itemsize: int) -> bytes:
    payload = encode_both(old, new, itemsize)
    delta = NUMPY.encode(old, new, itemsize=itemsize)
    assert delta.changed_bytes == int(np.count_nonzero(old != new))
    assert len(payload) <= NUMPY.max_payload_size(old.size)
    restored = decompress(compress(payload), max_size=NUMPY.max_payload_size(old.size), what="f")
    for decoder in DECODERS:
        target = old.copy()
        decoder.apply(target, restored, tensor="t")
        assert target.tobytes() == new.tobytes()
        decoder.apply(target, restored, tensor="t")
        assert target.tobytes() == old.tobytes()
    if delta.xor_changes is not None:  # what the publisher applies to its snapshot
        snapshot = old.copy()
        apply_changes(snapshot, delta.xor_changes)
        assert snapshot.tobytes() == new.tobytes()
    return payload


def stepped(old: np.ndarray, itemsize: int, density: float, seed: int, spread: int) -> np.ndarray:
    """``old`` with ``density`` of its elements moved by a step: mostly ±1, up to ``2**spread``
    (wrapping around at 0 and at the top), and some random replacements (escapes)."""
    rng = np.random.default_rng(seed)
    new = old.copy()
    if old.size % itemsize:
        itemsize = 1
    elements = new.view(f"<u{itemsize}") if itemsize in (1, 2, 4, 8) else new
    picked = np.flatnonzero(rng.random(elements.size) < density)
    bits = elements.dtype.itemsize * 8
    steps = rng.integers(1, 2 ** min(spread, bits - 1) + 1, size=picked.size, dtype=np.uint64)
    steps = np.where(rng.random(picked.size) < 0.5, steps, ~steps + np.uint64(1))  # -steps
    moved = elements[picked] + steps.astype(elements.dtype)
    wild = rng.random(picked.size) < 0.05
    moved[wild] = rng.integers(0, 2**bits, size=int(wild.sum()), dtype=np.uint64).astype(
        elements.dtype
    )
    elements[picked] = moved
    return new


@settings(max_examples=150, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 3, 4, 6, 8]),
    elements=st.sampled_from([0, 1, 2, 3, 7, 8, 9, 63, 257, 1001, 4099]),
    density=st.sampled_from(DENSITIES),
    spread=st.sampled_from([1, 3, 12, 40]),
    seed=st.integers(0, 2**32 - 1),
    tail=st.integers(0, 1),
)
def test_roundtrip_over_element_sizes_sizes_densities_and_steps(
    itemsize: int, elements: int, density: float, spread: int, seed: int, tail: int
):
    """Odd element sizes (3, 6) and sizes that are not whole elements (tail) code bytes; steps
    of every size, wrap-arounds and random replacements (escaped fields) round-trip, and both
    encoders write the same bytes."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, size=elements * itemsize + tail, dtype=np.uint8)
    roundtrip(old, stepped(old, itemsize, density, seed + 1, spread), itemsize)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("value", ["zero", "top", "half"])
def test_extreme_values_and_steps(itemsize: int, value: str):
    """Elements at 0, at the top and at the half-way point, moved by ±1, by half the range and
    to the opposite end: the widest fields and the ambiguous half-range step."""
    bits = itemsize * 8
    start = {"zero": 0, "top": 2**bits - 1, "half": 2 ** (bits - 1)}[value]
    dtype = np.dtype(f"<u{itemsize}")
    old = np.full(8, start, dtype=np.uint64).astype(dtype)
    deltas = [1, 2**bits - 1, 2 ** (bits - 1), 2 ** (bits - 1) + 1, 2 ** (bits - 1) - 1, 3, 0, 1]
    new = ((old.astype(object) + np.array(deltas, dtype=object)) % 2**bits).astype(dtype)
    roundtrip(old.view(np.uint8), new.view(np.uint8), itemsize)


CHUNK = 32 * 1024
"""Bytes of each tensor the compiled encoder compares before it records their changes."""


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("size", [CHUNK - 8, CHUNK, CHUNK + 8 + 3, 3 * CHUNK + 256 + 5])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.6])
def test_changes_at_block_and_chunk_edges(itemsize: int, size: int, density: float):
    """The compiled encoder reads a tensor in 256-byte blocks and 32 KB chunks and grows its
    buffers as changes come: changes on both sides of every edge, in the tail under a block,
    and dense enough to grow the buffers mid-tensor are found as the numpy path finds them."""
    rng = np.random.default_rng(size + itemsize)
    old = rng.integers(0, 256, size=size, dtype=np.uint8)
    new = stepped(old, itemsize, density, size, 3)
    for edge in (0, 255, 256, CHUNK - 1, CHUNK, 2 * CHUNK, size - 1):
        if edge < size:
            new[edge] ^= 1
    roundtrip(old, new, itemsize)


@pytest.mark.parametrize("use_jit", PATHS)
@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.bool],
    ids=str,
)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_torch_views_with_their_element_size(use_jit: bool, dtype: torch.dtype, layout: str):
    generator = torch.Generator().manual_seed(7)
    parent = torch.randn((34, 17), generator=generator).to(dtype)
    changed = torch.where(
        torch.rand((34, 17), generator=generator) < 0.05,
        (torch.randn((34, 17), generator=generator) * 0.001).to(dtype),
        parent,
    )
    views = {"contiguous": lambda t: t, "transposed": lambda t: t.T, "sliced": lambda t: t[::3, 1:]}
    old = tensor_bytes("t", views[layout](parent))
    new = tensor_bytes("t", views[layout](changed))
    encoding = CompactSparseEncoding(use_jit=use_jit)
    payload = encoding.encode(old, new, itemsize=parent.element_size()).payload
    assert bytes(payload) == encode_both(old, new, parent.element_size())
    target = old.copy()
    encoding.apply(target, payload, tensor="t")
    assert target.tobytes() == new.tobytes()


def _bits(data: bytes) -> str:
    return "".join(f"{b:08b}" for b in data)


def test_payload_layout():
    """Header, remainders, fields, patches and unary stream exactly as the module describes,
    read back with plain string operations."""
    old = np.zeros(4000, dtype=np.uint8)
    new = old.copy()
    elements = new.view("<u2")
    elements[[3, 300, 301, 1999]] = [1, 0xFFFF, 1, 0x8123]  # steps +1, -1, +1, wide
    payload = encode_both(old, new, 2)
    assert payload[:4] == bytes([0x21, 0xA0, 0x1F, 4])  # 4000 = 0xA0 0x1F, 4 changes
    k, width = payload[4], payload[5]
    assert width == 1
    rest = payload[6:]
    remainders = _bits(rest[: (4 * k + 7) // 8])
    rest = rest[(4 * k + 7) // 8 :]
    # +1 from 0: m=1, lo=0, bit 0 of lo = 0 -> field 0; -1: lo=0xFFFF, bit 0 = 1 -> field 1;
    # the wide one (m = 0x10000 - 0x8123, lo = 0x8123) -> (m - 1) << 1 | bit 0 of 0x8123
    wide = (0x10000 - 0x8123 - 1) << 1 | 1
    assert _bits(rest[:1])[:4] == "010" + str(wide & 1)
    assert rest[1] == 1  # one patch: index 3 (2 bits of 0..3), then the 15 high bits
    patch = _bits(rest[2:5])[: 2 + 15]
    assert int(patch[:2], 2) == 3 and int(patch[2:], 2) == wide >> 1
    unary = _bits(rest[5:])
    assert len(unary) - len(unary.rstrip("1")) < 8
    quotients = [len(run) for run in unary.rstrip("1").split("0")[:-1]]
    gaps = [
        (q << k) | int(remainders[i * k : (i + 1) * k] or "0", 2) for i, q in enumerate(quotients)
    ]
    assert gaps == [3, 296, 0, 1697]


def test_empty_and_unchanged_tensors():
    for old in (np.zeros(0, np.uint8), np.arange(10, dtype=np.uint8)):
        payload = roundtrip(old, old.copy(), 2)
        assert len(payload) <= 3


def test_odd_element_sizes_fall_back_to_bytes():
    old = np.zeros(24, dtype=np.uint8)
    new = old.copy()
    new[5] = 1
    for asked, recorded in [(2, 2), (4, 4), (8, 8), (3, 1), (16, 1), (1, 1)]:
        assert encode_both(old, new, asked)[0] == 0x20 | recorded.bit_length() - 1


def test_a_real_tensor_over_4_gib_round_trips():
    """4 GiB + 8 bytes of zero pages (calloc: untouched pages take no memory) with changes on
    both sides of byte 2**32: positions are u64."""
    nbytes = (1 << 32) + 8
    old = np.zeros(nbytes, dtype=np.uint8)
    new = np.zeros(nbytes, dtype=np.uint8)
    where = [17, (1 << 32) - 1, (1 << 32) + 5]
    new[where] = 0x81
    payload = encode_both(old, new, 1)
    positions, _, _ = NUMPY.decode(payload, nbytes, tensor="big")
    assert positions.tolist() == where
    NUMPY.apply(old, payload, tensor="big")
    assert old[where].tolist() == [0x81] * 3 and int(np.count_nonzero(old)) == 3


def test_the_fast_extra_is_optional(monkeypatch: pytest.MonkeyPatch):
    """DELTASTORE_NO_JIT keeps the default encoder on numpy; asking for numba without it is a
    clear ConfigError."""
    monkeypatch.setenv(sparse.NO_JIT_VARIABLE, "1")
    assert sparse.compiled_backend(None) is None
    monkeypatch.setenv(sparse.NO_JIT_VARIABLE, "0")
    assert (sparse.compiled_backend(None) is not None) == HAVE_NUMBA
    monkeypatch.setattr(sparse, "_compiled", [None])
    assert sparse.compiled_backend(None) is None
    with pytest.raises(ConfigError, match="deltastore\\[fast\\]"):
        sparse.compiled_backend(True)


def _payload() -> bytes:
    old = np.zeros(256, dtype=np.uint8)
    new = old.copy()
    new.view("<u2")[[1, 50, 51, 100]] = [1, 7, 0xFFFF, 0x4000]
    return encode_both(old, new, 2)


def _with_patch_count(payload: bytes, patches: int) -> bytes:
    """``payload`` (from :func:`_payload`, one-byte header varints) declaring ``patches``."""
    k, width = payload[4], payload[5]
    at = 6 + (4 * k + 7) // 8 + (4 * width + 7) // 8
    assert payload[at] >= 1  # _payload has a patched step
    return payload[:at] + bytes([patches]) + payload[at + 1 :]


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda p: b"", "does not start"),
        (lambda p: b"\x30" + p[1:], "does not start"),
        (lambda p: p[:2], "truncated inside its header"),
        (lambda p: p[:1] + b"\x80\x04" + p[3:], "made for a 512-byte tensor"),
        (lambda p: p[:3] + b"\x81\x01" + p[4:], "declares 129 changes"),
        (lambda p: p[:4], "truncated inside its header"),
        (lambda p: p[:4] + b"\x40" + p[5:], "k=64"),
        (lambda p: p[:5] + b"\x11" + p[6:], "w=17"),
        (lambda p: p[:8], "truncated"),
        (lambda p: _with_patch_count(p, 5), "patched steps"),
        (lambda p: _with_patch_count(p, 0), "not ascending"),
        (lambda p: p + b"\xff", "not ascending"),
        (lambda p: p + b"\x00", "not ascending"),
        (lambda p: p[:-1], "not ascending"),
    ],
)
@pytest.mark.parametrize("use_jit", PATHS)
def test_corrupt_payloads_are_refused(corrupt, match: str, use_jit: bool):
    payload = _payload()
    target = np.zeros(256, dtype=np.uint8)
    encoding = CompactSparseEncoding(use_jit=use_jit)
    with pytest.raises(FormatError, match=match) as caught:
        encoding.apply(target, corrupt(payload), tensor="layers.0.w")
    assert "layers.0.w" in str(caught.value)
    assert not target.any()


@settings(max_examples=200, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 7)), min_size=1, max_size=4))
def test_flipped_bits_are_refused_or_applied_alike_by_both_decoders(flips: list[tuple[int, int]]):
    """A payload with bits flipped is refused by both decoders with the same message, or
    applied by both to the same bytes (never out of bounds)."""
    payload = bytearray(_payload())
    for byte, bit in flips:
        payload[byte % len(payload)] ^= 1 << bit
    outcomes = []
    for decoder in DECODERS:
        target = np.arange(256, dtype=np.uint8)
        try:
            decoder.apply(target, bytes(payload), tensor="t")
            outcomes.append(("applied", target.tobytes()))
        except FormatError as exc:
            outcomes.append(("refused", str(exc).encode()))
            assert (target == np.arange(256, dtype=np.uint8)).all()
    assert all(outcome == outcomes[0] for outcome in outcomes)


def test_an_unchanged_payload_with_trailing_bytes_is_refused():
    payload = encode_both(np.zeros(16, np.uint8), np.zeros(16, np.uint8), 2) + b"\x00"
    with pytest.raises(FormatError, match="after an empty change"):
        NUMPY.apply(np.zeros(16, np.uint8), payload, tensor="t")


@pytest.mark.parametrize("use_jit", PATHS)
def test_read_only_unaligned_memory_maps(tmp_path, use_jit: bool):
    """The snapshot and a host's file are memory maps, at any offset: a read-only map at an odd
    offset encodes to the same bytes, and a writable one is applied in place."""
    path = tmp_path / "t.bin"
    np.arange(1001, dtype=np.uint8).tofile(path)
    old = np.memmap(path, dtype=np.uint8, mode="r")[1:]
    new = np.array(old)
    new[[5, 700]] ^= 3
    encoding = CompactSparseEncoding(use_jit=use_jit)
    payload = encoding.encode(old, new, itemsize=2).payload
    assert bytes(payload) == encode_both(np.array(old), new, 2)
    target = np.memmap(path, dtype=np.uint8, mode="r+")[1:]
    encoding.apply(target, payload, tensor="t")
    assert target.tobytes() == new.tobytes()


@pytest.mark.skipif(not HAVE_NUMBA, reason="no numba")
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_compiled_xor_changes_match_numpy_and_refuse_outside_positions(itemsize: int):
    """The snapshot advance (:func:`apply_changes`, compiled from 256 changes on) gives
    numpy's bytes, and a position past the tensor raises before any element is changed."""
    from deltastore.codecs import XorChanges, apply_changes
    from deltastore.codecs.sparse import COMPILED_XOR_CHANGES

    rng = np.random.default_rng(itemsize)
    dtype = np.dtype(f"<u{itemsize}")
    old = rng.integers(0, 256, size=4096 * itemsize, dtype=np.uint8)
    positions = np.sort(rng.choice(4096, size=COMPILED_XOR_CHANGES * 2, replace=False))
    values = rng.integers(1, 2 ** (8 * itemsize) - 1, size=positions.size, dtype=np.uint64)
    changes = XorChanges(positions.astype(np.int64), values.astype(dtype))
    compiled, by_numpy = old.copy(), old.copy()
    apply_changes(compiled, changes)
    by_numpy.view(dtype)[positions] ^= values.astype(dtype)
    assert compiled.tobytes() == by_numpy.tobytes() != old.tobytes()
    outside = XorChanges(
        np.append(changes.positions, 4096), np.append(changes.values, np.ones(1, dtype))
    )
    target = old.copy()
    # numpy's own message under DELTASTORE_NO_JIT=1
    with pytest.raises(IndexError, match=r"outside the 4096 elements|out of bounds"):
        apply_changes(target, outside)
    assert target.tobytes() == old.tobytes()


def test_warm_up_loads_the_compiled_kernels_where_they_are_used(monkeypatch: pytest.MonkeyPatch):
    """``warm_up`` says whether the compiled backend is in use, and is a no-op for numpy."""
    monkeypatch.setenv(sparse.NO_JIT_VARIABLE, "1")
    assert sparse.warm_up() is False
    monkeypatch.setenv(sparse.NO_JIT_VARIABLE, "0")
    assert sparse.warm_up() is HAVE_NUMBA


@pytest.mark.skipif(not HAVE_NUMBA, reason="no numba")
def test_warm_up_from_changes_leaves_the_coding_from_changes_nothing_to_compile() -> None:
    """``device_snapshot``'s writer has a kernel entry of its own: warmed only when asked (a
    fresh process, so no other test has called it)."""
    script = """
import numpy as np
from deltastore.codecs import XorChanges, numba_backend, warm_up
from deltastore.codecs.sparse import CompactSparseEncoding
warm_up()
plain = len(numba_backend._payload.signatures)
warm_up(from_changes=True)
warmed = len(numba_backend._payload.signatures)
old = np.zeros(64, np.uint8)
for size in (1, 2, 4, 8):
    changes = XorChanges(np.array([1], np.int64), np.ones(1, f"<u{size}"))
    CompactSparseEncoding(use_jit=True).encode_changes(old, changes, itemsize=size)
print(plain, warmed, len(numba_backend._payload.signatures))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    plain, warmed, used = map(int, out.stdout.split())
    assert plain == 0 < warmed == used


@pytest.mark.parametrize("use_jit", PATHS)
def test_strided_inputs_encode_as_their_contiguous_copies_and_sizes_must_match(use_jit: bool):
    """The compiled writer reads tensors by address: a strided view is made contiguous first
    (it read whatever lay between the elements before), and unequal sizes are refused."""
    rng = np.random.default_rng(5)
    wide_old = rng.integers(0, 255, 8192, dtype=np.uint8)
    wide_new = wide_old.copy()
    changed = rng.choice(wide_new.size, 300, replace=False)
    wide_new[changed] ^= rng.integers(1, 255, 300, dtype=np.uint8)
    old, new = wide_old[::2], wide_new[::2]
    assert not old.flags.c_contiguous
    encoding = CompactSparseEncoding(use_jit=use_jit)
    strided = encoding.encode(old, new, itemsize=2)
    copied = encoding.encode(old.copy(), new.copy(), itemsize=2)
    assert bytes(strided.payload) == bytes(copied.payload)
    target = old.copy()
    encoding.apply(target, memoryview(bytes(strided.payload)), tensor="t")
    assert target.tobytes() == new.tobytes()
    with pytest.raises(ConfigError, match="4096 old bytes and 4095 new"):
        encoding.encode(old, new[:-1], itemsize=1)

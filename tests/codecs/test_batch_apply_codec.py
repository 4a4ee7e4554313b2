"""Applying many payloads in one call: ``Encoding.apply_batch`` and ``decompress_many``.

The compiled batch kernel (:mod:`deltastore.codecs.numba_backend`) and the numpy path one
tensor at a time must give the same bytes for every valid payload, and refuse the same corrupt
payloads with the same message, writing nothing of the refused tensor; a batch stops at the
first refused payload with the ones before it applied and the ones after it untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs import compress, compression, decompress, sparse
from deltastore.codecs.compression import PayloadBatch, decompress_many
from deltastore.codecs.encodings import XorEncoding
from deltastore.codecs.sparse import AutoEncoding, CompactSparseEncoding
from deltastore.codecs.sparse_format import varint
from deltastore.errors import FormatError
from tests.codecs.test_sparse import stepped
from tests.conftest import HAVE_NUMBA

needs_numba = pytest.mark.skipif(not HAVE_NUMBA, reason="no numba")
PAIRS = [
    (CompactSparseEncoding(use_jit=False), CompactSparseEncoding(use_jit=True)),
    (AutoEncoding(use_jit=False), AutoEncoding(use_jit=True)),
]
"""(numpy, compiled) of each encoding with a compiled batch."""


def _batch(payloads: list[bytes]) -> PayloadBatch:
    offsets = np.array([0, *np.cumsum([len(p) for p in payloads])], np.int64)
    return PayloadBatch(np.frombuffer(b"".join(payloads) or b"\0", np.uint8), offsets)


def _laid_out(tensors: list[np.ndarray], gap: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(one buffer holding ``tensors`` at odd offsets, ``gap`` bytes apart; their starts)."""
    starts, at = [], gap
    for tensor in tensors:
        starts.append(at)
        at += tensor.size + gap
    target = np.full(at, 0xA5, np.uint8)
    for start, tensor in zip(starts, tensors):
        target[start : start + tensor.size] = tensor
    return target, np.array(starts, np.int64)


def _one_by_one(encoding, target, starts, sizes, payloads, names):  # type: ignore[no-untyped-def]
    """What the per-tensor path does: ``apply`` per payload, stopping at the first refused."""
    for i, name in enumerate(names):
        view = target[starts[i] : starts[i] + sizes[i]]
        try:
            encoding.apply(view, payloads[i], tensor=name)
        except FormatError as exc:
            return i, str(exc)
    return len(names), None


def _tensors(draw_seed: int, count: int, itemsize: int) -> tuple[list, list]:  # type: ignore[type-arg]
    rng = np.random.default_rng(draw_seed)
    olds, news = [], []
    for i in range(count):
        size = int(rng.choice([0, 1, 2, 9, 64, 257, 4096])) * itemsize + int(rng.integers(0, 2))
        old = rng.integers(0, 256, size, dtype=np.uint8)
        density = float(rng.choice([0.0, 0.004, 0.05, 0.5, 1.0]))
        olds.append(old)
        news.append(stepped(old, itemsize, density, draw_seed + i, int(rng.choice([1, 12, 40]))))
    return olds, news


@needs_numba
@settings(max_examples=60, deadline=None)
@given(
    pair=st.sampled_from(PAIRS),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    count=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_compiled_batches_give_the_bytes_of_numpy_one_by_one(pair, itemsize, count, seed):
    """Every valid payload (any element size, density, step size, a size not whole elements)
    gives the same bytes through the compiled batch as through numpy per tensor, and applying
    the batch again gives the old bytes back."""
    numpy_path, compiled = pair
    olds, news = _tensors(seed, count, itemsize)
    payloads = [
        bytes(numpy_path.encode(o, n, itemsize=itemsize).payload) for o, n in zip(olds, news)
    ]
    sizes = np.array([o.size for o in olds], np.int64)
    names = [f"t{i}" for i in range(count)]
    target, starts = _laid_out(olds)
    before = target.copy()
    assert compiled.apply_batch(target, starts, sizes, _batch(payloads), names) == (count, None)
    expected, _ = _laid_out(news)
    assert target.tobytes() == expected.tobytes()
    assert compiled.apply_batch(target, starts, sizes, _batch(payloads), names) == (count, None)
    assert target.tobytes() == before.tobytes()
    by_numpy = before.copy()
    assert _one_by_one(numpy_path, by_numpy, starts, sizes, payloads, names) == (count, None)
    assert by_numpy.tobytes() == expected.tobytes()


def _corrupted(payload: bytes, cut: int, flips: list[tuple[int, int]], extra: bytes) -> bytes:
    data = bytearray(payload[: max(0, len(payload) - cut)] + extra)
    for byte, bit in flips:
        if data:
            data[byte % len(data)] ^= 1 << bit
    return bytes(data)


@needs_numba
@settings(max_examples=300, deadline=None)
@given(
    pair=st.sampled_from(PAIRS),
    itemsize=st.sampled_from([1, 2, 8]),
    seed=st.integers(0, 2**32 - 1),
    cut=st.sampled_from([0, 0, 0, 1, 2, 5]),
    flips=st.lists(st.tuples(st.integers(0, 600), st.integers(0, 7)), max_size=3),
    extra=st.sampled_from([b"", b"", b"\x00", b"\xff", b"\x01\x02"]),
    where=st.integers(0, 3),
)
def test_corrupt_payloads_are_refused_or_applied_alike(
    pair, itemsize, seed, cut, flips, extra, where
):
    """One payload of a batch of four is truncated, has bits flipped or bytes appended: the
    compiled batch and numpy per tensor both refuse it with the same message (the ones before
    applied, it and the ones after untouched), or both apply every payload to the same bytes."""
    numpy_path, compiled = pair
    olds, news = _tensors(seed, 4, itemsize)
    payloads = [
        bytes(numpy_path.encode(o, n, itemsize=itemsize).payload) for o, n in zip(olds, news)
    ]
    payloads[where] = _corrupted(payloads[where], cut, flips, extra)
    sizes = np.array([o.size for o in olds], np.int64)
    names = [f"layers.{i}.w" for i in range(4)]
    target, starts = _laid_out(olds)
    by_numpy = target.copy()
    done, error = compiled.apply_batch(target, starts, sizes, _batch(payloads), names)
    assert (done, None if error is None else str(error)) == _one_by_one(
        numpy_path, by_numpy, starts, sizes, payloads, names
    )
    assert target.tobytes() == by_numpy.tobytes()
    if error is not None:
        assert done == where and names[where] in str(error)
        untouched, _ = _laid_out(news[:where] + olds[where:])
        assert target.tobytes() == untouched.tobytes()


@pytest.mark.parametrize("use_jit", [False, pytest.param(True, marks=needs_numba)])
def test_auto_batches_mix_xor_and_sparse_v2_payloads(use_jit: bool):
    """``auto`` chooses per tensor: a batch holds xor (dense) and sparse-v2 payloads; one
    tagged with the removed sparse-v1 stops the batch with what to do, nothing of it written."""
    rng = np.random.default_rng(3)
    olds = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(3)]
    news = [rng.integers(0, 256, 4096, dtype=np.uint8), olds[1].copy(), olds[2].copy()]
    news[1][::97] ^= 1
    news[2][[5, 900]] ^= 0x10
    auto = AutoEncoding(use_jit=use_jit)
    payloads = [bytes(auto.encode(o, n, itemsize=2).payload) for o, n in zip(olds, news)]
    assert [p[0] for p in payloads] == [0, 2, 2]
    target, starts = _laid_out(olds)
    sizes = np.full(3, 4096, np.int64)
    assert auto.apply_batch(target, starts, sizes, _batch(payloads), ["a", "b", "c"]) == (3, None)
    assert target.tobytes() == _laid_out(news)[0].tobytes()
    retired = list(payloads)
    retired[1] = b"\x01DSS" + bytes(40)
    target, _ = _laid_out(olds)
    done, error = auto.apply_batch(target, starts, sizes, _batch(retired), ["a", "b", "c"])
    assert done == 1 and "'b'" in str(error) and "sparse-v1" in str(error)
    assert target.tobytes() == _laid_out(news[:1] + olds[1:])[0].tobytes()
    valid = payloads[2]
    payloads[2] = valid[:1] + b"\x30" + valid[2:]
    target, _ = _laid_out(olds)
    done, error = auto.apply_batch(target, starts, sizes, _batch(payloads), ["a", "b", "c"])
    assert done == 2 and "'c'" in str(error) and "does not start" in str(error)
    assert target.tobytes() == _laid_out(news[:2] + olds[2:])[0].tobytes()
    for tag in (3, 0xFF):  # a tag a newer deltastore may write: refused, nothing written
        payloads[2] = bytes([tag]) + valid[1:]  # a valid sparse-v2 payload behind it
        target, _ = _laid_out(olds)
        done, error = auto.apply_batch(target, starts, sizes, _batch(payloads), ["a", "b", "c"])
        assert done == 2 and "'c'" in str(error) and "upgrade" in str(error)
        assert target.tobytes() == _laid_out(news[:2] + olds[2:])[0].tobytes()


@needs_numba
def test_a_tensor_outside_the_target_is_refused_before_the_kernel():
    """The kernel does not check indexes; the wrapper refuses a tensor past the target's end."""
    payload = bytes(
        CompactSparseEncoding().encode(np.zeros(8, np.uint8), np.ones(8, np.uint8)).payload
    )
    with pytest.raises(ValueError, match="outside"):
        CompactSparseEncoding(use_jit=True).apply_batch(
            np.zeros(10, np.uint8),
            np.array([4], np.int64),
            np.array([8], np.int64),
            _batch([payload]),
            ["t"],
        )


def test_no_jit_applyes_apply_one_by_one(monkeypatch: pytest.MonkeyPatch):
    """DELTASTORE_NO_JIT keeps the batch on numpy (the base class's loop), with the same bytes."""
    monkeypatch.setenv(sparse.NO_JIT_VARIABLE, "1")
    assert sparse.compiled_backend(None) is None
    olds, news = _tensors(11, 5, 2)
    auto = AutoEncoding()
    payloads = [bytes(auto.encode(o, n, itemsize=2).payload) for o, n in zip(olds, news)]
    target, starts = _laid_out(olds)
    sizes = np.array([o.size for o in olds], np.int64)
    assert auto.apply_batch(target, starts, sizes, _batch(payloads), list("abcde")) == (5, None)
    assert target.tobytes() == _laid_out(news)[0].tobytes()


# ------------------------------------------------------------------ decompress_many
def _frames(count: int = 20) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(5)
    raws = [
        rng.integers(0, 4, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes()
        for _ in range(count)
    ]
    return raws, [compress(r) for r in raws]


def test_decompress_many_gives_every_payload_in_one_call(monkeypatch: pytest.MonkeyPatch):
    """The frames are decompressed by one multi-frame call (not one call per frame, each of
    which releases and retakes the GIL), into one buffer that gives back each payload."""
    raws, frames = _frames()
    if not hasattr(compression._decompressor(), "multi_decompress_to_buffer"):
        pytest.skip("this zstandard backend has no multi_decompress_to_buffer")

    def one_frame(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a frame was decompressed on its own")

    monkeypatch.setattr(compression, "decompress", one_frame)
    batch = decompress_many(frames, [4000] * len(frames), False, lambda i: f"frame {i}")
    assert len(batch) == len(raws)
    assert [bytes(batch[i]) for i in range(len(raws))] == raws


@pytest.mark.parametrize("multi", [True, False])
def test_decompress_many_refuses_like_decompress(monkeypatch: pytest.MonkeyPatch, multi: bool):
    """A frame declaring more than its tensor allows (or not exactly its size, for an exact
    encoding) is refused before anything is allocated, and a corrupt one is refused, each with
    the message :func:`decompress` gives, naming that frame; without the multi-frame call the
    frames are decompressed one by one to the same bytes."""
    if not multi:
        monkeypatch.setattr(
            zstandard.ZstdDecompressor, "multi_decompress_to_buffer", None, raising=False
        )
        monkeypatch.setattr(compression, "_local", type(compression._local)())
    raws, frames = _frames(6)
    limits = [len(r) for r in raws]
    batch = decompress_many(frames, limits, True, lambda i: f"frame {i}")
    assert [bytes(batch[i]) for i in range(6)] == raws
    for case, limits_of, exact, broken in [
        ("too big", [*limits[:3], limits[3] - 1, *limits[4:]], False, frames),
        ("not exact", [*limits[:3], limits[3] + 1, *limits[4:]], True, frames),
        ("corrupt", [4000] * 6, False, [*frames[:3], frames[3][:-3], *frames[4:]]),
        ("not zstd", [4000] * 6, False, [*frames[:3], b"nope", *frames[4:]]),
    ]:
        with pytest.raises(FormatError) as many:
            decompress_many(broken, limits_of, exact, lambda i: f"frame {i}")
        with pytest.raises(FormatError) as one:
            decompress(
                broken[3],
                max_size=limits_of[3],
                exact_size=limits_of[3] if exact else None,
                what="frame 3",
            )
        assert str(many.value) == str(one.value), case


def test_xor_batches_check_each_size_first():
    """The base class's loop: an xor payload of the wrong size stops the batch at it."""
    olds = [np.arange(16, dtype=np.uint8), np.arange(16, dtype=np.uint8)]
    target, starts = _laid_out(olds)
    payloads = [bytes(16), bytes(15)]
    done, error = XorEncoding().apply_batch(
        target, starts, np.array([16, 16], np.int64), _batch(payloads), ["a", "b"]
    )
    assert done == 1 and "'b'" in str(error)


# ------------------------------------------------------------------ crafted payloads
def _bits(value: int, width: int) -> str:
    return format(value, f"0{width}b") if width else ""


def _packed(bits: str, pad: str = "0") -> bytes:
    bits += pad * (-len(bits) % 8)
    return bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))


def _crafted(
    nbytes: int = 200,
    itemsize: int = 2,
    gaps: tuple[int, ...] = (3, 0, 40, 50),
    k: int = 2,
    width: int = 1,
    fields: tuple[int, ...] = (0, 1, 0, 1),
    patches: tuple[tuple[int, int], ...] = (),
    count: int | None = None,
    padding: int = 0,
) -> bytes:
    """A sparse-v2 payload written field by field from the layout in ``codecs/sparse_format.py``, so
    a test can put any field at the edge of what is valid."""
    bits = itemsize * 8
    log2 = {1: 0, 2: 1, 4: 2, 8: 3}[itemsize]
    head = bytes([0x20 | log2]) + varint(nbytes) + varint(len(gaps) if count is None else count)
    if not gaps:
        return head
    index_width = (len(gaps) - 1).bit_length()
    patch_bits = "".join(_bits(i, index_width) + _bits(h, bits - width) for i, h in patches)
    return (
        head
        + bytes([k, width])
        + _packed("".join(_bits(g & ((1 << k) - 1), k) for g in gaps))
        + _packed("".join(_bits(f & ((1 << width) - 1), width) for f in fields))
        + varint(len(patches))
        + _packed(patch_bits)
        + _packed("".join("1" * (g >> k) + "0" for g in gaps) + "1" * padding, pad="1")
    )


CRAFTED = {
    "valid": _crafted(),
    "last element": _crafted(gaps=(3, 0, 40, 53)),  # positions 3, 4, 45, 99 of 100
    "one past the end": _crafted(gaps=(3, 0, 40, 54)),
    "far past the end": _crafted(gaps=(3, 0, 40, 500)),
    "7 padding bits": _crafted(gaps=(3, 0, 20, 0)),  # 4 + 5 unary bits
    "8 padding bits": _crafted(padding=8),
    "a zero in the padding": _crafted()[:-1] + bytes([_crafted()[-1] & 0xFE]),
    "too few codes": _crafted(count=5),
    "k at its bound": _crafted(k=8, gaps=(3, 0, 40, 50)),  # bit_length(100) + 1
    "k over its bound": _crafted(k=9, gaps=(3, 0, 40, 50)),
    "k = 63": _crafted(k=63),
    "w = 16 with no patch": _crafted(width=16, fields=(1, 2, 3, 4)),
    "w over the element": _crafted(width=17, fields=(1, 2, 3, 4)),
    "w = 16 with a patch": _crafted(width=16, fields=(1, 2, 3, 4), patches=((1, 0),)),
    "patches": _crafted(patches=((1, 0x7FFF), (3, 2))),
    "patches, last index": _crafted(patches=((3, 5),)),
    "patch index past the count": _crafted(  # 5 changes: 3 bits of index, 5 fits them
        gaps=(3, 0, 40, 20, 5), fields=(0, 1, 0, 1, 1), patches=((5, 5),)
    ),
    "patch index at the last": _crafted(
        gaps=(3, 0, 40, 20, 5), fields=(0, 1, 0, 1, 1), patches=((4, 5),)
    ),
    "patches repeated": _crafted(patches=((1, 3), (1, 3))),
    "patches descending": _crafted(patches=((3, 3), (1, 3))),
    "more patches than fields": _crafted(patches=((0, 1), (1, 1), (2, 1), (3, 1), (3, 1))),
    "w = 0, all patched": _crafted(width=0, patches=((0, 1), (1, 2), (2, 3), (3, 4))),
    "itemsize 8, wide patch": _crafted(
        nbytes=800, itemsize=8, width=3, fields=(1, 2, 3, 4), patches=((2, 2**61 - 1),)
    ),
    "itemsize 8, w = 64": _crafted(nbytes=800, itemsize=8, width=64, fields=(1, 2**64 - 1, 7, 9)),
    "no change": _crafted(gaps=()),
    "no change, a byte after": _crafted(gaps=()) + b"\x00",
    "size not whole elements": _crafted(nbytes=201),
    "more changes than elements": _crafted(count=101),
    "another tensor's size": _crafted(nbytes=198),
    "count varint over 64 bits": b"\x21\xc8\x01" + b"\xff" * 9 + b"\x02",
    "truncated before k": _crafted()[:5],
    "truncated in the fields": _crafted()[:7],
}


@needs_numba
@pytest.mark.parametrize("case", list(CRAFTED))
@pytest.mark.parametrize("tagged", [False, True], ids=["sparse-v2", "auto"])
def test_crafted_payloads_at_every_edge_are_judged_alike(case: str, tagged: bool):
    """Payloads with each field at, and one past, the edge of what is valid: the compiled
    batch and numpy per tensor accept the same ones (same bytes) and refuse the same ones
    (same message, nothing written)."""
    numpy_path, compiled = PAIRS[1] if tagged else PAIRS[0]
    payload = (b"\x02" if tagged else b"") + CRAFTED[case]
    rng = np.random.default_rng(1)
    olds = [rng.integers(0, 256, 200 if "itemsize 8" not in case else 800, dtype=np.uint8)]
    target, starts = _laid_out(olds)
    sizes = np.array([olds[0].size], np.int64)
    by_numpy = target.copy()
    done, error = compiled.apply_batch(target, starts, sizes, _batch([payload]), ["t"])
    expected = _one_by_one(numpy_path, by_numpy, starts, sizes, [payload], ["t"])
    assert (done, None if error is None else str(error)) == expected
    assert target.tobytes() == by_numpy.tobytes()
    valid = {
        "valid",
        "last element",
        "7 padding bits",
        "k at its bound",
        "patches",
        "patch index at the last",
        "patches, last index",
        "w = 16 with no patch",
        "w = 0, all patched",
        "no change",
        "itemsize 8, wide patch",
        "itemsize 8, w = 64",
    }
    assert (error is None) == (case in valid), error

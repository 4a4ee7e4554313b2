"""Hostile and corrupt sparse-v1 / auto payloads give a FormatError naming the tensor."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.codecs import ENCODINGS, compress, decompress, get_encoding
from deltastore.codecs.sparse import HEADER, SparseXorEncoding
from deltastore.errors import FormatError


def _payload(nbytes: int = 64, itemsize: int = 2, changed: tuple[int, ...] = (1, 5, 30)) -> bytes:
    old = np.zeros(nbytes, dtype=np.uint8)
    new = old.copy()
    new.view(f"<u{itemsize}")[list(changed)] = 7
    return bytes(SparseXorEncoding().encode(old, new, itemsize=itemsize).payload)


def _header(**fields: int | bytes) -> bytes:
    values: dict[str, int | bytes] = {
        "magic": b"DSS",
        "itemsize": 1,
        "k": 0,
        "coding": 0,
        "nbytes": 64,
        "count": 0,
        "unary_bits": 0,
        "values_len": 0,
    }
    values.update(fields)
    return HEADER.pack(*values.values())


def _values(*xors: int) -> bytes:
    return compress(bytes(xors))


def _apply_error(payload: bytes, nbytes: int = 64, name: str = "sparse-v1") -> str:
    target = np.zeros(nbytes, dtype=np.uint8)
    with pytest.raises(FormatError) as info:
        get_encoding(name).apply(target, payload, tensor="model.layers.3.mlp.up_proj.weight")
    message = str(info.value)
    assert "model.layers.3.mlp.up_proj.weight" in message
    assert not target.any(), "a refused payload must not have written anything"
    return message


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"", "truncated"),
        (b"DSS\x01", "truncated"),
        (_header(magic=b"XOR"), "header"),
        (_header(coding=1), "header"),
        (_header(nbytes=65), "65-byte tensor.*another checkpoint"),
        (_header(itemsize=3), "element size 3"),
        (_header(itemsize=16), "element size 16"),
        (_header(itemsize=8), None),  # valid: nothing changed
        (_header(k=9), "k=9 for 64 elements"),
        (_header(count=65), "65 changes"),
        (_header(count=1, unary_bits=200), "200 unary bits"),
        (_header(count=2, unary_bits=2) + b"\0", "expected 39"),  # no values frame
        (_header(count=1, unary_bits=1, values_len=3) + b"\0" + b"abc" + b"x", "holds 43"),
        # unary "0 0" = gaps 0, 0 but only one change declared
        (
            _header(count=1, unary_bits=2, values_len=len(_values(1))) + b"\0" + _values(1),
            "not ascending",
        ),
        # unary "1110" with k=4 remainder 0b1111: gap 3*16+15 = 63 -> position 63, ok; then
        # a second gap of 0 -> position 64 of 64
        (
            _header(count=2, k=4, unary_bits=5, values_len=len(_values(1, 1)))
            + bytes([0b11100000, 0b11110000])
            + _values(1, 1),
            "not ascending",
        ),
        (
            _header(count=1, unary_bits=1, values_len=len(_values(1, 2))) + b"\0" + _values(1, 2),
            "values of sparse-v1 payload.*exactly 1",
        ),
        (_header(count=1, unary_bits=1, values_len=4) + b"\0" + b"junk", "values of.*zstd"),
    ],
)
def test_corrupt_payloads_are_refused_before_writing(payload: bytes, match: str | None):
    if match is None:
        target = np.zeros(64, dtype=np.uint8)
        SparseXorEncoding().apply(target, payload, tensor="t")
        assert not target.any()
        return
    assert __import__("re").search(match, _apply_error(payload))


def test_quotients_that_overflow_64_bits_are_refused():
    """A unary run long enough to push (q << k) past 2**64 would wrap into a valid-looking gap."""
    nbytes = 1 << 40  # declared only: decode checks bounds without a target
    k = 41
    ones = (1 << 23) + 1  # q = 2**23 + 1; q << 41 overflows 64 bits
    unary = np.packbits(np.r_[np.ones(ones, np.uint8), 0]).tobytes()
    payload = (
        _header(
            itemsize=1, k=k, nbytes=nbytes, count=1, unary_bits=ones + 1, values_len=len(_values(1))
        )
        + unary
        + bytes(6)
        + _values(1)
    )
    with pytest.raises(FormatError, match="not ascending"):
        SparseXorEncoding().decode(payload, nbytes, tensor="t")


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_truncation_or_byte_flip_is_refused_or_stays_in_bounds(data: st.DataObject):
    """Cutting a payload anywhere is refused; flipping any byte is refused or writes only inside
    the tensor (a flipped value byte is a valid, different delta)."""
    payload = bytearray(_payload(nbytes=4096, itemsize=2, changed=(0, 9, 700, 2047)))
    cut = data.draw(st.integers(0, len(payload) - 1))
    _apply_error(bytes(payload[:cut]), nbytes=4096)
    where = data.draw(st.integers(0, len(payload) - 1))
    payload[where] ^= data.draw(st.integers(1, 255))
    target = np.zeros(4096, dtype=np.uint8)
    try:
        SparseXorEncoding().apply(target, bytes(payload), tensor="t")
    except FormatError as exc:
        assert "'t'" in str(exc)


def test_auto_refuses_empty_payloads_and_unknown_tags():
    assert "empty" in _apply_error(b"", name="auto")
    assert "tag 7" in _apply_error(b"\x07" + _payload(), name="auto")
    # the inner payload is checked by its own encoding, still naming the tensor
    assert "another checkpoint" in _apply_error(b"\x00" + bytes(63), name="auto")
    assert "truncated" in _apply_error(b"\x01DSS", name="auto")


@pytest.mark.parametrize("name", ["sparse-v1", "auto"])
def test_a_frame_declaring_more_than_the_bound_is_refused_before_allocating(name: str):
    """The store's zstd frame declares its content size; it is held against max_payload_size."""
    encoding = ENCODINGS[name]
    bound = encoding.max_payload_size(1000)
    frame = struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", bound + 1)
    with pytest.raises(FormatError, match="refusing to allocate"):
        decompress(frame + b"\x01\0\0", max_size=bound, what="payload of tensor 't'")
    real = compress(_payload(nbytes=1000, itemsize=4, changed=tuple(range(250))))
    assert len(decompress(real, max_size=bound, what="t")) <= bound


def test_new_encodings_declare_their_semantics():
    for name in ("sparse-v1", "auto"):
        encoding = ENCODINGS[name]
        assert encoding.idempotent is False  # both XOR values in: twice reverts
        assert encoding.self_inverse is True  # type: ignore[attr-defined]
        assert encoding.name == name

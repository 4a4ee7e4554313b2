"""Digest forms, the registry, and codec refusals of hostile or impossible input.

Hostile input (a frame declaring a huge size, overwrite payloads pointing outside the tensor
or cut short) must raise :class:`FormatError` before any large allocation; a tensor the
``overwrite`` encoding cannot address (4 GiB or more) is a :class:`ConfigError`, checked from
its size alone (no 4 GiB buffer is ever allocated here).
"""

from __future__ import annotations

import struct
import zlib

import blake3
import numpy as np
import pytest
import xxhash
import zstandard

from deltastore.codecs import (
    CHECKSUMS,
    ENCODINGS,
    check_compression,
    compress,
    decompress,
    get_checksum,
    get_encoding,
)
from deltastore.errors import ConfigError, FormatError

SAMPLES = [b"", b"a", b"Wikipedia", bytes(range(256)) * 33]


# ----------------------------------------------------------------- digests
@pytest.mark.parametrize("data", SAMPLES, ids=lambda d: f"{len(d)}B")
def test_digest_reference_forms(data: bytes):
    array = np.frombuffer(data, dtype=np.uint8)
    xxh = get_checksum("xxh3-128")
    assert xxh.hexdigest(array) == xxhash.xxh3_128_hexdigest(data)
    assert xxh.hex_length == 32
    b3 = get_checksum("blake3")
    assert b3.hexdigest(array) == blake3.blake3(data).hexdigest()
    assert b3.hex_length == 64
    adler = get_checksum("adler32")
    assert adler.hexdigest(array) == f"{zlib.adler32(data):08x}"
    assert adler.hex_length == 8
    for checksum in CHECKSUMS.values():
        digest = checksum.hexdigest(data)
        assert len(digest) == checksum.hex_length
        assert digest == digest.lower() and all(c in "0123456789abcdef" for c in digest)
        # bytes, memoryview and uint8 arrays of the same bytes give the same digest
        assert checksum.hexdigest(memoryview(data)) == digest == checksum.hexdigest(array)


def test_digest_known_vectors():
    """Published test vectors, so a swapped algorithm cannot pass by agreeing with itself."""
    assert get_checksum("adler32").hexdigest(b"Wikipedia") == "11e60398"
    assert get_checksum("adler32").hexdigest(b"") == "00000001"
    assert (
        get_checksum("blake3").hexdigest(b"")
        == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )
    assert get_checksum("xxh3-128").hexdigest(b"") == "99aa06d3014798d86001c324468d497f"


def test_digest_of_non_contiguous_array_slice():
    """A strided uint8 view is hashed as its logical bytes or refused, never misread."""
    data = np.arange(64, dtype=np.uint8)
    view = data[::2]
    for checksum in CHECKSUMS.values():
        try:
            digest = checksum.hexdigest(view)
        except (ValueError, TypeError, BufferError):
            continue  # refusing a strided buffer is acceptable; misreading it is not
        assert digest == checksum.hexdigest(view.tobytes())


# ---------------------------------------------------------------- registry
def test_unknown_names_list_known_ones():
    with pytest.raises(ConfigError) as info:
        get_encoding("lz4-delta")
    message = str(info.value)
    assert "lz4-delta" in message
    assert all(name in message for name in ENCODINGS)
    with pytest.raises(ConfigError) as info:
        get_checksum("md5")
    message = str(info.value)
    assert "md5" in message
    assert all(name in message for name in CHECKSUMS)
    with pytest.raises(ConfigError) as info:
        check_compression("lz4")
    assert "zstd" in str(info.value)
    check_compression("zstd")


def test_registry_holds_the_reference_names():
    assert set(ENCODINGS) >= {"xor", "overwrite"}
    assert set(CHECKSUMS) >= {"xxh3-128", "blake3", "adler32"}
    assert get_encoding("overwrite").idempotent and not get_encoding("xor").idempotent


# ------------------------------------------------------------ decompression
def _frame_declaring(size: int) -> bytes:
    """A zstd frame header declaring ``size`` content bytes, followed by one empty raw block.

    Magic 0xFD2FB528; frame header descriptor 0xE0 = 8-byte content size + single segment;
    block header 0x000001 = last block, raw, 0 bytes.
    """
    return struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", size) + b"\x01\0\0"


def test_crafted_frame_declares_the_size():
    assert zstandard.frame_content_size(_frame_declaring(1 << 60)) == 1 << 60


def test_decompress_refuses_a_declared_size_over_the_bound_before_allocating():
    # 2**60 bytes cannot be allocated: a MemoryError here would mean it tried.
    frame = _frame_declaring(1 << 60)
    with pytest.raises(FormatError, match="refusing") as info:
        decompress(frame, max_size=1024, what="payload of tensor 'w'")
    assert "'w'" in str(info.value) and str(1 << 60) in str(info.value)


def test_decompress_refuses_a_size_other_than_the_tensor_size():
    frame = compress(b"\0" * 100)
    with pytest.raises(FormatError, match="exactly 64"):
        decompress(frame, max_size=1000, exact_size=64, what="payload of tensor 'w'")
    assert decompress(frame, max_size=100, exact_size=100, what="w") == b"\0" * 100


def test_decompress_refuses_frames_without_content_size_and_garbage():
    no_size = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = no_size.compress(b"x" * 10) + no_size.flush()
    with pytest.raises(FormatError, match="content size"):
        decompress(frame, max_size=100, what="w")
    with pytest.raises(FormatError, match="not a zstd frame"):
        decompress(b"definitely not zstd", max_size=100, what="w")
    # A frame whose declared size does not match its real content.
    with pytest.raises(FormatError):
        decompress(_frame_declaring(50), max_size=100, what="w")


def test_compress_is_one_level_1_frame_with_content_size():
    payload = bytes(range(256)) * 40
    frame = compress(payload)
    params = zstandard.get_frame_parameters(frame)
    assert params.content_size == len(payload)
    assert zstandard.ZstdCompressor(level=1).compress(payload) == frame
    assert zstandard.ZstdDecompressor().decompress(frame) == payload


# ---------------------------------------------------------------- overwrite
def test_overwrite_over_4_gib_is_a_clear_config_error():
    overwrite = get_encoding("overwrite")
    overwrite.check_size(2**32 - 1, tensor="ok")
    for nbytes in (2**32, 2**32 + 1, 5 * 2**30):
        with pytest.raises(ConfigError) as info:
            overwrite.check_size(nbytes, tensor="model.embed_tokens.weight")
        message = str(info.value)
        assert "model.embed_tokens.weight" in message and "xor" in message
    get_encoding("xor").check_size(5 * 2**30, tensor="big")  # xor has no such limit


def _overwrite_payload(count: int, positions: list[int], values: bytes) -> bytes:
    return struct.pack("<I", count) + struct.pack(f"<{len(positions)}I", *positions) + values


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"", "truncated"),
        (b"\x01\0", "truncated"),
        (_overwrite_payload(1, [16], b"\x07"), "byte 16"),
        (_overwrite_payload(2, [0, 99999], b"\x07\x08"), "byte 99999"),
        (_overwrite_payload(3, [0, 1], b"\x07\x08"), "declares 3"),
        (_overwrite_payload(1, [0], b""), "declares 1"),
        (_overwrite_payload(0xFFFFFFFF, [], b""), "declares 4294967295"),
        (_overwrite_payload(0, [], b"\x01"), "declares 0"),
    ],
    ids=[
        "empty",
        "short-count",
        "position-at-end",
        "position-far-out",
        "fewer-positions",
        "missing-value",
        "huge-count",
        "trailing-byte",
    ],
)
def test_overwrite_refuses_hostile_payloads(payload: bytes, match: str):
    target = np.zeros(16, dtype=np.uint8)
    with pytest.raises(FormatError, match=match) as info:
        get_encoding("overwrite").apply(target, payload, tensor="layer.w")
    assert "layer.w" in str(info.value)
    assert not target.any(), "a refused payload must not write anything"


def test_overwrite_payload_layout_is_the_reference_one():
    old = np.zeros(10, dtype=np.uint8)
    new = old.copy()
    new[[2, 7]] = [0xAA, 0x55]
    payload = bytes(get_encoding("overwrite").encode(old, new).payload)
    assert payload == _overwrite_payload(2, [2, 7], b"\xaa\x55")


def test_xor_refuses_a_payload_of_another_size():
    target = np.zeros(16, dtype=np.uint8)
    with pytest.raises(FormatError, match=r"layer\.w"):
        get_encoding("xor").apply(target, b"\x01" * 15, tensor="layer.w")
    assert not target.any()

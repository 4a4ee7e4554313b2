"""Packed delta shards: deltastore's own encodings put every payload under one entry.

Readers see the per-tensor entries and digests a plain shard has; a hostile or corrupt table is
refused with a FormatError naming the shard, and a pull that meets one leaves the host verified
at its old version.
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import pytest
import torch
import zstandard

import deltastore as ds
from deltastore.errors import DeltastoreError, FormatError
from deltastore.format.packed import (
    PACK_ENTRY,
    PACK_KEY,
    build_packed_header,
    unpack_header,
)
from deltastore.format.safetensors_io import parse_header
from tests.conftest import checkpoint_bytes, perturb, raw_bytes

DIGESTS = ["0" * 31 + "1", "0" * 31 + "2", "f" * 32]


def _parsed(head: bytes) -> ds.format.SafetensorsHeader:
    (length,) = struct.unpack("<Q", head[:8])
    return parse_header(head[8 : 8 + length], source="shard")


def _raw_header(path: Path) -> dict[str, object]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header: dict[str, object] = json.loads(data[8 : 8 + length])
    return header


def test_a_packed_header_reads_back_as_one_entry_and_digest_per_tensor():
    head = build_packed_header(["a.weight", "b", "c.bias"], [5, 0, 7], DIGESTS)
    header = unpack_header(_parsed(head), source="shard")
    start = len(head)
    assert [(e.name, e.dtype, e.shape, e.start, e.end) for e in header.tensors.values()] == [
        ("a.weight", "U8", (5,), start, start + 5),
        ("b", "U8", (0,), start + 5, start + 5),
        ("c.bias", "U8", (7,), start + 5, start + 12),
    ]
    assert header.metadata == dict(zip(["a.weight", "b", "c.bias"], DIGESTS, strict=True))


def test_a_plain_header_is_left_as_it_is():
    plain = _parsed(ds.format.safetensors_io.build_header([], {"x": "y"}))
    assert unpack_header(plain, source="shard") is plain


def _with_table(table: object, *, raw: bytes | None = None, entry_bytes: int = 12) -> bytes:
    """A packed header whose table is ``table`` (JSON), or ``raw`` bytes as the metadata."""
    if raw is None:
        frame = zstandard.ZstdCompressor().compress(json.dumps(table).encode())
        raw = base64.b64encode(frame)
    header = {
        "__metadata__": {PACK_KEY: raw.decode("ascii")},
        PACK_ENTRY: {"dtype": "U8", "shape": [entry_bytes], "data_offsets": [0, entry_bytes]},
    }
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded


GOOD = {"format": 1, "names": ["a", "b"], "lengths": [5, 7], "digests": "ab" * 32}


@pytest.mark.parametrize(
    ("head", "message"),
    [
        (_with_table(GOOD, raw=b"not base64!"), "unreadable"),
        (_with_table(GOOD, raw=base64.b64encode(b"\x28\xb5\x2f\xfd garbage")), "unreadable"),
        (_with_table({**GOOD, "format": 2}), "format 2 is not 1"),
        (_with_table({**GOOD, "lengths": [5, 8]}), "accounts for 13 bytes"),
        (_with_table({**GOOD, "lengths": [5, -1]}), "names and lengths"),
        (_with_table({**GOOD, "names": ["a", "a"]}), "names 'a' twice"),
        (_with_table({**GOOD, "names": ["a", "b", "c"], "lengths": [4, 4, 4]}), "one per tensor"),
        (_with_table({**GOOD, "digests": "abc"}), "one per tensor"),
        (_with_table([1, 2]), "format None"),
    ],
)
def test_a_corrupt_table_is_refused_naming_the_shard(head: bytes, message: str):
    with pytest.raises(FormatError, match=f"shard: .*{message}"):
        unpack_header(_parsed(head), source="shard")


def test_a_table_declaring_a_huge_size_is_refused_before_decompressing():
    # A zstd frame header (single segment, 8-byte content size) claiming 2**40 bytes.
    hostile = b"\x28\xb5\x2f\xfd\xe0" + struct.pack("<Q", 1 << 40) + b"\x01\x00\x00"
    head = _with_table(None, raw=base64.b64encode(hostile))
    with pytest.raises(FormatError, match="declares 1099511627776 bytes"):
        unpack_header(_parsed(head), source="shard")


@pytest.mark.parametrize(
    ("encoding", "packed"), [("auto", True), ("sparse-v2", True), ("xor", False)]
)
def test_own_encodings_write_packed_shards_and_reference_ones_do_not(
    tmp_path: Path,
    base_dir: Path,
    small_model: dict[str, torch.Tensor],
    encoding: str,
    packed: bool,
):
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, encoding=encoding)
    publisher.seed()
    model = perturb(small_model, 1)
    publisher.publish(model.items())
    index = store.index(1)
    (shard,) = index.shards()
    raw = _raw_header(tmp_path / "store" / "weight_v000001" / shard)
    raw.pop("__metadata__")
    assert (list(raw) == [PACK_ENTRY]) is packed
    header = store.read_shard_header(1, shard)
    assert set(header.tensors) == set(index.weight_map)
    assert all(len(header.metadata[name]) == 32 for name in header.tensors)
    host = tmp_path / "host"
    ds.pull_weights(str(host), str(store.root), 1, base_dir=str(base_dir))
    assert checkpoint_bytes(host) == {name: raw_bytes(t) for name, t in model.items()}


def test_a_pull_that_meets_a_corrupt_table_leaves_the_host_at_its_version(
    tmp_path: Path, base_dir: Path, small_model: dict[str, torch.Tensor]
):
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, encoding="auto")
    publisher.seed()
    publisher.publish(perturb(small_model, 1).items())
    publisher.publish(perturb(small_model, 2).items())
    host = tmp_path / "host"
    ds.pull_weights(str(host), str(store.root), 1, base_dir=str(base_dir))
    before = checkpoint_bytes(host)
    (shard,) = store.index(2).shards()
    path = tmp_path / "store" / "weight_v000002" / shard
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    table = json.loads(
        zstandard.ZstdDecompressor().decompress(base64.b64decode(header["__metadata__"][PACK_KEY]))
    )
    table["lengths"][0] += 1  # no longer covers the packed entry exactly
    frame = zstandard.ZstdCompressor().compress(json.dumps(table).encode())
    header["__metadata__"][PACK_KEY] = base64.b64encode(frame).decode()
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])
    with pytest.raises(DeltastoreError, match=f"{shard}: the pack table accounts for"):
        ds.pull_weights(str(host), str(store.root), 2, base_dir=str(base_dir))
    assert checkpoint_bytes(host) == before
    assert ds.verify_local(str(host), str(store.root), base_dir=str(base_dir)) == 1

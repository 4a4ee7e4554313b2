"""Format validation: names, the index, and safetensors headers, against hostile input.

A weight_map target is read as a file inside the version directory, so anything but a plain
``*.safetensors`` name (``../x``, an absolute path, a subdirectory) is refused rather than
normalised; an index must agree with the directory it lives in; a header must describe a file
that is really there. Each refusal is a :class:`FormatError` naming what is wrong.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import deltastore as ds
from deltastore.errors import FormatError
from deltastore.format import (
    INDEX_NAME,
    TensorLayout,
    VersionIndex,
    check_shard_names,
    delta_shard_name,
    format_version,
    full_shard_name,
    parse_version_dir,
    read_header,
    read_header_file,
    version_dir_name,
    write_safetensors,
)
from deltastore.format.checkpoint import scan_checkpoint
from tests.conftest import checkpoint_bytes, raw_bytes


def _index(metadata: dict, weight_map: dict | None = None) -> bytes:
    return json.dumps({"metadata": metadata, "weight_map": weight_map or {}}).encode()


DELTA_META = {
    "version": "000003",
    "base_version": "000002",
    "delta_encoding": "xor",
    "compression_format": "zstd",
    "checksum_format": "xxh3-128",
}


def test_names():
    assert version_dir_name(7) == "weight_v000007"
    assert version_dir_name(1234567) == "weight_v1234567"
    assert parse_version_dir("weight_v000007") == 7
    assert parse_version_dir("s3://bucket/run/weight_v000012/") == 12
    assert parse_version_dir("weight_v7") is None and parse_version_dir("_claims") is None
    assert format_version(7) == "000007"
    assert delta_shard_name(0, 2) == "model-00000-of-00002.safetensors"
    assert full_shard_name(0, 2) == "model-00001-of-00002.safetensors"
    with pytest.raises(FormatError):
        version_dir_name(0)


def test_index_round_trip_keeps_reference_and_own_keys():
    index = VersionIndex(
        version=3,
        weight_map={
            "b": "model-00000-of-00001.safetensors",
            "a": "model-00000-of-00001.safetensors",
        },
        base_version=2,
        encoding="overwrite",
        compression="zstd",
        checksum="blake3",
        stream_id="s",
        commit_token="t",
        totals={"total_bytes": 10, "changed_bytes": 1, "wire_bytes": 50, "tensor_count": 2},
        extra={"custom": [1, 2]},
    )
    raw = json.loads(index.to_json())
    assert raw["metadata"]["version"] == "000003" and raw["metadata"]["base_version"] == "000002"
    assert raw["metadata"]["delta_encoding"] == "overwrite"
    assert list(raw["weight_map"]) == ["a", "b"]
    assert VersionIndex.from_json(index.to_json(), version=3) == index


def _delta_index(**changes: object) -> VersionIndex:
    fields: dict = dict(
        version=3,
        weight_map={"a": "model-00000-of-00001.safetensors"},
        base_version=2,
        encoding="xor",
        checksum="xxh3-128",
        stream_id="s",
        commit_token="t",
        totals={"wire_bytes": 50},
        extra={"signature": {"key_id": "k", "sig": "x"}},
    )
    fields.update(changes)
    return VersionIndex(**fields)


def test_content_digest_ignores_the_commit_token_and_the_layout():
    """Two replicas' copies of one version: each committed by its own writer (own token),
    possibly written with another JSON layout; a reader depends on neither."""
    ours = _delta_index()
    theirs = _delta_index(commit_token="another-writer")
    assert ours.to_json() != theirs.to_json()
    assert ours.content_digest() == theirs.content_digest()
    relaid = json.dumps(json.loads(theirs.to_json()), indent=None, sort_keys=True).encode()
    assert VersionIndex.from_json(relaid, version=3).content_digest() == ours.content_digest()


@pytest.mark.parametrize(
    "changes",
    [
        {"stream_id": "another-run"},
        {"base_version": 1},
        {"encoding": "overwrite"},
        {"checksum": "blake3"},
        {"weight_map": {"b": "model-00000-of-00001.safetensors"}},
        {"totals": {"wire_bytes": 51}},
        {"extra": {"signature": {"key_id": "k", "sig": "y"}}},
    ],
)
def test_content_digest_tells_apart_what_a_reader_depends_on(changes: dict):
    assert _delta_index(**changes).content_digest() != _delta_index().content_digest()


def test_index_without_delta_encoding_is_full_and_tolerates_foreign_keys():
    index = VersionIndex.from_json(
        _index({"total_size": 5}, {"w": "model-00001-of-00001.safetensors"}), version=4
    )
    assert index.kind == "full" and index.base_version is None
    assert index.extra == {"total_size": 5}
    # Readers accept any plain *.safetensors name, not only the reference pattern.
    VersionIndex.from_json(_index(DELTA_META, {"w": "weights.safetensors"}), version=3)
    # Integer versions are tolerated on read.
    VersionIndex.from_json(_index({**DELTA_META, "version": 3, "base_version": 2}), version=3)


@pytest.mark.parametrize(
    "target",
    [
        "../x.safetensors",
        "/etc/x.safetensors",
        "sub/x.safetensors",
        "..\\x.safetensors",
        ".hidden.safetensors",
        "model.bin",
        "",
        ".safetensors",
        "x.safetensors\x00.json",
    ],
)
def test_index_refuses_targets_outside_the_version_dir(target: str):
    with pytest.raises(FormatError, match="plain"):
        VersionIndex.from_json(_index(DELTA_META, {"w": target}), version=3)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"metadata": DELTA_META}).encode(), "weight_map"),
        (_index({**DELTA_META, "version": "000004"}), "000004"),
        (_index({**DELTA_META, "version": "three"}), "not a version number"),
        (_index({k: v for k, v in DELTA_META.items() if k != "base_version"}), "base_version"),
        (_index({k: v for k, v in DELTA_META.items() if k != "version"}), "version"),
        (_index({**DELTA_META, "base_version": "000003"}), "not older"),
        (_index({**DELTA_META, "base_version": "-1"}), "base_version"),
        (_index({**DELTA_META, "delta_encoding": 5}), "not a string"),
        (json.dumps({"metadata": [1], "weight_map": {}}).encode(), "metadata"),
    ],
    ids=[
        "not-json",
        "not-utf8",
        "list",
        "no-weight-map",
        "version-mismatch",
        "version-garbage",
        "no-base",
        "no-version",
        "base-not-older",
        "base-negative",
        "encoding-type",
        "metadata-type",
    ],
)
def test_index_refuses_malformed_json(data: bytes, match: str):
    with pytest.raises(FormatError, match=match):
        VersionIndex.from_json(data, version=3)


def test_check_shard_names_needs_exactly_the_mapped_names():
    shard = "model-00000-of-00001.safetensors"
    index = VersionIndex(3, {"a": shard, "b": shard}, 2, "xor", "zstd", "xxh3-128")
    check_shard_names(index, shard, {"a", "b"}, source="s")
    for names in ({"a"}, {"a", "b", "c"}, set()):
        with pytest.raises(FormatError, match="exactly"):
            check_shard_names(index, shard, names, source="s")


@pytest.mark.parametrize(
    "target", ["../base/model.safetensors", "/abs/model.safetensors", "../model.safetensors"]
)
def test_store_and_pull_refuse_a_hostile_index(tmp_path: Path, base_dir: Path, target: str):
    store_dir = tmp_path / "store"
    version_dir = store_dir / "weight_v000001"
    version_dir.mkdir(parents=True)
    meta = {**DELTA_META, "version": "000001", "base_version": "000000"}
    (version_dir / INDEX_NAME).write_bytes(_index(meta, {"model.norm.eps": target}))
    store = ds.VersionStore(store_dir)
    assert store.versions() == [1]
    with pytest.raises(FormatError, match="plain"):
        store.index(1)
    host = tmp_path / "host"
    ds.pull_weights(host, store_dir, 0, base_dir=base_dir)
    before = checkpoint_bytes(host)
    with pytest.raises(FormatError):
        ds.pull_weights(host, store_dir, 1, base_dir=base_dir)
    assert checkpoint_bytes(host) == before
    assert ds.verify_local(host, store_dir, base_dir=base_dir) == 0


def test_store_refuses_an_index_of_another_version(tmp_path: Path):
    version_dir = tmp_path / "store" / "weight_v000002"
    version_dir.mkdir(parents=True)
    meta = {**DELTA_META, "version": "000005", "base_version": "000001"}
    (version_dir / INDEX_NAME).write_bytes(_index(meta))
    with pytest.raises(FormatError, match="weight_v000002"):
        ds.VersionStore(tmp_path / "store").index(2)


# ------------------------------------------------------------ safetensors headers
def test_header_ranges_match_safetensors(tmp_path: Path, small_model: dict[str, torch.Tensor]):
    path = tmp_path / "model.safetensors"
    save_file(small_model, str(path), metadata={"format": "pt"})
    header = read_header_file(str(path))
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == set(small_model)
    data = path.read_bytes()
    with safe_open(str(path), framework="pt") as fh:
        for name, entry in header.tensors.items():
            tensor = fh.get_tensor(name)
            assert entry.shape == tuple(tensor.shape)
            assert data[entry.start : entry.end] == raw_bytes(tensor)
    assert set(scan_checkpoint(str(tmp_path))) == set(small_model)


def test_write_safetensors_is_read_by_safetensors(
    tmp_path: Path, small_model: dict[str, torch.Tensor]
):
    from deltastore.publish.snapshot import safetensors_dtype_of

    layouts = [
        (TensorLayout(n, safetensors_dtype_of(t) or "", tuple(t.shape)), raw_bytes(t))
        for n, t in sorted(small_model.items())
    ]
    out = io.BytesIO()
    written = write_safetensors(out, layouts, {"k": "v"})
    assert written == len(out.getvalue())
    (tmp_path / "w.safetensors").write_bytes(out.getvalue())
    assert checkpoint_bytes(tmp_path) == {n: raw_bytes(t) for n, t in small_model.items()}
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as fh:
        assert fh.metadata() == {"k": "v"}
        for name, t in small_model.items():
            assert fh.get_tensor(name).dtype == t.dtype
    with pytest.raises(FormatError, match="w"):
        write_safetensors(io.BytesIO(), [(TensorLayout("w", "F32", (2,)), b"\0" * 7)])


def _header_file(header: dict, data: bytes = b"") -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\x01\x02", "truncated"),
        (struct.pack("<Q", 1 << 40), "header"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
        (_header_file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}), "truncated"),
        (
            _header_file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8),
            "needs 16",
        ),
        (
            _header_file({"w": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
            "dtype",
        ),
        (_header_file({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}), "shape"),
        (
            _header_file({"w": {"dtype": "U8", "shape": [1], "data_offsets": [2, 1]}}, b"\0\0"),
            "offsets",
        ),
        (_header_file({"__metadata__": {"a": 1}}), "__metadata__"),
        (_header_file([]), "not a JSON object"),  # type: ignore[arg-type]
        (struct.pack("<Q", 4) + b"\xff\xff\xff\xff", "unreadable"),
    ],
    ids=[
        "short-prefix",
        "huge-header",
        "cut-header",
        "cut-data",
        "size-mismatch",
        "bad-dtype",
        "bad-shape",
        "bad-offsets",
        "bad-metadata",
        "not-object",
        "not-utf8",
    ],
)
def test_header_refuses_hostile_files(raw: bytes, match: str):
    with pytest.raises(FormatError, match=match):
        read_header(io.BytesIO(raw), file_size=len(raw), source="shard.safetensors")


def test_header_of_an_empty_uint8_array(tmp_path: Path):
    """A U8 entry of zero bytes (an empty tensor) parses to an empty range."""
    from safetensors.numpy import save_file as save_numpy

    save_numpy({"e": np.zeros(0, dtype=np.uint8)}, str(tmp_path / "e.safetensors"))
    entry = read_header_file(str(tmp_path / "e.safetensors")).tensors["e"]
    assert entry.nbytes == 0 and entry.shape == (0,)


def test_header_refuses_overlapping_tensors():
    """Two entries sharing bytes would let an in-place write to one change the other after it
    was verified; safetensors itself refuses such files."""
    raw = _header_file(
        {
            "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
        },
        b"\0" * 6,
    )
    with pytest.raises(FormatError, match="overlap"):
        read_header(io.BytesIO(raw), file_size=len(raw), source="shard.safetensors")


def test_header_refuses_duplicate_tensor_names():
    entry = b'{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    encoded = b'{"a": ' + entry + b', "a": ' + entry + b"}"
    raw = struct.pack("<Q", len(encoded)) + encoded + b"\0"
    with pytest.raises(FormatError, match="twice"):
        read_header(io.BytesIO(raw), file_size=len(raw), source="shard.safetensors")


@pytest.mark.parametrize(
    "value", ["\u00b2", "\u0663", "\uff17"], ids=["superscript", "arabic", "fullwidth"]
)
def test_version_fields_take_ascii_digits_only(value: str):
    """Non-ASCII digits are refused as a FormatError (``int()`` raised a bare ValueError on some
    and silently accepted others)."""
    with pytest.raises(FormatError, match="version"):
        VersionIndex.from_json(_index({**DELTA_META, "version": value}), version=3)
    with pytest.raises(FormatError, match="version"):
        ds.format.state.AppliedState.from_json(json.dumps({"version": value}).encode())


def test_deeply_nested_json_is_a_format_error():
    """JSON nested past the parser's recursion limit is refused as a FormatError, not a crash."""
    nested = b"[" * 100_000 + b"]" * 100_000
    raw = struct.pack("<Q", len(nested)) + nested
    with pytest.raises(FormatError, match="unreadable"):
        read_header(io.BytesIO(raw), file_size=len(raw), source="shard.safetensors")
    with pytest.raises(FormatError, match="not valid JSON"):
        VersionIndex.from_json(nested, version=3)
    with pytest.raises(FormatError, match="unreadable"):
        ds.format.state.AppliedState.from_json(nested)
    with pytest.raises(FormatError, match="unreadable"):
        ds.format.state.PendingTransition.from_json(nested)


@pytest.mark.parametrize(
    "weight_map",
    [["model.safetensors"], {"a": 1, "b": "model.safetensors"}, {"a": None}, "model.safetensors"],
    ids=["list", "mixed-types", "null", "string"],
)
def test_a_malformed_local_index_is_a_format_error(tmp_path: Path, weight_map: object):
    """A local checkpoint's HF index with a weight_map that is not name -> file name is a
    FormatError naming the index, not a TypeError from deep inside."""
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(FormatError, match="index"):
        scan_checkpoint(str(tmp_path))

"""Interoperability with the reference format, both ways.

* What deltastore publishes (xor and overwrite, every checksum, deltas, an empty delta and a
  full version) is applied byte-exactly by ``reference_reader``, written from
  the format description alone (docs/format.md).
* What a hand-written reference publisher writes (again from the format document alone: only
  the reference keys, several shards, ordinary HF full checkpoints without digests) is pulled
  byte-exactly by ``deltastore.pull_weights``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from safetensors.numpy import save_file as save_numpy

import deltastore as ds
from tests.conftest import checkpoint_bytes, make_checkpoint, perturb, raw_bytes
from tests.format import reference_reader

Bytes = dict[str, bytes]


def _as_bytes(tensors: dict[str, torch.Tensor]) -> Bytes:
    return {name: raw_bytes(t) for name, t in tensors.items()}


# ------------------------------------------------- deltastore → reference reader
@pytest.mark.parametrize(
    "encoding, checksum",
    [("xor", "xxh3-128"), ("overwrite", "blake3"), ("overwrite", "adler32"), ("xor", "blake3")],
)
def test_reference_reader_applies_what_deltastore_publishes(
    tmp_path: Path, base_dir: Path, small_model: dict[str, torch.Tensor], encoding, checksum
):
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, encoding=encoding, checksum=checksum)
    publisher.seed()
    states: dict[int, Bytes] = {0: _as_bytes(small_model)}
    model = small_model
    # v1 delta, v2 nothing changed, v3 delta, v4 full, v5 delta
    for version, full in ((1, False), (2, False), (3, False), (4, True), (5, False)):
        if version != 2:
            model = perturb(model, version)
        result = publisher.publish(model.items(), full=full)
        assert result.version == version
        states[version] = _as_bytes(model)
    assert states[2] == states[1]

    host = tmp_path / "host"
    for version in range(6):
        reference_reader.pull(str(host), str(store.root), version, str(base_dir))
        assert reference_reader.read_state(str(host)) == version
        assert checkpoint_bytes(host) == states[version], f"reference reader at v{version}"
    state = json.loads((host / ".weight_sync" / "state.json").read_text())
    assert state == {"version": "000005"}

    # A late host applies v4 (full) then v5; deltastore agrees byte for byte.
    late = tmp_path / "late"
    reference_reader.pull(str(late), str(store.root), 5, str(base_dir))
    ours = tmp_path / "ours"
    ds.pull_weights(ours, store, 5, base_dir=base_dir)
    assert checkpoint_bytes(late) == checkpoint_bytes(ours) == states[5]

    # deltastore can continue a checkpoint the reference reader brought to v3, and vice versa.
    mixed = tmp_path / "mixed"
    reference_reader.pull(str(mixed), str(store.root), 3, str(base_dir))
    ds.pull_weights(mixed, store, 5, base_dir=base_dir)
    assert checkpoint_bytes(mixed) == states[5]


# ------------------------------------------------- reference publisher → deltastore
def _digest(algorithm: str, data: bytes) -> str:
    return reference_reader.digest(algorithm, data)


def _payload(encoding: str, old: bytes, new: bytes) -> bytes:
    a = np.frombuffer(old, dtype=np.uint8)
    b = np.frombuffer(new, dtype=np.uint8)
    if encoding == "xor":
        return np.bitwise_xor(a, b).tobytes()
    positions = np.flatnonzero(a != b).astype("<u4")
    return struct.pack("<I", positions.size) + positions.tobytes() + b[positions].tobytes()


def reference_publish_delta(
    source: Path,
    version: int,
    old: Bytes,
    new: Bytes,
    *,
    encoding: str,
    checksum: str,
    shards: int,
) -> None:
    """Publish ``old → new`` as the reference trainer does (per docs/format.md only)."""
    changed = sorted(n for n in new if new[n] != old[n])
    directory = source / f"weight_v{version:06d}"
    directory.mkdir(parents=True)
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=True)
    weight_map: dict[str, str] = {}
    groups = [changed[i::shards] for i in range(shards)]
    groups = [g for g in groups if g]
    for i, names in enumerate(groups):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        frames = {
            n: np.frombuffer(compressor.compress(_payload(encoding, old[n], new[n])), np.uint8)
            for n in names
        }
        save_numpy(
            frames, str(directory / shard), metadata={n: _digest(checksum, new[n]) for n in names}
        )
        weight_map.update(dict.fromkeys(names, shard))
    index = {
        "metadata": {
            "version": f"{version:06d}",
            "base_version": f"{version - 1:06d}",
            "delta_encoding": encoding,
            "compression_format": "zstd",
            "checksum_format": checksum,
        },
        "weight_map": weight_map,
    }
    # The index is written last: its presence publishes the version.
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def reference_publish_full(source: Path, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """A full version: an ordinary HF checkpoint (no delta metadata, no digests)."""
    make_checkpoint(source / f"weight_v{version:06d}", tensors, shards=2)


@pytest.fixture
def reference_store(tmp_path: Path, small_model: dict[str, torch.Tensor]):
    """A store written by the reference publisher, and the model bytes at each version."""
    source = tmp_path / "reference-store"
    source.mkdir()
    models = {0: small_model}
    for version in (1, 2, 3, 4):
        models[version] = perturb(models[version - 1], version)
    states = {v: _as_bytes(m) for v, m in models.items()}
    reference_publish_delta(
        source, 1, states[0], states[1], encoding="xor", checksum="xxh3-128", shards=2
    )
    reference_publish_delta(
        source, 2, states[1], states[2], encoding="overwrite", checksum="blake3", shards=1
    )
    reference_publish_full(source, 3, models[3])
    reference_publish_delta(
        source, 4, states[3], states[4], encoding="overwrite", checksum="adler32", shards=2
    )
    return source, states


def test_deltastore_pulls_what_the_reference_publishes(
    tmp_path: Path, base_dir: Path, reference_store
):
    source, states = reference_store
    store = ds.VersionStore(source)
    assert store.versions() == [1, 2, 3, 4]
    assert store.index(3).kind == "full" and store.index(4).base_version == 3
    host = tmp_path / "host"
    for version in (1, 2, 3, 4):
        result = ds.pull_weights(host, source, version, base_dir=base_dir)
        assert result.version == version
        assert checkpoint_bytes(host) == states[version], f"deltastore at v{version}"
    for version in (4, 2, 0):  # fresh hosts, and backward targets
        fresh = tmp_path / f"fresh-{version}"
        ds.pull_weights(fresh, source, version, base_dir=base_dir)
        assert checkpoint_bytes(fresh) == states[version]
        ds.pull_weights(host, source, version, base_dir=base_dir)
        assert checkpoint_bytes(host) == states[version]


def test_verify_local_on_a_reference_delta_chain(tmp_path: Path, base_dir: Path, reference_store):
    source, _ = reference_store
    host = tmp_path / "host"
    ds.pull_weights(host, source, 2, base_dir=base_dir)
    assert ds.verify_local(host, source, base_dir=base_dir) == 2


def test_verify_local_on_a_reference_full_version(tmp_path: Path, base_dir: Path, reference_store):
    source, _ = reference_store
    host = tmp_path / "host"
    ds.pull_weights(host, source, 4, base_dir=base_dir)
    assert ds.verify_local(host, source, base_dir=base_dir) == 4


def test_reference_reader_agrees_on_the_reference_store(
    tmp_path: Path, base_dir: Path, reference_store
):
    """The two hand-written halves agree with each other, so neither test above is vacuous."""
    source, states = reference_store
    host = tmp_path / "host"
    for version in (1, 2, 3, 4):
        reference_reader.pull(str(host), str(source), version, str(base_dir))
        assert checkpoint_bytes(host) == states[version]
    assert os.path.exists(host / ".weight_sync" / "state.json")

"""Shard headers are read with one ranged read when short, two when longer than that read."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltastore.storage import VersionStore
from deltastore.testing.store_tests import write_version


@pytest.mark.parametrize("count", [3, 3000])
def test_shard_header_of_any_length(tmp_path: Path, count: int) -> None:
    store = VersionStore(tmp_path / "store")
    tensors = {
        f"model.layers.{i}.a_long_tensor_name_{i:06d}": bytes([i % 251]) * 5 for i in range(count)
    }
    index = write_version(store, 1, tensors=tensors)
    (shard,) = index.shards()
    header = store.read_shard_header(1, shard)
    data = (tmp_path / "store" / "weight_v000001" / shard).read_bytes()
    assert (count < 1000) == (8 + int.from_bytes(data[:8], "little") <= 64 * 1024)
    assert set(header.tensors) == set(tensors)
    for name, entry in header.tensors.items():
        assert data[entry.start : entry.end] == tensors[name]

"""Resume, anchors and new streams through a non-local store (fsspec ``memory://``): the
publisher's rebuild reads indexes, shard headers and payload ranges through the store API
only. One process: ``memory://`` is per-process, so ranks could not share it."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

import deltastore as ds
from deltastore.errors import StreamError
from tests.conftest import make_checkpoint
from tests.publish.harness import assert_checkpoint_equals, base_tensors, model_at

NAMES = [f"model.layers.{i}.weight" for i in range(4)] + ["model.norm.weight"]
CHANGES = {1: {NAMES[0]}, 2: {NAMES[1], NAMES[4]}, 3: {NAMES[2]}, 4: {NAMES[0], NAMES[3]}}


def test_resume_and_new_stream_on_a_memory_store(tmp_path: Path) -> None:
    tensors = base_tensors(NAMES)
    base = make_checkpoint(tmp_path / "base", tensors)
    url = f"memory://deltastore-{uuid.uuid4().hex}"
    pub = ds.DeltaPublisher(url, base, workers=2, anchor_every=2)
    pub.seed()
    for step in (1, 2, 3):
        pub.publish(model_at(tensors, CHANGES, step).items())
    store = ds.VersionStore(url)
    assert [store.index(v).kind for v in (1, 2, 3)] == ["delta", "full", "delta"]
    stream = store.index(3).stream_id

    with pytest.raises(StreamError):
        ds.DeltaPublisher(url, base).seed()

    resumed = ds.DeltaPublisher(url, base, workers=2, resume=True)
    resumed.seed()  # one process: every tensor rebuilt from v2 (full) + v3 and verified now
    assert resumed.snapshot is not None
    assert all(resumed.snapshot.is_loaded(n) for n in NAMES)
    assert (resumed.next_version, resumed.base_version, resumed.stream_id) == (4, 3, stream)
    result = resumed.publish(model_at(tensors, CHANGES, 4).items())
    assert (result.version, result.base_version, result.tensors_changed) == (4, 3, 2)
    local = tmp_path / "local"
    ds.pull_weights(local, store, 4, base_dir=base)
    assert_checkpoint_equals(local, model_at(tensors, CHANGES, 4))

    # A corrupted byte in the anchor is caught by the digest check when resuming.
    shard = store.index(2).weight_map[NAMES[3]]
    entry = store.read_shard_header(2, shard).tensors[NAMES[3]]
    path = f"{store.root}/weight_v000002/{shard}"
    good = store.fs.cat_file(path)
    bad = bytearray(good)
    bad[entry.start + 5] ^= 0x01
    store.fs.pipe_file(path, bytes(bad))
    with pytest.raises(ds.IntegrityError, match=NAMES[3]):
        ds.DeltaPublisher(url, base, resume=True).seed()
    store.fs.pipe_file(path, good)

    # A new stream builds on the base again, after the latest version.
    fresh = ds.DeltaPublisher(url, base, workers=2, new_stream=True)
    fresh.seed()
    changed = {n: t.clone() for n, t in tensors.items()}
    changed[NAMES[1]] += torch.ones_like(changed[NAMES[1]])
    result = fresh.publish(changed.items())
    index = store.index(5)
    assert (result.version, index.base_version) == (5, 0)
    assert index.stream_id not in (None, stream)
    ds.pull_weights(local, store, 5, base_dir=base)
    assert_checkpoint_equals(local, changed)

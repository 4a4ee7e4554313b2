"""A collective publish on two real gloo ranks signs its versions: each rank hashes the shards
it writes and rank 0 signs the whole version; a trusting host pulls them."""

from __future__ import annotations

from pathlib import Path

import pytest

import deltastore as ds
from deltastore.trust import SIGNATURE_KEY, generate_keypair
from tests.publish.harness import (
    assert_checkpoint_equals,
    base_tensors,
    model_at,
    run_ranks,
    write_base,
)

# Slow: real gloo ranks.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

NAMES = [f"model.layers.{i}.weight" for i in range(4)]
CHANGES = {1: {NAMES[0], NAMES[3]}, 2: {NAMES[1]}}


def _publish_signed(rank: int, world: int, base: str, store_url: str, key: str) -> list[int]:
    tensors = base_tensors(NAMES)
    pub = ds.DeltaPublisher(store_url, base, workers=1, signing_key=key)
    pub.seed()
    mine = NAMES[rank::world]  # every rank passes its own half
    versions = []
    for step in (1, 2):
        model = model_at(tensors, CHANGES, step)
        versions.append(pub.publish(((n, model[n]) for n in mine), full=step == 2).version)
    return versions


def test_two_ranks_sign_and_a_trusting_host_pulls(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    pair = generate_keypair(tmp_path / "keys" / "run")
    tensors = base_tensors(NAMES)
    base = write_base(tmp_path / "base", tensors)
    store_dir = tmp_path / "store"
    outs = run_ranks(
        2,
        _publish_signed,
        tmp_path / "ranks",
        base=str(base),
        store_url=str(store_dir),
        key=pair.private_path,
    )
    assert outs == [[1, 2], [1, 2]]
    store = ds.VersionStore(str(store_dir))
    for version in (1, 2):
        index = store.index(version)
        assert SIGNATURE_KEY in index.extra and len(index.shards()) == 2, index.shards()
    local = tmp_path / "host"
    ds.pull_weights(local, store, 1, base_dir=base, trusted_keys=[pair.public_path])
    assert_checkpoint_equals(local, model_at(tensors, CHANGES, 1))
    ds.pull_weights(local, store, 2, base_dir=base, trusted_keys=[pair.public_path])
    assert_checkpoint_equals(local, model_at(tensors, CHANGES, 2))

"""Syncing every k > 1 steps must diff against the last *published* state."""

from __future__ import annotations

from pathlib import Path

import torch

import deltastore as ds
from tests.conftest import checkpoint_bytes, make_checkpoint, raw_bytes


def test_changes_of_unpublished_steps_reach_the_engine(tmp_path: Path) -> None:
    weights = {"w": torch.zeros(64, dtype=torch.bfloat16), "b": torch.zeros(8)}
    base = make_checkpoint(tmp_path / "base", weights)
    publisher = ds.DeltaPublisher(ds.VersionStore(str(tmp_path / "store")), str(base))
    publisher.seed()
    # Step 1 changes w[0..3] and is not published; step 2 changes only b and is published.
    weights["w"][:4] = 1.0
    weights["b"][0] = 2.0
    result = publisher.publish(weights.items())
    assert result.tensors_changed == 2, "the unpublished step-1 change of w must be in v1"
    host = tmp_path / "host"
    ds.pull_weights(host, str(tmp_path / "store"), 1, base_dir=base)
    assert checkpoint_bytes(host) == {n: raw_bytes(t) for n, t in weights.items()}

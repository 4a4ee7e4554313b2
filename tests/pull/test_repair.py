"""Repairing interrupted transitions, from crash states built tensor by tensor.

Each test leaves a local checkpoint the way a crash mid-apply would (state removed, a pending
record naming the transition, each touched tensor at its old bytes, its new bytes, torn, or
garbage) and checks that the next pull keeps, applies and restores exactly the right tensors
and ends verified at its target.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from deltastore import pull_weights, verify_local
from deltastore.format.state import PendingTransition
from deltastore.pull import LocalCheckpoint
from tests.pull.helpers import (
    Published,
    changed_between,
    local_bytes,
    many_tensors,
    publish_versions,
    state_bytes,
    write_checkpoint,
    write_tensor,
)


@pytest.fixture(scope="module", params=["xor", "overwrite"])
def published(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Published:
    root = tmp_path_factory.mktemp(f"repair-{request.param}")
    base = many_tensors(60, seed=3, elements=512)
    write_checkpoint(root / "base", base)
    return publish_versions(
        root / "store", root / "base", base, 6, encoding=request.param, seed=4, fraction=0.5
    )


def crash_state(
    published: Published, local: Path, start: int, end: int, stream: str | None
) -> dict[str, set[str]]:
    """Pull ``start``, then fake a crash part way to ``end``; returns the names per fate."""
    pull_weights(local, published.store_dir, start, published.base_dir)
    touched = sorted(changed_between(published, start, end))
    old, new = state_bytes(published.states[start]), state_bytes(published.states[end])
    rng = np.random.default_rng(7)
    fates: dict[str, set[str]] = {"kept": set(), "applied": set(), "restored": set()}
    for i, name in enumerate(touched):
        kind = ("new", "old", "torn", "garbage")[i % 4]
        if kind == "new":
            write_tensor(local, name, new[name])
            fates["kept"].add(name)
        elif kind == "old":
            fates["applied"].add(name)
        elif kind == "torn":
            half = len(new[name]) // 2
            torn = new[name][:half] + old[name][half:]
            if torn in (old[name], new[name]):
                fates["applied" if torn == old[name] else "kept"].add(name)
            else:
                fates["restored"].add(name)
            write_tensor(local, name, torn)
        else:
            write_tensor(local, name, rng.integers(0, 256, len(new[name]), np.uint8).tobytes())
            fates["restored"].add(name)
    checkpoint = LocalCheckpoint(local)
    checkpoint.begin(PendingTransition(start, end, stream, stream, list(range(start + 1, end + 1))))
    assert checkpoint.read_state() is None
    return fates


def test_repair_keeps_applies_and_restores_each_tensor(published: Published, tmp_path: Path):
    local = tmp_path / "host"
    fates = crash_state(published, local, 2, 6, published.stream_id)
    assert all(fates.values()), fates  # every fate is exercised

    result = pull_weights(local, published.store_dir, 6, published.base_dir, workers=2)

    assert result.action == "repaired"
    assert result.repair is not None
    assert result.repair.kept == len(fates["kept"])
    assert result.repair.applied == len(fates["applied"])
    assert result.repair.restored == len(fates["restored"])
    assert local_bytes(local) == state_bytes(published.states[6])
    assert verify_local(local, published.store_dir, None, published.base_dir) == 6
    assert not os.path.exists(LocalCheckpoint(local).pending_path)


def test_repair_then_catch_up_further(published: Published, tmp_path: Path):
    local = tmp_path / "host"
    crash_state(published, local, 1, 4, published.stream_id)

    result = pull_weights(local, published.store_dir, 6, published.base_dir)

    assert result.repair is not None and result.repair.to_version == 4
    assert result.action == "applied" and result.versions_applied == [5, 6]
    assert local_bytes(local) == state_bytes(published.states[6])


def test_interrupted_reseed_reseeds(published: Published, tmp_path: Path):
    local = tmp_path / "host"
    pull_weights(local, published.store_dir, 3, published.base_dir)
    checkpoint = LocalCheckpoint(local)
    checkpoint.begin(PendingTransition(None, 0, None, published.stream_id, []))
    # A copy cut short: one file truncated.
    victim = sorted(p for p in os.listdir(local) if p.endswith(".safetensors"))[0]
    with open(local / victim, "r+b") as fh:
        fh.truncate(100)

    result = pull_weights(local, published.store_dir, 5, published.base_dir)

    assert result.action == "reseeded" and result.repair is None
    assert local_bytes(local) == state_bytes(published.states[5])


def test_unprovable_transition_reseeds(published: Published, tmp_path: Path):
    local = tmp_path / "host"
    crash_state(published, local, 2, 5, published.stream_id)
    # The record claims a run of versions the store's chain does not have.
    pending = LocalCheckpoint(local).pending_path
    body = json.loads(Path(pending).read_text())
    body["versions"] = ["000003", "000005"]
    Path(pending).write_text(json.dumps(body))

    result = pull_weights(local, published.store_dir, 5, published.base_dir)

    assert result.action == "reseeded" and result.repair is None
    assert local_bytes(local) == state_bytes(published.states[5])


def test_state_written_before_pending_cleared(published: Published, tmp_path: Path):
    local = tmp_path / "host"
    pull_weights(local, published.store_dir, 4, published.base_dir)
    checkpoint = LocalCheckpoint(local)
    Path(checkpoint.pending_path).write_bytes(
        PendingTransition(3, 4, published.stream_id, published.stream_id, [4]).to_json()
    )

    result = pull_weights(local, published.store_dir, 4, published.base_dir)

    assert result.action == "noop" and result.repair is None
    assert checkpoint.read_pending() is None


def test_backward_target_with_pending_reseeds(published: Published, tmp_path: Path):
    local = tmp_path / "host"
    crash_state(published, local, 3, 6, published.stream_id)

    result = pull_weights(local, published.store_dir, 2, published.base_dir)

    assert result.action == "reseeded"
    assert local_bytes(local) == state_bytes(published.states[2])


def test_repair_restores_from_a_full_version(tmp_path: Path):
    """A chain starting at a full version: previous digests and restored bytes come from it."""
    base = many_tensors(40, seed=5, elements=512)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(
        tmp_path / "store", tmp_path / "base", base, 7, seed=6, fraction=0.5, full_at=[4]
    )
    local = tmp_path / "host"
    fates = crash_state(published, local, 4, 7, published.stream_id)
    assert fates["restored"] and fates["applied"]

    result = pull_weights(local, published.store_dir, 7, published.base_dir)

    assert result.repair is not None
    assert (result.repair.applied, result.repair.restored) == (
        len(fates["applied"]),
        len(fates["restored"]),
    )
    assert local_bytes(local) == state_bytes(published.states[7])
    verify_local(local, published.store_dir, 7, published.base_dir)

"""A trainer's life on real gloo ranks: kill -9 of every rank between versions and resume; a
crashed writer's claim is skipped; anchors (full versions) reset the chain, late hosts seed from
the newest one and older deltas can be pruned."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from safetensors import safe_open

import deltastore as ds
from deltastore.storage import VersionStore
from tests.conftest import raw_bytes
from tests.publish.harness import (
    assert_checkpoint_equals,
    base_tensors,
    model_at,
    run_ranks,
    start_ranks,
    write_base,
)

# Slow: kill -9 of real gloo ranks, then resume.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LAYERS = [f"model.layers.{i}.weight" for i in range(6)]
NORM = "model.norm.weight"
FROZEN = "model.frozen.weight"  # never passed by any rank
NAMES = [*LAYERS, NORM, FROZEN]
CHANGES = {
    1: {LAYERS[0], LAYERS[1]},
    2: {LAYERS[2], LAYERS[3]},
    3: {LAYERS[3], NORM},
    4: {LAYERS[4], LAYERS[5]},
    5: {LAYERS[0]},
}


def held_by(rank: int) -> list[str]:
    names = [n for i, n in enumerate(LAYERS) if i % 2 == rank]
    return [*names, NORM] if rank == 0 else names


def model(step: int, big: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """The model at ``step``; at each step in ``big`` every layer is replaced by fresh noise."""
    tensors = model_at(base_tensors(NAMES), CHANGES, step)
    for s in big:
        if s <= step:
            g = torch.Generator().manual_seed(s)
            for name in LAYERS:
                tensors[name] = torch.randn(tensors[name].shape, generator=g).to(torch.bfloat16)
    return tensors


# ------------------------------------------------------------------------ kill -9 and resume
def _publish_then_wait(rank: int, world: int, base: str, store_url: str, marks: str) -> None:
    pub = ds.DeltaPublisher(store_url, base, workers=2)
    pub.seed()
    for step in (1, 2):
        tensors = model(step)
        pub.publish((n, tensors[n]) for n in held_by(rank))
    Path(marks, f"published-{rank}").touch()
    time.sleep(600)  # killed here, between versions


def _resume(rank: int, world: int, base: str, store_url: str, step: int) -> dict[str, Any]:
    pub = ds.DeltaPublisher(store_url, base, workers=2, resume=True)
    pub.seed()
    seeded = (pub.next_version, pub.base_version, pub.stream_id)
    tensors = model(step)
    result = pub.publish((n, tensors[n]) for n in held_by(rank))
    assert pub.snapshot is not None
    loaded = sorted(n for n in NAMES if pub.snapshot.is_loaded(n))
    return {"seeded": seeded, "result": result, "loaded": loaded}


def test_resume_after_kill_9_of_every_rank(tmp_path: Path) -> None:
    base = write_base(tmp_path / "base", base_tensors(NAMES))
    store_dir, marks = tmp_path / "store", tmp_path / "marks"
    marks.mkdir()
    procs, outs = start_ranks(
        2,
        _publish_then_wait,
        tmp_path / "ranks",
        base=str(base),
        store_url=str(store_dir),
        marks=str(marks),
    )
    deadline = time.monotonic() + 45
    while len(os.listdir(marks)) < 2:
        assert time.monotonic() < deadline, "ranks never published v2"
        assert all(p.is_alive() for p in procs), "a rank died before v2"
        time.sleep(0.05)
    for proc in procs:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    assert all(p.exitcode == -signal.SIGKILL for p in procs)
    store = VersionStore(str(store_dir))
    assert store.versions() == [1, 2]
    stream = store.index(2).stream_id

    # Restart every rank with resume=True: rebuilt from the base + v1 + v2, continues at v3.
    outs = run_ranks(
        2, _resume, tmp_path / "ranks", base=str(base), store_url=str(store_dir), step=3
    )
    for out in outs:
        assert out["seeded"] == (3, 2, stream)
        assert out["result"].version == 3
    # Each rank rebuilt (and digest-checked) only the tensors it is passed.
    assert outs[1]["loaded"] == sorted(held_by(1))
    index = store.index(3)
    assert (index.base_version, index.stream_id) == (2, stream)
    local = tmp_path / "local"
    ds.pull_weights(local, store, 3, base_dir=base)
    assert_checkpoint_equals(local, model(3))

    # A writer crashed after claiming v4 and writing part of a shard: never reuse that number.
    writer = store.begin(4, token="crashed-writer")
    writer.write_file("model-00000-of-00002.safetensors", b"partial garbage")
    outs = run_ranks(
        2, _resume, tmp_path / "ranks", base=str(base), store_url=str(store_dir), step=4
    )
    assert {out["result"].version for out in outs} == {5}
    assert store.versions() == [1, 2, 3, 5]
    assert store.index(5).base_version == 3
    result = ds.pull_weights(local, store, 5, base_dir=base)
    assert result.versions_applied == [5]
    assert_checkpoint_equals(local, model(4))


# ---------------------------------------------------------------------------------- anchors
SHARD_BYTES = 2100  # two bf16 layers (1 KiB each) per shard; the fp32 norm (2 KiB) alone


def _anchored(rank: int, world: int, base: str, store_url: str) -> dict[str, Any]:
    kinds = []
    pub = ds.DeltaPublisher(store_url, base, workers=2, anchor_every=3, max_shard_bytes=SHARD_BYTES)
    pub.seed()
    for step in (1, 2, 3, 4):
        tensors = model(step)
        kinds.append(pub.publish((n, tensors[n]) for n in held_by(rank)).kind)
    # Deltas before the anchor are prunable: the trainer no longer needs them either.
    if rank == 0:
        for version in (1, 2):
            shutil.rmtree(Path(store_url, f"weight_v{version:06d}"))
    # A restarted trainer resumes from the anchor (v3) + v4, anchoring now by wire bytes.
    pub = ds.DeltaPublisher(
        store_url,
        base,
        workers=2,
        resume=True,
        anchor_chain_bytes=0.5,
        max_shard_bytes=SHARD_BYTES,
    )
    pub.seed()
    for step in (5, 6):
        tensors = model(step, big=(6,))
        kinds.append(pub.publish((n, tensors[n]) for n in held_by(rank)).kind)
        if rank == 0:
            metrics = pub.pop_metrics()
    return {"kinds": kinds, "metrics": metrics if rank == 0 else None}


def test_anchors_reset_the_chain_and_late_hosts_seed_from_them(tmp_path: Path) -> None:
    base = write_base(tmp_path / "base", base_tensors(NAMES))
    store_dir = tmp_path / "store"
    # Publish v1..v4 (v3 an anchor), prune v1 and v2, resume from v3 + v4, publish v5, v6.
    outs = run_ranks(2, _anchored, tmp_path / "ranks", base=str(base), store_url=str(store_dir))
    # v1, v2 deltas; v3 full (every 3rd); v4, v5 deltas; v6 full (its wire would pass 50 %).
    assert (
        outs[0]["kinds"]
        == outs[1]["kinds"]
        == [
            "delta",
            "delta",
            "full",
            "delta",
            "delta",
            "full",
        ]
    )
    assert outs[0]["metrics"]["full"] == 1.0
    store = VersionStore(str(store_dir))

    for version, step in ((3, 3), (6, 6)):
        index = store.index(version)
        assert not index.is_delta and index.base_version is None
        expected = model(step, big=(6,))
        assert set(index.weight_map) == set(NAMES)  # complete, FROZEN included
        shards = sorted(set(index.weight_map.values()))
        count = len(shards)
        assert count > 2  # bounded size: several shards per rank
        assert shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        for shard in shards:
            path = store_dir / f"weight_v{version:06d}" / shard
            with safe_open(str(path), framework="pt") as fh:
                metadata = fh.metadata()
                names = set(fh.keys())
                for name in names:
                    want = raw_bytes(expected[name])
                    assert raw_bytes(fh.get_tensor(name)) == want
                    assert metadata[name] == xxhash.xxh3_128_hexdigest(want)
            assert names == {n for n, s in index.weight_map.items() if s == shard}
            assert len(names) == 1 or path.stat().st_size <= SHARD_BYTES + 1024
    assert store.index(4).base_version == 3
    assert store.index(5).base_version == 4

    # v1 and v2 were pruned: a late host (no base at hand) seeds from the newest anchor.
    assert store.versions() == [3, 4, 5, 6]
    local = tmp_path / "late-host"
    result = ds.pull_weights(local, str(store_dir), 5)
    assert result.action == "reseeded" and result.versions_applied == [3, 4, 5]
    assert_checkpoint_equals(local, model(5))
    result = ds.pull_weights(local, str(store_dir), 6)
    assert_checkpoint_equals(local, model(6, big=(6,)))

"""Collective publish on real gloo ranks: shard numbering, index completeness, replica dedup,
divergent replicas, a failing rank, tensors moving between ranks, global metrics, hooks."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

import deltastore as ds
from deltastore.format.names import INDEX_NAME
from deltastore.storage import VersionStore, store_objects
from tests.publish.harness import (
    assert_checkpoint_equals,
    base_tensors,
    model_at,
    run_ranks,
    write_base,
)

# Slow: real gloo ranks.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LAYERS = [f"model.layers.{i}.weight" for i in range(8)]
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
FROZEN = "model.frozen.weight"
NAMES = [*LAYERS, EMBED, NORM, FROZEN]

ROWS_4 = 32
"""Rows of the four-rank test's tensors: a step changes one, few enough that the device diff of
a stale copy (two rows) is still sent as changes rather than staged whole as a dense step."""

# Step → tensors it changes. EMBED is replicated on ranks 1 and 3 (tied embeddings).
CHANGES_4 = {
    1: {LAYERS[0], LAYERS[1], LAYERS[3], EMBED, NORM},  # rank 2 changes nothing
    2: set(),  # nothing changes: still a version
    3: {LAYERS[2], LAYERS[0]},  # LAYERS[0] has moved to rank 2
    4: {LAYERS[0], EMBED},  # ... and back to rank 0
    5: {LAYERS[5]},  # rank 2 alone asks for a full version
}


def held_by(rank: int, step: int) -> list[str]:
    """Tensors rank ``rank`` passes at ``step`` (of 4 ranks)."""
    names = [n for i, n in enumerate(LAYERS) if i % 4 == rank]
    if rank == 0:
        names.append(NORM)
    if rank in (1, 3):
        names.append(EMBED)
    if step == 3:
        if rank == 0:
            names.remove(LAYERS[0])
        if rank == 2:
            names.append(LAYERS[0])
    return names


def _four_ranks(
    rank: int, world: int, base: str, store_url: str, hooks: str, device_snapshot: bool = False
) -> dict[str, Any]:
    def hook(args: Any, version_dir: str, engines: Any) -> None:
        with open(os.path.join(hooks, f"{args}-{os.path.basename(version_dir)}"), "w") as fh:
            fh.write(version_dir)

    tensors = base_tensors(NAMES, rows=ROWS_4)
    pub = ds.DeltaPublisher(
        store_url,
        base,
        workers=2,
        post_write=hook,
        args=f"rank{rank}",
        device_snapshot=device_snapshot,
    )
    pub.seed()
    out: dict[str, Any] = {"results": [], "metrics": [], "loaded": [], "staged": []}
    for step in range(1, 6):
        model = model_at(tensors, CHANGES_4, step)
        full = step == 5 and rank == 2
        result = pub.publish(((n, model[n]) for n in held_by(rank, step)), full=full)
        out["results"].append(result)
        out["metrics"].append(pub.pop_metrics())
        assert pub.last_staging is not None
        out["staged"].append(pub.last_staging.staged)
        assert pub.snapshot is not None
        out["loaded"].append(sorted(n for n in NAMES if pub.snapshot.is_loaded(n)))
    return out


def _shard_names(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as fh:
        return set(fh.keys())


# device_snapshot: a rank's device copy of a tensor another rank published since must be
# dropped, or its next diff (LAYERS[0] back on rank 0 at step 4) starts from a stale state.
@pytest.mark.parametrize("device_snapshot", [False, True], ids=["staged", "device-snapshot"])
def test_four_ranks_numbering_completeness_dedup_and_moves(
    tmp_path: Path, device_snapshot: bool
) -> None:
    tensors = base_tensors(NAMES, rows=ROWS_4)
    base = write_base(tmp_path / "base", tensors)
    store_dir = tmp_path / "store"
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    outs = run_ranks(
        4,
        _four_ranks,
        tmp_path / "ranks",
        base=str(base),
        store_url=str(store_dir),
        hooks=str(hooks),
        device_snapshot=device_snapshot,
    )
    store = VersionStore(str(store_dir))
    assert store.versions() == [1, 2, 3, 4, 5]
    if device_snapshot:  # every tensor diffed on its device: no copy was found stale
        assert [o["staged"] for o in outs] == [[0] * 5] * 4

    expected_maps = {
        # Ranks 0, 1 and 3 changed something: shards 0, 1, 2 of 3, gap-free (rank 2 has none).
        # EMBED changed identically on ranks 1 and 3: the lowest rank (1) keeps it.
        1: {
            LAYERS[0]: "model-00000-of-00003.safetensors",
            NORM: "model-00000-of-00003.safetensors",
            LAYERS[1]: "model-00001-of-00003.safetensors",
            EMBED: "model-00001-of-00003.safetensors",
            LAYERS[3]: "model-00002-of-00003.safetensors",
        },
        2: {},
        # Rank 2 holds LAYERS[0] now (never held before: it re-reads it from the store).
        3: {
            LAYERS[0]: "model-00000-of-00001.safetensors",
            LAYERS[2]: "model-00000-of-00001.safetensors",
        },
        # LAYERS[0] is back on rank 0, whose copy went stale at v3.
        4: {
            LAYERS[0]: "model-00000-of-00002.safetensors",
            EMBED: "model-00001-of-00002.safetensors",
        },
    }
    stream_ids = set()
    for version, expected in expected_maps.items():
        index = store.index(version)
        assert index.is_delta and index.base_version == version - 1
        assert index.weight_map == expected, version
        stream_ids.add(index.stream_id)
        vdir = store_dir / f"weight_v{version:06d}"
        files = sorted(os.listdir(vdir))
        assert files == sorted({*expected.values(), INDEX_NAME})
        wire = 0
        for shard, names in index.shards().items():
            assert _shard_names(vdir / shard) == set(names)
            wire += (vdir / shard).stat().st_size
        metrics = [o["metrics"][version - 1] for o in outs]
        assert all(m == metrics[0] for m in metrics), "metrics differ across ranks"
        assert metrics[0]["wire_bytes"] == wire == index.totals["wire_bytes"]
        assert metrics[0]["tensors_changed"] == len(expected)
        assert metrics[0]["world_size"] == 4
        assert {o["results"][version - 1].version for o in outs} == {version}
        for rank in range(4):
            assert (hooks / f"rank{rank}-weight_v{version:06d}").exists()
    assert len(stream_ids) == 1 and None not in stream_ids

    # Each rank loads only what it is passed (and LAYERS[0] left rank 0's memory at v3).
    assert outs[2]["loaded"][0] == sorted([LAYERS[2], LAYERS[6]])
    assert LAYERS[0] not in outs[0]["loaded"][2]
    assert LAYERS[0] in outs[2]["loaded"][2]

    # A host applies v1 (the replicated EMBED once: XOR twice would revert it) and then v4.
    local = tmp_path / "local"
    ds.pull_weights(local, store, 1, base_dir=base)
    assert_checkpoint_equals(local, model_at(tensors, CHANGES_4, 1))
    result = ds.pull_weights(local, store, 4, base_dir=base)
    assert result.versions_applied == [2, 3, 4]
    assert_checkpoint_equals(local, model_at(tensors, CHANGES_4, 4))

    # publish(full=True) on one rank makes the version full on every rank: complete (FROZEN,
    # passed by no rank, included), ordinary 1-based HF shard names, one run per writing rank.
    assert {o["results"][4].kind for o in outs} == {"full"}
    index = store.index(5)
    assert not index.is_delta and set(index.weight_map) == set(NAMES)
    shards = sorted(set(index.weight_map.values()))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, 5)]
    fresh = tmp_path / "fresh"
    assert ds.pull_weights(fresh, store, 5).action == "reseeded"  # no base needed
    assert_checkpoint_equals(fresh, model_at(tensors, CHANGES_4, 5))


# ----------------------------------------------------------- failures: nothing is committed
TWO = [LAYERS[0], LAYERS[1], EMBED]
CHANGES_2 = {1: {LAYERS[0], LAYERS[1], EMBED}}


class FlakyStore(VersionStore):
    """A real local store whose shard writes fail while ``fail_writes`` is set."""

    fail_writes = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        objects = store_objects(self)
        open_write = objects.open_write

        def flaky(version: int, name: str) -> Any:
            if self.fail_writes:
                raise OSError(f"injected write failure for {name}")
            return open_write(version, name)

        objects.open_write = flaky  # type: ignore[method-assign]


def _store_state(root: Path) -> dict[str, list[str]]:
    claims = root / "_claims"
    return {
        "dirs": sorted(p for p in os.listdir(root) if p.startswith("weight_v"))
        if root.exists()
        else [],
        "claims": sorted(os.listdir(claims)) if claims.exists() else [],
    }


def _two_ranks_failing(rank: int, world: int, base: str, store_url: str) -> dict[str, Any]:
    tensors = base_tensors(TWO)
    store = FlakyStore(store_url)
    pub = ds.DeltaPublisher(store, base, workers=2)
    pub.seed()
    good = model_at(tensors, CHANGES_2, 1)
    mine = [LAYERS[rank], EMBED]
    out: dict[str, Any] = {"errors": [], "states": []}

    def attempt(pairs: list[tuple[str, Any]]) -> None:
        try:
            pub.publish(pairs)
            out["errors"].append(None)
        except ds.DeltastoreError as exc:
            out["errors"].append((type(exc).__name__, str(exc)))
        out["states"].append(_store_state(Path(store_url)))
        out.setdefault("next", []).append(pub.next_version)

    # 1. Divergent replica: rank 1's EMBED differs from rank 0's (which is unchanged).
    diverged = good[EMBED].clone() if rank == 1 else tensors[EMBED]
    attempt([(LAYERS[rank], good[LAYERS[rank]]), (EMBED, diverged)])
    # 2. Rank 1 fails while writing its shard (after rank 0 claimed the version).
    store.fail_writes = rank == 1
    attempt([(n, good[n]) for n in mine])
    store.fail_writes = False
    # 3. Rank 1 fails in its diff: a tensor of the wrong shape.
    bad = good[LAYERS[1]][:4] if rank == 1 else good[LAYERS[0]]
    attempt([(LAYERS[rank], bad), (EMBED, good[EMBED])])
    # 4. Everything right: commits as version 1 (failures did not move the counter).
    attempt([(n, good[n]) for n in mine])
    # 5. Another writer holds version 2: every rank raises VersionConflictError, as a single
    #    process does (one error contract whatever the world size).
    if rank == 0:
        VersionStore(store_url).begin(2)
    attempt([(n, good[n]) for n in mine])
    return out


def test_two_ranks_divergent_replicas_and_failing_rank_commit_nothing(tmp_path: Path) -> None:
    tensors = base_tensors(TWO)
    base = write_base(tmp_path / "base", tensors)
    store_dir = tmp_path / "store"
    outs = run_ranks(
        2, _two_ranks_failing, tmp_path / "ranks", base=str(base), store_url=str(store_dir)
    )
    for rank, out in enumerate(outs):
        divergent, write_failed, diff_failed, ok, conflict = out["errors"]
        assert conflict is not None and conflict[0] == "VersionConflictError", rank
        assert "weight_v000002" in conflict[1]
        assert divergent is not None and divergent[0] == "PublishError", rank
        assert repr(EMBED) in divergent[1] and "ranks [0, 1]" in divergent[1]
        assert write_failed is not None and write_failed[0] == "PublishError"
        assert "failed on rank 1" in write_failed[1] and "injected write failure" in write_failed[1]
        assert diff_failed is not None and diff_failed[0] == "PublishError"
        assert "failed on rank 1" in diff_failed[1]
        assert "[4, 64], the base has [8, 64]" in diff_failed[1]
        assert ok is None
        assert out["next"] == [1, 1, 1, 2, 2]
    # After each failure rank 0 saw no version directory and no claim left behind.
    for state in outs[0]["states"][:3]:
        assert state == {"dirs": [], "claims": []}
    store = VersionStore(str(store_dir))
    assert store.versions() == [1]
    assert store.index(1).weight_map == {
        LAYERS[0]: "model-00000-of-00002.safetensors",
        EMBED: "model-00000-of-00002.safetensors",
        LAYERS[1]: "model-00001-of-00002.safetensors",
    }
    local = tmp_path / "local"
    ds.pull_weights(local, store, 1, base_dir=base)
    assert_checkpoint_equals(local, model_at(tensors, CHANGES_2, 1))
    body = json.loads((store_dir / "weight_v000001" / INDEX_NAME).read_text())
    assert body["metadata"]["delta_encoding"] == "xor"


# ------------------------------------------------- a subset of ranks publishes (a given group)
def _subgroup(rank: int, world: int, base: str, store_url: str) -> int | None:
    import torch.distributed as dist

    group = dist.new_group(ranks=[1, 2], backend="gloo")  # every rank must create it
    if rank == 0:
        return None  # e.g. a rank that holds no source tensors
    tensors = base_tensors(TWO)
    model = model_at(tensors, CHANGES_2, 1)
    pub = ds.DeltaPublisher(store_url, base, workers=1, process_group=group)
    pub.seed()
    mine = [LAYERS[rank - 1], EMBED]
    return pub.publish((n, model[n]) for n in mine).version


def test_a_process_group_of_some_ranks_publishes_alone(tmp_path: Path) -> None:
    tensors = base_tensors(TWO)
    base = write_base(tmp_path / "base", tensors)
    store_dir = tmp_path / "store"
    outs = run_ranks(3, _subgroup, tmp_path / "ranks", base=str(base), store_url=str(store_dir))
    assert outs == [None, 1, 1]
    store = VersionStore(str(store_dir))
    # Group rank 0 (global rank 1) writes shard 0 and keeps the replicated EMBED.
    assert store.index(1).weight_map == {
        LAYERS[0]: "model-00000-of-00002.safetensors",
        EMBED: "model-00000-of-00002.safetensors",
        LAYERS[1]: "model-00001-of-00002.safetensors",
    }
    local = tmp_path / "local"
    ds.pull_weights(local, store, 1, base_dir=base)
    assert_checkpoint_equals(local, model_at(tensors, CHANGES_2, 1))


# ------------------------------------------------ one rank fails before the first collective
def _seed_one_bad_base(rank: int, world: int, bases: list[str], store_url: str) -> str:
    pub = ds.DeltaPublisher(store_url, bases[rank], workers=1)
    try:
        pub.seed()
    except ds.DeltastoreError as exc:
        # A trainer whose rank failed lives on a while (logging, teardown): its peers must not
        # learn of the failure only from its exit.
        time.sleep(2.0)
        return f"{type(exc).__name__}: {exc}"
    return "seeded"


def test_a_rank_whose_base_cannot_be_read_fails_seed_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's base checkpoint is unreadable: every rank raises, none waits in a collective
    for a rank that already gave up (the harness would report the hang)."""
    tensors = base_tensors(TWO)
    good = write_base(tmp_path / "good", tensors)
    bad = write_base(tmp_path / "bad", tensors)
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:4])  # cut inside the 8-byte header length
    outs = run_ranks(
        2,
        _seed_one_bad_base,
        tmp_path / "ranks",
        bases=[str(good), str(bad)],
        store_url=str(tmp_path / "store"),
    )
    assert outs[1] != "seeded" and shard.name in outs[1]
    assert outs[0] != "seeded" and "rank 1" in outs[0] and shard.name in outs[0], outs[0]
    assert "timed out" not in outs[0] and "died" not in outs[0]

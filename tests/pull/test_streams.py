"""Streams and backward targets: a reset and a replay, never a silent no-op (a restarted
trainer or a wiped store reuses version numbers for other weights)."""

from __future__ import annotations

import shutil
from pathlib import Path

from deltastore import pull_weights
from deltastore.pull import LocalCheckpoint
from tests.pull.helpers import (
    local_bytes,
    many_tensors,
    publish_versions,
    state_bytes,
    write_checkpoint,
)


def test_restarted_trainer_new_stream_resets_a_host_of_the_old_stream(tmp_path: Path):
    """Trainer restarts with new_stream=True and publishes v6.. on base 0; a host at v5 of the
    old stream pulling a new-stream version must reset to the base and replay."""
    base = many_tensors(40, seed=61, elements=512)
    write_checkpoint(tmp_path / "base", base)
    old = publish_versions(tmp_path / "store", tmp_path / "base", base, 5, seed=62)
    host = tmp_path / "host"
    pull_weights(host, tmp_path / "store", 5, tmp_path / "base")

    new = publish_versions(tmp_path / "store", tmp_path / "base", base, 3, seed=63, new_stream=True)
    assert sorted(new.states) == [0, 6, 7, 8] and new.stream_id != old.stream_id

    result = pull_weights(host, tmp_path / "store", 7, tmp_path / "base")

    assert result.action == "reseeded" and result.versions_applied == [6, 7]
    assert "reseed from the base" in result.plan
    assert local_bytes(host) == state_bytes(new.states[7])
    state = LocalCheckpoint(host).read_state()
    assert state is not None and (state.version, state.stream_id) == (7, new.stream_id)


def test_wiped_store_republished_same_numbers_is_not_a_noop(tmp_path: Path):
    """The store is wiped and a new stream republishes v1..v5: a host at v5 (old) must not
    treat the new v5 as already applied, nor catch up from its old v3."""
    base = many_tensors(40, seed=71, elements=512)
    write_checkpoint(tmp_path / "base", base)
    publish_versions(tmp_path / "store", tmp_path / "base", base, 5, seed=72)
    at5, at3 = tmp_path / "at5", tmp_path / "at3"
    pull_weights(at5, tmp_path / "store", 5, tmp_path / "base")
    pull_weights(at3, tmp_path / "store", 3, tmp_path / "base")
    shutil.rmtree(tmp_path / "store")
    new = publish_versions(tmp_path / "store", tmp_path / "base", base, 5, seed=73)

    for host in (at5, at3):
        result = pull_weights(host, tmp_path / "store", 5, tmp_path / "base")
        assert result.action == "reseeded", result.plan
        assert "stream" in result.plan
        assert local_bytes(host) == state_bytes(new.states[5])


def test_backward_target_rederives_from_newest_full_version(tmp_path: Path):
    base = many_tensors(40, seed=81, elements=512)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(
        tmp_path / "store", tmp_path / "base", base, 8, seed=82, full_at=[3]
    )
    host = tmp_path / "host"
    pull_weights(host, tmp_path / "store", 8, tmp_path / "base")

    result = pull_weights(host, tmp_path / "store", 5, tmp_path / "base")

    assert result.action == "reseeded" and result.versions_applied == [3, 4, 5]
    assert "backward target" in result.plan and "full version v000003" in result.plan
    assert local_bytes(host) == state_bytes(published.states[5])

    # Back to the base (version 0) and forward again.
    assert pull_weights(host, tmp_path / "store", 0, tmp_path / "base").action == "reseeded"
    assert local_bytes(host) == state_bytes(published.states[0])
    result = pull_weights(host, tmp_path / "store", 2, tmp_path / "base")
    assert result.action == "applied" and result.versions_applied == [1, 2]
    assert local_bytes(host) == state_bytes(published.states[2])


def _strip_stream_ids(store_dir: Path) -> None:
    """Make a store look written by a reference publisher: indexes without ``stream_id``."""
    import json

    for index_path in store_dir.glob("weight_v*/model.safetensors.index.json"):
        body = json.loads(index_path.read_text())
        body["metadata"].pop("stream_id", None)
        index_path.write_text(json.dumps(body))


def test_wiped_store_republished_by_a_reference_publisher_is_not_a_noop(tmp_path: Path):
    """A host of deltastore stream X; the store is wiped and a publisher that records no stream
    id (the reference trainer) republishes v1..v5. The host's version is of stream X, the new
    ones are not: it must reset, never take the new v5 as applied or catch up from its old v3."""
    base = many_tensors(40, seed=74, elements=512)
    write_checkpoint(tmp_path / "base", base)
    publish_versions(tmp_path / "store", tmp_path / "base", base, 5, seed=75)
    at5, at3 = tmp_path / "at5", tmp_path / "at3"
    pull_weights(at5, tmp_path / "store", 5, tmp_path / "base")
    pull_weights(at3, tmp_path / "store", 3, tmp_path / "base")
    shutil.rmtree(tmp_path / "store")
    new = publish_versions(tmp_path / "store", tmp_path / "base", base, 5, seed=76)
    _strip_stream_ids(tmp_path / "store")

    for host in (at5, at3):
        result = pull_weights(host, tmp_path / "store", 5, tmp_path / "base")
        assert result.action == "reseeded", result.plan
        assert "stream" in result.plan
        assert local_bytes(host) == state_bytes(new.states[5])
    # Between two versions of the stream-less store, a host catches up as usual.
    pull_weights(at3, tmp_path / "store", 3, tmp_path / "base")
    result = pull_weights(at3, tmp_path / "store", 5, tmp_path / "base")
    assert result.action == "applied", result.plan

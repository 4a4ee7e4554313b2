"""Catch-up: a host k versions behind applies the chain in one pass per tensor."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from deltastore import DeltaPublisher, DeltastoreError, VersionStore, pull_weights, verify_local
from deltastore.errors import PutBackError
from deltastore.format.checkpoint import scan_checkpoint
from deltastore.pull import LocalCheckpoint
from deltastore.pull.chain import collect_history
from deltastore.pull.local import MappedFiles
from deltastore.storage import store_objects
from tests.pull.helpers import (
    evolve,
    local_bytes,
    many_tensors,
    publish_versions,
    state_bytes,
    write_checkpoint,
)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_catch_up_v0_to_v10_equals_stepwise(
    encoding: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    base = many_tensors(80, seed=21, elements=1024)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(
        tmp_path / "store", tmp_path / "base", base, 10, encoding=encoding, seed=22
    )
    store = VersionStore(str(published.store_dir))
    stepwise, catchup = tmp_path / "stepwise", tmp_path / "catchup"
    pull_weights(catchup, store, 0, published.base_dir)
    for version in range(0, 11):
        pull_weights(stepwise, store, version, published.base_dir)

    with caplog.at_level(logging.INFO, logger="deltastore.pull"):
        result = pull_weights(catchup, store, 10, published.base_dir, workers=2)

    assert local_bytes(catchup) == local_bytes(stepwise) == state_bytes(published.states[10])
    verify_local(catchup, store, 10, published.base_dir)
    assert result.action == "applied" and result.versions_applied == list(range(1, 11))
    indexes = [store.index(v) for v in range(1, 11)]
    changed = set().union(*(i.weight_map for i in indexes))
    # Each changed tensor is read once per version that changes it and written once.
    assert result.payloads_read == sum(len(i.weight_map) for i in indexes)
    assert result.tensors_applied == len(changed)
    assert "catch up v000000 -> v000010: 10 delta(s)" in result.plan
    assert any("bytes to move" in r.getMessage() for r in caplog.records)


def test_catch_up_across_a_change_of_encoding(tmp_path: Path):
    """XOR deltas then overwrite deltas (a resumed stream): folds, then applies in order."""
    base = many_tensors(50, seed=31, elements=512)
    write_checkpoint(tmp_path / "base", base)
    first = publish_versions(tmp_path / "store", tmp_path / "base", base, 4, seed=32)
    # A restarted trainer resumes the stream (rebuilding v4 from the base and the chain).
    publisher = DeltaPublisher(
        str(tmp_path / "store"), str(tmp_path / "base"), encoding="overwrite", resume=True
    )
    publisher.seed()
    assert publisher.next_version == 5
    rng = np.random.default_rng(33)
    current = first.states[4]
    for _ in range(4):
        current = evolve(current, rng, 0.5, 0.05)
        publisher.publish(current.items())

    result = pull_weights(tmp_path / "host", tmp_path / "store", 8, tmp_path / "base")

    assert result.versions_applied == list(range(1, 9))
    assert local_bytes(tmp_path / "host") == state_bytes(current)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_failed_catch_up_puts_every_tensor_back(
    encoding: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    base = many_tensors(60, seed=41, elements=512)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(
        tmp_path / "store", tmp_path / "base", base, 8, encoding=encoding, seed=42, fraction=0.6
    )
    host = tmp_path / "host"
    pull_weights(host, published.store_dir, 2, published.base_dir)
    # Corrupt v5's payload of a tensor applied late, so earlier tensors are already written.
    store = VersionStore(str(published.store_dir))
    index = store.index(5)
    victim = max(index.weight_map)
    shard = Path(store_objects(store).file_path(5, index.weight_map[victim]))
    entry = store.read_shard_header(5, index.weight_map[victim]).tensors[victim]
    data = bytearray(shard.read_bytes())
    for at in range(entry.start + 8, entry.end):
        data[at] ^= 0x5A
    shard.write_bytes(bytes(data))

    with (
        caplog.at_level(logging.WARNING, logger="deltastore.pull"),
        pytest.raises(DeltastoreError, match=victim.replace(".", r"\.")),
    ):
        pull_weights(host, published.store_dir, 8, published.base_dir, workers=1)

    assert any("put back" in r.getMessage() for r in caplog.records)
    checkpoint = LocalCheckpoint(host)
    state = checkpoint.read_state()
    assert state is not None and state.version == 2
    assert checkpoint.read_pending() is None
    assert local_bytes(host) == state_bytes(published.states[2])


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_a_failure_in_one_task_puts_back_the_tensors_of_every_window_and_task(
    encoding: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Windows of a few payloads and tasks of a few tensors, on 4 threads: the tensors written
    # before the failure, by its own task, other tasks and other windows, are put back.
    import deltastore.pull.apply as apply_module

    plan_windows = apply_module.plan_windows

    def three_windows(tensors: list) -> list:
        wire = sum(p.size for tensor in tensors for p in tensor.payloads)
        return plan_windows(tensors, window_bytes=wire // 3 + 1)

    monkeypatch.setattr(apply_module, "plan_windows", three_windows)
    monkeypatch.setattr(
        apply_module,
        "tasks_of",
        lambda sizes: [range(i, min(i + 3, len(sizes))) for i in range(0, len(sizes), 3)],
    )
    base = many_tensors(60, seed=43, elements=512)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(
        tmp_path / "store", tmp_path / "base", base, 3, encoding=encoding, seed=44, fraction=0.9
    )
    host = tmp_path / "host"
    pull_weights(host, published.store_dir, 1, published.base_dir)
    store = VersionStore(str(published.store_dir))
    index = store.index(3)
    # The victim is applied in its task after another tensor of that task (written by then).
    windows = three_windows(list(collect_history(store, [store.index(2), index]).values()))
    victim = next(
        tensor.name
        for tensor in windows[1].tensors[1::3]
        if tensor.payloads[-1].version == 3 and tensor.name in index.weight_map
    )
    shard = Path(store_objects(store).file_path(3, index.weight_map[victim]))
    entry = store.read_shard_header(3, index.weight_map[victim]).tensors[victim]
    data = bytearray(shard.read_bytes())
    for at in range(entry.start + 8, entry.end):
        data[at] ^= 0x5A
    shard.write_bytes(bytes(data))

    with pytest.raises(DeltastoreError, match=victim.replace(".", r"\.")):
        pull_weights(host, published.store_dir, 3, published.base_dir, workers=4)

    assert LocalCheckpoint(host).read_state().version == 1
    assert local_bytes(host) == state_bytes(published.states[1])


def test_reseeds_from_full_version_when_off_the_chain(tmp_path: Path):
    """v6 is full: a host at v3 cannot catch up through it and reseeds from it."""
    base = many_tensors(40, seed=51, elements=512)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(
        tmp_path / "store", tmp_path / "base", base, 9, seed=52, full_at=[6]
    )
    host = tmp_path / "host"
    pull_weights(host, published.store_dir, 3, published.base_dir)

    result = pull_weights(host, published.store_dir, 9, published.base_dir)

    assert result.action == "reseeded"
    assert result.versions_applied == [6, 7, 8, 9]
    assert "reseed from full version v000006" in result.plan
    assert local_bytes(host) == state_bytes(published.states[9])
    # The engine loads the local dir as an ordinary HF checkpoint.
    assert set(scan_checkpoint(str(host))) == set(base)


@pytest.mark.parametrize(
    ("failure", "raised"),
    [(OSError(5, "Input/output error"), PutBackError), (KeyboardInterrupt(), KeyboardInterrupt)],
    ids=["io-error", "ctrl-c"],
)
def test_a_flush_that_fails_after_the_apply_names_no_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException, raised: type
) -> None:
    """Every tensor is written when the flush fails, so the state must not name the old
    version (nor the new one): the pending record stays and the next pull repairs. A Ctrl-C
    there stays a KeyboardInterrupt (the command says "interrupted", not a flush error)."""
    base = many_tensors(12, seed=51, elements=1024)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", tmp_path / "base", base, 3, seed=52)
    host = tmp_path / "host"
    pull_weights(host, published.store_dir, 1, published.base_dir)

    def failing_flush(self: MappedFiles) -> None:
        raise failure

    with monkeypatch.context() as patch:
        patch.setattr(MappedFiles, "flush", failing_flush)
        with pytest.raises(raised) as caught:
            pull_weights(host, published.store_dir, 3, published.base_dir)
    assert raised is KeyboardInterrupt or "could not be flushed" in str(caught.value)
    checkpoint = LocalCheckpoint(host)
    assert checkpoint.read_pending() is not None
    pull_weights(host, published.store_dir, 3, published.base_dir)
    assert checkpoint.read_state().version == 3
    assert local_bytes(host) == state_bytes(published.states[3])

"""Mirror hooks across two datacenters that share only a bucket.

The trainer writes versions to its own local directory and mirrors each one with a commit
hook; an engine host in the other datacenter mirrors the target's chain into its own local
directory with a refresh hook, then pulls from that directory. Servers: moto (S3) and
fake-gcs-server (GCS) on 127.0.0.1.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import deltastore as ds
from deltastore.errors import HookError
from deltastore.format.names import INDEX_NAME, delta_shard_name
from deltastore.hooks import load, mirror_from_store, mirror_to_store, s3_commit, s3_refresh
from deltastore.hooks.context import publishing_rank
from deltastore.storage import VersionStore
from deltastore.testing.faults import FaultProxy
from deltastore.testing.store_tests import write_version
from tests.storage.models import assert_model, model_at, write_base


def point_hooks_at(monkeypatch: pytest.MonkeyPatch, url: str, options: dict[str, Any]) -> None:
    """What an operator sets on both sides: the remote URL and (optionally) its options."""
    monkeypatch.setenv("DELTASTORE_REMOTE_URL", url)
    monkeypatch.setenv("DELTASTORE_STORAGE_OPTIONS", json.dumps(options))


def publish(trainer_dir: Path, base: Path, hook_path: str, kinds: dict[int, str]) -> None:
    publisher = ds.DeltaPublisher(
        VersionStore(trainer_dir),
        base,
        post_write=load(hook_path, kind="post_write"),
        args=SimpleNamespace(rank=0),
    )
    publisher.seed()
    for step, kind in kinds.items():
        assert publisher.publish(model_at(step).items(), full=kind == "full").version == step


@pytest.mark.parametrize(
    ("backend", "commit_hook", "refresh_hook"),
    [
        ("s3", "deltastore.hooks.s3_commit", "deltastore.hooks.s3_refresh"),
        ("gcs", "deltastore.hooks.gcs_commit", "deltastore.hooks.gcs_refresh"),
        ("s3", "hooks.nfs_then_s3.commit", "hooks.nfs_then_s3.refresh"),
    ],
)
def test_two_datacenters_share_only_a_bucket(
    backend: str,
    commit_hook: str,
    refresh_hook: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    server = request.getfixturevalue(f"{backend}_server")
    url = request.getfixturevalue(f"{backend}_url")
    point_hooks_at(monkeypatch, url, server.storage_options)
    base = write_base(tmp_path / "base")
    trainer_dir = tmp_path / "dc1" / "deltas"
    engine_dir, host = tmp_path / "dc2" / "deltas", tmp_path / "dc2" / "host"

    publish(trainer_dir, base, commit_hook, {1: "delta", 2: "delta", 3: "full", 4: "delta"})
    remote = VersionStore(url, server.storage_options)
    assert remote.versions() == [1, 2, 3, 4]
    for version in (1, 3):
        local_index = (trainer_dir / f"weight_v{version:06d}" / INDEX_NAME).read_bytes()
        assert remote.index(version) == ds.VersionIndex.from_json(local_index, version=version)
    shutil.rmtree(trainer_dir)  # the engine side can reach nothing of the trainer's but the bucket

    pre_read = load(refresh_hook, kind="pre_read")
    assert ds.pull_weights(host, engine_dir, 2, base, pre_read=pre_read).version == 2
    assert_model(host, 2)
    assert VersionStore(engine_dir).versions() == [1, 2]
    # v4 builds on the full v3: only that chain is mirrored, then pulled.
    assert ds.pull_weights(host, engine_dir, 4, base, pre_read=pre_read).version == 4
    assert_model(host, 4)
    assert VersionStore(engine_dir).versions() == [1, 2, 3, 4]
    assert ds.verify_local(host, engine_dir, base_dir=base) == 4


@pytest.fixture
def trainer_version(tmp_path: Path) -> tuple[Path, Path]:
    """A trainer directory holding a published weight_v000001 (no hook ran yet)."""
    base = write_base(tmp_path / "base")
    trainer_dir = tmp_path / "trainer"
    publisher = ds.DeltaPublisher(VersionStore(trainer_dir), base)
    publisher.seed()
    publisher.publish(model_at(1).items())
    return trainer_dir / "weight_v000001", base


def test_every_rank_calls_the_commit_hook_one_uploads(
    trainer_version: tuple[Path, Path],
    s3_server: Any,
    s3_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    version_dir, _ = trainer_version
    shard = delta_shard_name(0, 1)
    with FaultProxy(s3_server.endpoint_url) as proxy:
        point_hooks_at(monkeypatch, s3_url, proxy.storage_options(s3_server.storage_options))
        errors: list[BaseException] = []

        def rank(i: int) -> None:
            try:
                s3_commit(SimpleNamespace(rank=i), str(version_dir), None)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(i,)) for i in (2, 1, 0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        uploads = [t for m, t in proxy.seen if m == "PUT" and t.endswith(shard)]
        assert len(uploads) == 1
        # Running the hook again (a retry after a crash) is a no-op: nothing is uploaded.
        s3_commit(SimpleNamespace(rank=0), str(version_dir), None)
        assert [t for m, t in proxy.seen if m == "PUT" and t.endswith(shard)] == uploads
    token = json.loads((version_dir / INDEX_NAME).read_bytes())["metadata"]["commit_token"]
    assert VersionStore(s3_url, s3_server.storage_options).index(1).commit_token == token


def test_a_publishing_group_without_global_rank_0_still_uploads_once(
    trainer_version: tuple[Path, Path],
    s3_server: Any,
    s3_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Global ranks 1 and 2 publish as a group: the publisher tells the hook their group rank."""
    version_dir, _ = trainer_version
    shard = delta_shard_name(0, 1)
    with FaultProxy(s3_server.endpoint_url) as proxy:
        point_hooks_at(monkeypatch, s3_url, proxy.storage_options(s3_server.storage_options))
        errors: list[BaseException] = []

        def rank(global_rank: int, group_rank: int) -> None:
            try:
                with publishing_rank(group_rank):
                    s3_commit(SimpleNamespace(rank=global_rank), str(version_dir), None)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=r) for r in ((2, 1), (1, 0))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        assert len([t for m, t in proxy.seen if m == "PUT" and t.endswith(shard)]) == 1
    assert VersionStore(s3_url, s3_server.storage_options).versions() == [1]


def test_a_second_trainer_cannot_overwrite_a_mirrored_version(
    trainer_version: tuple[Path, Path],
    tmp_path: Path,
    s3_server: Any,
    s3_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    version_dir, base = trainer_version
    point_hooks_at(monkeypatch, s3_url, s3_server.storage_options)
    s3_commit(None, str(version_dir), None)
    other = ds.DeltaPublisher(VersionStore(tmp_path / "other"), base)
    other.seed()
    other.publish(model_at(2).items())
    with pytest.raises(HookError, match="another writer"):
        s3_commit(None, str(tmp_path / "other" / "weight_v000001"), None)


def test_refresh_never_looks_at_files_of_an_uncommitted_version(
    tmp_path: Path, s3_server: Any, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = VersionStore(s3_url, s3_server.storage_options)
    write_version(trainer, 1)
    write_version(trainer, 2, base=1, commit=False)  # the trainer is mid-upload
    engine_dir = tmp_path / "engine"
    with FaultProxy(s3_server.endpoint_url) as proxy:
        point_hooks_at(monkeypatch, s3_url, proxy.storage_options(s3_server.storage_options))
        with pytest.raises(HookError, match="weight_v000002 is not committed"):
            s3_refresh(str(engine_dir), 2)
        assert not [t for _, t in proxy.seen if "weight_v000002/" in t and INDEX_NAME not in t]
        assert not (engine_dir / "weight_v000002").exists()
        s3_refresh(str(engine_dir), 1)
    assert VersionStore(engine_dir).versions() == [1]


def test_mirror_checks_sizes_and_is_idempotent(tmp_path: Path, s3_server: Any, s3_url: str) -> None:
    remote = VersionStore(s3_url, s3_server.storage_options)
    write_version(remote, 1, tensors={"w": b"x" * 1000})
    write_version(remote, 2, base=1)
    engine_dir = tmp_path / "engine"
    assert mirror_from_store(remote, str(engine_dir), 2) == [1, 2]
    assert mirror_from_store(remote, str(engine_dir), 2) == []
    assert VersionStore(engine_dir).versions() == [1, 2]
    shard = engine_dir / "weight_v000001" / "model-00001-of-00001.safetensors"
    assert shard.stat().st_size == remote.file_size(1, shard.name)


def test_commit_hook_uploads_the_directory_it_is_given(tmp_path: Path) -> None:
    """The upload reads the version directory the hook was pointed at, whatever its zero
    padding, and lands the same bytes in the remote under the canonical name."""
    trainer = VersionStore(tmp_path / "trainer")
    index = write_version(trainer, 1, tensors={"w": b"y" * 3000})
    padded = tmp_path / "elsewhere" / "weight_v0000001"
    shutil.copytree(tmp_path / "trainer" / "weight_v000001", padded)
    remote = VersionStore(f"memory://mirror-{tmp_path.name}")
    assert mirror_to_store(str(padded), remote) == 1
    assert remote.versions() == [1]
    shard = next(iter(index.shards()))
    local = (padded / shard).read_bytes()
    assert remote.read_range(1, shard, 0, remote.file_size(1, shard)) == local


def test_hook_configuration_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELTASTORE_REMOTE_URL", raising=False)
    with pytest.raises(HookError, match="DELTASTORE_REMOTE_URL"):
        s3_refresh(str(tmp_path), 1)
    monkeypatch.setenv("DELTASTORE_REMOTE_URL", "gs://bucket/run")
    with pytest.raises(HookError, match="not a s3:// URL"):
        s3_refresh(str(tmp_path), 1)
    monkeypatch.setenv("DELTASTORE_REMOTE_URL", "s3://bucket/run")
    monkeypatch.setenv("DELTASTORE_STORAGE_OPTIONS", "{not json")
    with pytest.raises(HookError, match="DELTASTORE_STORAGE_OPTIONS is not valid JSON"):
        s3_refresh(str(tmp_path), 1)
    monkeypatch.delenv("DELTASTORE_STORAGE_OPTIONS")
    with pytest.raises(HookError, match="not a weight_vNNNNNN"):
        s3_commit(None, str(tmp_path), None)


def test_audit_log_example_records_both_sides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log_path = tmp_path / "audit.jsonl"
    monkeypatch.setenv("DELTASTORE_AUDIT_LOG", str(log_path))
    base = write_base(tmp_path / "base")
    publish(tmp_path / "deltas", base, "hooks.audit_log.on_commit", {1: "delta"})
    pre_read = load("hooks.audit_log.on_refresh", kind="pre_read")
    ds.pull_weights(tmp_path / "host", tmp_path / "deltas", 1, base, pre_read=pre_read)
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [r["hook"] for r in records] == ["commit", "refresh"]
    assert records[0]["version_dir"].endswith("weight_v000001")
    assert INDEX_NAME in records[0]["files"]
    assert records[1]["target_version"] == 1


def test_refresh_refuses_a_local_version_of_another_store(
    tmp_path: Path, s3_server: Any, s3_url: str
) -> None:
    """An engine directory that mirrored weight_v000001 of one run, pointed at another run's
    bucket whose weight_v000001 differs, must not serve the old run's files as the new v1."""
    old_run = VersionStore(s3_url, s3_server.storage_options)
    write_version(old_run, 1, tensors={"w": b"old run"})
    engine_dir = tmp_path / "engine"
    assert mirror_from_store(old_run, str(engine_dir), 1) == [1]
    new_run = VersionStore(s3_url + "-new", s3_server.storage_options)
    write_version(new_run, 1, tensors={"w": b"new run"})
    write_version(new_run, 2, base=1)
    with pytest.raises(HookError, match=r"weight_v000001.*another store or stream"):
        mirror_from_store(new_run, str(engine_dir), 1)
    with pytest.raises(HookError, match=r"weight_v000001.*another store or stream"):
        mirror_from_store(new_run, str(engine_dir), 2)
    assert not (engine_dir / "weight_v000002" / INDEX_NAME).exists()
    # The same run again is fine, and so is a local version its remote has since pruned.
    assert mirror_from_store(old_run, str(engine_dir), 1) == []
    old_run.prune(keep=1, grace_s=0)
    write_version(old_run, 2, base=None)
    old_run.prune(keep=1, grace_s=0)
    assert old_run.versions() == [2]
    assert mirror_from_store(old_run, str(engine_dir), 1) == []


def test_a_missing_version_is_named_once_with_the_hook_question(tmp_path: Path) -> None:
    remote = VersionStore(str(tmp_path / "remote"))
    with pytest.raises(HookError) as caught:
        mirror_from_store(remote, str(tmp_path / "engine"), 3)
    message = str(caught.value)
    assert "weight_v000003 is not committed in" in message and "commit hook finished?" in message
    assert message.count("not committed") == 1, message  # the store's own words are the cause
    assert isinstance(caught.value.__cause__, ds.VersionNotFoundError)

"""``replicate`` between real stores: what is copied, in which order, and what a reader sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import deltastore as ds
from deltastore.errors import ConfigError, IntegrityError, StreamError
from deltastore.format.names import INDEX_NAME
from deltastore.replicate import ReplicationPolicy
from deltastore.storage import VersionStore, store_objects
from tests.replicate.helpers import assert_pulls, assert_replica, publish_run
from tests.storage.models import write_base

KINDS = {1: "delta", 2: "delta", 3: "full", 4: "delta", 5: "delta"}


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write_base(tmp_path / "base")


@pytest.fixture
def src(tmp_path: Path, base: Path) -> VersionStore:
    store = VersionStore(tmp_path / "src")
    publish_run(store, base, KINDS)
    return store


def test_local_to_local_copies_every_version_in_order(
    src: VersionStore, base: Path, tmp_path: Path
) -> None:
    dst = VersionStore(tmp_path / "dst")
    report = ds.replicate(src, dst, verify=True, policy=ReplicationPolicy(chunk_bytes=1000))
    assert report.copied == (1, 2, 3, 4, 5)
    assert [v.outcome for v in report.versions] == ["copied"] * 5
    assert report.versions[2].verified_tensors == 4  # the full version's tensors, recomputed
    assert_replica(src, dst, [1, 2, 3, 4, 5])
    assert_pulls(dst, base, tmp_path / "host", [2, 5])
    again = ds.replicate(src, dst)
    assert again.copied == () and again.latest == 5


def test_packed_shards_replicate_with_their_digests_checked(base: Path, tmp_path: Path) -> None:
    src = VersionStore(tmp_path / "packed-src")
    publish_run(src, base, KINDS, encoding="auto")
    dst = VersionStore(tmp_path / "dst")
    report = ds.replicate(src, dst, verify=True, policy=ReplicationPolicy(chunk_bytes=1000))
    assert report.copied == (1, 2, 3, 4, 5)
    assert_replica(src, dst, [1, 2, 3, 4, 5])
    assert dst.read_shard_header(1, "model-00000-of-00001.safetensors").tensors  # unpacked
    assert_pulls(dst, base, tmp_path / "host", [2, 5])


def test_from_starts_at_the_newest_full_version(src: VersionStore, tmp_path: Path) -> None:
    dst = VersionStore(tmp_path / "dst")
    report = ds.replicate(src, dst, from_version=4)
    assert report.copied == (3, 4, 5)
    assert report.skipped == (1, 2)
    assert_replica(src, dst, [3, 4, 5])


def test_from_before_any_full_version_starts_at_the_chain_on_the_base(
    src: VersionStore, tmp_path: Path
) -> None:
    dst = VersionStore(tmp_path / "dst")
    assert ds.replicate(src, dst, from_version=2).copied == (1, 2, 3, 4, 5)


def test_a_corrupt_full_version_is_refused_with_verify(src: VersionStore, tmp_path: Path) -> None:
    index = src.index(3)
    shard = sorted(index.shards())[0]
    path = Path(store_objects(src).file_path(3, shard))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    dst = VersionStore(tmp_path / "dst")
    with pytest.raises(IntegrityError, match="weight_v000003"):
        ds.replicate(src, dst, verify=True)
    dst.refresh()
    assert dst.versions() == [1, 2]  # nothing of v3 is visible, and nothing after it
    assert not Path(store_objects(dst).version_path(3)).exists()


def test_a_destination_of_another_run_is_refused(
    src: VersionStore, base: Path, tmp_path: Path
) -> None:
    other = VersionStore(tmp_path / "other")
    publish_run(other, base, {1: "delta"})
    with pytest.raises(StreamError, match="weight_v000001"):
        ds.replicate(src, other)


def test_prune_like_source_drops_only_what_the_source_dropped(
    src: VersionStore, tmp_path: Path
) -> None:
    dst = VersionStore(tmp_path / "dst")
    ds.replicate(src, dst)
    src.prune(keep=1, grace_s=0)  # keeps v5 and its chain: v3 (full), v4
    assert src.versions() == [3, 4, 5]
    report = ds.replicate(src, dst, prune_like_source=True)
    assert report.pruned == (1, 2)
    assert dst.versions() == [3, 4, 5]


def test_cli_json_prints_a_line_per_version_and_a_summary(
    src: VersionStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deltastore.cli import main

    assert main(["replicate", src.url, str(tmp_path / "dst"), "--json", "--jobs", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["version"] for line in lines[:-1]] == [1, 2, 3, 4, 5]
    assert {"bytes", "seconds", "mb_per_s", "retries"} <= set(lines[0])
    assert lines[-1]["summary"] is True and lines[-1]["copied"] == [1, 2, 3, 4, 5]
    assert (tmp_path / "dst" / "weight_v000005" / INDEX_NAME).exists()


def test_a_missing_local_source_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no store at"):
        ds.replicate(tmp_path / "typo", tmp_path / "dst")

"""The user's model path (the base, version 0) is never modified, linked or written through."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from deltastore import ConfigError, pull_weights, verify_local
from deltastore.format.state import PendingTransition
from deltastore.pull import LocalCheckpoint
from deltastore.pull.local import MappedFiles
from tests.pull.helpers import (
    changed_between,
    local_bytes,
    many_tensors,
    publish_versions,
    state_bytes,
    write_checkpoint,
    write_tensor,
)


def fingerprint(directory: Path) -> dict[str, tuple[int, int, int, str]]:
    """name → (inode, nlink, mtime_ns, sha256) of every file in ``directory``."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = directory / name
        st = path.stat()
        out[name] = (
            st.st_ino,
            st.st_nlink,
            st.st_mtime_ns,
            hashlib.sha256(path.read_bytes()).hexdigest(),
        )
    return out


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_pulls_deltas_repairs_and_resets_never_touch_the_base(encoding: str, tmp_path: Path):
    base = many_tensors(40, seed=91, elements=512)
    base_dir = write_checkpoint(tmp_path / "base", base)
    published = publish_versions(
        tmp_path / "store", base_dir, base, 6, encoding=encoding, seed=92, fraction=0.6
    )
    before = fingerprint(base_dir)
    assert all(nlink == 1 for _, nlink, _, _ in before.values())
    host = tmp_path / "host"

    pull_weights(host, published.store_dir, 0, base_dir)  # seed: a copy of the base
    pull_weights(host, published.store_dir, 3, base_dir)  # deltas applied in place
    # A crash mid 3 -> 6 with a torn tensor, repaired (restored from the base's bytes).
    name = sorted(changed_between(published, 3, 6))[0]
    write_tensor(host, name, bytes(len(state_bytes(published.states[6])[name])))
    LocalCheckpoint(host).begin(
        PendingTransition(3, 6, published.stream_id, published.stream_id, [4, 5, 6])
    )
    result = pull_weights(host, published.store_dir, 6, base_dir)
    assert result.repair is not None and result.repair.restored >= 1
    pull_weights(host, published.store_dir, 2, base_dir)  # backward: reseed from the base
    pull_weights(host, published.store_dir, 6, base_dir)
    assert local_bytes(host) == state_bytes(published.states[6])

    assert fingerprint(base_dir) == before
    base_inodes = {ino for ino, _, _, _ in before.values()}
    for name in os.listdir(host):
        path = host / name
        if path.is_file():
            assert path.stat().st_ino not in base_inodes, f"{name} shares the base's inode"
            assert path.stat().st_nlink == 1


def test_local_dir_that_is_the_base_is_refused(tmp_path: Path):
    base = many_tensors(4, seed=93, elements=64)
    base_dir = write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", base_dir, base, 1, seed=94)
    before = fingerprint(base_dir)
    with pytest.raises(ConfigError, match="base"):
        pull_weights(base_dir, published.store_dir, 1, base_dir)
    assert fingerprint(base_dir) == before


def test_local_dir_that_is_a_symlink_to_the_base_is_refused(tmp_path: Path):
    """A local path that resolves to the base (a symlink) is the base: refused, base untouched."""
    base = many_tensors(4, seed=95, elements=64)
    base_dir = write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", base_dir, base, 1, seed=96)
    before = fingerprint(base_dir)
    alias = tmp_path / "alias"
    alias.symlink_to(base_dir, target_is_directory=True)
    for local, base_arg in ((alias, base_dir), (base_dir, alias)):
        with pytest.raises(ConfigError, match="base"):
            pull_weights(local, published.store_dir, 1, base_arg)
        assert fingerprint(base_dir) == before


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_in_place_writes_never_reach_another_link_of_a_local_file(encoding: str, tmp_path: Path):
    """Local files that share an inode with another path (a dir cloned with ``cp -al``, or
    hard links to the base) are unlinked from it before the first in-place write: the other
    path keeps its bytes, and its own state stays true."""
    base = many_tensors(12, seed=97, elements=256)
    base_dir = write_checkpoint(tmp_path / "base", base)
    published = publish_versions(
        tmp_path / "store", base_dir, base, 3, encoding=encoding, seed=98, fraction=1.0
    )
    before = fingerprint(base_dir)
    host = tmp_path / "host"
    pull_weights(host, published.store_dir, 1, base_dir)
    clone = tmp_path / "clone"  # `cp -al host clone`
    (clone / ".weight_sync").mkdir(parents=True)
    for name in os.listdir(host):
        if (host / name).is_file():
            os.link(host / name, clone / name)
    shutil.copy(host / ".weight_sync" / "state.json", clone / ".weight_sync" / "state.json")
    linked = tmp_path / "linked"  # weights hard-linked to the base, with a state saying v0
    (linked / ".weight_sync").mkdir(parents=True)
    for name in os.listdir(base_dir):
        os.link(base_dir / name, linked / name)
    (linked / ".weight_sync" / "state.json").write_text('{"version": "000000"}')

    assert pull_weights(clone, published.store_dir, 3, base_dir).action == "applied"
    assert pull_weights(linked, published.store_dir, 2, base_dir).action == "applied"

    assert local_bytes(clone) == state_bytes(published.states[3])
    assert local_bytes(linked) == state_bytes(published.states[2])
    assert local_bytes(host) == state_bytes(published.states[1])
    assert verify_local(host, published.store_dir, None, base_dir) == 1
    assert {n: v[3] for n, v in fingerprint(base_dir).items()} == {
        n: v[3] for n, v in before.items()
    }


def test_a_file_that_cannot_be_mapped_leaves_no_descriptor_open(tmp_path: Path):
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    before = len(os.listdir("/proc/self/fd"))
    with MappedFiles() as files, pytest.raises(ValueError):
        files.array(str(empty))  # (an empty file cannot be mapped)
    assert len(os.listdir("/proc/self/fd")) == before

"""No path to wrong weights on the pull side: links, a local dir in the store, bad full
versions, and bytes changed behind a correct state. Each case once led to a host serving
bytes other than the version it claims (or to another host's or the store's bytes changing).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import deltastore as ds
from deltastore.errors import ConfigError, IntegrityError, NameMismatchError, VersionNotFoundError
from tests.conftest import checkpoint_bytes, make_checkpoint, perturb, raw_bytes
from tests.pull.helpers import write_tensor

Model = dict[str, torch.Tensor]
Bytes = dict[str, bytes]


def _publish(store: ds.VersionStore, base_dir: Path, model: Model, plan: str) -> dict[int, Bytes]:
    """One version per letter of ``plan`` (d = delta, f = full); bytes at every version."""
    publisher = ds.DeltaPublisher(store, base_dir)
    publisher.seed()
    states = {0: {n: raw_bytes(t) for n, t in model.items()}}
    for version, kind in enumerate(plan, start=1):
        model = perturb(model, version)
        publisher.publish(model.items(), full=kind == "f")
        states[version] = {n: raw_bytes(t) for n, t in model.items()}
    return states


def _state(host: Path) -> dict:
    return json.loads((host / ".weight_sync" / "state.json").read_text())


def _store_files(store: ds.VersionStore) -> dict[str, bytes]:
    root = Path(store.root)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------- links
def test_a_symlink_clone_of_another_host_is_not_patched_through(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish(store, base_dir, small_model, "dd")
    host_a, host_b = tmp_path / "hostA", tmp_path / "hostB"
    ds.pull_weights(host_a, store, 1, base_dir=base_dir)
    subprocess.run(["cp", "-as", str(host_a), str(host_b)], check=True)
    assert any(p.is_symlink() for p in host_b.glob("*.safetensors"))

    result = ds.pull_weights(host_b, store, 2, base_dir=base_dir)
    assert result.version == 2
    # hostA still holds exactly what its state says.
    assert checkpoint_bytes(host_a) == states[1]
    assert _state(host_a)["version"] == "000001"
    assert ds.verify_local(host_a, store, base_dir=base_dir) == 1
    assert checkpoint_bytes(host_b) == states[2]
    assert not any(p.is_symlink() for p in host_b.glob("*.safetensors"))


def test_shard_files_linked_into_the_base_leave_the_base_untouched(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish(store, base_dir, small_model, "d")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 0, base_dir=base_dir)
    for shard in host.glob("*.safetensors"):
        shard.unlink()
        shard.symlink_to(base_dir / shard.name)

    ds.pull_weights(host, store, 1, base_dir=base_dir)
    assert checkpoint_bytes(host) == states[1]
    assert checkpoint_bytes(base_dir) == states[0]


# --------------------------------------------------------------------- dir in the store
def test_a_local_dir_inside_the_store_is_refused(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    _publish(store, base_dir, small_model, "dd")
    published = _store_files(store)
    inside = Path(store.root) / "weight_v000002"
    with pytest.raises(ConfigError, match="overlaps the store") as info:
        ds.pull_weights(inside, store, 1, base_dir=base_dir)
    assert str(inside) in str(info.value) and store.url in str(info.value)
    with pytest.raises(ConfigError, match="overlaps the store"):
        ds.pull_weights(store.root, store.url, 1, base_dir=base_dir)
    assert _store_files(store) == published


def test_a_local_dir_that_contains_the_store_is_refused(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    host = tmp_path / "host"
    store = ds.VersionStore(host / "store")
    _publish(store, base_dir, small_model, "d")
    link = tmp_path / "host-link"
    link.symlink_to(host)
    with pytest.raises(ConfigError, match="overlaps the store"):
        ds.pull_weights(link, store, 1, base_dir=base_dir)


# ------------------------------------------------------------------------- full versions
def _flip_data_byte(store: ds.VersionStore, version: int) -> None:
    index = store.index(version)
    name = sorted(n for n, t in index.weight_map.items())[0]
    shard = index.weight_map[name]
    entry = store.read_shard_header(version, shard).tensors[name]
    path = Path(store.root) / f"weight_v{version:06d}" / shard
    raw = bytearray(path.read_bytes())
    raw[entry.start] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_corrupt_full_version_leaves_the_host_at_its_verified_version(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish(store, base_dir, small_model, "ddf")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 2, base_dir=base_dir)
    _flip_data_byte(store, 3)

    with pytest.raises(IntegrityError, match="weight_v000003"):
        ds.pull_weights(host, store, 3, base_dir=base_dir)
    assert checkpoint_bytes(host) == states[2]
    assert _state(host)["version"] == "000002"
    assert ds.verify_local(host, store, base_dir=base_dir) == 2
    assert not (host / ".weight_sync" / "staging").exists()
    # The next good pull is cheap again (no verification needed) and still catches up.
    assert ds.pull_weights(host, store, 2, base_dir=base_dir).action == "noop"


def _drop_tensor_from_full(store: ds.VersionStore, version: int) -> str:
    """Rewrite a full version without one tensor (as an incomplete upload would leave it)."""
    vdir = Path(store.root) / f"weight_v{version:06d}"
    index_path = vdir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = sorted(index["weight_map"])[-1]
    shard = vdir / index["weight_map"].pop(victim)
    with safe_open(str(shard), framework="pt") as fh:
        metadata = dict(fh.metadata() or {})
        tensors = {n: fh.get_tensor(n) for n in fh.keys() if n != victim}  # noqa: SIM118
    metadata.pop(victim, None)
    save_file(tensors, str(shard), metadata=metadata)
    index_path.write_text(json.dumps(index))
    store.refresh()
    return victim


def test_an_incomplete_full_version_is_refused_before_touching_anything(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish(store, base_dir, small_model, "ddf")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 2, base_dir=base_dir)
    victim = _drop_tensor_from_full(store, 3)
    store = ds.VersionStore(store.root)

    with pytest.raises(NameMismatchError, match=victim.replace(".", r"\.")):
        ds.pull_weights(host, store, 3, base_dir=base_dir)
    assert checkpoint_bytes(host) == states[2]
    assert _state(host)["version"] == "000002"


# --------------------------------------------------------- bytes changed behind the state
def _garble(host: Path, name: str, *, keep_mtime: bool = False) -> None:
    size = len(checkpoint_bytes(host)[name])
    time.sleep(0.05)  # past the filesystem's mtime granularity
    write_tensor(host, name, bytes([0xA5]) * size, keep_mtime=keep_mtime)


def test_bytes_changed_behind_a_correct_state_are_noticed_and_repaired(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish(store, base_dir, small_model, "dd")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 2, base_dir=base_dir)
    name = "model.layers.0.mlp.up_proj.weight"
    _garble(host, name)

    result = ds.pull_weights(host, store, 2, base_dir=base_dir)
    assert checkpoint_bytes(host) == states[2]
    assert result.action == "reseeded"
    assert _state(host)["files"], "the state records the weight files' fingerprints"
    assert ds.pull_weights(host, store, 2, base_dir=base_dir).action == "noop"


def test_a_state_without_fingerprints_is_verified_before_it_is_trusted(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    """A state written by another tool (the reference's plain ``{"version": ...}``)."""
    store = ds.VersionStore(tmp_path / "store")
    states = _publish(store, base_dir, small_model, "dd")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    _garble(host, "model.embed_tokens.weight", keep_mtime=True)
    state_path = host / ".weight_sync" / "state.json"
    body = _state(host)
    body.pop("files", None)
    state_path.write_text(json.dumps(body))

    result = ds.pull_weights(host, store, 2, base_dir=base_dir)
    assert result.action == "reseeded"
    assert checkpoint_bytes(host) == states[2]


def test_a_change_the_fingerprints_cannot_see_is_still_caught_by_verify_local(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    """The stated bound: same size, same mtime -> the cheap check misses it; verify finds it."""
    store = ds.VersionStore(tmp_path / "store")
    _publish(store, base_dir, small_model, "d")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    _garble(host, "model.embed_tokens.weight", keep_mtime=True)
    assert ds.pull_weights(host, store, 1, base_dir=base_dir).action == "noop"
    with pytest.raises(IntegrityError, match="embed_tokens"):
        ds.verify_local(host, store, base_dir=base_dir)


def test_pull_accepts_latest(tmp_path: Path, base_dir: Path, small_model: Model):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish(store, base_dir, small_model, "dd")
    result = ds.pull_weights(tmp_path / "host", store, "latest", base_dir=base_dir)
    assert result.version == 2 and checkpoint_bytes(tmp_path / "host") == states[2]
    with pytest.raises(ConfigError, match="no store at"):
        ds.pull_weights(tmp_path / "h2", tmp_path / "nowhere", "latest", base_dir=base_dir)
    with pytest.raises(ConfigError, match="neither a version number nor 'latest'"):
        ds.pull_weights(tmp_path / "h2", store, "newest", base_dir=base_dir)  # type: ignore[arg-type]


def test_a_mistyped_object_store_prefix_is_no_store_for_pull_and_verify(
    tmp_path: Path, base_dir: Path, s3_server, s3_url: str
):
    """An S3 prefix where nothing was published: the same message as a mistyped path, not
    "v000003 is not published, the latest is v000000" nor "missing or pruned"."""
    store = ds.VersionStore(s3_url + "-typo", s3_server.storage_options)
    for target in (3, "latest"):
        with pytest.raises(ConfigError, match=r"no store at s3://.*nothing was ever published"):
            ds.pull_weights(tmp_path / "host", store, target, base_dir=base_dir)
    with pytest.raises(ConfigError, match=r"no store at s3://.*nothing was ever published"):
        ds.verify_local(tmp_path / "host", store, 3, base_dir=base_dir)
    assert not (tmp_path / "host").exists(), "no host dir, lock or state for a pull that cannot run"


def test_verify_and_pull_give_a_wrong_base_the_same_diagnosis(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    """A --base that is another model (a tensor renamed): both name the base, not the host."""
    store = ds.VersionStore(tmp_path / "store")
    _publish(store, base_dir, small_model, "dd")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 2, base_dir=base_dir)
    other = dict(small_model)
    other["model.renamed"] = other.pop("model.norm.eps")
    wrong = make_checkpoint(tmp_path / "wrong-base", other)
    said = []
    for call in (
        lambda: ds.verify_local(host, store, 2, base_dir=wrong),
        lambda: ds.pull_weights(tmp_path / "fresh", store, 2, base_dir=wrong),
    ):
        with pytest.raises(NameMismatchError, match="the model the trainer was seeded from") as e:
            call()
        said.append(str(e.value))
    assert said[0] == said[1] and f"base {wrong}" in said[0]
    assert "lacks ['model.norm.eps']" in said[0] and "has ['model.renamed']" in said[0]
    assert ds.verify_local(host, store, 2, base_dir=base_dir) == 2


def test_the_callers_store_is_not_modified(tmp_path: Path, base_dir: Path, small_model: Model):
    store = ds.VersionStore(tmp_path / "store")
    _publish(store, base_dir, small_model, "d")
    seen: list[tuple[str, int]] = []
    ds.pull_weights(
        tmp_path / "host", store, 1, base_dir=base_dir, pre_read=lambda u, v: seen.append((u, v))
    )
    assert seen == [(store.url, 1)]
    assert store.pre_read is None


def test_stray_staging_from_a_killed_reseed_is_cleared(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish(store, base_dir, small_model, "f")
    host = tmp_path / "host"
    staging = host / ".weight_sync" / "staging"
    staging.mkdir(parents=True)
    (staging / "junk.safetensors").write_bytes(b"junk")
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    assert checkpoint_bytes(host) == states[1]
    assert not staging.exists()
    shutil.rmtree(host)
    os.makedirs(host)


def test_a_version_not_published_creates_nothing_on_a_fresh_host(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    """A fresh host's pull of a version the store does not have fails before the host dir,
    its lock or its state exist (as a mistyped store does)."""
    store = ds.VersionStore(tmp_path / "store")
    _publish(store, base_dir, small_model, "dd")
    host = tmp_path / "host"
    with pytest.raises(VersionNotFoundError, match=r"weight_v000009 is not published.*v000002"):
        ds.pull_weights(host, store, 9, base_dir=base_dir)
    assert not host.exists()
    assert ds.pull_weights(host, store, 2, base_dir=base_dir).version == 2

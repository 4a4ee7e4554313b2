"""publish → pull end to end on a local store, and every refusal of the engine side.

Chains mix deltas, an empty delta and a full version; two hosts follow them differently (step
by step, and by jumps including backward targets and version 0). After every pull the bytes
are compared with what was published and ``verify_local`` judges them by digest. Failures
(out-of-order, a broken chain, a name mismatch, a corrupted or truncated shard) must name the
version and tensor, and leave the checkpoint verifiably at the version it held before.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import zstandard

import deltastore as ds
from deltastore.errors import (
    DeltastoreError,
    FormatError,
    NameMismatchError,
    OutOfOrderError,
    VersionNotFoundError,
)
from deltastore.format.safetensors_io import TensorLayout, read_header_file, write_safetensors
from deltastore.pull.chain import check_contiguous
from tests.conftest import checkpoint_bytes, make_checkpoint, perturb, raw_bytes

Model = dict[str, torch.Tensor]
Bytes = dict[str, bytes]


def _bytes(model: Model) -> Bytes:
    return {n: raw_bytes(t) for n, t in model.items()}


def _state(host: Path) -> dict:
    return json.loads((host / ".weight_sync" / "state.json").read_text())


def _publish_chain(
    store: ds.VersionStore, base_dir: Path, model: Model, plan: str, **kwargs
) -> dict[int, Bytes]:
    """Publish one version per letter of ``plan`` (d = delta, e = empty, f = full).

    Returns the expected bytes at every version, 0 included.
    """
    publisher = ds.DeltaPublisher(store, base_dir, **kwargs)
    publisher.seed()
    states = {0: _bytes(model)}
    for version, kind in enumerate(plan, start=1):
        if kind != "e":
            model = perturb(model, version)
        result = publisher.publish(model.items(), full=kind == "f")
        assert (result.version, result.kind) == (version, "full" if kind == "f" else "delta")
        states[version] = _bytes(model)
    return states


def _check(host: Path, store: ds.VersionStore, base_dir: Path, states: dict[int, Bytes], v: int):
    assert checkpoint_bytes(host) == states[v], f"{host.name} bytes at v{v}"
    assert ds.verify_local(host, store, base_dir=base_dir) == v
    assert _state(host)["version"] == f"{v:06d}"


# ---------------------------------------------------------------- end to end
@pytest.mark.parametrize(
    "encoding, checksum", [("xor", "xxh3-128"), ("overwrite", "blake3"), ("xor", "adler32")]
)
def test_publish_pull_chain_on_two_hosts(
    tmp_path: Path, base_dir: Path, small_model: Model, encoding: str, checksum: str
):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish_chain(
        store, base_dir, small_model, "dedfdd", encoding=encoding, checksum=checksum
    )
    assert states[2] == states[1]
    assert store.versions() == [1, 2, 3, 4, 5, 6]

    stepper = tmp_path / "host-a"
    for version in range(7):
        result = ds.pull_weights(stepper, store, version, base_dir=base_dir)
        assert result.version == version
        _check(stepper, store, base_dir, states, version)
    again = ds.pull_weights(stepper, store, 6, base_dir=base_dir)
    assert again.action == "noop" and again.version == 6

    jumper = tmp_path / "host-b"
    for version in (3, 6, 2, 0, 5, 1, 6):
        ds.pull_weights(jumper, store.url, version, base_dir=base_dir)
        _check(jumper, store, base_dir, states, version)
    # The base itself is never modified by any of this.
    assert checkpoint_bytes(base_dir) == states[0]


def test_pull_version_zero_resets_to_the_base(tmp_path: Path, base_dir: Path, small_model: Model):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish_chain(store, base_dir, small_model, "dd")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 2, base_dir=base_dir)
    # Even a locally damaged checkpoint is reset to exactly the base.
    victim = next(host.glob("*.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    ds.pull_weights(host, store, 0, base_dir=base_dir)
    _check(host, store, base_dir, states, 0)


# ------------------------------------------------------------------ refusals
def test_out_of_order_apply_is_refused_naming_both_versions(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish_chain(store, base_dir, small_model, "ddd")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    with pytest.raises(OutOfOrderError) as info:
        check_contiguous([store.index(3)], 1)  # (what the apply checks first)
    message = str(info.value)
    assert "v000001" in message and "weight_v000003" in message and "v000002" in message
    assert checkpoint_bytes(host) == states[1]
    assert ds.verify_local(host, store, base_dir=base_dir) == 1


def test_a_chain_with_a_missing_version_is_refused(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish_chain(store, base_dir, small_model, "ddd")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    shutil.rmtree(tmp_path / "store" / "weight_v000002")  # pruned, say
    for local in (host, tmp_path / "fresh"):
        with pytest.raises(VersionNotFoundError, match="weight_v000002"):
            ds.pull_weights(local, store, 3, base_dir=base_dir)
    assert checkpoint_bytes(host) == states[1]
    assert _state(host)["version"] == "000001"
    with pytest.raises(VersionNotFoundError, match="weight_v000007"):
        ds.pull_weights(host, store, 7, base_dir=base_dir)


def test_a_delta_naming_an_unknown_tensor_is_a_name_mismatch(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir)
    publisher.seed()
    new = dict(small_model)
    new["model.norm.eps"] = torch.tensor(2.0)
    publisher.publish(new.items())
    other = {n: t for n, t in small_model.items() if n != "model.norm.eps"}
    other_base = make_checkpoint(tmp_path / "other-base", other)
    host = tmp_path / "host"
    ds.pull_weights(host, store, 0, base_dir=other_base)
    with pytest.raises(NameMismatchError, match=r"model\.norm\.eps"):
        ds.pull_weights(host, store, 1, base_dir=other_base)
    assert checkpoint_bytes(host) == _bytes(other)
    assert _state(host)["version"] == "000000"


def test_versions_ignore_a_directory_without_index(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    _publish_chain(store, base_dir, small_model, "dd")
    orphan = tmp_path / "store" / "weight_v000003"
    orphan.mkdir()
    shutil.copy(next((tmp_path / "store" / "weight_v000002").glob("*.safetensors")), orphan)
    make_checkpoint(tmp_path / "store" / "weight_v000004", small_model)  # a plain HF dir, no index
    store.refresh()
    assert store.versions() == [1, 2] and store.latest() == 2
    with pytest.raises(VersionNotFoundError, match="weight_v000003"):
        ds.pull_weights(tmp_path / "host", store, 3, base_dir=base_dir)


# ------------------------------------------------------------ corrupted shards
def _shard_of(store_dir: Path, version: int) -> Path:
    (shard,) = (store_dir / f"weight_v{version:06d}").glob("*.safetensors")
    return shard


@pytest.mark.parametrize(
    "encoding, which",
    [
        ("xor", "first"),
        ("xor", "last"),
        ("overwrite", "first"),
        ("overwrite", "last"),
    ],
)
def test_a_flipped_byte_fails_loud_and_the_host_stays_at_its_version(
    tmp_path: Path, base_dir: Path, small_model: Model, encoding: str, which: str
):
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, encoding=encoding)
    publisher.seed()
    v1 = perturb(small_model, 1)
    publisher.publish(v1.items())
    v2 = dict(v1)
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.eps",
    ):
        v2[name] = v1[name] + 1  # three tensors change, each densely
    publisher.publish(v2.items())
    states = {1: _bytes(v1)}

    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    shard = _shard_of(tmp_path / "store", 2)
    entries = sorted(read_header_file(str(shard)).tensors.values(), key=lambda e: e.start)
    target = entries[0] if which == "first" else entries[-1]
    data = bytearray(shard.read_bytes())
    data[(target.start + target.end) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    with pytest.raises(DeltastoreError) as info:
        ds.pull_weights(host, store, 2, base_dir=base_dir, workers=1)
    message = str(info.value)
    assert target.name in message
    if encoding == "xor":  # overwrite: see test_a_refused_overwrite_payload_names_the_version
        assert "weight_v000002" in message
    assert _state(host)["version"] == "000001"
    assert ds.verify_local(host, store, version=1, base_dir=base_dir) == 1
    assert ds.verify_local(host, store, base_dir=base_dir) == 1
    assert checkpoint_bytes(host) == states[1]
    with pytest.raises(DeltastoreError):
        ds.verify_local(host, store, version=2, base_dir=base_dir)


def test_a_truncated_shard_fails_loud_and_the_host_stays_at_its_version(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    states = _publish_chain(store, base_dir, small_model, "dd")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    shard = _shard_of(tmp_path / "store", 2)
    shard.write_bytes(shard.read_bytes()[:-5])
    with pytest.raises(DeltastoreError, match="weight_v000002") as info:
        ds.pull_weights(host, store, 2, base_dir=base_dir)
    assert "truncated" in str(info.value)
    assert _state(host)["version"] == "000001"
    assert ds.verify_local(host, store, version=1, base_dir=base_dir) == 1
    assert checkpoint_bytes(host) == states[1]


def test_a_refused_overwrite_payload_names_the_version(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    """A well-formed frame whose overwrite payload points outside the tensor (a hostile or
    mismatched delta) is refused with the version and tensor named."""
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, encoding="overwrite")
    publisher.seed()
    new = dict(small_model)
    new["model.norm.eps"] = torch.tensor(2.0)
    publisher.publish(new.items())
    shard = _shard_of(tmp_path / "store", 1)
    header = read_header_file(str(shard))
    entry = header.tensors["model.norm.eps"]
    hostile = zstandard.ZstdCompressor(level=1).compress(struct.pack("<II", 1, 4) + b"\x07")
    layout = [(TensorLayout("model.norm.eps", "U8", (len(hostile),)), hostile)]
    with open(shard, "wb") as fh:
        write_safetensors(fh, layout, header.metadata)
    assert entry.nbytes > 0
    host = tmp_path / "host"
    ds.pull_weights(host, store, 0, base_dir=base_dir)
    with pytest.raises(FormatError) as info:
        ds.pull_weights(host, store, 1, base_dir=base_dir)
    message = str(info.value)
    assert "model.norm.eps" in message
    assert ds.verify_local(host, store, version=0, base_dir=base_dir) == 0
    assert "weight_v000001" in message
    assert "corrupt or was made for another checkpoint" in message


def test_verify_refuses_a_negative_version(tmp_path: Path, base_dir: Path, small_model: Model):
    """Version -1 is no version: verifying against it must not pass as "matches the base"."""
    store = ds.VersionStore(tmp_path / "store")
    _publish_chain(store, base_dir, small_model, "d")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 0, base_dir=base_dir)
    with pytest.raises(ds.ConfigError, match="negative"):
        ds.verify_local(host, store, -1, base_dir=base_dir)

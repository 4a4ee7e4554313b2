"""Signed versions end to end: the real publisher signs, the real pull verifies, on a local
store and on S3 (moto). Every refusal leaves the host's checkpoint byte-identical (every file
hashed before and after) at its verified previous version."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from deltastore import DeltaPublisher, VersionStore, pull_weights
from deltastore.errors import IntegrityError, SignatureError
from deltastore.format import INDEX_NAME
from deltastore.pull import verify_local
from deltastore.storage import store_objects
from deltastore.testing.servers import S3Server
from deltastore.trust import SIGNATURE_KEY, KeyPairFiles, generate_keypair
from deltastore.trust.manifest import BASE_DIGESTS_KEY
from tests.conftest import checkpoint_bytes, make_checkpoint, perturb, raw_bytes, small_tensors
from tests.format import reference_reader


@dataclasses.dataclass
class Keys:
    k1: KeyPairFiles
    k2: KeyPairFiles


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    (tmp_path / "keys").mkdir()
    return Keys(
        generate_keypair(tmp_path / "keys" / "k1"), generate_keypair(tmp_path / "keys" / "k2")
    )


@pytest.fixture(params=["local", "s3"])
def store_at(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    """A fresh store URL and its storage options, on each backend."""
    if request.param == "local":
        return str(tmp_path / "store"), None
    server: S3Server = request.getfixturevalue("s3_server")
    return request.getfixturevalue("s3_url"), server.storage_options


@dataclasses.dataclass
class Run:
    url: str
    options: dict[str, Any] | None
    base: Path
    states: dict[int, dict[str, torch.Tensor]]
    publisher: DeltaPublisher

    @property
    def store(self) -> VersionStore:
        return VersionStore(self.url, self.options)

    def pull(self, host: Path, version: int | str, trust: Any = None) -> Any:
        return pull_weights(
            host, self.url, version, self.base, storage_options=self.options, trusted_keys=trust
        )

    def read(self, version: int, name: str) -> bytes:
        store = self.store
        return bytes(store.fs.cat_file(store_objects(store).file_path(version, name)))

    def write(self, version: int, name: str, data: bytes) -> None:
        store = self.store
        store.fs.pipe_file(store_objects(store).file_path(version, name), data)

    def edit_index(self, version: int, change: Callable[[dict[str, Any]], None]) -> None:
        body = json.loads(self.read(version, INDEX_NAME))
        change(body["metadata"])
        self.write(version, INDEX_NAME, json.dumps(body).encode())


def publish_run(
    url: str, options: dict[str, Any] | None, tmp: Path, key: Any, count: int, **kw: Any
) -> Run:
    """``count`` versions of a small model, signed with ``key`` (None: unsigned)."""
    tensors = small_tensors()
    base = make_checkpoint(tmp / "base", tensors, shards=2)
    publisher = DeltaPublisher(VersionStore(url, options), base, signing_key=key, workers=1, **kw)
    publisher.seed()
    states = {0: tensors}
    for step in range(1, count + 1):
        tensors = perturb(tensors, step)
        states[publisher.publish(tensors.items()).version] = tensors
    return Run(url, options, base, states, publisher)


def expected(states: dict[int, dict[str, torch.Tensor]], version: int) -> dict[str, bytes]:
    return {name: raw_bytes(t) for name, t in states[version].items()}


def tree(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (the state dir included) → BLAKE3 of its bytes."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, directory)] = blake3.blake3(fh.read()).hexdigest()
    return out


def test_signed_round_trip(store_at: tuple[str, Any], tmp_path: Path, keys: Keys) -> None:
    url, options = store_at
    run = publish_run(url, options, tmp_path, keys.k1.private_path, 3)
    run.publisher.publish(perturb(run.states[3], 4).items(), full=True)
    run.states[4] = perturb(run.states[3], 4)
    run.publisher.publish(perturb(run.states[4], 5).items())
    run.states[5] = perturb(run.states[4], 5)
    store = run.store
    for version in range(1, 6):
        assert SIGNATURE_KEY in store.index(version).extra, version
    host = tmp_path / "host"
    assert run.pull(host, 2, [keys.k1.public_path]).version == 2
    assert checkpoint_bytes(host) == expected(run.states, 2)
    assert not os.path.exists(host / ".weight_sync" / "verified-deltas")
    assert run.pull(host, 5, keys.k1.public_path).version == 5  # one key: a path is enough
    assert checkpoint_bytes(host) == expected(run.states, 5)
    verify = functools.partial(verify_local, host, url, base_dir=run.base, storage_options=options)
    assert verify(trusted_keys=[keys.k1.public_path]) == 5
    with pytest.raises(SignatureError, match="not trusted"):
        verify(trusted_keys=[keys.k2.public_path])


def test_reference_reader_reads_a_signed_store(tmp_path: Path, keys: Keys) -> None:
    run = publish_run(str(tmp_path / "store"), None, tmp_path, keys.k1.private_path, 3)
    host = tmp_path / "ref-host"
    reference_reader.pull(str(host), run.url, 3, str(run.base))
    assert checkpoint_bytes(host) == expected(run.states, 3)


def _flip_shard_byte(run: Run, version: int) -> None:
    shard = sorted(run.store.index(version).shards())[0]
    data = bytearray(run.read(version, shard))
    data[-1] ^= 0x01
    run.write(version, shard, bytes(data))


def _alter_header_digest(run: Run, version: int) -> None:
    shard = sorted(run.store.index(version).shards())[0]
    data = run.read(version, shard)
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    name, digest = next((n, d) for n, d in header["__metadata__"].items() if n != "format")
    forged = ("0" if digest[0] != "0" else "1") + digest[1:]
    raw = data[8 : 8 + length].replace(digest.encode(), forged.encode())
    assert len(raw) == length and raw != data[8 : 8 + length], name
    run.write(version, shard, data[:8] + raw + data[8 + length :])


def _unsign(run: Run, version: int) -> None:
    run.edit_index(version, lambda meta: meta.pop(SIGNATURE_KEY))


def _alter_encoding(run: Run, version: int) -> None:
    run.edit_index(version, lambda meta: meta.update(delta_encoding="overwrite"))


def _alter_signed_size(run: Run, version: int) -> None:
    def change(meta: dict[str, Any]) -> None:
        fact = next(iter(meta[SIGNATURE_KEY]["shards"].values()))
        fact["size"] += 1

    run.edit_index(version, change)


TAMPER = {
    "unsigned": (_unsign, "not signed"),
    "index altered": (_alter_encoding, "does not match"),
    "signed shard table altered": (_alter_signed_size, "does not match"),
    "shard header altered": (_alter_header_digest, "does not match"),
    "shard bytes altered": (_flip_shard_byte, "altered after signing"),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_tampered_version_is_refused_before_a_write(
    store_at: tuple[str, Any], tmp_path: Path, keys: Keys, case: str
) -> None:
    url, options = store_at
    run = publish_run(url, options, tmp_path, keys.k1.private_path, 2)
    host = tmp_path / "host"
    trust = [keys.k1.public_path]
    run.pull(host, 1, trust)
    before = tree(host)
    tamper, message = TAMPER[case]
    tamper(run, 2)
    with pytest.raises(SignatureError, match=message):
        run.pull(host, 2, trust)
    assert tree(host) == before
    assert checkpoint_bytes(host) == expected(run.states, 1)
    # Without trusted keys a tampered shard is still caught (after a put-back) or applied as
    # the pull always did; with them, nothing was written above.


def test_untrusted_key_and_rotation(tmp_path: Path, keys: Keys) -> None:
    run = publish_run(str(tmp_path / "store"), None, tmp_path, keys.k1.private_path, 2)
    rotated = DeltaPublisher(
        run.store, run.base, signing_key=keys.k2.private_path, workers=1, resume=True
    )
    rotated.seed()
    run.states[3] = perturb(run.states[2], 3)
    rotated.publish(run.states[3].items())
    host = tmp_path / "host"
    run.pull(host, 2, [keys.k1.public_path])
    before = tree(host)
    with pytest.raises(SignatureError, match=f"signed by key {keys.k2.key_id}.*not trusted"):
        run.pull(host, 3, [keys.k1.public_path])
    assert tree(host) == before
    both = [keys.k1.public_path, keys.k2.public_path]
    assert run.pull(host, 3, both).version == 3
    assert checkpoint_bytes(host) == expected(run.states, 3)
    fresh = tmp_path / "fresh"
    with pytest.raises(SignatureError, match=f"signed by key {keys.k1.key_id}"):
        run.pull(fresh, 3, [keys.k2.public_path])  # v1, v2 are the old key's
    assert not list(fresh.glob("*.safetensors"))


def test_replay_under_another_number(store_at: tuple[str, Any], tmp_path: Path, keys: Keys) -> None:
    url, options = store_at
    run = publish_run(url, options, tmp_path, keys.k1.private_path, 2)
    store = run.store
    store.fs.makedirs(store_objects(store).version_path(3), exist_ok=True)
    for name in store.index(2).shards():
        store.fs.pipe_file(store_objects(store).file_path(3, name), run.read(2, name))
    body = json.loads(run.read(2, INDEX_NAME))
    body["metadata"]["version"] = "000003"
    body["metadata"]["base_version"] = "000002"
    store.fs.pipe_file(store_objects(store).file_path(3, INDEX_NAME), json.dumps(body).encode())
    host = tmp_path / "host"
    trust = [keys.k1.public_path]
    run.pull(host, 2, trust)
    before = tree(host)
    with pytest.raises(SignatureError, match=r"weight_v000003.*replayed"):
        run.pull(host, 3, trust)
    assert tree(host) == before


def test_replay_under_another_stream(tmp_path: Path, keys: Keys) -> None:
    run = publish_run(str(tmp_path / "store"), None, tmp_path, keys.k1.private_path, 2)
    host = tmp_path / "host"
    trust = [keys.k1.public_path]
    run.pull(host, 1, trust)
    before = tree(host)
    for version in (1, 2):
        run.edit_index(version, lambda meta: meta.update(stream_id="another-stream"))
    with pytest.raises(SignatureError, match=r"weight_v000001.*does not match"):
        run.pull(host, 2, trust)
    assert tree(host) == before


def test_altered_full_version_is_refused(tmp_path: Path, keys: Keys) -> None:
    run = publish_run(str(tmp_path / "store"), None, tmp_path, keys.k1.private_path, 1)
    run.states[2] = perturb(run.states[1], 2)
    run.publisher.publish(run.states[2].items(), full=True)
    host = tmp_path / "host"
    trust = [keys.k1.public_path]
    run.pull(host, 1, trust)
    before = tree(host)
    _flip_shard_byte(run, 2)
    with pytest.raises(IntegrityError):  # a SignatureError or the tensor digest: before a swap
        run.pull(host, 2, trust)
    assert tree(host) == before


def test_unsigned_store_pulls_as_before_without_keys(tmp_path: Path, keys: Keys) -> None:
    run = publish_run(str(tmp_path / "store"), None, tmp_path, None, 2)
    assert SIGNATURE_KEY not in run.store.index(2).extra
    host = tmp_path / "host"
    assert run.pull(host, 2).version == 2
    fresh = tmp_path / "fresh"
    with pytest.raises(SignatureError, match="not signed"):
        run.pull(fresh, 2, [keys.k1.public_path])
    assert not list(fresh.glob("*.safetensors"))


# ------------------------------------------------------------------ base check (issue 9 item 11)
def test_base_differing_in_an_untouched_tensor_is_refused(
    store_at: tuple[str, Any], tmp_path: Path
) -> None:
    url, options = store_at
    run = publish_run(url, options, tmp_path, None, 2)
    changed = {
        n
        for v in (1, 2)
        for n, t in run.states[v].items()
        if raw_bytes(t) != raw_bytes(run.states[0][n])
    }
    untouched = sorted(n for n in run.states[0] if n not in changed and run.states[0][n].numel())
    record = run.store.index(1).extra[BASE_DIGESTS_KEY]
    carried = set(run.store.index(1).weight_map)  # checked once applied: not in the record
    assert set(record["tensors"]) == set(run.states[0]) - carried
    assert record["checksum"] == "xxh3-128"
    assert BASE_DIGESTS_KEY not in run.store.index(2).extra  # only deltas built on version 0
    other = dict(run.states[0])
    victim = untouched[0]
    flat = other[victim].clone().reshape(-1).view(torch.uint8)
    flat[0] ^= 0x01 if other[victim].dtype == torch.bool else 0x10
    other[victim] = flat.view(other[victim].dtype).reshape(other[victim].shape)
    wrong_base = make_checkpoint(tmp_path / "wrong-base", other, shards=2)
    host = tmp_path / "host"
    with pytest.raises(IntegrityError, match=f"{victim}.*differ from the trainer's base"):
        pull_weights(host, url, 2, wrong_base, storage_options=options)
    assert not list(host.glob("*.safetensors"))  # refused before copying the base
    # The right base pulls; a host at v0 of the wrong base is refused before it catches up.
    assert pull_weights(host, url, 2, run.base, storage_options=options).version == 2
    at_zero = tmp_path / "at-zero"
    pull_weights(at_zero, url, 0, wrong_base, storage_options=options)
    before = tree(at_zero)
    with pytest.raises(IntegrityError, match=victim):
        pull_weights(at_zero, url, 1, wrong_base, storage_options=options)
    assert tree(at_zero) == before


def test_base_differing_in_a_tensor_the_first_delta_carries_is_refused(
    store_at: tuple[str, Any], tmp_path: Path
) -> None:
    """The record leaves out what v1 carries: a wrong base there fails the applied tensor's
    check, the message points at the base, and the host claims no version until a pull from
    the right base."""
    url, options = store_at
    run = publish_run(url, options, tmp_path, None, 2)
    carried = run.store.index(1).weight_map
    victim = sorted(n for n in carried if run.states[0][n].numel())[0]
    assert victim not in run.store.index(1).extra[BASE_DIGESTS_KEY]["tensors"]
    other = dict(run.states[0])
    flat = other[victim].clone().reshape(-1).view(torch.uint8)
    flat[-1] ^= 0x01 if other[victim].dtype == torch.bool else 0x10
    other[victim] = flat.view(other[victim].dtype).reshape(other[victim].shape)
    wrong_base = make_checkpoint(tmp_path / "wrong-base", other, shards=2)
    host = tmp_path / "host"
    with pytest.raises(IntegrityError, match=f"{victim}.*a copy of --base"):
        pull_weights(host, url, 2, wrong_base, storage_options=options)
    with pytest.raises(IntegrityError):
        verify_local(host, url, base_dir=run.base, storage_options=options)
    assert pull_weights(host, url, 2, run.base, storage_options=options).version == 2
    assert checkpoint_bytes(host) == {n: raw_bytes(t) for n, t in run.states[2].items()}


def test_base_record_is_covered_by_the_signature(tmp_path: Path, keys: Keys) -> None:
    run = publish_run(str(tmp_path / "store"), None, tmp_path, keys.k1.private_path, 1)

    def forge(meta: dict[str, Any]) -> None:
        name = sorted(meta[BASE_DIGESTS_KEY]["tensors"])[0]
        meta[BASE_DIGESTS_KEY]["tensors"][name] = "0" * 32

    run.edit_index(1, forge)
    with pytest.raises(SignatureError, match="does not match"):
        run.pull(tmp_path / "host", 1, [keys.k1.public_path])

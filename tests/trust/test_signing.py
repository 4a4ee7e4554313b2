"""Signed versions over versions the real publisher wrote: round trip, every manifest field
tampered, untrusted keys, rotation, and a genuine version replayed under another number or
stream."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from deltastore.errors import IntegrityError, SignatureError
from deltastore.format import INDEX_NAME, VersionIndex, read_header_file, version_dir_name
from deltastore.trust import (
    MANIFEST_DOMAIN,
    SIGNATURE_KEY,
    ShardFact,
    ShardHasher,
    SignatureRecord,
    TensorFact,
    VersionManifest,
    build_manifest,
    generate_keypair,
    load_private_key,
    load_public_key,
    sign_manifest,
    signed_index,
    unsigned_index,
    verify_index,
    verify_manifest,
)
from tests.pull.helpers import Published, many_tensors, publish_versions, write_checkpoint


@dataclasses.dataclass
class Version:
    index: VersionIndex
    digests: dict[str, dict[str, str]]
    facts: dict[str, ShardFact]
    directory: Path


def read_version(store: Path, version: int) -> Version:
    """What a reader holds after reading the index, the shard headers and the shard bytes."""
    directory = store / version_dir_name(version)
    index = VersionIndex.from_json((directory / INDEX_NAME).read_bytes(), version=version)
    shards = index.shards()
    digests = {s: dict(read_header_file(str(directory / s)).metadata) for s in shards}
    facts = {s: ShardFact.of_file(directory / s) for s in shards}
    return Version(index, digests, facts, directory)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    root = tmp_path_factory.mktemp("signed")
    base = many_tensors(12, seed=201, elements=256)
    write_checkpoint(root / "base", base)
    return publish_versions(root / "store", root / "base", base, 3, seed=202, full_at=(3,))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("keys")
    old, new, stranger = (generate_keypair(root / name) for name in ("old", "new", "stranger"))
    return {
        name: (load_private_key(files.private_path), load_public_key(files.public_path))
        for name, files in (("old", old), ("new", new), ("stranger", stranger))
    }


def sign_version(v: Version, signing) -> VersionIndex:
    """What the publisher does: manifest from what it wrote, sign, store in the index."""
    record = sign_manifest(signing, build_manifest(v.index, v.digests, v.facts))
    return signed_index(v.index, record)


def reread(index: VersionIndex) -> VersionIndex:
    """The index as a reader parses it back from the bytes the publisher commits."""
    return VersionIndex.from_json(index.to_json(), version=index.version)


def test_round_trip_and_reference_readers_still_read_it(published, keys):
    private, public = keys["old"]
    for version in (1, 2, 3):
        v = read_version(published.store_dir, version)
        index = reread(sign_version(v, private))
        record = verify_index([public], index, v.digests)
        for shard, fact in v.facts.items():
            record.check_shard(version, shard, fact)
        # The record is one extra metadata key; weight_map and the reference keys are untouched.
        body = json.loads(index.to_json())
        original = json.loads(v.index.to_json())
        assert body["weight_map"] == original["weight_map"]
        assert {k: body["metadata"][k] for k in original["metadata"]} == original["metadata"]
        assert set(body["metadata"]) - set(original["metadata"]) == {SIGNATURE_KEY}
        assert unsigned_index(index) == v.index
    manifest = build_manifest(v.index, v.digests, v.facts)
    signed = manifest.canonical_bytes()
    assert signed.startswith(MANIFEST_DOMAIN)
    reordered = build_manifest(
        v.index,
        {s: dict(reversed(d.items())) for s, d in reversed(v.digests.items())},
        dict(reversed(v.facts.items())),
    )
    assert reordered.canonical_bytes() == signed  # canonical: insertion order does not matter
    payload = signed[len(MANIFEST_DOMAIN) :]
    assert b"\n" not in payload and b", " not in payload and b'": ' not in payload
    assert json.loads(signed[len(MANIFEST_DOMAIN) :])["version"] == 3


def tampered_manifests(manifest: VersionManifest):
    """One changed copy per field that decides the applied bytes."""
    name = sorted(manifest.tensors)[0]
    shard = sorted(manifest.shards)[0]
    tensor, fact = manifest.tensors[name], manifest.shards[shard]
    flipped = ("0" if fact.digest[0] != "0" else "1") + fact.digest[1:]
    yield "version", dataclasses.replace(manifest, version=manifest.version + 1)
    yield (
        "base_version",
        dataclasses.replace(manifest, base_version=(manifest.base_version or 0) + 7),
    )
    yield "stream_id", dataclasses.replace(manifest, stream_id="another-stream")
    yield "encoding", dataclasses.replace(manifest, encoding="overwrite")
    yield "compression", dataclasses.replace(manifest, compression=None)
    yield "checksum", dataclasses.replace(manifest, checksum="adler32")
    digest = (tensor.digest or "00")[::-1]
    yield (
        "tensor digest",
        dataclasses.replace(
            manifest, tensors={**manifest.tensors, name: TensorFact(tensor.shard, digest)}
        ),
    )
    yield (
        "tensor shard",
        dataclasses.replace(
            manifest,
            tensors={**manifest.tensors, name: TensorFact("other.safetensors", tensor.digest)},
        ),
    )
    yield (
        "tensor added",
        dataclasses.replace(
            manifest, tensors={**manifest.tensors, "extra.weight": TensorFact(shard, tensor.digest)}
        ),
    )
    yield (
        "tensor removed",
        dataclasses.replace(
            manifest, tensors={k: t for k, t in manifest.tensors.items() if k != name}
        ),
    )
    yield (
        "shard size",
        dataclasses.replace(
            manifest, shards={**manifest.shards, shard: ShardFact(fact.size + 1, fact.digest)}
        ),
    )
    yield (
        "shard digest",
        dataclasses.replace(
            manifest, shards={**manifest.shards, shard: ShardFact(fact.size, flipped)}
        ),
    )


def test_tampering_any_manifest_field_is_refused(published, keys):
    private, public = keys["old"]
    v = read_version(published.store_dir, 2)
    manifest = build_manifest(v.index, v.digests, v.facts)
    record = sign_manifest(private, manifest)
    assert verify_manifest([public], manifest, record) == public
    seen = set()
    for field_name, altered in tampered_manifests(manifest):
        assert altered != manifest, field_name
        with pytest.raises(SignatureError, match="does not match"):
            verify_manifest([public], altered, record)
        seen.add(field_name)
    assert len(seen) == 12
    forged = dataclasses.replace(record, signature=bytes(64))
    with pytest.raises(SignatureError, match="does not match"):
        verify_manifest([public], manifest, forged)


def test_tampered_store_files_are_refused(published, keys):
    """The same, the way an attacker does it: edit the committed index or a shard's bytes."""
    private, public = keys["old"]
    v = read_version(published.store_dir, 2)
    index = reread(sign_version(v, private))
    body = json.loads(index.to_json())
    for key, value in (("base_version", "000000"), ("delta_encoding", "overwrite")):
        edited = json.loads(json.dumps(body))
        edited["metadata"][key] = value
        altered = VersionIndex.from_json(json.dumps(edited).encode(), version=2)
        with pytest.raises(SignatureError):
            verify_index([public], altered, v.digests)
    name = sorted(v.index.weight_map)[0]
    shard = v.index.weight_map[name]
    digests = {**v.digests, shard: {**v.digests[shard], name: "0" * 32}}
    with pytest.raises(SignatureError):
        verify_index([public], index, digests)  # a shard header rewritten
    record = verify_index([public], index, v.digests)
    data = bytearray((v.directory / shard).read_bytes())
    data[-1] ^= 0x01
    hasher = ShardHasher()
    hasher.update(data[:100])
    hasher.update(data[100:])
    with pytest.raises(SignatureError, match=shard):
        record.check_shard(2, shard, hasher.fact())
    edited = json.loads(json.dumps(body))
    edited["metadata"][SIGNATURE_KEY]["shards"][shard]["size"] += 1
    with pytest.raises(SignatureError):
        verify_index(
            [public], VersionIndex.from_json(json.dumps(edited).encode(), version=2), v.digests
        )


def test_unsigned_and_untrusted_versions_are_refused(published, keys):
    private, public = keys["old"]
    _, stranger_public = keys["stranger"]
    v = read_version(published.store_dir, 1)
    with pytest.raises(SignatureError, match="not signed"):
        verify_index([public], v.index, v.digests)
    with pytest.raises(SignatureError, match="not signed"):
        verify_manifest([public], build_manifest(v.index, v.digests, v.facts), None)
    index = reread(sign_version(v, private))
    with pytest.raises(SignatureError, match=rf"key {private.key_id}.*not trusted"):
        verify_index([stranger_public], index, v.digests)
    # A stranger re-signing the version with their own key is refused just the same.
    stranger_private, _ = keys["stranger"]
    with pytest.raises(SignatureError, match="not trusted"):
        verify_index([public], reread(sign_version(v, stranger_private)), v.digests)
    assert issubclass(SignatureError, IntegrityError)
    for garbage in ({"sig": "zz", "key_id": "ab", "shards": {}}, "a string", {"shards": []}):
        bad = dataclasses.replace(v.index, extra={SIGNATURE_KEY: garbage})
        with pytest.raises(SignatureError, match="signature record"):
            verify_index([public], bad, v.digests)


def test_rotation_accepts_any_trusted_key(published, keys):
    old_private, old_public = keys["old"]
    new_private, new_public = keys["new"]
    assert old_private.key_id != new_private.key_id
    v1, v2 = read_version(published.store_dir, 1), read_version(published.store_dir, 2)
    before = reread(sign_version(v1, old_private))
    after = reread(sign_version(v2, new_private))
    both = [new_public, old_public]
    assert verify_index(both, before, v1.digests).key_id == old_private.key_id
    assert verify_index(both, after, v2.digests).key_id == new_private.key_id
    with pytest.raises(SignatureError, match="not trusted"):
        verify_index([new_public], before, v1.digests)  # the old key retired


def test_a_genuine_version_replayed_under_another_number_or_stream_is_refused(published, keys):
    private, public = keys["old"]
    v = read_version(published.store_dir, 2)
    genuine = reread(sign_version(v, private))
    assert verify_index([public], genuine, v.digests)
    # Served as version 5: the same files in weight_v000005 with the version field rewritten.
    body = json.loads(genuine.to_json())
    body["metadata"]["version"] = "000005"
    as_five = VersionIndex.from_json(json.dumps(body).encode(), version=5)
    with pytest.raises(SignatureError, match=r"weight_v000005.*replayed"):
        verify_index([public], as_five, v.digests)
    # Served in another stream (a store the attacker controls, under the victim's stream id).
    body = json.loads(genuine.to_json())
    body["metadata"]["stream_id"] = "victim-stream"
    with pytest.raises(SignatureError, match="replayed"):
        verify_index(
            [public], VersionIndex.from_json(json.dumps(body).encode(), version=2), v.digests
        )
    # And a full version replayed as another full version.
    v3 = read_version(published.store_dir, 3)
    full = json.loads(reread(sign_version(v3, private)).to_json())
    full["metadata"]["version"] = "000004"
    with pytest.raises(SignatureError):
        verify_index(
            [public], VersionIndex.from_json(json.dumps(full).encode(), version=4), v3.digests
        )


def test_signature_record_round_trips_through_json(published, keys):
    private, _ = keys["old"]
    v = read_version(published.store_dir, 1)
    record = sign_manifest(private, build_manifest(v.index, v.digests, v.facts))
    stored = json.loads(json.dumps(record.to_dict()))
    assert stored["alg"] == "ed25519" and stored["key_id"] == private.key_id
    assert len(stored["sig"]) == 128
    assert SignatureRecord.from_dict(stored, version=1) == record


def test_manifest_needs_exactly_the_indexed_shards(published):
    v = read_version(published.store_dir, 1)
    from deltastore.errors import FormatError

    with pytest.raises(FormatError, match="weight_v000001"):
        build_manifest(v.index, v.digests, {})
    extra = {**v.facts, "model-99999-of-99999.safetensors": ShardFact(1, "0" * 64)}
    with pytest.raises(FormatError):
        build_manifest(v.index, v.digests, extra)

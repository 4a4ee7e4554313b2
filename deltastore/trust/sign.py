"""Sign a version's manifest and verify it against trusted public keys.

The signature record lives in the version's index, under the metadata key ``signature``
(:data:`SIGNATURE_KEY`), which reference readers ignore::

    "signature": {"format": "deltastore-signed-version-v1", "alg": "ed25519",
                  "key_id": "<16 hex>", "sig": "<128 hex>",
                  "shards": {"<shard file>": {"size": <bytes>, "blake3": "<64 hex>"}}}

The record carries the shard table it signed, so a reader checks the signature from the index
and the shard headers before it writes a byte, then each shard's bytes as it reads them. The
signature is over the manifest (:mod:`deltastore.trust.manifest`), which excludes the record.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deltastore.errors import FormatError, SignatureError
from deltastore.format.index import VersionIndex
from deltastore.trust.keys import SigningKey, TrustedKey, require_cryptography
from deltastore.trust.manifest import (
    MANIFEST_FORMAT,
    SHARD_DIGEST,
    ShardFact,
    VersionManifest,
    build_manifest,
)

SIGNATURE_KEY = "signature"
"""Index metadata key holding the signature record."""

ALGORITHM = "ed25519"

_HEX = re.compile(r"^[0-9a-f]*$")


def _where(version: int) -> str:
    return f"weight_v{version:06d}"


@dataclass(frozen=True)
class SignatureRecord:
    """A signature over one version's manifest, as stored in its index."""

    key_id: str
    signature: bytes  # 64 bytes
    shards: Mapping[str, ShardFact]  # the table the manifest was built with
    alg: str = ALGORITHM
    format: str = MANIFEST_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "alg": self.alg,
            "key_id": self.key_id,
            "sig": self.signature.hex(),
            "shards": {name: fact.to_dict() for name, fact in sorted(self.shards.items())},
        }

    @classmethod
    def from_dict(cls, body: object, *, version: int) -> SignatureRecord:
        """Parse a stored record; :class:`SignatureError` when it is malformed."""

        def bad(what: str) -> SignatureError:
            return SignatureError(
                f"{_where(version)}: the signature record {what}; the index was altered or "
                "written by an incompatible publisher"
            )

        if not isinstance(body, dict):
            raise bad("is not an object")
        sig, key_id, shards = body.get("sig"), body.get("key_id"), body.get("shards")
        if not isinstance(sig, str) or len(sig) != 128 or not _HEX.match(sig):
            raise bad("has no 128-hex-character 'sig'")
        if not isinstance(key_id, str) or not key_id or not _HEX.match(key_id):
            raise bad("has no hex 'key_id'")
        if not isinstance(shards, dict):
            raise bad("has no 'shards' table")
        facts = {}
        for name, fact in shards.items():
            size = fact.get("size") if isinstance(fact, dict) else None
            digest = fact.get(SHARD_DIGEST) if isinstance(fact, dict) else None
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise bad(f"gives shard {name!r} no valid size")
            if not isinstance(digest, str) or len(digest) != 64 or not _HEX.match(digest):
                raise bad(f"gives shard {name!r} no {SHARD_DIGEST} digest")
            facts[name] = ShardFact(size, digest)
        return cls(
            key_id,
            bytes.fromhex(sig),
            facts,
            alg=str(body.get("alg")),
            format=str(body.get("format")),
        )

    @classmethod
    def from_index(cls, index: VersionIndex) -> SignatureRecord:
        """The record inside ``index``; :class:`SignatureError` when the version is unsigned."""
        if SIGNATURE_KEY not in index.extra:
            raise SignatureError(
                f"{_where(index.version)} is not signed and trusted keys were given; publish it "
                "with a signing key (deltastore publish --sign-key) or pull without --trust"
            )
        return cls.from_dict(index.extra[SIGNATURE_KEY], version=index.version)

    def check_shard(self, version: int, shard: str, fact: ShardFact) -> None:
        """Refuse a shard whose bytes are not the signed ones (:class:`SignatureError`)."""
        signed = self.shards.get(shard)
        if signed != fact:
            raise SignatureError(
                f"{_where(version)}: shard {shard} holds {fact.size} bytes with {SHARD_DIGEST} "
                f"{fact.digest[:16]}..., the signature covers {signed}; the shard was altered "
                "after signing: republish the version"
            )


def sign_manifest(key: SigningKey, manifest: VersionManifest) -> SignatureRecord:
    """Sign ``manifest`` with ``key``; the record to store in the index (:func:`signed_index`)."""
    signature = key.private.sign(manifest.canonical_bytes())
    return SignatureRecord(key.key_id, signature, dict(manifest.shards))


def verify_manifest(
    trusted_keys: Iterable[TrustedKey], manifest: VersionManifest, record: SignatureRecord | None
) -> TrustedKey:
    """The trusted key that signed exactly ``manifest``.

    Raises :class:`SignatureError` when ``record`` is None (unsigned), names another layout or
    algorithm, was made by a key not in ``trusted_keys``, or does not match ``manifest``
    (forged, altered, or a genuine version replayed under another number, base or stream).
    """
    where = _where(manifest.version)
    if record is None:
        raise SignatureError(f"{where} is not signed and trusted keys were given")
    if record.format != MANIFEST_FORMAT or record.alg != ALGORITHM:
        raise SignatureError(
            f"{where} is signed as {record.format}/{record.alg}; this deltastore verifies "
            f"{MANIFEST_FORMAT}/{ALGORITHM} only: upgrade deltastore"
        )
    keys = {key.key_id: key for key in trusted_keys}
    key = keys.get(record.key_id)
    if key is None:
        raise SignatureError(
            f"{where} is signed by key {record.key_id}, which is not trusted here (trusted: "
            f"{sorted(keys)}); pass its PREFIX.pub with --trust if that key is yours"
        )
    require_cryptography()  # the ConfigError naming the extra when cryptography is missing
    from cryptography.exceptions import InvalidSignature

    try:
        key.public.verify(record.signature, manifest.canonical_bytes())
    except InvalidSignature:
        raise SignatureError(
            f"{where}: the signature of key {record.key_id} does not match this version's "
            "manifest (version, base, stream, encoding, tensor or shard digests); it was altered, "
            "forged or replayed from another version: do not apply it"
        ) from None
    return key


def verify_index(
    trusted_keys: Iterable[TrustedKey],
    index: VersionIndex,
    tensor_digests: Mapping[str, Mapping[str, str]],
) -> SignatureRecord:
    """Check a version's signature from its index and its shards' ``__metadata__`` alone;
    returns the record, whose :meth:`~SignatureRecord.check_shard` the caller applies to each
    shard it reads. Raises :class:`SignatureError` as :func:`verify_manifest` does, and when the
    signed shard table names other shards than the index."""
    record = SignatureRecord.from_index(index)
    try:
        manifest = build_manifest(index, tensor_digests, record.shards)
    except FormatError as exc:
        raise SignatureError(f"the signed shard table does not match the index: {exc}") from None
    verify_manifest(trusted_keys, manifest, record)
    return record


def signed_index(index: VersionIndex, record: SignatureRecord) -> VersionIndex:
    """``index`` with ``record`` stored under the ``signature`` metadata key."""
    return dataclasses.replace(index, extra={**index.extra, SIGNATURE_KEY: record.to_dict()})


def unsigned_index(index: VersionIndex) -> VersionIndex:
    """``index`` without its signature record."""
    extra = {k: v for k, v in index.extra.items() if k != SIGNATURE_KEY}
    return dataclasses.replace(index, extra=extra)

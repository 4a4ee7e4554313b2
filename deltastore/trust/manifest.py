"""The canonical manifest of a version: everything that decides the bytes a pull applies.

A signature covers these bytes and nothing else, so what is in the manifest is what a signature
protects: the version and the version it builds on, the publisher's stream, the delta
encoding, compression and checksum algorithm, every tensor's shard and the digest of its new
bytes, and every shard's size and whole-file BLAKE3 digest. Keys that do not decide the bytes
(the commit token, byte totals, the signature itself) are left out, so a signature can be
computed before the index is written and carried inside it.

Canonical bytes are :data:`MANIFEST_DOMAIN` followed by the manifest as JSON with sorted keys,
no whitespace, UTF-8; the domain prefix keeps a signature over a manifest from ever being valid
for another kind of message signed with the same key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3

from deltastore.errors import FormatError
from deltastore.format.index import VersionIndex

MANIFEST_FORMAT = "deltastore-signed-version-v1"
"""Name of the manifest layout; a signature record names the layout it was computed over."""

MANIFEST_DOMAIN = (MANIFEST_FORMAT + "\n").encode("ascii")
"""Prefix of the signed bytes (domain separation)."""

SHARD_DIGEST = "blake3"
"""Algorithm of the whole-file shard digests (64 hex characters)."""

_READ_CHUNK = 8 << 20
BASE_DIGESTS_KEY = "base_digests"
"""Index metadata key of the base-model record a stream's first delta carries:
``{"checksum": "<algorithm>", "tensors": {name: hex digest}}``."""


@dataclass(frozen=True)
class ShardFact:
    """Size and whole-file BLAKE3 digest (64 lower-case hex characters) of one shard file."""

    size: int
    digest: str

    @classmethod
    def of_bytes(cls, data: bytes | bytearray | memoryview) -> ShardFact:
        return cls(len(memoryview(data)), blake3.blake3(data).hexdigest())

    @classmethod
    def of_file(cls, path: str | os.PathLike[str]) -> ShardFact:
        """Read in 8 MiB chunks; raises ``OSError``."""
        hasher = ShardHasher()
        with open(path, "rb") as fh:
            while chunk := fh.read(_READ_CHUNK):
                hasher.update(chunk)
        return hasher.fact()

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, SHARD_DIGEST: self.digest}


class ShardHasher:
    """Builds a :class:`ShardFact` from a shard streamed in pieces (in file order)."""

    def __init__(self) -> None:
        self._hasher = blake3.blake3()
        self._size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hasher.update(data)
        self._size += len(memoryview(data))

    def fact(self) -> ShardFact:
        return ShardFact(self._size, self._hasher.hexdigest())


@dataclass(frozen=True)
class TensorFact:
    """Where a tensor's payload lives and the digest of the bytes it leaves behind."""

    shard: str
    digest: str | None
    """In the version's checksum algorithm; None when the shard's metadata records none (a
    foreign full version: its shard digest still binds it)."""

    def to_dict(self) -> dict[str, Any]:
        return {"shard": self.shard, "digest": self.digest}


@dataclass(frozen=True)
class VersionManifest:
    """What a signature over a version covers (see the module docstring)."""

    version: int
    base_version: int | None
    stream_id: str | None
    encoding: str | None  # None for a full version
    compression: str | None
    checksum: str | None
    tensors: Mapping[str, TensorFact] = field(default_factory=dict)
    shards: Mapping[str, ShardFact] = field(default_factory=dict)
    base_digests: Mapping[str, Any] | None = None
    """Covered only when present, so versions without one sign the same bytes as before."""

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "base_version": self.base_version,
            "stream_id": self.stream_id,
            "delta_encoding": self.encoding,
            "compression_format": self.compression,
            "checksum_format": self.checksum,
            "shard_digest": SHARD_DIGEST,
            "tensors": {name: fact.to_dict() for name, fact in self.tensors.items()},
            "shards": {name: fact.to_dict() for name, fact in self.shards.items()},
        }
        if self.base_digests is not None:
            body[BASE_DIGESTS_KEY] = self.base_digests
        return body

    def canonical_bytes(self) -> bytes:
        """The bytes a signature is computed over: domain prefix + canonical JSON."""
        body = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return MANIFEST_DOMAIN + body.encode("utf-8")


def build_manifest(
    index: VersionIndex,
    tensor_digests: Mapping[str, Mapping[str, str]],
    shards: Mapping[str, ShardFact],
) -> VersionManifest:
    """The manifest of the version ``index`` describes, from each shard's ``__metadata__``
    (``tensor_digests``: tensor name → hex digest) and :class:`ShardFact` (``shards``), both by
    shard file name. Raises :class:`FormatError` when ``shards`` does not name exactly the
    index's shards."""
    where = f"weight_v{index.version:06d}"
    named = set(index.shards())
    if set(shards) != named:
        raise FormatError(
            f"{where}: the shard facts name {sorted(set(shards) - named)[:5]} that the index "
            f"does not, and lack {sorted(named - set(shards))[:5]}; the version is inconsistent"
        )
    tensors = {
        name: TensorFact(shard, tensor_digests.get(shard, {}).get(name))
        for name, shard in sorted(index.weight_map.items())
    }
    lineage = (index.version, index.base_version, index.stream_id)
    codecs = (index.encoding, index.compression, index.checksum)
    shard_facts = dict(sorted(shards.items()))
    return VersionManifest(
        *lineage, *codecs, tensors, shard_facts, index.extra.get(BASE_DIGESTS_KEY)
    )

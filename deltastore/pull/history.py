"""What a run of deltas does to each tensor: its payloads and its digest after each version."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from deltastore.codecs import Checksum, Digest, check_compression, get_checksum, get_encoding
from deltastore.errors import ConfigError, FormatError, NameMismatchError, OutOfOrderError
from deltastore.format.checkpoint import CheckpointTensor
from deltastore.format.index import VersionIndex, check_shard_names
from deltastore.format.names import version_dir_name
from deltastore.format.payload import PayloadRef
from deltastore.format.safetensors_io import SafetensorsHeader, TensorEntry
from deltastore.format.shard_stream import StreamedShardCheck
from deltastore.storage import VersionStore

_LOWER_HEX = re.compile("[0-9a-f]*")


@dataclass
class TensorHistory:
    """The payloads of one tensor along a run of deltas, and its digest after each."""

    name: str
    payloads: list[PayloadRef] = field(default_factory=list)
    digests: dict[int, Digest] = field(default_factory=dict)
    """Version → digest of the tensor's bytes at that version (only versions that change it)."""

    def after(self, version: int) -> list[PayloadRef]:
        """Payloads still to apply on the tensor's bytes at ``version``."""
        return [p for p in self.payloads if p.version > version]

    def digest_at(self, version: int) -> Digest | None:
        """Digest at ``version`` if a delta ≤ ``version`` in this history changed the tensor."""
        known = [v for v in self.digests if v <= version]
        return self.digests[max(known)] if known else None

    @property
    def final(self) -> Digest:
        """Digest after the last payload."""
        return self.digests[self.payloads[-1].version]


def check_index_codecs(index: VersionIndex) -> Checksum:
    """The checksum a delta index names; :class:`FormatError` naming the version for an
    unknown encoding, compression or checksum."""
    try:
        get_encoding(index.encoding or "")
        check_compression(index.compression)
        return get_checksum(index.checksum or "")
    except ConfigError as exc:
        raise FormatError(f"{version_dir_name(index.version)} cannot be applied: {exc}") from None


def check_digest(checksum: Checksum, digest: object, *, name: str, where: str) -> Digest:
    """``digest`` (from shard metadata) as a :class:`Digest`; :class:`FormatError` if invalid."""
    if (
        not isinstance(digest, str)
        or len(digest) != checksum.hex_length
        or _LOWER_HEX.fullmatch(digest) is None
    ):
        raise FormatError(
            f"{where}: tensor {name!r} has no valid {checksum.name} digest in its shard metadata"
        )
    return Digest(checksum, digest)


def recorded_digests(
    header: SafetensorsHeader, checksum: Checksum, *, where: str, required: bool = False
) -> dict[str, Digest]:
    """The digests a shard's metadata records, by tensor; :class:`FormatError` for an invalid
    one, or (``required``: a delta's) a missing one. A foreign full version may record none."""
    digests = {}
    for name in header.tensors:
        value = header.metadata.get(name)
        if value is not None or required:
            digests[name] = check_digest(checksum, value, name=name, where=where)
    return digests


@dataclass(frozen=True)
class FullTensor:
    """One tensor of a full version: its shard, where it lies, its recorded digest (if any)."""

    shard: str
    entry: TensorEntry
    digest: Digest | None


def full_tensors(store: VersionStore, index: VersionIndex) -> dict[str, FullTensor]:
    """Every tensor of a full version, from its shard headers (ranged reads)."""
    checksum = get_checksum(index.checksum or "xxh3-128")
    found = {}
    for shard in index.shards():
        header = store.read_shard_header(index.version, shard)
        digests = recorded_digests(header, checksum, where=version_dir_name(index.version))
        for name, entry in header.tensors.items():
            found[name] = FullTensor(shard, entry, digests.get(name))
    return found


def full_shard_check(checksum: Checksum, where: str, source: str) -> StreamedShardCheck:
    """A download sink (see :meth:`VersionStore.download`) for one shard of a full version:
    every tensor its metadata gives a digest for is hashed as its bytes arrive, so a reseed
    verifies in the same pass as it downloads (``where`` names the version in errors,
    ``source`` the shard's URL)."""

    def expected(header: SafetensorsHeader) -> dict[str, str]:
        return {n: d.hex for n, d in recorded_digests(header, checksum, where=where).items()}

    return StreamedShardCheck(source, checksum.hasher, expected)


def collect_history(
    store: VersionStore, deltas: Sequence[VersionIndex]
) -> dict[str, TensorHistory]:
    """Read each delta's shard headers once, each checked to hold exactly the 1-D U8 payloads
    its index maps to it: every changed tensor's payloads and digests."""
    history: dict[str, TensorHistory] = {}
    for index in deltas:
        where = version_dir_name(index.version)
        checksum = check_index_codecs(index)
        for shard in index.shards():
            header = store.read_shard_header(index.version, shard)
            source = f"{store.url}/{where}/{shard}"
            check_shard_names(index, shard, set(header.tensors), source=source)
            for name, entry in header.tensors.items():
                if entry.dtype != "U8" or len(entry.shape) != 1:
                    raise FormatError(
                        f"{source}: payload of tensor {name!r} is not a 1-D U8 tensor"
                    )
                digest = check_digest(checksum, header.metadata.get(name), name=name, where=where)
                tensor = history.setdefault(name, TensorHistory(name))
                tensor.payloads.append(
                    PayloadRef(index.version, shard, entry.start, entry.end, index.encoding or "")
                )
                tensor.digests[index.version] = digest
    return history


def check_contiguous(deltas: Sequence[VersionIndex], applied_version: int) -> None:
    """Refuse a run of deltas that does not build, link by link, on ``applied_version``."""
    current = applied_version
    for index in deltas:
        if index.base_version != current:
            raise OutOfOrderError(
                f"out-of-order delta: local checkpoint at v{current:06d}, "
                f"weight_v{index.version:06d} builds on v{index.base_version or 0:06d}"
            )
        current = index.version


def check_local_names(
    history: dict[str, TensorHistory], tensors: dict[str, CheckpointTensor], local_dir: str
) -> None:
    """Every changed tensor must exist locally with a size its encodings can address."""
    for name, tensor in history.items():
        target = tensors.get(name)
        if target is None:
            raise NameMismatchError(
                f"weight_v{tensor.payloads[0].version:06d} changes tensor {name!r}, which the "
                f"local checkpoint {local_dir} does not have; it was published against another base"
            )
        for payload in tensor.payloads:
            get_encoding(payload.encoding).check_size(target.entry.nbytes, tensor=name)

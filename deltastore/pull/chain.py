"""Which versions lead to a target (:func:`resolve_chain`), how to get there from what the
host holds (:func:`plan_pull`: nothing, catch up, or reseed from the chain's start, by bytes
moved), and what a run of deltas does to each tensor (:func:`collect_history`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from deltastore.codecs import Checksum, Digest, check_compression, get_checksum, get_encoding
from deltastore.errors import (
    ConfigError,
    FormatError,
    NameMismatchError,
    OutOfOrderError,
    VersionNotFoundError,
)
from deltastore.format.checkpoint import CheckpointTensor
from deltastore.format.index import VersionIndex, check_shard_names
from deltastore.format.names import version_dir_name
from deltastore.format.payload import PayloadRef
from deltastore.format.safetensors_io import SafetensorsHeader, TensorEntry
from deltastore.format.shard_stream import StreamedShardCheck
from deltastore.format.state import AppliedState
from deltastore.storage import VersionStore
from deltastore.storage.chain import IndexSource, iter_chain, walk_chain


@dataclass(frozen=True)
class Chain:
    """How to build a target version: a start (0, the base, or a full version), then deltas."""

    target: int
    start: int
    start_index: VersionIndex | None
    deltas: list[VersionIndex]
    start_stream: str | None
    partial: bool = False
    """True when resolved only back to the host's applied version ``start``, not to a full
    version or the base: good for a catch-up, not a reseed."""

    @property
    def stream_id(self) -> str | None:
        return self.deltas[-1].stream_id if self.deltas else self.start_stream

    def suffix_after(self, version: int) -> list[VersionIndex] | None:
        """The deltas still to apply on a checkpoint at ``version`` of this chain, or None."""
        if version == self.start:
            return list(self.deltas)
        for i, delta in enumerate(self.deltas):
            if delta.version == version:
                return self.deltas[i + 1 :]
        return None

    def stream_at(self, version: int) -> str | None:
        if version == self.start:
            return self.start_stream
        for delta in self.deltas:
            if delta.version == version:
                return delta.stream_id
        return None


def resolve_chain(store: IndexSource, target: int) -> Chain:
    """Walk ``base_version`` links back from ``target`` to a full version or the base;
    :class:`VersionNotFoundError` if the target or a link is not committed (a partial chain
    must never be replayed onto the wrong start), :class:`FormatError` if streams mix."""
    start, deltas = walk_chain(store, target)
    if start is None:
        return Chain(target, 0, None, deltas, None)
    return Chain(target, start.version, start, deltas, start.stream_id)


def resolve_onto(store: VersionStore, target: int, state: AppliedState | None) -> Chain:
    """The chain to ``target`` as seen from a host holding ``state``: O(versions applied).

    The walk from ``target`` stops at the host's version, each delta of the host's stream and
    linking onto it; anything else (no state, the base, a full version or a gap on the way,
    another stream, a backward target) resolves the whole chain (a reseed needs its start).
    """
    if state is None or state.version <= 0 or state.version >= target:
        return resolve_chain(store, target)
    held = state.version
    once = _ReadOnce(store)  # the full walk, if it comes to one, reuses what was read

    def read(version: int) -> VersionIndex | None:
        return None if version <= held else once.index(version)

    try:
        deltas = list(iter_chain(target, read))
    except VersionNotFoundError:
        return resolve_chain(once, target)  # the full walk names what is missing
    deltas.reverse()
    if (
        not deltas
        or not all(d.is_delta for d in deltas)
        or deltas[0].base_version != held
        or any(d.stream_id != state.stream_id for d in deltas)
    ):
        return resolve_chain(once, target)
    return Chain(target, held, None, deltas, state.stream_id, partial=True)


class _ReadOnce:
    """A store's indexes for one resolution, each read (two requests on S3) at most once."""

    def __init__(self, store: IndexSource) -> None:
        self.store = store
        self.url = store.url
        self._read: dict[int, VersionIndex] = {}

    def index(self, version: int) -> VersionIndex:
        if version not in self._read:
            self._read[version] = self.store.index(version)
        return self._read[version]


def version_bytes(store: VersionStore, index: VersionIndex) -> int:
    """Bytes a reader moves to fetch a version: its shards (from the index totals if recorded)."""
    recorded = index.totals.get("wire_bytes")
    if recorded is not None:
        return recorded
    return sum(store.file_size(index.version, shard) for shard in index.shards())


@dataclass(frozen=True)
class Plan:
    """How one pull brings the local checkpoint to ``target``."""

    action: str
    """``noop``, ``catchup`` (deltas on top of the local version) or ``reseed``."""
    target: int
    start: int
    """Version the deltas build on: the local version (catch-up) or the chain's start (reseed)."""
    deltas: list[VersionIndex] = field(default_factory=list)
    bytes_to_move: int = 0
    """Bytes read from the store (a reseed from the base also copies the base locally)."""
    reason: str = ""
    alternative_bytes: int | None = None
    """What the other way (reseed vs catch-up) would have moved, when both were possible."""

    @property
    def versions(self) -> list[int]:
        return [d.version for d in self.deltas]

    def describe(self) -> str:
        if self.action == "noop":
            return f"already at v{self.target:06d}"
        source = "the base" if self.start == 0 else f"full version v{self.start:06d}"
        head = (
            f"catch up v{self.start:06d} -> v{self.target:06d}"
            if self.action == "catchup"
            else f"reseed from {source}, then to v{self.target:06d}"
        )
        versions = self.versions
        span = f"v{versions[0]:06d}..v{versions[-1]:06d}" if versions else "none"
        text = f"{head}: {len(versions)} delta(s) ({span}), {self.bytes_to_move} bytes to move"
        if self.alternative_bytes is not None:
            other = "reseeding" if self.action == "catchup" else "catching up"
            text += f" ({other} would move {self.alternative_bytes})"
        return f"{text}; {self.reason}" if self.reason else text


def _reseed_bytes(store: VersionStore, chain: Chain) -> int:
    start = version_bytes(store, chain.start_index) if chain.start_index is not None else 0
    return start + sum(version_bytes(store, d) for d in chain.deltas)


def plan_pull(store: VersionStore, chain: Chain, state: AppliedState | None) -> Plan:
    """How to reach ``chain.target`` from ``state`` (None: nothing verified locally): a state
    on the chain (same stream) catches up, unless reseeding from the chain's start moves fewer
    bytes; anything else reseeds and replays, never a silent no-op."""
    target = chain.target
    if state is None:
        reason = "no verified local state"
    else:
        todo = chain.suffix_after(state.version)
        expected_stream = chain.stream_at(state.version)
        # Streams must agree both ways: a version of stream X is not the same-numbered version
        # of a store republished by a publisher that records no stream (the reference trainer).
        foreign = state.version != 0 and state.stream_id != expected_stream
        if todo is None:
            reason = f"local v{state.version:06d} is not on the chain of v{target:06d} " + (
                "(backward target)" if state.version > target else "(another chain or stream)"
            )
        elif foreign:
            reason = (
                f"local v{state.version:06d} is of stream {state.stream_id}, the target's chain "
                f"is stream {expected_stream}"
            )
        elif not todo:
            return Plan("noop", target, state.version)
        else:
            catchup = sum(version_bytes(store, d) for d in todo)
            if chain.partial:
                # A partial chain never includes a full version between the host and the
                # target, so reseeding would move every byte of this catch-up and more.
                return Plan("catchup", target, state.version, todo, catchup)
            reseed_bytes = _reseed_bytes(store, chain)
            if chain.start_index is not None and reseed_bytes < catchup:
                why = f"full version v{chain.start:06d} moves fewer bytes than the chain"
                return Plan("reseed", target, chain.start, chain.deltas, reseed_bytes, why, catchup)
            return Plan("catchup", target, state.version, todo, catchup, "", reseed_bytes)
    return Plan(
        "reseed", target, chain.start, list(chain.deltas), _reseed_bytes(store, chain), reason
    )


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
        return self.digests[self.payloads[-1].version]


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
    """A download sink for one shard of a full version hashing every tensor its metadata
    gives a digest for as its bytes arrive, so a reseed verifies as it downloads."""

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
        try:  # an unknown encoding, compression or checksum
            get_encoding(index.encoding or "")
            check_compression(index.compression)
            checksum = get_checksum(index.checksum or "")
        except ConfigError as exc:
            raise FormatError(f"{where} cannot be applied: {exc}") from None
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

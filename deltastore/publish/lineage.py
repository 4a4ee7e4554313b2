"""Rebuilding the trainer's snapshot from what a store already holds (resume).

A version's state is its chain: a full version (or the base, version 0), then the deltas
forward, as :func:`deltastore.storage.chain.walk_chain` (shared with the engine side) finds
them. Only indexes and shard headers are read (ranged reads, no payloads); they become
per-tensor overlays on the base checkpoint, and the snapshot reads and verifies the bytes when
a tensor is first used.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace

from deltastore.codecs import check_compression, get_checksum, get_encoding
from deltastore.errors import ConfigError, FormatError, StreamError
from deltastore.format import PayloadRef
from deltastore.format.index import VersionIndex, check_shard_names
from deltastore.format.safetensors_io import SafetensorsHeader
from deltastore.publish.snapshot import Snapshot, TensorSource
from deltastore.storage import VersionStore
from deltastore.storage.chain import walk_chain


@dataclass(frozen=True)
class Overlay:
    """What a chain changes about one tensor: a full-version start and/or deltas, and the
    digest of the result. It is relative to the base, so each rank lays it on its own copy."""

    full_version: int | None = None
    shard: str | None = None
    offset: int = 0
    deltas: tuple[PayloadRef, ...] = ()
    checksum: str | None = None
    digest: str | None = None

    def on(self, base: TensorSource) -> TensorSource:
        """``base`` (the tensor in the base checkpoint) with this overlay laid on it."""
        source = replace(base, deltas=self.deltas, checksum=self.checksum, digest=self.digest)
        if self.full_version is None:
            return source
        return replace(
            source, file=None, full_version=self.full_version, shard=self.shard, offset=self.offset
        )


@dataclass(frozen=True)
class Lineage:
    """The state of ``version`` of a stream, as overlays on the base checkpoint."""

    version: int
    start: int
    """0 (the base) or the newest full version on the chain."""
    stream_id: str | None
    overlays: dict[str, Overlay] = field(default_factory=dict)
    deltas: int = 0
    """Deltas on the chain after ``start``, and their wire bytes (for the anchor rule)."""
    wire_bytes: int = 0


def _check_layout(name: str, nbytes: int, sources: dict[str, TensorSource], where: str) -> None:
    base = sources.get(name)
    if base is None:
        raise StreamError(
            f"{where} holds tensor {name!r}, which the base checkpoint lacks; the stream was "
            "built on another base (pass the engines' model path as base_checkpoint)"
        )
    if nbytes != base.nbytes:
        raise StreamError(
            f"{where} holds tensor {name!r} with {nbytes} bytes, the base has {base.nbytes}; "
            "the stream was built on another base"
        )


def rebuild_lineage(
    store: VersionStore,
    target: int,
    sources: dict[str, TensorSource],
    names: Collection[str] | None = None,
) -> Lineage:
    """Overlays that turn the base's ``sources`` into the state of ``target``.

    ``names`` limits the walk to some tensors (only their shards' headers are read). Raises
    :class:`StreamError` when the store's tensors do not fit the base, :class:`FormatError`
    for a corrupt or incomplete version.
    """
    start, deltas = walk_chain(store, target)
    stream = deltas[-1].stream_id if deltas else (start.stream_id if start else None)
    overlays: dict[str, Overlay] = {}
    wanted = None if names is None else set(names)
    if start is not None:
        _overlay_full(store, start, sources, wanted, overlays)
    for delta in deltas:
        _overlay_delta(store, delta, sources, wanted, overlays)
    return Lineage(
        version=target,
        start=start.version if start else 0,
        stream_id=stream,
        overlays=overlays,
        deltas=len(deltas),
        wire_bytes=sum(int(delta.totals.get("wire_bytes", 0)) for delta in deltas),
    )


def _headers(
    store: VersionStore, index: VersionIndex, wanted: set[str] | None, where: str
) -> Iterator[tuple[str, list[str], SafetensorsHeader]]:
    """Each shard of ``index`` holding a wanted tensor (all when ``wanted`` is None), its
    names and its header, checked against the index."""
    for shard, shard_names in index.shards().items():
        if wanted is not None and not wanted.intersection(shard_names):
            continue
        header = store.read_shard_header(index.version, shard)
        check_shard_names(index, shard, set(header.tensors), source=f"{where}/{shard}")
        yield shard, shard_names, header


def _overlay_full(
    store: VersionStore,
    start: VersionIndex,
    sources: dict[str, TensorSource],
    wanted: set[str] | None,
    overlays: dict[str, Overlay],
) -> None:
    """Point the wanted tensors at the full version ``start`` (every tensor of a shard read is
    checked against the base)."""
    where = f"{store.url}/weight_v{start.version:06d}"
    missing = sorted(set(sources) - set(start.weight_map))
    if missing:
        raise FormatError(
            f"full version {where} lacks base tensors {missing[:5]}; a full version must be "
            "complete"
        )
    if start.checksum:
        get_checksum(start.checksum)
    for shard, shard_names, header in _headers(store, start, wanted, where):
        for name in shard_names:
            entry = header.tensors[name]
            _check_layout(name, entry.nbytes, sources, where)
            if wanted is None or name in wanted:
                digest = header.metadata.get(name)
                overlays[name] = Overlay(
                    start.version, shard, entry.start, (), start.checksum, digest
                )


def _overlay_delta(
    store: VersionStore,
    delta: VersionIndex,
    sources: dict[str, TensorSource],
    wanted: set[str] | None,
    overlays: dict[str, Overlay],
) -> None:
    """Append one delta's payloads to the wanted tensors' overlays."""
    where = f"{store.url}/weight_v{delta.version:06d}"
    try:
        encoding = get_encoding(delta.encoding or "")
        check_compression(delta.compression)
        get_checksum(delta.checksum or "")
    except ConfigError as exc:
        raise FormatError(f"{where} cannot be replayed: {exc}") from None
    for shard, shard_names, header in _headers(store, delta, wanted, where):
        for name in shard_names:
            if name not in sources:
                _check_layout(name, 0, sources, where)
            if wanted is not None and name not in wanted:
                continue
            entry = header.tensors[name]
            digest = header.metadata.get(name)
            if digest is None:
                raise FormatError(f"{where}/{shard}: tensor {name!r} has no digest")
            ref = PayloadRef(delta.version, shard, entry.start, entry.end, encoding.name)
            previous = overlays.get(name, Overlay())
            overlays[name] = replace(
                previous, deltas=(*previous.deltas, ref), checksum=delta.checksum, digest=digest
            )


def apply_lineage(
    snapshot: Snapshot, lineage: Lineage, base_sources: dict[str, TensorSource]
) -> None:
    """Point the snapshot's sources at the lineage, laid on this rank's ``base_sources``
    (bytes are read and verified on first use)."""
    for name, overlay in lineage.overlays.items():
        snapshot.set_source(name, overlay.on(base_sources[name]))

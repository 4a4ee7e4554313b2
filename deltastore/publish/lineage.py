"""Rebuilding the trainer's snapshot from what a store already holds (resume).

A version's state is its chain: follow ``base_version`` links back from it to a full version (or
to the base, version 0), then apply the deltas forward. This module walks that chain through a
:class:`VersionStore` (indexes and shard headers only: ranged reads, no payloads) and turns it
into per-tensor :class:`TensorSource` recipes; the snapshot reads and verifies the bytes when a
tensor is first used. The link walk itself is :func:`deltastore.storage.chain.walk_chain`,
shared with the engine side.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from deltastore.codecs import check_compression, get_checksum, get_encoding
from deltastore.errors import ConfigError, FormatError, StreamError
from deltastore.format import PayloadRef
from deltastore.format.index import VersionIndex, check_shard_names
from deltastore.publish.snapshot import Snapshot, TensorSource
from deltastore.storage import VersionStore
from deltastore.storage.chain import walk_chain


@dataclass(frozen=True)
class Overlay:
    """What a chain changes about one tensor: a full-version start and/or deltas, and the
    digest of the result."""

    full_version: int | None
    shard: str | None
    offset: int
    deltas: tuple[PayloadRef, ...]
    checksum: str | None
    digest: str | None


@dataclass(frozen=True)
class Lineage:
    """The state of ``version`` of a stream, as overlays on the base checkpoint."""

    version: int
    start: int
    """0 (the base) or the newest full version on the chain."""
    stream_id: str | None
    overlays: dict[str, Overlay] = field(default_factory=dict)
    deltas: int = 0
    """Deltas on the chain after ``start``."""
    wire_bytes: int = 0
    """Wire bytes of those deltas (what the anchor-by-bytes rule accumulates)."""


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
    wanted = set(sources) if names is None else set(names)
    if start is not None:
        _overlay_full(store, start, sources, wanted, names is not None, overlays)
    wire = 0
    for delta in deltas:
        wire += int(delta.totals.get("wire_bytes", 0))
        _overlay_delta(store, delta, sources, wanted, names is not None, overlays)
    return Lineage(
        version=target,
        start=start.version if start else 0,
        stream_id=stream,
        overlays=overlays,
        deltas=len(deltas),
        wire_bytes=wire,
    )


def _overlay_full(
    store: VersionStore,
    start: VersionIndex,
    sources: dict[str, TensorSource],
    wanted: set[str],
    limited: bool,
    overlays: dict[str, Overlay],
) -> None:
    """Point the ``wanted`` tensors at the full version ``start`` (every base tensor checked
    there; only shards holding a wanted tensor are read when ``limited``)."""
    where = f"{store.url}/weight_v{start.version:06d}"
    missing = sorted(set(sources) - set(start.weight_map))
    if missing:
        raise FormatError(
            f"full version {where} lacks base tensors {missing[:5]}; a full version must be "
            "complete"
        )
    if start.checksum:
        get_checksum(start.checksum)
    for shard, shard_names in start.shards().items():
        if limited and not wanted.intersection(shard_names):
            continue
        header = store.read_shard_header(start.version, shard)
        check_shard_names(start, shard, set(header.tensors), source=f"{where}/{shard}")
        for name in shard_names:
            entry = header.tensors[name]
            _check_layout(name, entry.nbytes, sources, where)
            if name in wanted:
                digest = header.metadata.get(name)
                overlays[name] = Overlay(
                    start.version, shard, entry.start, (), start.checksum, digest
                )


def _overlay_delta(
    store: VersionStore,
    delta: VersionIndex,
    sources: dict[str, TensorSource],
    wanted: set[str],
    limited: bool,
    overlays: dict[str, Overlay],
) -> None:
    """Append one delta's payloads to the ``wanted`` tensors' overlays."""
    where = f"{store.url}/weight_v{delta.version:06d}"
    try:
        encoding = get_encoding(delta.encoding or "")
        check_compression(delta.compression)
        get_checksum(delta.checksum or "")
    except ConfigError as exc:
        raise FormatError(f"{where} cannot be replayed: {exc}") from None
    for shard, shard_names in delta.shards().items():
        if limited and not wanted.intersection(shard_names):
            continue
        header = store.read_shard_header(delta.version, shard)
        check_shard_names(delta, shard, set(header.tensors), source=f"{where}/{shard}")
        for name in shard_names:
            if name not in sources:
                _check_layout(name, 0, sources, where)
            if name not in wanted:
                continue
            entry = header.tensors[name]
            ref = PayloadRef(delta.version, shard, entry.start, entry.end, encoding.name)
            digest = header.metadata.get(name)
            if digest is None:
                raise FormatError(f"{where}/{shard}: tensor {name!r} has no digest")
            previous = overlays.get(name)
            overlays[name] = Overlay(
                previous.full_version if previous else None,
                previous.shard if previous else None,
                previous.offset if previous else 0,
                (previous.deltas if previous else ()) + (ref,),
                delta.checksum,
                digest,
            )


def apply_lineage(
    snapshot: Snapshot, lineage: Lineage, base_sources: dict[str, TensorSource]
) -> None:
    """Point the snapshot's sources at the lineage, built on the base checkpoint's
    ``base_sources`` (bytes are read and verified on first use)."""
    for name, overlay in lineage.overlays.items():
        base = base_sources[name]
        if overlay.full_version is not None:
            source = replace(
                base,
                file=None,
                full_version=overlay.full_version,
                shard=overlay.shard,
                offset=overlay.offset,
                deltas=overlay.deltas,
                checksum=overlay.checksum,
                digest=overlay.digest,
            )
        else:
            source = replace(
                base, deltas=overlay.deltas, checksum=overlay.checksum, digest=overlay.digest
            )
        snapshot.set_source(name, source)

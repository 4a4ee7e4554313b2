"""Rank 0's planning of a version as pure functions over the ranks' messages (replicas, delta
or full, who writes which shard, completeness, the index): tested with plain values.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from deltastore.codecs import COMPRESSION_NAME
from deltastore.errors import PublishError
from deltastore.format.index import VersionIndex
from deltastore.format.names import delta_shard_name, full_shard_name
from deltastore.publish.config import PublisherConfig
from deltastore.publish.messages import (
    DiffReport,
    Failure,
    Layout,
    Placement,
    PublishResult,
    ShardJob,
    StreamState,
    TensorChange,
    Written,
    rank_errors,
)

Shards = tuple[tuple[ShardJob, ...], ...]
Holders = dict[str, list[tuple[int, TensorChange | None]]]  # name -> (rank, change), rank order


def divergent_replicas(holders: Holders, version: int) -> Failure | None:
    """A failure naming tensors passed on several ranks with different new bytes, or None."""
    divergent = []
    ranks: set[int] = set()
    for name, held in sorted(holders.items()):
        if len({change.digest if change else None for _, change in held}) > 1:
            states = ", ".join(
                f"rank {rank}: {'digest ' + change.digest if change else 'unchanged'}"
                for rank, change in held
            )
            divergent.append(f"{name!r} ({states})")
            ranks.update(rank for rank, _ in held)
    if not divergent:
        return None
    return Failure(
        f"replicated tensors differ across ranks {sorted(ranks)}: {'; '.join(divergent[:5])}; "
        "a tensor passed on several ranks must be identical on each. Nothing was committed "
        f"for weight_v{version:06d}"
    )


def wants_full(
    reports: Sequence[DiffReport],
    stream: StreamState,
    config: PublisherConfig,
    *,
    wire_estimate: int,
    total_bytes: int,
) -> bool:
    """Whether this version is a full one: asked for by a rank, or due by an anchor rule."""
    every, share = config.anchor_every, config.anchor_chain_bytes
    if any(r.full for r in reports):
        return True
    if every and stream.chain_deltas + 1 >= every:
        return True
    return bool(share and stream.chain_wire + wire_estimate > share * total_bytes)


def assign_delta(owner: Mapping[str, int], changed: Sequence[str], world_size: int) -> Shards:
    """One delta shard per rank that owns a changed tensor, numbered gap-free across them."""
    per_rank: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(changed):
        per_rank[owner[name]].append(name)
    writers = [r for r in range(world_size) if per_rank[r]]
    shards: list[tuple[ShardJob, ...]] = [() for _ in range(world_size)]
    for i, rank in enumerate(writers):
        shards[rank] = (ShardJob(delta_shard_name(i, len(writers)), tuple(per_rank[rank])),)
    return tuple(shards)


def assign_full(
    sizes: Mapping[str, int],
    owner: Mapping[str, int],
    holders: Mapping[str, int],
    world_size: int,
    max_shard_bytes: int,
) -> Shards:
    """Every tensor of the model (``sizes``, in checkpoint order) on one rank: its owner, else
    the rank that last published it, else the least loaded; in shards of bounded size."""
    load = [0] * world_size
    for name, rank in owner.items():
        load[rank] += sizes[name]
    per_rank: list[list[str]] = [[] for _ in range(world_size)]
    for name, nbytes in sizes.items():
        rank = owner.get(name, holders.get(name, -1))
        if not 0 <= rank < world_size:
            rank = min(range(world_size), key=lambda r: load[r])
        if name not in owner:
            load[rank] += nbytes
        per_rank[rank].append(name)
    groups = [_bounded_groups(names, sizes, max_shard_bytes) for names in per_rank]
    count = sum(len(g) for g in groups)
    numbers = itertools.count()
    return tuple(
        tuple(ShardJob(full_shard_name(next(numbers), count), tuple(names)) for names in group)
        for group in groups
    )


def _bounded_groups(names: list[str], sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = []
    size = 0
    for name in names:
        if not groups or (groups[-1] and size + sizes[name] > max_bytes):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += sizes[name]
    return groups


def plan_layout(
    reports: Sequence[DiffReport],
    stream: StreamState,
    sizes: Mapping[str, int],
    config: PublisherConfig,
) -> Layout | Failure:
    """Rank 0's whole decision for the next version from every rank's report (one a rank)."""
    version = stream.next_version
    failed = rank_errors(reports)
    if failed:
        return Failure(
            f"publishing weight_v{version:06d} failed on {failed}; nothing was committed and "
            "no snapshot advanced"
        )
    holders: Holders = {}
    for report in sorted(reports, key=lambda r: r.rank):
        for name, change in report.passed.items():
            holders.setdefault(name, []).append((report.rank, change))
    failure = divergent_replicas(holders, version)
    if failure is not None:
        return failure
    owner = {name: held[0][0] for name, held in holders.items()}  # the lowest rank passing it
    changes = {name: held[0][1] for name, held in holders.items() if held[0][1] is not None}
    full = wants_full(
        reports,
        stream,
        config,
        wire_estimate=sum(c.payload_bytes for c in changes.values()),
        total_bytes=sum(sizes.values()),
    )
    if full:
        shards = assign_full(sizes, owner, stream.holders, len(reports), config.max_shard_bytes)
    else:
        shards = assign_delta(owner, list(changes), len(reports))
    changed = {name: change.changed_bytes for name, change in changes.items()}
    return Layout(full=full, shards=shards, changed=changed, owner=owner)


def written_failure(writes: Sequence[Written], version: int, url: str) -> Failure | None:
    """A failure naming every rank whose shard writes failed, or None."""
    failed = rank_errors(writes)
    if not failed:
        return None
    return Failure(
        f"writing weight_v{version:06d} to {url} failed on {failed}; nothing was committed "
        "(its files were removed) and no snapshot advanced"
    )


def check_written(
    layout: Layout, writes: Sequence[Written], sizes: Mapping[str, int], version: int
) -> dict[str, Placement]:
    """Every tensor's placement, once each, exactly the expected set (and sizes, if full);
    else :class:`PublishError` naming the tensors at fault."""
    entries: dict[str, Placement] = {}
    for w in writes:
        twice = set(entries) & set(w.entries)
        if twice:
            raise PublishError(f"tensors {sorted(twice)[:5]} were written by two ranks")
        entries.update(w.entries)
    expected = set(sizes) if layout.full else set(layout.changed)
    if set(entries) != expected:
        missing = sorted(expected - set(entries))[:5]
        extra = sorted(set(entries) - expected)[:5]
        raise PublishError(
            f"weight_v{version:06d} is incomplete: missing {missing}, unexpected {extra}"
        )
    if layout.full:
        wrong = [n for n, e in entries.items() if e.nbytes != sizes[n]]
        if wrong:
            raise PublishError(f"full weight_v{version:06d} has wrong sizes for {wrong[:5]}")
    return entries


def version_totals(
    layout: Layout, writes: Sequence[Written], stream: StreamState, total_bytes: int, version: int
) -> PublishResult:
    """The global totals of the version ``layout`` describes."""
    return PublishResult(
        version=version,
        kind="full" if layout.full else "delta",
        base_version=None if layout.full else stream.base_version,
        tensors_changed=len(layout.changed),
        changed_bytes=sum(layout.changed.values()),
        total_bytes=total_bytes,
        wire_bytes=sum(w.wire for w in writes),
    )


def build_index(
    token: str,
    layout: Layout,
    entries: Mapping[str, Placement],
    totals: PublishResult,
    stream: StreamState,
    *,
    encoding: str,
    checksum: str,
) -> VersionIndex:
    """The index that commits ``totals``' version (reference keys plus deltastore's own)."""
    return VersionIndex(
        version=totals.version,
        weight_map={n: e.shard for n, e in entries.items()},
        base_version=totals.base_version,
        encoding=None if layout.full else encoding,
        compression=None if layout.full else COMPRESSION_NAME,
        checksum=checksum,
        stream_id=stream.stream_id,
        commit_token=token,
        totals={
            "total_bytes": totals.total_bytes,
            "changed_bytes": totals.changed_bytes,
            "wire_bytes": totals.wire_bytes,
            "tensor_count": len(entries),
        },
        extra={"total_size": totals.total_bytes} if layout.full else {},
    )

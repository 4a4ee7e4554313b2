"""Which source versions a replica gets, in which order, and which destination versions go.

Pure decisions over listings and indexes; nothing here writes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from deltastore.errors import VersionNotFoundError
from deltastore.format.index import VersionIndex
from deltastore.storage import VersionStore
from deltastore.storage.chain import walk_chain
from deltastore.storage.prune import needed_versions

log = logging.getLogger("deltastore.replicate")


def same_content(a: VersionIndex, b: VersionIndex) -> bool:
    """Whether two indexes publish the same version: equal in everything but the token of the
    writer that committed each copy (:meth:`VersionIndex.content_digest`)."""
    return a.content_digest() == b.content_digest()


def start_version(src: VersionStore, src_versions: list[int], from_version: int | None) -> int:
    """The first source version a replica needs so that it can serve ``from_version`` on.

    None: the oldest the source lists. Otherwise the start of the chain of the newest source
    version at or below ``from_version`` (the full version it builds on, or its first delta on
    the base when the chain goes back to version 0), so older deltas are skipped and every
    copied delta finds its base in the replica or on the engines (version 0).
    """
    if not src_versions:
        return 1
    if from_version is None:
        return src_versions[0]
    at_or_below = [v for v in src_versions if v <= from_version]
    if not at_or_below:
        return from_version
    full, deltas = walk_chain(src, at_or_below[-1])
    if full is not None:
        return full.version
    return deltas[0].version if deltas else at_or_below[-1]


def versions_to_copy(
    src_versions: Iterable[int], dst_versions: Iterable[int], start: int
) -> tuple[list[int], list[int]]:
    """(to copy in ascending order, skipped): source versions from ``start`` on that are newer
    than the destination's newest. A version older than that is never inserted behind it: a
    reader that saw the newer one must never see history change below it."""
    dst_set = set(dst_versions)
    floor = max(dst_set, default=0)
    todo: list[int] = []
    skipped: list[int] = []
    for version in sorted(src_versions):
        if version in dst_set:
            continue
        (todo if version > floor and version >= start else skipped).append(version)
    return todo, skipped


def chain_holds(index: VersionIndex, dst_versions: set[int]) -> bool:
    """Whether the destination can serve ``index``: a full version, a delta on the base
    (version 0, which engines hold), or a delta on a version the destination has committed."""
    return not index.is_delta or not index.base_version or index.base_version in dst_versions


def prune_keep(dst: VersionStore, src_versions: set[int], dst_versions: list[int]) -> int | None:
    """``keep`` for the destination's own prune so that it mirrors the source's pruning.

    Destination versions older than the oldest the source still lists are the candidates;
    prune keeps every newer one and every chain they need, so only versions the source no
    longer lists AND that no kept chain needs are dropped. None: nothing to drop.
    """
    listed = [v for v in dst_versions if v in src_versions]
    if not listed:
        return None  # the source lists none of ours: mirroring would empty the replica
    oldest_listed = min(listed)
    keep = sum(1 for v in dst_versions if v >= oldest_listed)
    needed = needed_versions(dst, sorted(listed, reverse=True), set(dst_versions))
    droppable = [v for v in dst_versions if v < oldest_listed and v not in needed]
    return keep if droppable else None


def newest_common_check(
    src: VersionStore, dst: VersionStore, src_versions: list[int], dst_versions: list[int]
) -> tuple[int, VersionIndex, VersionIndex] | None:
    """The newest version both stores list, with both indexes, if they differ (another stream
    in the destination); None when they agree or share no version."""
    common = sorted(set(src_versions) & set(dst_versions))
    if not common:
        return None
    version = common[-1]
    try:
        ours, theirs = src.index(version), dst.index(version)
    except VersionNotFoundError:
        return None  # pruned meanwhile: the next round looks again
    return None if same_content(ours, theirs) else (version, ours, theirs)

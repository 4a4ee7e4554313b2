"""``replicate(src, dst)``: committed versions of one store into another, in order.

Each round lists both stores (caches dropped), picks the source versions the destination lacks
and is behind on, and copies them oldest first, each through the destination's version-writing
transaction (see :mod:`deltastore.replicate.version`). ``follow`` repeats rounds, waiting a
jittered, doubling interval while nothing is new; ``prune_like_source`` then unpublishes, with
the destination's own prune rules, versions the source no longer lists and no kept chain needs.
The decisions of a round (which versions, in which order, which go) are pure functions here.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Iterable
from typing import Any

from deltastore.errors import ConfigError, StreamError, VersionNotFoundError
from deltastore.format.index import VersionIndex
from deltastore.format.names import version_dir_name
from deltastore.replicate.report import (
    Observer,
    ReplicationPolicy,
    ReplicationReport,
    VersionCopy,
)
from deltastore.replicate.version import VersionCopier, same_content
from deltastore.storage import VersionStore, is_transient
from deltastore.storage.chain import walk_chain
from deltastore.storage.listing import no_store_error
from deltastore.storage.prune import needed_versions

log = logging.getLogger("deltastore.replicate")

StoreLike = VersionStore | str | os.PathLike[str]


def _open(store: StoreLike, options: dict[str, Any] | None, side: str) -> VersionStore:
    if isinstance(store, VersionStore):
        if options:
            raise ConfigError(f"{side} is a VersionStore already; pass its storage options to it")
        return store
    return VersionStore(store, options)


def start_version(src: VersionStore, src_versions: list[int], from_version: int | None) -> int:
    """The first source version a replica needs so that it can serve ``from_version`` on
    (None: the oldest the source lists): the start of the chain of the newest source version at
    or below it (its full version, or its first delta on the base), so older deltas are skipped
    and every copied delta finds its base in the replica or on the engines (version 0)."""
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
    """``keep`` for the destination's own prune so that it mirrors the source's pruning: only
    versions older than the oldest the source still lists, that no kept chain needs, are
    dropped. None: nothing to drop."""
    listed = [v for v in dst_versions if v in src_versions]
    if not listed:
        return None  # the source lists none of ours: mirroring would empty the replica
    oldest_listed = min(listed)
    keep = sum(1 for v in dst_versions if v >= oldest_listed)
    needed = needed_versions(dst, sorted(listed, reverse=True), set(dst_versions))
    droppable = [v for v in dst_versions if v < oldest_listed and v not in needed]
    return keep if droppable else None


def check_same_run(
    src: VersionStore, dst: VersionStore, src_versions: list[int], dst_versions: list[int]
) -> None:
    """:class:`StreamError` when the newest version both stores list differs between them
    (the destination replicates another run)."""
    common = sorted(set(src_versions) & set(dst_versions))
    if not common:
        return
    version = common[-1]
    try:
        ours, theirs = src.index(version), dst.index(version)
    except VersionNotFoundError:
        return  # pruned meanwhile: the next round looks again
    if not same_content(ours, theirs):
        raise StreamError(
            f"{version_dir_name(version)} differs between {src.url} (stream "
            f"{ours.stream_id}) and {dst.url} (stream {theirs.stream_id}); the "
            "destination replicates another run: point the replicator at an empty one"
        )


class Replicator:
    """The rounds (:meth:`run`) of one replicator, copying with ``copier``."""

    def __init__(self, copier: VersionCopier) -> None:
        self.copier = copier
        self.src, self.dst, self.policy = copier.src, copier.dst, copier.policy
        self.observer = copier.observer
        self.records: list[VersionCopy] = []
        self.skipped: set[int] = set()
        self.pruned: list[int] = []
        self._start: int | None = None

    def run(
        self, from_version: int | None, follow: bool, prune: bool, stop: threading.Event
    ) -> ReplicationReport:
        started = time.monotonic()
        delay = self.policy.poll_min_s
        while not stop.is_set():
            try:
                found = self.round(from_version, stop)
                if prune:
                    self.pruned.extend(self.mirror_pruning())
            except Exception as exc:
                if not follow or not is_transient(exc):
                    raise
                log.warning("replicating %s to %s: %s; trying again", self.src, self.dst, exc)
                found = False
            if not follow:
                break
            if found:
                delay = self.policy.poll_min_s
            else:
                self.observer.idle(self.dst.latest())
                delay = min(delay * 2, self.policy.poll_max_s)
            stop.wait(random.uniform(delay / 2, delay))
        return ReplicationReport(
            src=self.src.url,
            dst=self.dst.url,
            versions=tuple(self.records),
            skipped=tuple(sorted(self.skipped)),
            pruned=tuple(self.pruned),
            seconds=time.monotonic() - started,
            latest=self.dst.latest(),
        )

    def round(self, from_version: int | None, stop: threading.Event) -> bool:
        """Copy what the destination lacks now; True if anything new was found."""
        self.src.refresh()
        self.dst.refresh()
        src_versions, dst_versions = self.src.versions(), self.dst.versions()
        check_same_run(self.src, self.dst, src_versions, dst_versions)
        if self._start is None and src_versions:
            self._start = start_version(self.src, src_versions, from_version)
        todo, skipped = versions_to_copy(src_versions, dst_versions, self._start or 0)
        self.skipped.update(skipped)
        committed = set(dst_versions)
        for version in todo:
            if stop.is_set():
                break
            try:
                index = self.src.index(version)
            except VersionNotFoundError:
                self.skipped.add(version)  # pruned at the source since it was listed
                continue
            if not chain_holds(index, committed):
                log.warning(
                    "%s is a delta on weight_v%06d, which %s does not hold; skipped until the "
                    "next full version",
                    version_dir_name(version),
                    index.base_version or 0,
                    self.dst.url,
                )
                self.skipped.add(version)
                continue
            record = self.copier.copy(version, index)
            if record is None:
                self.skipped.add(version)
                continue
            committed.add(version)
            self.skipped.discard(version)
            self.records.append(record)
            self.observer.version_done(record)
        return bool(todo)

    def mirror_pruning(self) -> list[int]:
        """Unpublish destination versions the source no longer lists (prune's rules)."""
        src_versions = set(self.src.versions())
        dst_versions = self.dst.versions()
        keep = prune_keep(self.dst, src_versions, dst_versions)
        if keep is None:
            return []
        grace = self.policy.prune_grace_s
        plan = self.dst.prune(keep=keep, grace_s=grace, dry_run=True)
        if set(plan.unpublish) & src_versions:
            log.warning("not pruning %s: the destination changed meanwhile", self.dst.url)
            return []
        report = self.dst.prune(keep=keep, grace_s=grace)
        return list(report.unpublish)


def replicate(
    src: StoreLike,
    dst: StoreLike,
    *,
    from_version: int | None = None,
    verify: bool = False,
    jobs: int = 4,
    follow: bool = False,
    prune_like_source: bool = False,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    policy: ReplicationPolicy | None = None,
    observer: Observer | None = None,
    stop: threading.Event | None = None,
) -> ReplicationReport:
    """Copy every committed version of ``src`` that ``dst`` lacks, oldest first, each through
    ``dst``'s version-writing transaction, with the source's index content (docs/api.md).

    ``from_version``: a new replica starts at the chain start of the newest version at or
    below it. ``verify``: recompute every tensor digest of full versions, check that every
    tensor of a delta carries one, and read each copied file back (without it: sizes only).
    ``jobs``: files and byte ranges in flight. ``follow``: keep copying until ``stop`` is set.
    ``prune_like_source``: unpublish what the source pruned (after ``policy.prune_grace_s``).
    Raises :class:`ConfigError` for bad arguments, :class:`StreamError` when ``dst`` holds
    another run, :class:`IntegrityError` / :class:`FormatError` for a corrupt source version,
    and store errors that outlast the retries (in ``follow``, transient ones are waited out).
    """
    if jobs < 1:
        raise ConfigError(f"jobs={jobs}: at least one transfer must run")
    if from_version is not None and from_version < 0:
        raise ConfigError(f"from_version={from_version} is negative")
    src_store = _open(src, src_storage_options, "src")
    dst_store = _open(dst, dst_storage_options, "dst")
    if src_store.url == dst_store.url and src_store.storage_options == dst_store.storage_options:
        raise ConfigError(f"source and destination are the same store ({src_store.url})")
    if src_store.is_local and not os.path.isdir(src_store.root):
        # A mistyped path must not read as an empty source and report success.
        raise no_store_error(src_store.url)
    policy, observer = policy or ReplicationPolicy(), observer or Observer()
    copier = VersionCopier(
        src_store, dst_store, verify=verify, jobs=jobs, policy=policy, observer=observer
    )
    replicator = Replicator(copier)
    try:
        return replicator.run(from_version, follow, prune_like_source, stop or threading.Event())
    finally:
        copier.close()

"""Pruning old versions and garbage from a store, in two phases.

Retention keeps the newest ``keep`` committed versions *and every version needed to reach
them* (each kept version's ``base_version`` links back to a full version or the base), so a host
can always rebuild any kept version. Deletion is two-phase, so a host mid-pull is not cut off:

1. **Unpublish**: a tombstone ``_claims/weight_vNNNNNN.abort`` is created, then the version's
   index is removed; its shards stay.
2. **Delete**: on a later run, once the tombstone is older than ``grace_s``, the index (if a
   late one landed), the shards and the claim go; the tombstone stays for good, so an index
   that lands late is never visible. A reader that loses a file mid-read gets
   :class:`~deltastore.errors.VersionNotFoundError` telling it to re-resolve.

Uncommitted leftovers (a claim and shards, no index) older than ``grace_s`` are first
**fenced** with a create-only tombstone, so their writer can never commit them (the writer
checks before and after writing its index), then deleted. ``grace_s=0`` does both phases in one
run. Prune reaches the store only through its :class:`~deltastore.storage.writer.StoreObjects`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deltastore.errors import ConfigError, VersionNotFoundError
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME
from deltastore.progress import ProgressCallback, ProgressMeter
from deltastore.storage.chain import IndexSource, iter_chain
from deltastore.storage.listing import StoreListing, age

if TYPE_CHECKING:
    from deltastore.storage.writer import StoreObjects

log = logging.getLogger("deltastore.storage")


@dataclass(frozen=True)
class PruneReport:
    """What a prune run found and did (or, with ``dry_run``, would do). Versions ascending."""

    keep: tuple[int, ...]
    """Committed versions that stay published (the newest ``keep`` and their chains)."""
    unpublish: tuple[int, ...]
    """Committed versions unpublished now (tombstone, then index removed; data stays)."""
    fence: tuple[int, ...]
    """Uncommitted versions older than the grace period, fenced now with a tombstone."""
    delete: tuple[int, ...]
    """Versions whose data is deleted now (unpublished or fenced, past the grace period)."""
    waiting: tuple[int, ...]
    """Unpublished or uncommitted versions still inside the grace period (left alone)."""
    stray: tuple[str, ...]
    """Store-internal leftovers (old probe objects, partial temp files) removed now."""
    dry_run: bool
    grace_s: float
    committed_meanwhile: tuple[int, ...] = ()
    """Versions committed while being fenced: left published."""
    chain_kept: tuple[int, ...] = ()
    """Kept versions beyond the newest ``keep``: a newer kept delta's chain needs them."""

    @property
    def changes(self) -> bool:
        return bool(self.unpublish or self.fence or self.delete or self.stray)

    def lines(self) -> list[str]:
        """A human-readable summary, one line per category."""
        verb = "would" if self.dry_run else "did"

        def fmt(versions: tuple[int, ...]) -> str:
            return ", ".join(f"v{v:06d}" for v in versions) or "none"

        lines = [
            f"keep ({len(self.keep)}): {fmt(self.keep)}",
            f"{verb} unpublish ({len(self.unpublish)}): {fmt(self.unpublish)}",
            f"{verb} fence stale uncommitted ({len(self.fence)}): {fmt(self.fence)}",
            f"{verb} delete data ({len(self.delete)}): {fmt(self.delete)}",
            f"waiting for the {self.grace_s:g} s grace period ({len(self.waiting)}): "
            f"{fmt(self.waiting)}",
        ]
        if self.stray:
            lines.append(f"{verb} remove {len(self.stray)} stray internal object(s)")
        if self.chain_kept:
            newer = tuple(v for v in self.keep if v not in self.chain_kept)
            one = len(newer) == 1
            deltas = "is a delta whose chain needs" if one else "are deltas whose chains need"
            lines.append(
                f"why more than asked: {fmt(newer)} {deltas} "
                f"{fmt(self.chain_kept)}; only a full version (`deltastore publish --full`, or "
                "anchors) lets the versions before it be pruned"
            )
        if self.committed_meanwhile:
            lines.append(f"committed while fencing, kept: {fmt(self.committed_meanwhile)}")
        return lines


def needed_versions(store: IndexSource, roots: list[int], committed: set[int]) -> set[int]:
    """Every version on the chains of ``roots``; a link to a version that is not committed
    ends that walk with a warning (the chain is broken; pull will say so)."""
    needed: set[int] = set()
    for root in roots:

        def read(version: int, root: int = root) -> VersionIndex | None:
            if version in needed:
                return None
            if version not in committed:
                log.warning(
                    "%s: weight_v%06d needs weight_v%06d, which is not committed; its chain is "
                    "broken",
                    store.url,
                    root,
                    version,
                )
                return None
            try:
                return store.index(version)
            except VersionNotFoundError:
                return None

        needed.update(index.version for index in iter_chain(root, read))
    return needed


def plan(
    store: StoreObjects, keep: int, grace_s: float, listing: StoreListing, now: float
) -> PruneReport:
    """Decide what a prune run does, from one listing (nothing is changed)."""
    committed = listing.committed
    newest = committed[-keep:]
    needed = needed_versions(store, list(reversed(newest)), set(committed))
    unpublish = [v for v in committed if v not in needed]
    fence: list[int] = []
    delete: list[int] = []
    waiting: list[int] = []
    uncommitted = (set(listing.files) | set(listing.claims) | set(listing.aborted)) - set(committed)
    for version in sorted(uncommitted):
        if version in listing.aborted:
            if version not in listing.files and version not in listing.claims:
                continue  # a tombstone whose data is gone: nothing left to do
            # Unpublished or fenced by an earlier run: data goes once the marker is old.
            if age(listing.aborted[version], now=now) >= grace_s:
                delete.append(version)
            else:
                waiting.append(version)
            continue
        if listing.idle_s(version, now) >= grace_s:
            fence.append(version)
            delete.append(version)
        else:
            waiting.append(version)
    if grace_s <= 0:
        delete.extend(unpublish)
    stray = [path for path, entry in listing.other.items() if age(entry, now=now) >= grace_s]
    return PruneReport(
        keep=tuple(sorted(needed)),
        unpublish=tuple(unpublish),
        fence=tuple(fence),
        delete=tuple(sorted(set(delete))),
        waiting=tuple(waiting),
        stray=tuple(sorted(stray)),
        dry_run=True,
        grace_s=grace_s,
        chain_kept=tuple(sorted(needed - set(newest))),
    )


class _Sizes:
    """Bytes a prune run removes at each step, from the listing it planned with."""

    def __init__(self, listing: StoreListing, report: PruneReport) -> None:
        self.listing = listing
        self.unpublished = set(report.unpublish)

    def index(self, version: int) -> int:
        entry = self.listing.files.get(version, {}).get(INDEX_NAME)
        return 0 if entry is None else entry.size

    def data(self, version: int) -> int:
        """A deleted version's files and claim (its index is counted when unpublished)."""
        files = sum(e.size for e in self.listing.files.get(version, {}).values())
        claim = self.listing.claims.get(version)
        already = self.index(version) if version in self.unpublished else 0
        return files + (0 if claim is None else claim.size) - already

    def total(self, report: PruneReport) -> int:
        return (
            sum(self.index(v) for v in report.unpublish)
            + sum(self.data(v) for v in report.delete)
            + sum(self.listing.other[p].size for p in report.stray)
        )


def _fence(store: StoreObjects, versions: tuple[int, ...]) -> list[int]:
    """Fence stale uncommitted versions; returns those committed meanwhile (left alone)."""
    meanwhile: list[int] = []
    for version in versions:
        token = store.write_tombstone(version, "fenced")
        # The writer may have committed between our listing and our tombstone. It writes its
        # index, then checks for a tombstone; we write the tombstone, then check for an index:
        # one of the two sees the other. Seeing an index, we back off (the writer, had it seen
        # our tombstone, withdraws its index and reports the conflict).
        if store.exists(store.file_path(version, INDEX_NAME)):
            marker = store.read_optional(store.abort_path(version)) or b""
            if token and token.encode() in marker:
                store.remove(store.abort_path(version))
            meanwhile.append(version)
            log.warning("%s: weight_v%06d was committed while being fenced", store.url, version)
            continue
        log.info("%s: fenced stale uncommitted weight_v%06d", store.url, version)
    return meanwhile


def _delete(store: StoreObjects, version: int) -> None:
    # Index first: a half-finished delete must never leave an index without its shards. The
    # tombstone stays for good: an index that lands late is never visible.
    store.remove(store.file_path(version, INDEX_NAME))
    store.remove(store.version_path(version), recursive=True)
    store.remove(store.claim_path(version))
    log.info("%s: deleted the data of weight_v%06d", store.url, version)


def check_prune_args(keep: int, grace_s: float) -> None:
    """The checks :func:`prune` makes before it reads the store."""
    if keep < 1:
        raise ConfigError(f"prune keep={keep}: at least the latest version must be kept")
    if grace_s < 0:
        raise ConfigError(f"prune grace period {grace_s} s is negative")


def prune(
    store: StoreObjects, keep: int, grace_s: float, dry_run: bool, progress: ProgressCallback | None
) -> PruneReport:
    check_prune_args(keep, grace_s)
    store.refresh()
    listing = store.listing()
    report = plan(store, keep, grace_s, listing, time.time())
    if dry_run:
        return report
    sizes = _Sizes(listing, report)
    meter = ProgressMeter.start(progress, "prune", sizes.total(report) if progress else None)
    advance = meter.advance if meter is not None else (lambda n: None)
    for version in report.unpublish:
        store.write_tombstone(version, "pruned")
        store.remove(store.file_path(version, INDEX_NAME))
        log.info("%s: unpublished weight_v%06d", store.url, version)
        advance(sizes.index(version))
    meanwhile = _fence(store, report.fence)
    for version in report.delete:
        if version not in meanwhile:
            _delete(store, version)
        advance(sizes.data(version))
    for path in report.stray:
        store.remove(path)
        advance(listing.other[path].size)
    return dataclasses.replace(
        report,
        fence=tuple(v for v in report.fence if v not in meanwhile),
        delete=tuple(v for v in report.delete if v not in meanwhile),
        dry_run=False,
        committed_meanwhile=tuple(meanwhile),
    )

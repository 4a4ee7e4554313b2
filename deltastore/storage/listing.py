"""What a store holds, from one recursive listing: plain values, no store behind them."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import logging
from dataclasses import dataclass, field
from typing import Any

from deltastore.errors import ConfigError
from deltastore.format.names import INDEX_NAME, parse_version_dir, version_dir_name

log = logging.getLogger("deltastore.storage")

CLAIMS_DIR = "_claims"  # store-internal objects: claims, tombstones, successors, probes
CLAIM_SUFFIX = ".json"
ABORT_SUFFIX = ".abort"  # a version's tombstone (permanent)
SUCCESSOR_SUFFIX = ".successor-"
PROBE_PREFIX = "_probe-"


def modified_time(info: dict[str, Any]) -> float | None:
    """Modification time (POSIX seconds) from an fsspec info dict of any backend, if any."""
    for key in ("mtime", "LastModified", "updated", "created", "timeCreated"):
        value = info.get(key)
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, _dt.datetime):
            return value.timestamp()
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return _dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


def age(*entries: FileEntry, now: float) -> float:
    """Seconds since the newest of ``entries`` was modified; infinite when none has a time."""
    times = [e.mtime for e in entries if e.mtime is not None]
    return now - max(times) if times else float("inf")


@dataclass(frozen=True)
class FileEntry:
    size: int
    mtime: float | None
    """Modification time in POSIX seconds (the server's clock on object stores)."""


@dataclass(frozen=True)
class StoreListing:
    """Everything under a store's root, from one recursive listing."""

    indexes: frozenset[int]
    """Versions whose index exists (committed, unless also aborted)."""
    aborted: dict[int, FileEntry]
    """Versions with a tombstone (fenced or unpublished by prune)."""
    claims: dict[int, FileEntry]
    files: dict[int, dict[str, FileEntry]]
    """Version → file name → entry, for every file inside a version directory."""
    other: dict[str, FileEntry] = field(default_factory=dict)
    """Store-internal leftovers under ``_claims/`` (probes, partial temp files): path → entry."""

    @property
    def committed(self) -> list[int]:
        return sorted(v for v in self.indexes if v not in self.aborted)

    def idle_s(self, version: int, now: float) -> float:
        """Seconds since the last sign of life of ``version``'s writer (its claim or any of its
        files); infinite when the backend gives no times."""
        entries = [*self.files.get(version, {}).values()]
        if version in self.claims:
            entries.append(self.claims[version])
        return age(*entries, now=now)

    @property
    def holds_nothing(self) -> bool:
        """Nothing under the root was written by a publisher (no store is there)."""
        return not (self.indexes or self.files or self.claims or self.aborted or self.other)


def no_store_error(url: str) -> ConfigError:
    """The one error for a URL where no store is: every command and call says it so."""
    return ConfigError(f"no store at {url}: nothing was ever published there; check the store URL")


def _internal(rel: str, path: str, entry: FileEntry, listing: StoreListing) -> None:
    if rel.endswith(".lock") or SUCCESSOR_SUFFIX in rel:
        return  # a local mirror's lock file, or a successor: never garbage
    for suffix, bucket in ((CLAIM_SUFFIX, listing.claims), (ABORT_SUFFIX, listing.aborted)):
        if rel.endswith(suffix) and "/" not in rel:
            version = parse_version_dir(rel[: -len(suffix)])
            if version is not None:
                bucket[version] = entry
                return
    listing.other[path] = entry


def parse_listing(found: dict[str, dict[str, Any]], root: str) -> StoreListing:
    """A :class:`StoreListing` from one ``find(detail=True)`` of ``root``. Only canonical
    version directory names count: readers open only those, so listing and reading agree."""
    prefix = root.rstrip("/") + "/"
    listing = StoreListing(frozenset(), {}, {}, {})
    for path, info in found.items():
        if info.get("type", "file") != "file":
            continue
        path = path if path.startswith(prefix) else "/" + path.lstrip("/")
        if not path.startswith(prefix):
            continue
        entry = FileEntry(int(info.get("size") or 0), modified_time(info))
        top, _, rest = path[len(prefix) :].partition("/")
        if top == CLAIMS_DIR:
            _internal(rest, path, entry, listing)
            continue
        version = parse_version_dir(top)
        if version is None or not rest or "/" in rest or version < 1:
            continue
        if top != version_dir_name(version):
            log.debug("%s: ignoring non-canonical version directory %s", root, top)
            continue
        listing.files.setdefault(version, {})[rest] = entry
    indexes = frozenset(v for v, files in listing.files.items() if INDEX_NAME in files)
    return dataclasses.replace(listing, indexes=indexes)

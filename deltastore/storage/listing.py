"""What a store holds, from one recursive listing: plain values, no store behind them."""

from __future__ import annotations

import contextlib
import datetime as _dt
from dataclasses import dataclass, field
from typing import Any


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


@dataclass(frozen=True)
class FileEntry:
    """One object of a store listing."""

    size: int
    mtime: float | None
    """Modification time in POSIX seconds (the server's clock on object stores)."""


@dataclass(frozen=True)
class StoreListing:
    """Everything under a store's root, from one recursive listing."""

    indexes: frozenset[int]
    """Versions whose index exists (committed, unless also aborted)."""
    aborted: dict[int, FileEntry]
    """Versions with an abort marker (fenced or unpublished by prune)."""
    claims: dict[int, FileEntry]
    files: dict[int, dict[str, FileEntry]]
    """Version → file name → entry, for every file inside a version directory."""
    other: dict[str, FileEntry] = field(default_factory=dict)
    """Store-internal leftovers under ``_claims/`` (probes, partial temp files): path → entry."""

    @property
    def committed(self) -> list[int]:
        """Committed versions, ascending."""
        return sorted(v for v in self.indexes if v not in self.aborted)

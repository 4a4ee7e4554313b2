"""Where one delta payload lies in a published version: a shard and a byte range."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PayloadRef:
    """A delta payload (one zstd frame) at bytes ``[start, end)`` of a published shard, in
    the registered encoding its index names."""

    version: int
    shard: str
    start: int
    end: int
    encoding: str

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def where(self) -> str:
        """The version dir, for messages."""
        return f"weight_v{self.version:06d}"

"""Where one delta payload lies in a published version: a shard and a byte range."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PayloadRef:
    """A delta payload (one zstd frame) inside a published shard.

    Shared by the publisher (rebuilding its snapshot from the store) and the pull side
    (applying a run of deltas). ``encoding`` is the registered encoding's name, as the
    version's index records it.
    """

    version: int
    shard: str
    start: int
    """Absolute byte offset of the frame in the shard file."""
    end: int
    """Absolute byte offset one past the frame's last byte."""
    encoding: str

    @property
    def size(self) -> int:
        """Compressed size of the frame, in bytes."""
        return self.end - self.start

    @property
    def where(self) -> str:
        """``weight_vNNNNNN``: the version dir, for messages."""
        return f"weight_v{self.version:06d}"

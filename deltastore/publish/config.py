"""``PublisherConfig``: every plain setting of a :class:`~deltastore.publish.DeltaPublisher`
(its keywords are the fields), checked once."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from deltastore.codecs import Checksum, Encoding, get_checksum, get_encoding
from deltastore.errors import ConfigError


def default_workers() -> int:
    """Encode threads when none are asked for: the cores, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class PublisherConfig:
    """Settings of a publisher (docs/publishing.md and docs/api.md explain each). Raises
    :class:`ConfigError` on construction for an unknown codec name or an out-of-range value."""

    encoding: str = "xor"  # delta encoding (deltastore.codecs)
    checksum: str = "xxh3-128"  # digests of new tensor bytes
    workers: int | None = None  # encode / digest threads (None: default_workers())
    resume: bool = False  # seed() on a store with versions continues its stream
    new_stream: bool = False  # ... or starts a new stream after them
    max_shard_bytes: int = 4 * 1024**3  # per shard of a full version
    spool_memory_bytes: int = 256 * 1024**2  # payloads in memory, then a temp file
    collective: bool | None = None  # None: when torch.distributed has ranks; False: alone
    anchor_every: int | None = None  # every K-th version (since the last full one) is full
    anchor_chain_bytes: float | None = None  # ... or once the chain exceeds this model fraction
    max_inflight_bytes: int = 1024**3  # tensor bytes staged for the encoders
    preload: bool | None = None  # load the whole snapshot at seed() (None: single process)
    pin_memory: bool | None = None  # pinned host buffers (None: when CUDA is available)
    stage_host_tensors: bool = False  # copy host tensors too (the trainer may change them)
    device_snapshot: bool = False  # diff torch tensors on their device against a copy there
    signing_key: Any = None  # sign every version: a key file path or a SigningKey (signing.md)
    require_signed: bool = False  # seed() refuses unsigned publishing onto a signed store
    record_base_digests: bool = True  # base digests in each delta built on version 0

    def __post_init__(self) -> None:
        get_encoding(self.encoding)
        get_checksum(self.checksum)
        every = self.anchor_every
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ConfigError(f"anchor_every must be a positive integer, got {every!r}")
        if self.anchor_chain_bytes is not None and not self.anchor_chain_bytes > 0:
            raise ConfigError(
                "anchor_chain_bytes must be a positive fraction of the model's bytes, got "
                f"{self.anchor_chain_bytes!r}"
            )
        if self.max_shard_bytes < 1 or self.max_inflight_bytes < 1:
            raise ConfigError("max_shard_bytes and max_inflight_bytes must be positive")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers must be a positive integer, got {self.workers!r}")

    @property
    def threads(self) -> int:
        return self.workers or default_workers()

    @classmethod
    def build(cls, config: PublisherConfig | None, settings: dict[str, Any]) -> PublisherConfig:
        """``config`` (or the defaults) with the keyword ``settings`` on top; ConfigError
        naming a keyword that is not a setting."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(
                f"unknown DeltaPublisher setting(s) {unknown}; known: {sorted(known)}"
            )
        return dataclasses.replace(config or cls(), **settings)


@dataclass(frozen=True)
class Settings:
    """A publisher's config, the codecs it names and its base checkpoint."""

    config: PublisherConfig
    encoding: Encoding
    checksum: Checksum
    base_checkpoint: str

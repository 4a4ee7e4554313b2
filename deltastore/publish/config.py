"""``PublisherConfig``: every setting of a :class:`~deltastore.publish.DeltaPublisher` that is a
plain value (what to encode with, how big, how many, when to anchor), checked once.

The publisher's documented keywords (``encoding=``, ``checksum=``, ``anchor_every=``, ...) are
the fields of this frozen dataclass; pass either the keywords or a ``config=`` object.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from deltastore.codecs import Checksum, Encoding, get_checksum, get_encoding
from deltastore.errors import ConfigError

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
DEFAULT_MAX_INFLIGHT_BYTES = 1024**3
DEFAULT_SPOOL_MEMORY_BYTES = 256 * 1024**2


def default_workers() -> int:
    """Encode threads when none are asked for: the cores, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class PublisherConfig:
    """Settings of a publisher (docs/publishing.md explains each). Raises :class:`ConfigError`
    on construction for an unknown codec name or an out-of-range value."""

    encoding: str = "xor"
    """Delta encoding name (``deltastore.codecs``)."""
    checksum: str = "xxh3-128"
    """Checksum algorithm name for the digests of new tensor bytes."""
    workers: int | None = None
    """Encode / digest threads (None: :func:`default_workers`)."""
    resume: bool = False
    """``seed()`` on a store with versions continues its stream."""
    new_stream: bool = False
    """``seed()`` on a store with versions starts a new stream after them."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Bytes per shard of a full version."""
    spool_memory_bytes: int = DEFAULT_SPOOL_MEMORY_BYTES
    """Compressed payload bytes kept in memory before spilling to a temp file."""
    collective: bool | None = None
    """None: collective when torch.distributed has several ranks; False: alone; True: must be."""
    anchor_every: int | None = None
    """Every K-th version (deltas since the last full one) is a full version."""
    anchor_chain_bytes: float | None = None
    """A full version once the chain's wire bytes would exceed this fraction of the model."""
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    """Tensor bytes staged for the encode pool at once."""
    preload: bool | None = None
    """Load the whole snapshot at ``seed()`` (None: only in a single process)."""
    pin_memory: bool | None = None
    """Pinned host buffers for device tensors (None: when CUDA is available)."""
    stage_host_tensors: bool = False
    """Copy host tensors too before encoding (the trainer may change them meanwhile)."""
    signing_key: Any = None
    """Sign every version: a private key file path (``deltastore keygen``) or a
    :class:`~deltastore.trust.SigningKey`; None publishes unsigned versions (docs/signing.md)."""
    require_signed: bool = False
    """Refuse (at ``seed()``) to publish unsigned versions into a store whose latest version is
    signed; without it that only warns (:class:`~deltastore.errors.UnsignedVersionWarning`)."""
    record_base_digests: bool = True
    """Record every base tensor's digest in each delta built on version 0 (``base_digests``),
    so a host seeded from another base is refused; costs one hash of the base per stream."""

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
        """Encode / digest threads to use."""
        return self.workers or default_workers()

    @classmethod
    def build(cls, config: PublisherConfig | None, settings: dict[str, Any]) -> PublisherConfig:
        """``config`` (or the defaults) with the keyword ``settings`` applied on top.

        Raises :class:`ConfigError` naming a keyword that is not a setting.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(
                f"unknown DeltaPublisher setting(s) {unknown}; known: {sorted(known)}"
            )
        return dataclasses.replace(config or cls(), **settings)


@dataclass(frozen=True)
class Settings:
    """A publisher's fixed settings: its config, the codecs it names and its base checkpoint
    (named in the error for a tensor the base lacks)."""

    config: PublisherConfig
    encoding: Encoding
    checksum: Checksum
    base_checkpoint: str

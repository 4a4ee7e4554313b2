"""The error tree of deltastore.

Every error raised on purpose by deltastore derives from :class:`DeltastoreError`. Classes also
derive from the closest built-in (``ValueError``, ``OSError``, ``KeyError``) so callers that
already catch those keep working. Messages name the version, tensor or path at fault and say
what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class DeltastoreError(Exception):
    """Root of every error deltastore raises on purpose."""


class ConfigError(DeltastoreError, ValueError):
    """A setting is invalid: an unknown codec name, a missing path, a bad argument."""


class FormatError(DeltastoreError, ValueError):
    """A published or local file does not follow the version format (index, shard, header)."""


class IntegrityError(DeltastoreError):
    """Bytes do not match the digest that was published for them."""


class StoreError(DeltastoreError, OSError):
    """The version store could not be read or written."""


class VersionNotFoundError(StoreError, KeyError):
    """A version that was asked for is not committed in the store."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class VersionConflictError(StoreError):
    """Another writer claimed or committed the same version first."""


class TransientStoreError(StoreError):
    """A store operation failed in a way that may succeed on retry (5xx, throttling, reset)."""


class PublishError(DeltastoreError):
    """Publishing a version failed; nothing was committed and the snapshot did not advance."""


class ApplyError(DeltastoreError):
    """Applying a version to a local checkpoint failed."""


class OutOfOrderError(ApplyError):
    """A delta does not build on the version the local checkpoint holds."""


class NameMismatchError(ApplyError):
    """Published tensor names or sizes do not match the local checkpoint (wrong base)."""


class PutBackError(ApplyError):
    """A failed apply could not put back the tensors it had written, or a finished apply could
    not be flushed: the checkpoint is dirty (its pending record stays, and the next pull
    repairs it)."""


class GroupPullError(ApplyError):
    """A pull failed on at least one rank of the group.

    ``outcomes`` holds every rank's :class:`deltastore.pull.HostOutcome` (rank, host, local
    dir, success, message), in rank order.
    """

    def __init__(self, message: str, outcomes: Sequence[Any]) -> None:
        super().__init__(message)
        self.outcomes = list(outcomes)

    @property
    def failed(self) -> list[Any]:
        """The outcomes of the ranks that failed."""
        return [o for o in self.outcomes if not o.success]


class StreamError(DeltastoreError):
    """A store holds a different stream than the one the caller continues."""


class LockTimeoutError(DeltastoreError, TimeoutError):
    """The per-host lock of a local checkpoint could not be taken in time."""


class HookError(DeltastoreError):
    """A hook could not be loaded, or raised while running."""


class SnapshotError(DeltastoreError):
    """A publish failed at or after its commit: the version is (or may be) in the store and
    the publisher's snapshot did not follow it.

    Unlike :class:`PublishError` nothing is promised about the store: check
    ``store.latest()`` and restart every rank of the publisher with ``resume=True``.
    """


class SignatureError(IntegrityError):
    """A version is unsigned, its signature does not match its manifest (forged, altered or
    replayed under another version or stream), or it is signed by a key that is not trusted."""


class EngineSyncError(DeltastoreError):
    """Bringing an inference engine to a version failed. The message names the engine, the
    step (pull, pause, reload, resume) and the state the engine was left in."""


class EngineLeftPausedError(EngineSyncError):
    """An engine's reload failed, and so did the one retry from the verified checkpoint: the
    engine is left paused (never resumed on partly updated weights) until an operator or the
    next sync reloads it."""


class UnsignedVersionWarning(UserWarning):
    """A publisher without a signing key publishes into a store whose latest version is
    signed: engines that trust a key will refuse its versions (``require_signed`` refuses)."""


class InsecureKeyFileWarning(UserWarning):
    """A private key file is readable or writable by users other than its owner (a warning,
    not an error: ``chmod 600`` the file)."""

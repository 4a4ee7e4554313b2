"""deltastore: keep remote inference engines' weights in step with a trainer by shipping only
the bytes that changed.

>>> import deltastore as ds
>>> store = ds.VersionStore("/shared/run1")                  # or memory://, s3://, gs://
>>> pub = ds.DeltaPublisher(store, base_checkpoint="/ckpt/hf")
>>> pub.seed()                                               # version 0, publishes nothing
>>> pub.publish(model.named_parameters())                    # weight_v000001
>>> ds.pull_weights("/nvme/ckpt", "/shared/run1", 1, base_dir="/ckpt/hf")
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from deltastore import errors as _errors
from deltastore.errors import (
    ApplyError,
    ConfigError,
    DeltastoreError,
    FormatError,
    IntegrityError,
    PublishError,
    StoreError,
    VersionNotFoundError,
)

# The rest of the surface is imported on first use: `import deltastore` (and so the
# `deltastore` command, whose module sits in this package) costs only the error tree, and a
# Ctrl-C while the command starts lands in its own handler, not in an import of torch here.
_LAZY = {
    "register_encoding": "deltastore.codecs",
    "VersionIndex": "deltastore.format",
    "ProgressCallback": "deltastore.progress",
    "DeltaPublisher": "deltastore.publish",
    "PublisherConfig": "deltastore.publish",
    "PublishResult": "deltastore.publish",
    "HostOutcome": "deltastore.pull",
    "PullResult": "deltastore.pull",
    "RepairSummary": "deltastore.pull",
    "pull_weights": "deltastore.pull",
    "verify_local": "deltastore.pull",
    "ReplicationReport": "deltastore.replicate",
    "replicate": "deltastore.replicate",
    "RetryPolicy": "deltastore.storage",
    "VersionStore": "deltastore.storage",
}

if TYPE_CHECKING:
    from deltastore.codecs import register_encoding
    from deltastore.format import VersionIndex
    from deltastore.progress import ProgressCallback
    from deltastore.publish import DeltaPublisher, PublisherConfig, PublishResult
    from deltastore.pull import HostOutcome, PullResult, RepairSummary, pull_weights, verify_local
    from deltastore.replicate import ReplicationReport, replicate
    from deltastore.storage import RetryPolicy, VersionStore

__version__ = "0.1.0"

# The verbs, their objects and results, what users configure or extend, and the error
# categories worth catching (every error class lives in deltastore.errors).
__all__ = [
    "ApplyError",
    "ConfigError",
    "DeltaPublisher",
    "DeltastoreError",
    "FormatError",
    "HostOutcome",
    "IntegrityError",
    "ProgressCallback",
    "PublishError",
    "PublishResult",
    "PublisherConfig",
    "PullResult",
    "RepairSummary",
    "ReplicationReport",
    "RetryPolicy",
    "StoreError",
    "VersionIndex",
    "VersionNotFoundError",
    "VersionStore",
    "__version__",
    "pull_weights",
    "register_encoding",
    "replicate",
    "verify_local",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # looked up once
        return value
    # The other error classes were exported here before; they still resolve, with a warning,
    # so code written against the old top level keeps running while it moves over.
    found = getattr(_errors, name, None)
    if isinstance(found, type) and issubclass(found, (DeltastoreError, Warning)):
        import warnings

        warnings.warn(
            f"deltastore.{name} is no longer exported from the top level; import it from "
            f"deltastore.errors (from deltastore.errors import {name})",
            DeprecationWarning,
            stacklevel=2,
        )
        return found
    raise AttributeError(f"module 'deltastore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _TopLevel(types.ModuleType):
    """``deltastore.replicate`` is the verb, as it was when this module imported it eagerly:
    the import system binds each subpackage it loads as an attribute here, and the package
    ``deltastore.replicate`` (loaded on first use now) must not replace the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _TopLevel

"""deltastore: keep remote inference engines' weights in step with a trainer by shipping only
the bytes that changed.

>>> import deltastore as ds
>>> store = ds.VersionStore("/shared/run1")                  # or memory://, s3://, gs://
>>> pub = ds.DeltaPublisher(store, base_checkpoint="/ckpt/hf")
>>> pub.seed()                                               # version 0, publishes nothing
>>> pub.publish(model.named_parameters())                    # weight_v000001
>>> ds.pull_weights("/nvme/ckpt", "/shared/run1", 1, base_dir="/ckpt/hf")
"""

from deltastore.errors import (
    ApplyError,
    ConfigError,
    DeltastoreError,
    FormatError,
    GroupPullError,
    HookError,
    InsecureKeyFileWarning,
    IntegrityError,
    LockTimeoutError,
    NameMismatchError,
    OutOfOrderError,
    PublishError,
    PutBackError,
    SignatureError,
    SnapshotError,
    StoreError,
    StreamError,
    TransientStoreError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format import VersionIndex
from deltastore.progress import ProgressCallback
from deltastore.publish import DeltaPublisher, PublishResult
from deltastore.pull import HostOutcome, PullResult, RepairSummary, pull_weights, verify_local
from deltastore.replicate import replicate
from deltastore.storage import RetryPolicy, VersionStore

__version__ = "0.1.0"

__all__ = [
    "ApplyError",
    "ConfigError",
    "DeltaPublisher",
    "DeltastoreError",
    "FormatError",
    "GroupPullError",
    "HookError",
    "HostOutcome",
    "InsecureKeyFileWarning",
    "IntegrityError",
    "LockTimeoutError",
    "NameMismatchError",
    "OutOfOrderError",
    "ProgressCallback",
    "PublishError",
    "PublishResult",
    "PullResult",
    "PutBackError",
    "RepairSummary",
    "RetryPolicy",
    "SignatureError",
    "SnapshotError",
    "StoreError",
    "StreamError",
    "TransientStoreError",
    "VersionConflictError",
    "VersionIndex",
    "VersionNotFoundError",
    "VersionStore",
    "__version__",
    "pull_weights",
    "replicate",
    "verify_local",
]

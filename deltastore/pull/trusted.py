"""What a pull checks before it writes a byte: the signatures of every version it will apply
(given trusted keys) and, on a seed from the base, the base itself.

Given trusted keys, :func:`preflight` verifies each version of the plan from its index and
shard headers, then downloads every delta shard whole into a staging store under the state
dir, checking its size and BLAKE3 against the signed record as it streams. The deltas are
applied from that copy, so the bytes applied are exactly the bytes verified, whatever the
store serves later. A full version is staged by the reseed, and
:meth:`CheckedPlan.check_staged` checks its files before they replace anything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from deltastore.format.checkpoint import CheckpointTensor, scan_checkpoint
from deltastore.format.index import VersionIndex
from deltastore.format.names import version_dir_name
from deltastore.pull.chain import Chain, Plan
from deltastore.pull.local import PullContext
from deltastore.pull.verify import verify_signatures
from deltastore.storage import VersionStore
from deltastore.storage.durable import fsync_path
from deltastore.trust import ShardFact, ShardHasher, SignatureRecord, TrustedKey
from deltastore.trust.base import check_base

TRUSTED_STAGING = "verified-deltas"
"""Dir under the checkpoint's state dir holding the verified copies of the deltas to apply."""

_CHUNK = 8 << 20


@dataclass
class CheckedPlan:
    """The outcome of :func:`preflight`."""

    records: dict[int, SignatureRecord] = field(default_factory=dict)
    delta_store: VersionStore | None = None
    """Read the deltas from here instead of the remote store (None: read the store)."""
    local_tensors: dict[str, CheckpointTensor] | None = None
    """The local checkpoint's tensors as scanned for the base check of a catch-up (None: not
    scanned); the apply reuses them instead of parsing the headers again."""

    def check_staged(self, staging: str, index: VersionIndex) -> None:
        """Refuse a staged full version whose files are not the signed bytes (no-op unsigned)."""
        record = self.records.get(index.version)
        if record is None:
            return
        for shard in index.shards():
            fact = ShardFact.of_file(os.path.join(staging, shard))
            record.check_shard(index.version, shard, fact)


def _download_checked(
    store: VersionStore, index: VersionIndex, shard: str, record: SignatureRecord, dst: str
) -> None:
    """Copy one shard to ``dst`` (fsynced), refusing it unless it is the signed bytes."""
    signed = record.shards[shard]
    hasher = ShardHasher()
    size = 0
    with store.open_read(index.version, shard) as src, open(dst, "wb") as out:
        # One byte past the signed size is enough to refuse a longer file: never read the rest.
        while chunk := src.read(min(_CHUNK, signed.size + 1 - size)):
            hasher.update(chunk)
            size += len(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    record.check_shard(index.version, shard, hasher.fact())


def stage_deltas(
    store: VersionStore,
    deltas: Sequence[VersionIndex],
    records: dict[int, SignatureRecord],
    staging: str,
) -> VersionStore:
    """Download every shard of ``deltas`` into ``staging`` as a local store, each checked
    against its signed record."""
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    for index in deltas:
        vdir = os.path.join(staging, version_dir_name(index.version))
        os.makedirs(vdir)
        for shard in index.shards():
            dst = os.path.join(vdir, shard)
            _download_checked(store, index, shard, records[index.version], dst)
        fsync_path(vdir)
    return VersionStore(staging)


@contextlib.contextmanager
def preflight(
    pull: PullContext, chain: Chain, plan: Plan, keys: Sequence[TrustedKey] | None
) -> Iterator[CheckedPlan]:
    """Check everything ``plan`` will apply before the first write, the staged copies removed
    on exit: :class:`SignatureError` (given ``keys``), and on a seed from version 0 what
    :func:`~deltastore.trust.base.check_base` raises."""
    store, local, workers = pull.store, pull.local, pull.workers
    checked = CheckedPlan()
    staging = os.path.join(local.state_dir, TRUSTED_STAGING)
    try:
        if keys is not None:
            start = [chain.start_index] if plan.action == "reseed" and chain.start_index else []
            checked.records = verify_signatures(store, [*start, *plan.deltas], keys)
            if plan.deltas:
                checked.delta_store = stage_deltas(store, plan.deltas, checked.records, staging)
        first = plan.deltas[0] if plan.deltas else None
        if first is not None and first.base_version == 0:
            if plan.action == "reseed":
                if pull.base is not None:
                    check_base(pull.base, first, workers=workers)
            else:
                # The tensors the plan changes are verified after the apply (and put back on
                # a mismatch); the base check hashes only the ones no delta of it touches.
                checked.local_tensors = scan_checkpoint(local.dir)
                changed = {name for delta in plan.deltas for name in delta.weight_map}
                tensors = checked.local_tensors
                check_base(local.dir, first, workers=workers, tensors=tensors, covered=changed)
        yield checked
    finally:
        shutil.rmtree(staging, ignore_errors=True)

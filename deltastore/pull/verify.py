"""Checking a local checkpoint's bytes against a published version, tensor by tensor, and
what a pull checks before it writes a byte (:func:`preflight`).

Given trusted keys, :func:`preflight` verifies each version of the plan from its index and
shard headers, then stages every delta shard whole, checked against the signed record as it
streams: the bytes applied are exactly the bytes verified, whatever the store serves later. A
staged full version is checked by :meth:`CheckedPlan.check_staged` before it replaces anything.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltastore.codecs import Digest, get_checksum
from deltastore.errors import ConfigError, IntegrityError, NameMismatchError, VersionNotFoundError
from deltastore.format.checkpoint import CheckpointTensor, read_tensor, scan_checkpoint
from deltastore.format.index import VersionIndex
from deltastore.format.names import version_dir_name
from deltastore.progress import ProgressCallback, ProgressMeter
from deltastore.pull.chain import Chain, Plan, full_tensors, recorded_digests, resolve_chain
from deltastore.pull.local import LocalCheckpoint, PullContext, wait_recorded
from deltastore.pull.source import open_store, require_stores
from deltastore.storage import VersionStore
from deltastore.storage.durable import fsync_path
from deltastore.trust import ShardFact, ShardHasher, SignatureRecord, TrustedKey, verify_index
from deltastore.trust.base import check_base, check_base_names, hash_tensor
from deltastore.trust.keys import TrustedKeys, load_trusted


def expected_digests(
    store: VersionStore, chain: Chain, base_dir: str | None, progress: ProgressCallback | None
) -> dict[str, Digest]:
    """Digest of every tensor at the chain's target; tensors no version changed since the
    base are hashed from the base's bytes (``base_dir``, else :class:`ConfigError`), reported
    to ``progress`` as phase ``base``."""
    expected: dict[str, Digest] = {}
    full = chain.start_index
    if full is not None:
        checksum = get_checksum(full.checksum or "xxh3-128")
        for name, found in full_tensors(store, full).items():
            # A foreign full version may record no digests: hash the version's own bytes.
            entry = found.entry
            expected[name] = found.digest or Digest.of(
                checksum, store.read_range(full.version, found.shard, entry.start, entry.end)
            )
    for delta in chain.deltas:
        checksum = get_checksum(delta.checksum or "")
        where = version_dir_name(delta.version)
        for shard in delta.shards():
            header = store.read_shard_header(delta.version, shard)
            expected.update(recorded_digests(header, checksum, where=where, required=True))
    if full is None:
        if base_dir is None:
            raise ConfigError("verifying against a chain that starts at the base needs base_dir")
        checksum = get_checksum("xxh3-128")
        base_tensors = scan_checkpoint(base_dir)
        if chain.deltas:
            # A wrong base gets the diagnosis a pull gives it, not a blame on the host.
            check_base_names(base_dir, chain.deltas[0], base_tensors)
        unchanged = {n: t for n, t in base_tensors.items() if n not in expected}
        total = sum(t.entry.nbytes for t in unchanged.values()) if progress else None
        meter = ProgressMeter.start(progress, "base", total)
        for name, tensor in unchanged.items():
            expected[name] = Digest.of(checksum, read_tensor(tensor, name))
            if meter is not None:
                meter.advance(tensor.entry.nbytes)
    return expected


def verify_checkpoint(
    store: VersionStore,
    local_dir: str,
    version: int,
    base_dir: str | None,
    workers: int,
    progress: ProgressCallback | None = None,
) -> None:
    """Hash every tensor of ``local_dir`` against ``version`` of ``store`` (``progress`` phase
    ``verify``: the bytes hashed); raises :class:`IntegrityError` / :class:`NameMismatchError`
    naming the tensors at fault, :class:`VersionNotFoundError` for a chain no longer stored."""
    chain = resolve_chain(store, version)
    expected = expected_digests(store, chain, base_dir, progress)
    local_tensors = scan_checkpoint(local_dir)
    where = f"{local_dir} at v{version:06d}"
    extra = sorted(set(local_tensors) - set(expected))
    if extra:
        raise NameMismatchError(f"{where}: local tensors {extra[:5]} are not in the version")
    missing = sorted(set(expected) - set(local_tensors))
    if missing:
        raise NameMismatchError(f"{where}: the local checkpoint lacks tensors {missing[:5]}")
    total = sum(t.entry.nbytes for t in local_tensors.values()) if progress else None
    meter = ProgressMeter.start(progress, "verify", total)

    def check(name: str) -> str | None:
        digest = expected[name]
        matches = hash_tensor(local_tensors[name], digest.checksum) == digest.hex
        if meter is not None:
            meter.advance(local_tensors[name].entry.nbytes)
        return None if matches else name

    with cf.ThreadPoolExecutor(max(1, workers)) as pool:
        bad = [n for n in pool.map(check, sorted(expected)) if n is not None]
    if bad:
        raise IntegrityError(
            f"{where}: {len(bad)} tensor(s) do not match their published digests, e.g. {bad[:5]}"
        )


def verify_signatures(
    store: VersionStore, indexes: Sequence[VersionIndex], keys: Sequence[TrustedKey]
) -> dict[int, SignatureRecord]:
    """Verify each version's signature from its index and shard headers (ranged reads);
    :class:`SignatureError` as :func:`deltastore.trust.verify_index` raises it."""
    records = {}
    for index in indexes:
        headers = {s: store.read_shard_header(index.version, s).metadata for s in index.shards()}
        records[index.version] = verify_index(keys, index, headers)
    return records


def verify_local(
    local_checkpoint_dir: str | os.PathLike[str],
    source_dir: VersionStore | str | os.PathLike[str],
    version: int | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    workers: int = 4,
    trusted_keys: TrustedKeys | None = None,
    progress: ProgressCallback | None = None,
) -> int:
    """Check every tensor of a local checkpoint against ``version`` (default: the one its
    state records) by digest; returns the version. With ``trusted_keys`` every version of the
    chain must be signed by one of them first. ``progress`` gets phases ``base`` and
    ``verify``. Raises :class:`IntegrityError` / :class:`NameMismatchError` naming the tensors
    at fault, :class:`SignatureError` for a version the keys do not vouch for."""
    keys = load_trusted(trusted_keys)
    local = LocalCheckpoint(local_checkpoint_dir)
    store = open_store(source_dir, storage_options)
    wait_recorded(local.dir)  # a pull of the dir in this process that replied before its flush
    if version is None:
        state = local.read_state()
        if state is None and local.read_pending() is not None and os.path.isdir(local.dir):
            # A pull in another process may be making its reply durable: it holds the lock.
            with local.lock():
                state = local.read_state()
        if state is None:
            raise IntegrityError(
                f"{local.dir} records no applied version (no state, or a pull was interrupted); "
                "pass --version to verify against one"
            )
        version = state.version
    if version < 0:
        raise ConfigError(f"version {version} is negative; versions are 0 (the base) and up")
    store.refresh()
    base = os.fspath(base_dir) if base_dir is not None else None
    try:
        if keys is not None and version > 0:
            chain = resolve_chain(store, version)
            start = [chain.start_index] if chain.start_index is not None else []
            verify_signatures(store, [*start, *chain.deltas], keys)
        verify_checkpoint(store, local.dir, version, base, workers, progress)
    except VersionNotFoundError:
        if not store.versions():
            require_stores(store)  # a mistyped URL, not a pruned version
        raise
    return version


TRUSTED_STAGING = "verified-deltas"  # under the state dir: the verified delta copies

_CHUNK = 8 << 20


@dataclass
class CheckedPlan:
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


def stage_deltas(
    store: VersionStore,
    deltas: Sequence[VersionIndex],
    records: dict[int, SignatureRecord],
    staging: str,
) -> VersionStore:
    """Download every shard of ``deltas`` into ``staging`` as a local store (fsynced), each
    refused unless it is the signed bytes."""
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    for index in deltas:
        vdir = os.path.join(staging, version_dir_name(index.version))
        os.makedirs(vdir)
        record = records[index.version]
        for shard in index.shards():
            signed, hasher, size = record.shards[shard], ShardHasher(), 0
            dst = os.path.join(vdir, shard)
            with store.open_read(index.version, shard) as src, open(dst, "wb") as out:
                # One byte past the signed size is enough to refuse a longer file.
                while chunk := src.read(min(_CHUNK, signed.size + 1 - size)):
                    hasher.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            record.check_shard(index.version, shard, hasher.fact())
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

"""``pull_weights``: bring a host-local checkpoint to a published version, verified."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from deltastore.codecs import Checksum, get_checksum
from deltastore.errors import (
    ConfigError,
    DeltastoreError,
    IntegrityError,
    NameMismatchError,
    VersionNotFoundError,
)
from deltastore.format.checkpoint import scan_checkpoint
from deltastore.format.state import AppliedState, PendingTransition
from deltastore.pull.apply import (
    ApplyStats,
    PutBackError,
    apply_chain,
    full_digests,
    seed_from_full,
    verify_tensors,
)
from deltastore.pull.chain import Chain, plan_pull, resolve_chain
from deltastore.pull.fanout import pull_in_group, resolve_group
from deltastore.pull.local import LocalCheckpoint, same_dir
from deltastore.pull.repair import RepairSummary, repair_pending
from deltastore.pull.result import PullResult
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.pull")


def open_store(
    source: VersionStore | str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    pre_read: Callable[[str, int], None] | None = None,
) -> VersionStore:
    if isinstance(source, VersionStore):
        if pre_read is not None:
            source.pre_read = pre_read
        return source
    return VersionStore(os.fspath(source), storage_options, pre_read=pre_read)


def pull_weights(
    local_checkpoint_dir: str | os.PathLike[str],
    source_dir: VersionStore | str | os.PathLike[str],
    target_version: int,
    base_dir: str | os.PathLike[str] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    pre_read: Callable[[str, int], None] | None = None,
    workers: int = 4,
    lock_timeout_s: float = 3600.0,
    process_group: Any = None,
) -> PullResult:
    """Bring ``local_checkpoint_dir`` to ``target_version`` of the store at ``source_dir``.

    Under the per-host lock: an interrupted transition (a pending record) is repaired tensor
    by tensor, or the checkpoint reseeds when the repair cannot be proven; then version 0
    resets to ``base_dir`` (copied and content-verified, never modified); a checkpoint holding
    a version on the target's chain catches up with the remaining deltas in one pass per
    tensor; anything else (no state, another stream, a backward target) reseeds from the base
    or the newest full version on the chain and replays. Every written tensor is verified
    against the published digest; the state file never names a version whose bytes were not
    verified and flushed.

    ``process_group`` (a ``ProcessGroup``, ``"world"``, or ``"auto"`` for the default group
    when torch.distributed is initialised) makes this a collective: every rank pulls into its
    host's dir and the call succeeds only if every rank did (see :mod:`deltastore.pull.fanout`).

    Raises a :class:`DeltastoreError` subclass naming the version and tensor at fault
    (:class:`GroupPullError` listing every failed rank in a group pull).
    """
    group = resolve_group(process_group)

    store = open_store(source_dir, storage_options, pre_read)

    def pull_here() -> PullResult:
        def attempt() -> PullResult:
            return _pull_here(
                local_checkpoint_dir,
                store,
                target_version,
                base_dir,
                workers=workers,
                lock_timeout_s=lock_timeout_s,
            )

        try:
            return attempt()
        except VersionNotFoundError as exc:
            return _re_resolve(store, target_version, exc, attempt)

    if group is None:
        return pull_here()
    return pull_in_group(
        group,
        pull_here,
        local_dir=os.path.abspath(os.fspath(local_checkpoint_dir)),
        target_version=target_version,
    )


def _re_resolve(
    store: VersionStore,
    target_version: int,
    lost: VersionNotFoundError,
    attempt: Callable[[], PullResult],
) -> PullResult:
    """A version vanished mid-pull (pruned): resolve the target again, once, and say so.

    Whatever was applied before the loss is verified and recorded (or put back), so starting
    over is safe. When the target itself is gone, the error names the newest version instead.
    """
    store.refresh()
    committed = store.versions()
    if target_version not in committed:
        latest = committed[-1] if committed else 0
        if target_version > latest:
            raise VersionNotFoundError(
                f"weight_v{target_version:06d} is not published in {store.url}; the latest "
                f"version is v{latest:06d}"
            ) from None
        raise VersionNotFoundError(
            f"weight_v{target_version:06d} is no longer in {store.url} (pruned while this pull "
            f"read it: {lost}); the latest version is v{latest:06d}: pull that instead"
        ) from lost
    log.warning(
        "a version vanished while pulling v%06d (%s); re-resolving its chain once",
        target_version,
        lost,
    )
    return attempt()


def _pull_here(
    local_checkpoint_dir: str | os.PathLike[str],
    store: VersionStore,
    target_version: int,
    base_dir: str | os.PathLike[str] | None,
    *,
    workers: int,
    lock_timeout_s: float,
) -> PullResult:
    started = time.perf_counter()
    if target_version < 0:
        raise ConfigError(f"target version {target_version} is negative")
    base = os.path.abspath(os.fspath(base_dir)) if base_dir is not None else None
    local = LocalCheckpoint(local_checkpoint_dir)
    if base is not None and same_dir(base, local.dir):
        raise ConfigError(
            f"local checkpoint {local.dir} is the base model path; pass a host-local copy dir"
        )
    os.makedirs(local.dir, exist_ok=True)
    stats = ApplyStats()
    with local.lock(lock_timeout_s):
        state = local.read_state()
        pending = local.read_pending()
        store.refresh(target_version if target_version > 0 else None)
        chain = resolve_chain(store, target_version)
        repair: RepairSummary | None = None
        if pending is not None:
            state, repair = _recover(store, local, pending, state, chain, base, workers, stats)
        plan = plan_pull(store, chain, state)
        log.info("%s: plan: %s", local.dir, plan.describe())

        def result(version: int, action: str) -> PullResult:
            return PullResult(
                version,
                action,
                stats.versions,
                stats.tensors,
                stats.bytes_read,
                time.perf_counter() - started,
                plan.describe(),
                repair,
                stats.payloads,
            )

        if plan.action == "noop":
            assert state is not None
            return result(state.version, "noop" if repair is None else "repaired")
        current = plan.start
        if plan.action == "reseed":
            if chain.start_index is None and base is None:
                why = plan.reason or "the target builds on version 0"
                raise ConfigError(
                    f"{local.dir} must be reseeded from the base model ({why}) but no base_dir "
                    "was given"
                )
            start_stream = chain.stream_at(chain.start)
            local.begin(
                PendingTransition(
                    None, chain.start, start_stream, state.stream_id if state else None, []
                )
            )
            _reseed(store, chain, local, base, stats)
            local.finish(AppliedState(chain.start, start_stream, store.url))
        if plan.deltas:
            from_stream = chain.stream_at(current)
            local.begin(
                PendingTransition(
                    current, target_version, chain.stream_id, from_stream, plan.versions
                )
            )
            try:
                apply_chain(store, plan.deltas, local, current, workers=workers, stats=stats)
            except PutBackError:
                raise  # the pending record stays: the next pull repairs
            except DeltastoreError:
                # apply_chain put back what it wrote: the bytes hold `current` again.
                local.finish(AppliedState(current, from_stream, store.url))
                raise
            local.finish(AppliedState(target_version, chain.stream_id, store.url))
    done = result(target_version, "reseeded" if plan.action == "reseed" else "applied")
    log.info("%s: %s", local.dir, done.message)
    return done


def _recover(
    store: VersionStore,
    local: LocalCheckpoint,
    pending: PendingTransition,
    state: AppliedState | None,
    chain: Chain,
    base: str | None,
    workers: int,
    stats: ApplyStats,
) -> tuple[AppliedState | None, RepairSummary | None]:
    """Deal with an interrupted transition: the state to plan from (None: reseed)."""
    if state is not None and state.version == pending.to_version:
        # The crash fell between writing the new state and clearing the record: the data was
        # flushed before the state was written, so the state stands.
        local.finish(state)
        return state, None
    if pending.from_version is None:
        log.warning("%s: an interrupted reseed was found; reseeding again", local.dir)
        return None, None
    repaired_state = AppliedState(pending.to_version, pending.stream_id, store.url)
    if plan_pull(store, chain, repaired_state).action == "reseed":
        log.warning(
            "%s: an interrupted transition to v%06d was found, but v%06d does not lead to "
            "v%06d: reseeding",
            local.dir,
            pending.to_version,
            pending.to_version,
            chain.target,
        )
        return None, None
    try:
        summary = repair_pending(store, local, pending, base, workers=workers, stats=stats)
    except DeltastoreError as exc:
        log.warning(
            "%s: cannot repair the interrupted transition to v%06d (%s); reseeding",
            local.dir,
            pending.to_version,
            exc,
        )
        return None, None
    local.finish(repaired_state)
    return repaired_state, summary


def _reseed(
    store: VersionStore, chain: Chain, local: LocalCheckpoint, base: str | None, stats: ApplyStats
) -> None:
    if chain.start_index is None:
        assert base is not None
        log.info("%s: seeding from base %s", local.dir, base)
        local.seed_from_base(base)
    else:
        log.info("%s: seeding from full version %d", local.dir, chain.start)
        seed_from_full(store, chain.start_index, local, stats=stats)
        local.copy_missing_extras(base)


def expected_digests(
    store: VersionStore, chain: Chain, base_dir: str | None
) -> tuple[dict[str, tuple[Checksum, str]], set[str]]:
    """Digest of every tensor at the chain's target, plus the names to compare with the base.

    Names the chain never changed since the base are returned separately: they are checked by
    hashing the base's bytes with the same algorithm.
    """
    expected: dict[str, tuple[Checksum, str]] = {}
    if chain.start_index is not None:
        full = chain.start_index
        checksum = get_checksum(full.checksum or "xxh3-128")
        expected.update(full_digests(store, full, checksum))
        # A foreign full version may record no digests: hash the version's own bytes.
        for shard in full.shards():
            header = store.read_shard_header(full.version, shard)
            for name, entry in header.tensors.items():
                if name not in expected:
                    data = store.read_range(full.version, shard, entry.start, entry.end)
                    expected[name] = (checksum, checksum.hexdigest(data))
    for delta in chain.deltas:
        checksum = get_checksum(delta.checksum or "")
        for shard in delta.shards():
            header = store.read_shard_header(delta.version, shard)
            for name in header.tensors:
                expected[name] = (checksum, header.metadata.get(name, ""))
    from_base: set[str] = set()
    if chain.start_index is None:
        if base_dir is None:
            raise ConfigError("verifying against a chain that starts at the base needs base_dir")
        from_base = set(scan_checkpoint(base_dir)) - set(expected)
    return expected, from_base


def verify_local(
    local_checkpoint_dir: str | os.PathLike[str],
    source_dir: VersionStore | str | os.PathLike[str],
    version: int | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    workers: int = 4,
) -> int:
    """Check every tensor of a local checkpoint against ``version`` by digest (not by state).

    ``version`` defaults to the one the local state records. Returns the version verified.
    Raises :class:`IntegrityError` / :class:`NameMismatchError` naming the tensors at fault.
    """
    local = LocalCheckpoint(local_checkpoint_dir)
    store = open_store(source_dir, storage_options)
    if version is None:
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
    chain = resolve_chain(store, version)
    base = os.fspath(base_dir) if base_dir is not None else None
    expected, from_base = expected_digests(store, chain, base)
    local_tensors = scan_checkpoint(local.dir)
    where = f"{local.dir} at v{version:06d}"
    if from_base:
        assert base is not None
        base_tensors = scan_checkpoint(base)
        checksum = get_checksum("xxh3-128")
        for name in from_base:
            tensor = base_tensors[name]
            with open(tensor.file, "rb") as fh:
                fh.seek(tensor.entry.start)
                expected[name] = (checksum, checksum.hexdigest(fh.read(tensor.entry.nbytes)))
    extra = sorted(set(local_tensors) - set(expected))
    if extra:
        raise NameMismatchError(f"{where}: local tensors {extra[:5]} are not in the version")
    verify_tensors(local_tensors, expected, where=where, workers=workers)
    return version

"""``pull_weights``: bring a host-local checkpoint to a published version, verified."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deltastore.codecs import Checksum, get_checksum
from deltastore.errors import ConfigError, IntegrityError, NameMismatchError
from deltastore.format.checkpoint import scan_checkpoint
from deltastore.format.state import AppliedState, PendingTransition
from deltastore.pull.apply import (
    ApplyStats,
    apply_delta,
    full_digests,
    seed_from_full,
    verify_tensors,
)
from deltastore.pull.chain import Chain, resolve_chain
from deltastore.pull.local import LocalCheckpoint
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.pull")


@dataclass(frozen=True)
class PullResult:
    """What one :func:`pull_weights` call did."""

    version: int
    """The version the local checkpoint now holds (verified)."""
    action: str
    """``noop``, ``applied`` (deltas on top of what was there) or ``reseeded``."""
    versions_applied: list[int] = field(default_factory=list)
    tensors_applied: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def message(self) -> str:
        if self.action == "noop":
            return f"already at v{self.version:06d}"
        return (
            f"{self.action} to v{self.version:06d} ({len(self.versions_applied)} version(s), "
            f"{self.tensors_applied} tensors, {self.bytes_read} bytes read, {self.seconds:.2f} s)"
        )


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
) -> PullResult:
    """Bring ``local_checkpoint_dir`` to ``target_version`` of the store at ``source_dir``.

    Under the per-host lock: version 0 resets to ``base_dir`` (copied and content-verified);
    a checkpoint holding a version on the target's chain applies the remaining deltas in
    place; anything else (no state, an interrupted transition, another stream, a backward
    target) reseeds from the base or the newest full version on the chain and replays. Every
    written tensor is verified against the published digest; the state file never names a
    version whose bytes were not verified. Raises a :class:`DeltastoreError` subclass naming
    the version and tensor at fault.
    """
    started = time.perf_counter()
    if target_version < 0:
        raise ConfigError(f"target version {target_version} is negative")
    base = os.path.abspath(os.fspath(base_dir)) if base_dir is not None else None
    local = LocalCheckpoint(local_checkpoint_dir)
    if base is not None and base == local.dir:
        raise ConfigError(
            f"local checkpoint {local.dir} is the base model path; pass a host-local copy dir"
        )
    store = open_store(source_dir, storage_options, pre_read)
    os.makedirs(local.dir, exist_ok=True)
    stats = ApplyStats()
    with local.lock(lock_timeout_s):
        state = local.read_state()
        pending = local.read_pending()
        if pending is not None:
            log.warning(
                "%s: an interrupted transition to v%06d was found; reseeding",
                local.dir,
                pending.to_version,
            )
            state = None
        store.refresh(target_version if target_version > 0 else None)
        chain = resolve_chain(store, target_version)
        todo = _plan(chain, state)
        if todo is not None and not todo and state is not None:
            return PullResult(state.version, "noop", seconds=time.perf_counter() - started)
        action = "applied"
        current = state.version if state is not None else None
        if todo is None:
            action = "reseeded"
            local.begin(
                PendingTransition(current, target_version, chain.stream_id, None, chain.versions())
            )
            _reseed(store, chain, local, base, stats)
            current = chain.start
            todo = chain.deltas
            local.finish(
                AppliedState(
                    current, chain.start_index.stream_id if chain.start_index else None, store.url
                )
            )
        tensors = scan_checkpoint(local.dir)
        for delta in todo:
            assert current is not None
            local.begin(
                PendingTransition(
                    current,
                    delta.version,
                    delta.stream_id,
                    chain.stream_at(current),
                    [delta.version],
                )
            )
            try:
                apply_delta(
                    store, delta, local, current, workers=workers, tensors=tensors, stats=stats
                )
            except BaseException:
                # apply_delta reverted what it wrote: the bytes hold `current` again.
                local.finish(AppliedState(current, chain.stream_at(current), store.url))
                raise
            current = delta.version
            local.finish(AppliedState(current, delta.stream_id, store.url))
    result = PullResult(
        target_version,
        action,
        stats.versions,
        stats.tensors,
        stats.bytes_read,
        time.perf_counter() - started,
    )
    log.info("%s: %s", local.dir, result.message)
    return result


def _plan(chain: Chain, state: AppliedState | None) -> list[Any] | None:
    """Deltas to apply on the current state, or None when the checkpoint must reseed."""
    if state is None:
        return None
    todo = chain.suffix_after(state.version)
    if todo is None:
        return None
    expected_stream = chain.stream_at(state.version)
    if state.version != 0 and expected_stream is not None and state.stream_id != expected_stream:
        log.warning(
            "local state v%06d is of stream %s, the target's chain is stream %s: reseeding",
            state.version,
            state.stream_id,
            expected_stream,
        )
        return None
    return todo


def _reseed(
    store: VersionStore, chain: Chain, local: LocalCheckpoint, base: str | None, stats: ApplyStats
) -> None:
    if chain.start_index is None:
        if base is None:
            raise ConfigError(
                f"{local.dir} must be reseeded from the base model (no verified state, or the "
                f"target builds on version 0) but no base_dir was given"
            )
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
        checksum = get_checksum(chain.start_index.checksum or "xxh3-128")
        expected.update(full_digests(store, chain.start_index, checksum))
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

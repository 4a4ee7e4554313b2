"""``pull_weights``: bring a host-local checkpoint to a published version, verified."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltastore.errors import (
    ConfigError,
    DeltastoreError,
    PutBackError,
    VersionNotFoundError,
)
from deltastore.format.checkpoint import CheckpointTensor, scan_checkpoint
from deltastore.format.names import version_dir_name
from deltastore.format.state import AppliedState, PendingTransition
from deltastore.gc_pause import gc_paused
from deltastore.progress import ProgressCallback
from deltastore.pull.apply import apply_chain, flush_applied
from deltastore.pull.chain import Chain, Plan, plan_pull, resolve_chain, resolve_onto
from deltastore.pull.completion import complete_behind, wait_recorded
from deltastore.pull.fanout import pull_in_group, resolve_group
from deltastore.pull.full import discard_staging, stage_full, swap_in
from deltastore.pull.local import LocalCheckpoint, same_dir
from deltastore.pull.mapped import MappedFiles
from deltastore.pull.recover import recover, trusted_state
from deltastore.pull.repair import RepairSummary
from deltastore.pull.result import PullResult
from deltastore.pull.source import (
    PreRead,
    PullSource,
    StoreSpec,
    each_store,
    make_source,
    require_committed,
    source_of,
)
from deltastore.pull.stats import ApplyStats
from deltastore.pull.trusted import CheckedPlan, preflight
from deltastore.storage import VersionStore
from deltastore.trust import TrustedKey
from deltastore.trust.keys import TrustedKeys, load_trusted

log = logging.getLogger("deltastore.pull")


def pull_weights(
    local_checkpoint_dir: str | os.PathLike[str],
    source_dir: StoreSpec | Sequence[StoreSpec],
    target_version: int | str,
    base_dir: str | os.PathLike[str] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    pre_read: PreRead | None = None,
    workers: int = 4,
    lock_timeout_s: float = 3600.0,
    process_group: Any = None,
    trusted_keys: TrustedKeys | None = None,
    progress: ProgressCallback | None = None,
    flush_after_reply: bool = False,
) -> PullResult:
    """Bring ``local_checkpoint_dir`` to ``target_version`` of the store at ``source_dir``.

    ``target_version`` is a version number or ``"latest"`` (the newest committed version).
    Under the per-host lock: an interrupted transition (a pending record) is repaired tensor
    by tensor, or the checkpoint reseeds when the repair cannot be proven; a checkpoint whose
    files changed since its state was written (or after a repair, or with a state written by
    another tool) is verified in full first; then version 0 resets to ``base_dir`` (copied and
    content-verified, never modified); a checkpoint holding a version on the target's chain
    catches up with the remaining deltas in one pass per tensor; anything else (no state,
    another stream, a backward target) reseeds from the base or the newest full version on the
    chain (staged and verified before it replaces anything) and replays. Every written tensor
    is verified against the published digest; the state file never names a version whose
    bytes were not verified and flushed. A store passed in is not modified (``pre_read`` is
    this call's own hook).

    ``source_dir`` may be a list of stores holding copies of one run, nearest first (e.g. a
    replica made by ``deltastore replicate``, then the trainer's store): each version is read
    from the first that has it committed, and ``state.json`` records where each came from
    (see :mod:`deltastore.pull.nearest`).

    ``process_group`` (a ``ProcessGroup``, ``"world"``, or ``"auto"`` for the default group
    when torch.distributed is initialised) makes this a collective: every rank pulls into its
    host's dir and the call succeeds only if every rank did (see :mod:`deltastore.pull.fanout`).

    ``trusted_keys`` (public key files or :class:`~deltastore.trust.TrustedKey`, several for
    rotation) makes the pull apply only versions signed by one of them: every version to
    apply is verified, and its delta shards staged and checked byte for byte, before the
    first write (docs/signing.md states the exact guarantee). A seed from the base checks
    the base against the stream's recorded base digests first.

    ``progress`` (see :mod:`deltastore.progress`) gets phase ``seed`` (the base's bytes
    copied), ``download`` (a full version's shard bytes staged) and ``apply`` (the delta
    payload bytes read and applied). If it raises, the pull stops as on any error there: a
    catch-up puts back what it wrote and the checkpoint stays at its verified version; a
    reseed from the base is repaired by the next pull.

    ``flush_after_reply=True`` returns once a catch-up's tensors are verified in the mapped
    files; the flush and the state follow (:mod:`deltastore.pull.completion`, docs/engines.md).

    Raises a :class:`DeltastoreError` subclass naming the version and tensor at fault
    (:class:`SignatureError` for a version the trusted keys do not vouch for,
    :class:`ConfigError` for a local dir overlapping a local store,
    :class:`GroupPullError` listing every failed rank in a group pull).
    """
    group = resolve_group(process_group)
    keys = load_trusted(trusted_keys)
    source = make_source(source_dir, storage_options, pre_read)
    target = source.resolve_target(target_version)
    attempt = functools.partial(
        _pull_here,
        local_checkpoint_dir,
        source,
        target,
        base_dir,
        workers=workers,
        lock_timeout_s=lock_timeout_s,
        keys=keys,
        progress=progress,
        flush_after_reply=flush_after_reply,
    )
    pull_here = functools.partial(_re_resolving, source.store, target, attempt)
    if group is None:
        return pull_here()
    local_dir = os.path.abspath(os.fspath(local_checkpoint_dir))
    return pull_in_group(group, pull_here, local_dir=local_dir, target_version=target)


def _re_resolving(
    store: VersionStore, target_version: int, attempt: Callable[[], PullResult]
) -> PullResult:
    """``attempt()``, resolved once more if a version vanished while it ran."""
    try:
        return attempt()
    except VersionNotFoundError as exc:
        return _re_resolve(store, target_version, exc, attempt)


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
    require_committed(store, target_version, lost=lost)
    log.warning(
        "a version vanished while pulling v%06d (%s); re-resolving its chain once",
        target_version,
        lost,
    )
    return attempt()


@dataclass
class _PullRun:
    """One pull on this host, under its lock: the store, the dir, what it has done so far."""

    source: PullSource
    local: LocalCheckpoint
    base: str | None
    workers: int
    stats: ApplyStats
    started: float
    checked: CheckedPlan = field(default_factory=CheckedPlan)
    """What the preflight verified (signature records, the verified delta copies)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase so far (see :attr:`PullResult.phase_seconds`)."""
    _mark: float = 0.0

    def phase_done(self, name: str) -> None:
        """The time since the previous mark (or the start) went to phase ``name``."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - (self._mark or self.started)
        self._mark = now

    @property
    def store(self) -> VersionStore:
        return self.source.store

    def result(
        self, plan: Plan, version: int, action: str, repair: RepairSummary | None
    ) -> PullResult:
        s = self.stats
        seconds = time.perf_counter() - self.started
        if not self._mark:
            self.phase_done("prepare")
        try:
            total = len(scan_checkpoint(self.local.dir))  # headers only
        except (DeltastoreError, OSError):
            total = s.tensors
        return PullResult(
            version,
            action,
            s.versions,
            s.tensors,
            s.bytes_read,
            seconds,
            plan.describe(),
            repair,
            s.payloads,
            bytes_reconstructed=s.bytes_written,
            tensors_skipped=0 if action == "reseeded" else max(0, total - s.tensors),
            reseeds=int(action == "reseeded"),
            phase_seconds=dict(self.phases),
        )

    def applied(self, version: int, stream: str | None) -> AppliedState:
        """The state recording ``version``: the store it came from, and, when reading from
        several stores, where each version this pull read came from."""
        sources = None
        if len(each_store(self.store)) > 1:
            read = [*self.stats.versions, version]
            sources = {v: source_of(self.store, v) for v in read if v > 0}
        return AppliedState(version, stream, source_of(self.store, version), sources=sources)

    def reseed(self, chain: Chain, state: AppliedState | None, why: str) -> None:
        """Seed from the chain's start and record it; a full version is staged and verified
        before anything local changes (on failure the host keeps its state and bytes)."""
        stream = chain.stream_at(chain.start)
        pending = PendingTransition(None, chain.start, stream, state.stream_id if state else None)
        if chain.start_index is None:
            if self.base is None:
                raise ConfigError(
                    f"{self.local.dir} must be reseeded from the base model ({why}) but no "
                    "base_dir was given"
                )
            self.local.begin(pending)
            log.info("%s: seeding from base %s", self.local.dir, self.base)
            self.local.seed_from_base(self.base, self.stats.progress)
            seeded = scan_checkpoint(self.local.dir)
            self.stats.add(bytes_written=sum(t.entry.nbytes for t in seeded.values()))
        else:
            log.info("%s: seeding from full version %d", self.local.dir, chain.start)
            self.stats.report("download", chain.start_index.totals.get("wire_bytes"))
            try:
                staging = stage_full(
                    self.store,
                    chain.start_index,
                    self.local,
                    model=self._model(),
                    workers=self.workers,
                    stats=self.stats,
                )
                self.checked.check_staged(staging, chain.start_index)
                self.stats.end_report()
            except BaseException:
                discard_staging(self.local)
                raise
            self.local.begin(pending)
            tensors = swap_in(staging, self.local)
            self.local.copy_missing_extras(self.base)
            self.stats.add(tensors=tensors)
            self.stats.versions.append(chain.start)
        self.local.finish(self.applied(chain.start, stream))

    def _model(self) -> dict[str, CheckpointTensor] | None:
        """The tensors a full version must match: the base's, else the local checkpoint's."""
        for directory in (self.base, self.local.dir):
            if directory is not None:
                try:
                    return scan_checkpoint(directory)
                except DeltastoreError:
                    continue
        return None

    def catch_up(self, chain: Chain, plan: Plan) -> Callable[[], None]:
        """Apply ``plan``'s deltas in place inside a pending record, verified in the mapped
        files; returns the steps left once the pull replies: flush the patched files, then
        record the target (see :mod:`deltastore.pull.completion`)."""
        current, target = plan.start, chain.target
        from_stream = chain.stream_at(current)
        self.local.begin(
            PendingTransition(current, target, chain.stream_id, from_stream, plan.versions)
        )
        files = MappedFiles()
        try:
            apply_chain(
                self.checked.delta_store or self.store,
                plan.deltas,
                self.local,
                current,
                workers=self.workers,
                tensors=self.checked.local_tensors,
                stats=self.stats,
                files=files,
            )
        except BaseException as exc:
            files.close()
            if isinstance(exc, Exception) and not isinstance(exc, PutBackError):
                # apply_chain put back (and flushed) what it wrote, whatever failed (a
                # progress callback included): the bytes hold `current` again. After a
                # PutBackError the pending record stays: the next pull repairs.
                self.local.finish(self.applied(current, from_stream))
            raise
        state = self.applied(target, chain.stream_id)

        def make_durable() -> None:
            try:
                flush_applied(files, version_dir_name(target), self.local.dir)
            finally:
                files.close()
            self.local.finish(state)

        return make_durable


def _pull_here(
    local_checkpoint_dir: str | os.PathLike[str],
    source: PullSource,
    target_version: int,
    base_dir: str | os.PathLike[str] | None,
    *,
    workers: int,
    lock_timeout_s: float,
    keys: tuple[TrustedKey, ...] | None = None,
    progress: ProgressCallback | None = None,
    flush_after_reply: bool = False,
) -> PullResult:
    base = os.path.abspath(os.fspath(base_dir)) if base_dir is not None else None
    local = LocalCheckpoint(local_checkpoint_dir)
    if base is not None and same_dir(base, local.dir):
        raise ConfigError(
            f"local checkpoint {local.dir} is the base model path; pass a host-local copy dir"
        )
    source.check_apart_from(local.dir)
    # The arguments are checked before the host dir, its lock or its state are created.
    if base is not None and not os.path.isdir(base):
        raise ConfigError(
            f"base_dir {base} does not exist; pass the checkpoint dir of the base model the "
            "trainer was seeded from"
        )
    if target_version > 0:
        fresh = not os.path.exists(local.dir)
        source.check_roots(list_remote=fresh)
        if fresh:
            source.check_published(target_version)
    os.makedirs(local.dir, exist_ok=True)
    stats = ApplyStats(progress=progress)
    run = _PullRun(source, local, base, workers, stats, time.perf_counter())
    wait_recorded(local.dir, lock_timeout_s)  # this process's last pull of the dir, first
    with local.lock(lock_timeout_s) as held, gc_paused():
        # The collector resumes once the pull's objects (headers, histories, the scanned
        # checkpoint) are gone with _pull_locked's frame, so its first collection is short.
        done, make_durable = _pull_locked(run, target_version, keys, flush_after_reply)
        if make_durable is not None:
            # Reply now: every written tensor is verified in the page cache the engine
            # reloads from; the flush and the state follow under the host lock.
            complete_behind(local.dir, make_durable, held.hand_over().release)
    log.info("%s: %s", local.dir, done.message)
    return done


def _pull_locked(
    run: _PullRun,
    target_version: int,
    keys: tuple[TrustedKey, ...] | None,
    flush_after_reply: bool = False,
) -> tuple[PullResult, Callable[[], None] | None]:
    """The pull itself, under the host's lock: recover, plan, apply or reseed, record; with
    ``flush_after_reply``, the steps a catch-up leaves for after the reply (None: all done)."""
    source, local, base, workers = run.source, run.local, run.base, run.workers
    state = local.read_state()
    pending = local.read_pending()
    source.refresh(target_version if target_version > 0 else None)
    # A host holding a version of the target's stream resolves only what is new; the
    # whole chain is walked only for a repair or a reseed.
    chain = (
        resolve_onto(source.store, target_version, state)
        if pending is None
        else resolve_chain(source.store, target_version)
    )
    repair: RepairSummary | None = None
    if pending is not None:
        state, repair = recover(
            source.store, local, pending, state, chain, base, workers, run.stats
        )
    state = trusted_state(
        source.store, local, state, chain, base, workers, suspect=pending is not None
    )
    plan = plan_pull(source.store, chain, state)
    if plan.action == "reseed" and chain.partial:
        chain = resolve_chain(source.store, target_version)
        plan = plan_pull(source.store, chain, state)
    log.info("%s: plan: %s", local.dir, plan.describe())
    if plan.action == "noop":
        assert state is not None
        action = "noop" if repair is None else "repaired"
        return run.result(plan, state.version, action, repair), None
    make_durable = None
    with preflight(source.store, chain, plan, local, base, keys, workers=workers) as checked:
        run.checked = checked
        run.phase_done("prepare")
        if plan.action == "reseed":
            run.reseed(chain, state, plan.reason or "the target builds on version 0")
            run.phase_done("reseed")
        if plan.deltas:
            make_durable = run.catch_up(chain, plan)
            if not flush_after_reply:
                make_durable()  # (the flush counts as part of the apply)
                make_durable = None
            run.phase_done("apply")
    run.checked = CheckedPlan()  # (the scanned checkpoint goes before the collector resumes)
    action = "reseeded" if plan.action == "reseed" else "applied"
    return run.result(plan, target_version, action, repair), make_durable

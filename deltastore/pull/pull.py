"""``pull_weights``: bring a host-local checkpoint to a published version, verified.

Under the per-host lock: an interrupted transition (a pending record) is repaired tensor by
tensor, or the checkpoint reseeds when the repair cannot be proven; a checkpoint whose files
changed since its state was written (or after a repair, or with a foreign state) is verified
in full first; then the plan catches up, reseeds or does nothing.

With a process group every rank pulls into its own host's dir (ranks sharing a host collapse
to one apply on the ``flock``; the others find the target: a no-op), then the outcomes are
gathered: the pull succeeds on every rank only if every host verified its checkpoint, else
:class:`GroupPullError` on every rank names each failed rank, its host and its dir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltastore.errors import (
    ConfigError,
    DeltastoreError,
    FormatError,
    GroupPullError,
    IntegrityError,
    NameMismatchError,
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
from deltastore.pull.full import discard_staging, stage_full, swap_in
from deltastore.pull.local import (
    LocalCheckpoint,
    MappedFiles,
    PullContext,
    complete_behind,
    same_dir,
    wait_recorded,
)
from deltastore.pull.repair import repair_pending
from deltastore.pull.result import ApplyStats, HostOutcome, PullResult, RepairSummary
from deltastore.pull.source import (
    PreRead,
    PullSource,
    StoreSpec,
    each_store,
    open_store,
    require_committed,
    source_of,
)
from deltastore.pull.verify import CheckedPlan, preflight, verify_checkpoint, verify_signatures
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
    """Bring ``local_checkpoint_dir`` to ``target_version`` (a number or ``"latest"``) of the
    store at ``source_dir`` (or a list of copies of one run, nearest first), verified.

    Version 0 resets to ``base_dir`` (copied and content-verified, never modified); a host on
    the target's chain catches up in one pass per tensor; anything else reseeds from the base
    or the newest full version on the chain (staged and verified first) and replays. The state
    file never names a version whose bytes were not verified and flushed. ``process_group``
    makes this a collective; ``trusted_keys`` applies only versions signed by one of them;
    ``progress`` gets phases ``seed``, ``download`` and ``apply``; ``flush_after_reply=True``
    returns once a catch-up's tensors are verified in the mapped files, the flush and the state
    following (:mod:`deltastore.pull.local`). See docs/api.md. Raises a
    :class:`DeltastoreError` subclass naming the version and tensor at fault.
    """
    group = resolve_group(process_group)
    options = _Options(workers, lock_timeout_s, load_trusted(trusted_keys), flush_after_reply)
    source = PullSource(open_store(source_dir, storage_options), pre_read)
    target = source.resolve_target(target_version)

    def pull_here() -> PullResult:
        try:
            return _pull_here(local_checkpoint_dir, source, target, base_dir, options, progress)
        except VersionNotFoundError as lost:
            # A version vanished mid-pull (pruned): what was applied is verified and recorded
            # (or put back), so resolving once more is safe.
            require_committed(source.store, target, lost=lost)
            log.warning(
                "a version vanished while pulling v%06d (%s); re-resolving its chain once",
                target,
                lost,
            )
            return _pull_here(local_checkpoint_dir, source, target, base_dir, options, progress)

    if group is None:
        return pull_here()
    local_dir = os.path.abspath(os.fspath(local_checkpoint_dir))
    return pull_in_group(group, pull_here, local_dir=local_dir, target_version=target)


def resolve_group(process_group: Any) -> Any | None:
    """The process group to gather over, or None: ``None``/``False`` none, ``"auto"`` the
    default group when torch.distributed is initialised, ``True``/``"world"`` the default group
    (must be initialised), anything else a ``ProcessGroup``. Opt-in, because a collective
    called from only some ranks of an initialised group would wait forever."""
    if process_group is None or process_group is False:
        return None
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if isinstance(process_group, str) or process_group is True:
        if process_group not in ("auto", "world", True):
            raise ConfigError(
                f"process_group={process_group!r}: pass a ProcessGroup, 'world', 'auto' or None"
            )
        if not initialised:
            if process_group == "auto":
                return None
            raise ConfigError(
                "process_group='world' but torch.distributed is not initialised; call "
                "init_process_group first or pass process_group=None"
            )
        return dist.group.WORLD
    if not initialised:
        raise ConfigError("a process group was given but torch.distributed is not initialised")
    return process_group


def pull_in_group(
    group: Any, pull: Callable[[], PullResult], *, local_dir: str, target_version: int
) -> PullResult:
    """Run ``pull`` on this rank, gather every rank's outcome (one rank's exception never
    skips the collective), and raise :class:`GroupPullError` on every rank when any failed
    (chained to the local error on the failing rank)."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    host = socket.gethostname()
    result: PullResult | None = None
    error: Exception | None = None
    try:
        result = pull()
        mine = HostOutcome(
            rank, host, local_dir, True, result.message, result.version, result.action
        )
    except Exception as exc:  # every rank must reach the gather below
        error = exc
        mine = HostOutcome(rank, host, local_dir, False, f"{type(exc).__name__}: {exc}")
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dataclasses.asdict(mine), group=group)
    outcomes = [HostOutcome(**o) for o in gathered]
    failed = [o for o in outcomes if not o.success]
    if failed:
        message = (
            f"pull of v{target_version:06d} failed on {len(failed)} of {len(outcomes)} rank(s): "
            + "; ".join(o.describe() for o in failed)
        )
        raise GroupPullError(message, outcomes) from error
    assert result is not None
    ranks, hosts = len(outcomes), len({(o.host, o.local_dir) for o in outcomes})
    log.info("v%06d verified on all %d rank(s) (%d host dir(s))", target_version, ranks, hosts)
    return dataclasses.replace(result, group=tuple(outcomes))


@dataclass(frozen=True)
class _Options:
    workers: int
    lock_timeout_s: float
    keys: tuple[TrustedKey, ...] | None
    flush_after_reply: bool


@dataclass
class _PullRun(PullContext):
    source: PullSource
    options: _Options
    started: float = field(default_factory=time.perf_counter)
    checked: CheckedPlan = field(default_factory=CheckedPlan)
    phases: dict[str, float] = field(default_factory=dict)
    _mark: float = 0.0

    def phase_done(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - (self._mark or self.started)
        self._mark = now

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
                staging = stage_full(self, chain.start_index, self._model())
                self.checked.check_staged(staging, chain.start_index)
                self.stats.end_report()
            except BaseException:
                discard_staging(self.local)
                raise
            self.local.begin(pending)
            self.local.copy_missing_extras(self.base)  # (swap_in's dir fsync covers them)
            tensors = swap_in(staging, self.local)
            self.stats.add(tensors=tensors)
            self.stats.versions.append(chain.start)
        self.local.finish(self.applied(chain.start, stream))

    def _model(self) -> dict[str, CheckpointTensor] | None:
        """The tensors a full version must match: the base's, else the local checkpoint's."""
        for directory in filter(None, (self.base, self.local.dir)):
            with contextlib.suppress(DeltastoreError):
                return scan_checkpoint(directory)
        return None

    def catch_up(self, chain: Chain, plan: Plan) -> Callable[[], None]:
        """Apply ``plan``'s deltas in place inside a pending record, verified in the mapped
        files; returns the steps left once the pull replies: flush the patched files, then
        record the target (see :mod:`deltastore.pull.local`)."""
        current, target = plan.start, chain.target
        from_stream = chain.stream_at(current)
        self.local.begin(
            PendingTransition(current, target, chain.stream_id, from_stream, plan.versions)
        )
        files = MappedFiles()
        store, tensors = self.checked.delta_store or self.store, self.checked.local_tensors
        try:
            apply_chain(self, store, plan.deltas, current, tensors, files)
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

    def recover(
        self, pending: PendingTransition, state: AppliedState | None, chain: Chain
    ) -> tuple[AppliedState | None, RepairSummary | None]:
        """The state to plan from after an interrupted transition (None: reseed)."""
        local = self.local
        if state is not None and state.version == pending.to_version:
            # The crash fell between writing the new state and clearing the record: the data
            # was flushed before the state was written, so the state stands.
            local.finish(state)
            return state, None
        to, summary, why = pending.to_version, None, None
        repaired = self.applied(to, pending.stream_id)
        if pending.from_version is None:
            why = "an interrupted reseed was found"
        elif plan_pull(self.store, chain, repaired).action == "reseed":
            why = f"an interrupted transition to v{to:06d} does not lead to v{chain.target:06d}"
        else:
            if self.options.keys is not None:
                # The repair verifies each tensor by the digests in the chain's shard headers:
                # only versions the keys vouch for, as a catch-up would (SignatureError).
                signed = [chain.start_index] if chain.start_index is not None else []
                verify_signatures(self.store, [*signed, *chain.deltas], self.options.keys)
            try:
                summary = repair_pending(self, pending)
            except DeltastoreError as exc:
                why = f"cannot repair the interrupted transition to v{to:06d} ({exc})"
        if why is not None:
            log.warning("%s: %s; reseeding", local.dir, why)
            return None, None
        local.finish(repaired)
        return repaired, summary

    def trusted(
        self, state: AppliedState | None, chain: Chain, *, suspect: bool
    ) -> AppliedState | None:
        """``state`` if the checkpoint's bytes can be taken to hold it, else None (reseed):
        cheap when the weight files' fingerprints match the state's, else (or ``suspect``: an
        interrupted pull was found) every tensor is hashed against the state's version."""
        local = self.local
        if state is None or chain.suffix_after(state.version) is None:
            return state
        # A stat per file: a rewrite of the same size within the mtime granularity passes.
        if not suspect and state.files == local.fingerprints():
            return state
        why = (
            "an interrupted pull was found"
            if suspect
            else "its state records no file fingerprints (written by another tool)"
            if state.files is None
            else "its weight files changed since its state was written"
        )
        log.warning("%s: %s; verifying every tensor against v%06d", local.dir, why, state.version)
        try:
            verify_checkpoint(self.store, local.dir, state.version, self.base, self.workers)
        except (IntegrityError, NameMismatchError, FormatError, ConfigError) as exc:
            log.warning("%s does not hold v%06d (%s); reseeding", local.dir, state.version, exc)
            local.invalidate_state()
            return None
        local.write_state(state)  # fresh fingerprints: the next pull is cheap again
        return state

    def pull(self, target: int) -> tuple[PullResult, Callable[[], None] | None]:
        """The pull itself, under the host's lock: recover, plan, apply or reseed, record;
        with ``flush_after_reply``, the steps a catch-up leaves for after the reply."""
        state = self.local.read_state()
        pending = self.local.read_pending()
        self.source.refresh(target if target > 0 else None)
        # A host holding a version of the target's stream resolves only what is new; the
        # whole chain is walked only for a repair or a reseed.
        chain = resolve_onto(self.store, target, state if pending is None else None)
        repair: RepairSummary | None = None
        if pending is not None:
            state, repair = self.recover(pending, state, chain)
        state = self.trusted(state, chain, suspect=pending is not None)
        plan = plan_pull(self.store, chain, state)
        if plan.action == "reseed" and chain.partial:
            chain = resolve_chain(self.store, target)
            plan = plan_pull(self.store, chain, state)
        log.info("%s: plan: %s", self.local.dir, plan.describe())
        if plan.action == "noop":
            assert state is not None
            action = "noop" if repair is None else "repaired"
            return self.result(plan, state.version, action, repair), None
        make_durable = None
        with preflight(self, chain, plan, self.options.keys) as checked:
            self.checked = checked
            self.phase_done("prepare")
            if plan.action == "reseed":
                self.reseed(chain, state, plan.reason or "the target builds on version 0")
                self.phase_done("reseed")
            if plan.deltas:
                try:
                    make_durable = self.catch_up(chain, plan)
                except IntegrityError:
                    if plan.action == "reseed" and chain.start_index is None:
                        # The base copied just now fails a check of the stream's first delta
                        # (the base record leaves the tensors it carries to that check): the
                        # seed stays unfinished, so the next pull seeds again from its --base.
                        self.local.begin(PendingTransition(None, 0, chain.stream_at(0)))
                    raise
                if not self.options.flush_after_reply:
                    make_durable()  # (the flush counts as part of the apply)
                    make_durable = None
                self.phase_done("apply")
        self.checked = CheckedPlan()  # (the scanned checkpoint goes before the collector resumes)
        action = "reseeded" if plan.action == "reseed" else "applied"
        return self.result(plan, target, action, repair), make_durable


def _pull_here(
    local_checkpoint_dir: str | os.PathLike[str],
    source: PullSource,
    target: int,
    base_dir: str | os.PathLike[str] | None,
    options: _Options,
    progress: ProgressCallback | None,
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
    if target > 0:
        source.check_target(target, fresh=not os.path.exists(local.dir))
    os.makedirs(local.dir, exist_ok=True)
    stats = ApplyStats(progress=progress)
    run = _PullRun(source.store, local, base, options.workers, stats, source, options)
    wait_recorded(local.dir, options.lock_timeout_s)  # this process's last pull of the dir
    with local.lock(options.lock_timeout_s) as hand_over, gc_paused():
        # The collector resumes once the pull's objects (headers, histories, the scanned
        # checkpoint) are gone with run.pull's frame, so its first collection is short.
        done, make_durable = run.pull(target)
        if make_durable is not None:
            # Reply now: every written tensor is verified in the page cache the engine
            # reloads from; the flush and the state follow under the host lock.
            complete_behind(local.dir, make_durable, hand_over())
    log.info("%s: %s", local.dir, done.message)
    return done

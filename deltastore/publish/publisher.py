"""``DeltaPublisher``: a thin driver over the publish modules, one code path for one process
and many ranks (alone, every collective is the identity). One publish is five phases, diff,
plan (and claim), write, commit and finish (docs/publishing.md has the full account); every rank
takes part in each, whatever failed before, so none is left waiting in a collective.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from deltastore.codecs import get_checksum, get_encoding
from deltastore.errors import ConfigError, DeltastoreError, PublishError, SnapshotError
from deltastore.gc_pause import gc_paused
from deltastore.progress import ProgressCallback
from deltastore.publish import commit as commit_protocol
from deltastore.publish.config import PublisherConfig, Settings
from deltastore.publish.device import StagerStats
from deltastore.publish.diff import NamedTensors, Step, diff_tensors
from deltastore.publish.messages import (
    METRIC_KEYS,
    SECONDS_KEYS,
    DiffReport,
    Failure,
    Final,
    Outcome,
    Plan,
    PublishResult,
    StreamState,
    Written,
    after_commit_error,
    describe,
    record,
    warn_if_dense,
)
from deltastore.publish.planning import plan_layout
from deltastore.publish.rank_state import Coordinator, RankSnapshot, make_coordinator, seed_rank
from deltastore.publish.shards import ShardWriter
from deltastore.publish.snapshot import Snapshot
from deltastore.publish.spool import PayloadSpool
from deltastore.storage import VersionStore
from deltastore.trust import SigningKey, as_signing_key
from deltastore.trust.base import base_digests_record

log = logging.getLogger("deltastore.publish")


class DeltaPublisher:
    """Publishes versions of a model to a :class:`VersionStore`, from one process or many ranks
    (docs/api.md). ``base_checkpoint`` is the engines' own model path (version 0); the settings
    are :class:`PublisherConfig`'s fields as keywords, or one ``config=``. ``post_write`` is a
    reference-signature hook ``hook(args, version_dir, rollout_engines)`` run on every rank
    after each commit (without it the store's own hook runs). Raises :class:`ConfigError` for an
    unknown codec, a bad setting or a base checkpoint that is not a directory.
    """

    def __init__(
        self,
        store: VersionStore | str | os.PathLike[str],
        base_checkpoint: str | os.PathLike[str],
        config: PublisherConfig | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        post_write: Callable[[Any, str, Any], None] | None = None,
        args: Any = None,
        rollout_engines: Any = None,
        process_group: Any = None,
        **settings: Any,
    ) -> None:
        self.config = PublisherConfig.build(config, settings)
        self.encoding = get_encoding(self.config.encoding)
        self.checksum = get_checksum(self.config.checksum)
        self.base_checkpoint = os.fspath(base_checkpoint)
        if not os.path.isdir(self.base_checkpoint):
            raise ConfigError(
                f"base checkpoint {self.base_checkpoint!r} is not a directory; pass the engines' "
                "model path (an HF safetensors checkpoint)"
            )
        if not isinstance(store, VersionStore):
            store = VersionStore(store, storage_options)
        self.store = store
        self._post_write: Callable[[str], None] | None = None
        if post_write is not None:
            hook = post_write
            self._post_write = lambda version_dir: hook(args, version_dir, rollout_engines)
        self.coordinator: Coordinator = make_coordinator(
            process_group, collective=self.config.collective
        )
        self.rank = self.coordinator.rank
        self.world_size = self.coordinator.world_size
        preload = self.config.preload
        self.preload = self.world_size == 1 if preload is None else preload
        self._settings = Settings(self.config, self.encoding, self.checksum, self.base_checkpoint)
        self._signing_key: SigningKey | None = None
        if self.config.signing_key is not None and self.rank == 0:
            self._signing_key = as_signing_key(self.config.signing_key)
        self._base_record: dict[str, Any] | None = None
        self.stream: StreamState | None = None  # replaced (never changed) after each commit
        self._held: RankSnapshot | None = None
        self._sizes: dict[str, int] = {}
        self._metrics: dict[str, float] = dict.fromkeys(METRIC_KEYS, 0.0)
        self._warned_density = False
        self.last_staging: StagerStats | None = None  # host staging of the last publish

    @property
    def snapshot(self) -> Snapshot | None:
        """This rank's snapshot (None before :meth:`seed`)."""
        return None if self._held is None else self._held.snapshot

    @property
    def next_version(self) -> int:
        return 1 if self.stream is None else self.stream.next_version

    @property
    def base_version(self) -> int:
        """Version the next delta builds on."""
        return 0 if self.stream is None else self.stream.base_version

    @property
    def stream_id(self) -> str | None:
        return None if self.stream is None else self.stream.stream_id

    def seed(
        self, *, continue_latest: bool = False, progress: ProgressCallback | None = None
    ) -> None:
        """Set up version 0 (the base checkpoint's bytes) or resume; publishes nothing.
        ``continue_latest=True`` (``deltastore publish --prev``) continues the latest version's
        stream, taking the base checkpoint as that version's state (the caller checks it).
        Collective: every rank gets rank 0's answer or the same error."""
        self._held, self.stream = seed_rank(
            self.store,
            self.base_checkpoint,
            self.coordinator,
            self.config,
            preload=self.preload,
            continue_latest=continue_latest,
            progress=progress,
        )
        self._sizes = {name: s.nbytes for name, s in self._held.snapshot.sources.items()}
        if self.stream.base_version == 0 and self.config.record_base_digests and self.rank == 0:
            self._base_digests()  # once per stream: with the seed's reads, not in a publish

    def publish(
        self,
        named_tensors: NamedTensors,
        *,
        full: bool = False,
        progress: ProgressCallback | None = None,
    ) -> PublishResult:
        """Diff ``named_tensors`` (a mapping name → tensor, or pairs; tensors not passed are
        unchanged) against the snapshot and publish the change as one version; ``full=True``
        (on any rank) publishes a complete checkpoint that resets the chain. Raises
        :class:`PublishError` / :class:`VersionConflictError` (nothing committed) or
        :class:`HookError` / :class:`SnapshotError` (committed, or may be).
        """
        if self._held is None or self.stream is None:
            raise PublishError("publish() before seed(): call seed() once first")
        started = time.perf_counter()
        with gc_paused(), PayloadSpool(self.config.spool_memory_bytes) as spool:
            step = Step(self._held, self.stream, spool, progress)
            local_error = self._diff_phase(step, named_tensors)
            self._plan_phase(step, step.diff.report(self.rank, local_error, full=full))
            self._raise_failure(step.plan.failure, local_error)
            written, local_error = self._write_phase(step)
            outcome = self._commit_phase(step, written)
            if outcome.failure is not None:
                self.stream = step.stream.aborted()
            self._raise_failure(outcome.failure, local_error)
            advance_error: BaseException | None = None
            try:
                step.held.advance(step.plan, outcome, step.diff.encoded, spool, self._settings)
            except Exception as exc:
                advance_error = exc
        plan, metrics, result = step.plan, step.metrics, outcome.result
        assert plan.layout is not None and result is not None and step.slot is not None
        self.stream = step.stream.committed(plan.layout, result)
        hook_error = commit_protocol.run_post_write(step.slot, self._post_write, self.rank, metrics)
        metrics["publish_s"] = time.perf_counter() - started
        error = self._finish_phase(step, advance_error, hook_error)
        self._metrics = record(metrics, result, tensors=len(self._sizes), world=self.world_size)
        if not self._warned_density:
            self._warned_density = warn_if_dense(result)
        if error is not None:
            if isinstance(error, SnapshotError):
                self._held = None
            raise error from (advance_error or hook_error)
        return result

    def pop_metrics(self) -> dict[str, float]:
        """Metrics of the last publish (:data:`METRIC_KEYS`), then cleared to zero; the same
        global figures on every rank (totals over ranks, the slowest rank's seconds)."""
        metrics, self._metrics = self._metrics, dict.fromkeys(METRIC_KEYS, 0.0)
        return metrics

    def _raise_failure(self, failure: Failure | None, local_error: BaseException | None) -> None:
        """Raise a phase's failure on every rank (see :meth:`Failure.error`)."""
        if failure is None:
            return
        if failure.kind == "uncertain":
            self._held = None
        raise failure.error() from local_error

    def _diff_phase(self, step: Step, named_tensors: NamedTensors) -> BaseException | None:
        try:
            step.diff = diff_tensors(named_tensors, step, self._settings)
        except Exception as exc:
            return exc
        self.last_staging = step.diff.staging
        return None

    def _plan_phase(self, step: Step, report: DiffReport) -> None:
        """Rank 0 plans (pure) and claims; every rank gets the plan and a slot to write into."""
        begun = time.perf_counter()
        reports = self.coordinator.gather(report, what="publish: gather diffs")
        plan: Plan | None = None
        if reports is not None:
            layout = plan_layout(reports, step.stream, self._sizes, self.config)
            if isinstance(layout, Failure):
                plan = Plan(failure=layout)
            else:
                step.slot, failure = commit_protocol.claim(self.store, step.stream)
                if step.slot is None:
                    plan = Plan(failure=failure)
                else:
                    plan = Plan(None, step.slot.version, step.slot.token, layout)
        step.plan = plan = self._collective(step, self.coordinator.broadcast, plan, "plan")
        if step.slot is None and plan.failure is None:
            step.slot = self.store.join(plan.version, plan.token)
        step.metrics["coord_s"] += time.perf_counter() - begun

    def _write_phase(self, step: Step) -> tuple[Written, BaseException | None]:
        layout, slot = step.plan.layout, step.slot
        assert slot is not None and layout is not None
        begun = time.perf_counter()
        try:
            writer = ShardWriter(slot.open_write, step, self._settings)
            entries, wire, facts = writer.write_all(layout.shards[self.rank], full=layout.full)
        except Exception as exc:
            return Written(self.rank, describe(exc)), exc
        finally:
            step.metrics["write_s"] = time.perf_counter() - begun
        return Written(self.rank, None, entries, wire, facts), None

    def _commit_phase(self, step: Step, written: Written) -> Outcome:
        begun, metrics, version = time.perf_counter(), step.metrics, step.plan.version
        what = f"commit weight_v{version:06d}"
        writes = self._collective(step, self.coordinator.gather, written, what)
        outcome: Outcome | None = None
        if writes is not None:
            assert step.slot is not None
            commit_started = time.perf_counter()
            outcome = commit_protocol.commit_version(
                step.slot,
                step.plan,
                writes,
                step.stream,
                self._sizes,
                self._settings,
                signing_key=self._signing_key,
                base_record=self._base_digests if self.config.record_base_digests else None,
            )
            metrics["commit_s"] = time.perf_counter() - commit_started
        where = f"weight_v{version:06d} may be committed in {self.store.url}"
        outcome = self._collective(step, self.coordinator.broadcast, outcome, what, after=where)
        metrics["coord_s"] += time.perf_counter() - begun - metrics["commit_s"]
        return outcome

    def _collective(
        self, step: Step, collective: Callable[..., Any], obj: Any, what: str, after: str = ""
    ) -> Any:
        """One collective of a publish. Failing before the commit, rank 0 removes the version's
        claim and files (nothing was committed: the error stays a :class:`PublishError`);
        after it (``after`` says what is committed) it is a :class:`SnapshotError`, and this
        rank keeps no snapshot."""
        try:
            return collective(obj, what=f"publish: {what}")
        except Exception as exc:
            if not after:
                if step.slot is not None:
                    step.slot.abort()  # a no-op on the other ranks (they only joined)
                raise
            self._held = None
            raise SnapshotError(f"{after}: {exc}") from exc

    def _base_digests(self) -> dict[str, Any]:
        """Rank 0: every base tensor's digest (hashed once per publisher, on first need)."""
        if self._base_record is None:
            self._base_record = base_digests_record(
                self.base_checkpoint, self.checksum.name, workers=self.config.threads
            )
        return self._base_record

    def _finish_phase(
        self, step: Step, advance_error: BaseException | None, hook_error: BaseException | None
    ) -> DeltastoreError | None:
        """Exchange every rank's post-commit failures and timings; the error to raise, if any."""
        metrics, version = step.metrics, step.plan.version
        seconds = {k: metrics[k] for k in SECONDS_KEYS}
        final = Final(self.rank, describe(advance_error), describe(hook_error), seconds)
        where = f"weight_v{version:06d} is committed in {self.store.url}"
        finals = self._collective(
            step, self.coordinator.all_gather, final, f"finish weight_v{version:06d}", where
        )
        for key in SECONDS_KEYS:
            metrics[key] = max(f.seconds[key] for f in finals)
        return after_commit_error(where, finals)

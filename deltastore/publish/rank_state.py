"""What one rank holds of the published model, how ``seed()`` builds it and how it advances
after each commit; and the :class:`Coordinator` ranks agree through (the process group, never
the store: neither ordered nor fast enough to be a lock). A seed failure is raised on every
rank, as the same class, naming the ranks at fault.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import deltastore.errors
from deltastore.codecs import ByteArray, Encoding, apply_changes, get_encoding, warm_up
from deltastore.errors import (
    ConfigError,
    DeltastoreError,
    PublishError,
    StreamError,
    UnsignedVersionWarning,
)
from deltastore.progress import ProgressCallback, ProgressMeter
from deltastore.publish.config import PublisherConfig, Settings
from deltastore.publish.device import DeviceSnapshot
from deltastore.publish.messages import Outcome, Plan, StreamState, describe
from deltastore.publish.snapshot import (
    Lineage,
    Overlay,
    Snapshot,
    TensorSource,
    apply_lineage,
    rebuild_lineage,
)
from deltastore.publish.spool import Encoded, PayloadSpool, apply_frame
from deltastore.storage import VersionStore, new_token
from deltastore.trust import SIGNATURE_KEY

log = logging.getLogger("deltastore.publish")

PARALLEL_BYTES = 64 * 1024**2
"""Below this many bytes of changed tensors the snapshot advances on the calling thread: there
the hand-offs to the pool cost more than the second thread saves."""
PARALLEL_TENSOR_BYTES = 1024**2
"""Nor is it split when the changed tensors average less than this: a small tensor's advance is
a few short numpy calls, and two threads trading the GIL between them take longer than one."""


@dataclass(eq=False)
class RankSnapshot:
    """A rank's snapshot, the base checkpoint's sources and the store to re-read the chain
    from, and which tensors another rank has ``moved`` on since this rank held them."""

    snapshot: Snapshot
    base_sources: dict[str, TensorSource]
    store: VersionStore
    workers: int = 1
    device: DeviceSnapshot | None = None
    moved: set[str] = field(default_factory=set)
    _pool: tuple[int, cf.ThreadPoolExecutor] | None = field(default=None, init=False)

    def pool(self) -> cf.ThreadPoolExecutor:
        """The rank's ``workers`` threads (encode, advance), all started at once by ``seed()``
        and kept (started per publish, each start waited for the GIL while the first thread
        encoded); a process forked since gets its own."""
        if self._pool is None or self._pool[0] != os.getpid():
            pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="deltastore-publish")
            started = threading.Barrier(self.workers + 1)
            for _ in range(self.workers):  # each waits for the others: every thread starts
                pool.submit(started.wait)
            try:
                started.wait()
            except BaseException:  # (a Ctrl-C): the threads must not wait on forever
                started.abort()
                pool.shutdown(wait=False)
                raise
            self._pool = (os.getpid(), pool)
        return self._pool[1]

    def old_bytes(self, name: str, stream: StreamState, *, keep: bool = True) -> ByteArray:
        self.refresh(name, stream)
        return self.snapshot.load(name) if keep else self.snapshot.peek(name)

    def refresh(self, name: str, stream: StreamState) -> None:
        """Point a tensor another rank changed since this rank held it at the store's chain."""
        if name not in self.moved or self.snapshot.is_loaded(name):
            return
        if not stream.walk_from_base:
            raise PublishError(
                f"tensor {name!r} was published by another rank since this rank last held "
                "it, and this stream continues a checkpoint (continue_latest) rather than "
                "its base: pass each tensor on the same rank, or publish a full version"
            )
        lineage = rebuild_lineage(self.store, stream.base_version, self.base_sources, names=[name])
        apply_lineage(self.snapshot, lineage, self.base_sources)
        self.moved.discard(name)

    def advance(
        self,
        plan: Plan,
        outcome: Outcome,
        encoded: dict[str, Encoded],
        spool: PayloadSpool,
        settings: Settings,
    ) -> None:
        """Move the snapshot to the committed version: replicas this rank diffed but did not
        write advance too; tensors another rank changed are forgotten; after a full version
        every tensor is read back from it."""
        layout, checksum = plan.layout, settings.checksum.name
        assert layout is not None
        self._apply_all(list(encoded.values()), settings.encoding, spool)
        for name in layout.changed:
            if name not in encoded:
                self.snapshot.evict(name)
                self.moved.add(name)
                if self.device is not None:
                    self.device.forget(name)
        if not layout.full:
            return
        for name, placed in outcome.entries.items():
            overlay = Overlay(plan.version, placed.shard, placed.start, (), checksum, placed.digest)
            self.snapshot.set_source(name, overlay.on(self.base_sources[name]), keep_loaded=True)
        self.moved.clear()

    def _apply_all(self, entries: list[Encoded], encoding: Encoding, spool: PayloadSpool) -> None:
        """Apply every change, split over ``workers`` threads (decompression and the XOR of
        large tensors release the GIL)."""

        if self.device is not None:
            self.device.advance_all([(entry.name, entry.changes) for entry in entries])

        def apply(batch: list[Encoded]) -> None:
            for entry in batch:
                target = self.snapshot.load(entry.name)
                if entry.changes is not None:
                    apply_changes(target, entry.changes)
                else:
                    apply_frame(
                        encoding, entry.name, target, spool.read(entry.offset, entry.length)
                    )

        sources = self.snapshot.sources
        total = sum(sources[e.name].nbytes for e in entries)
        if self.workers < 2 or total < max(PARALLEL_BYTES, PARALLEL_TENSOR_BYTES * len(entries)):
            apply(entries)
            return
        # Several batches per thread, so one large tensor does not leave the others idle.
        count = min(len(entries), 4 * self.workers)
        batches = [entries[i::count] for i in range(count)]
        list(self.pool().map(apply, batches))


@dataclass(frozen=True)
class SeedDecision:
    """Rank 0 → every rank at seed: the stream and the chain to rebuild the snapshot from."""

    error: BaseException | None
    stream: StreamState | None = None
    lineage: Lineage | None = None


def read_bases(base_checkpoint: str, coord: Coordinator) -> dict[str, TensorSource]:
    """Every rank's base checkpoint, described and compared; :class:`ConfigError` (every
    rank) naming the ranks that cannot read theirs or hold a different one."""
    sources: dict[str, TensorSource] = {}
    read_error: BaseException | None = None
    try:
        sources = Snapshot.describe_checkpoint(base_checkpoint)
    except Exception as exc:
        read_error = exc
    fingerprint = hashlib.sha256()  # of what ranks must agree on
    for name, s in sources.items():
        fingerprint.update(f"{name}\0{s.dtype}\0{s.shape}\0{s.nbytes}\n".encode())
    # Exchanged even on failure, so a rank that cannot read its base reports it through the
    # collective instead of leaving its peers waiting in it.
    gathered = coord.all_gather(
        (describe(read_error), fingerprint.hexdigest()), what="seed: compare bases"
    )
    unreadable = [f"rank {r}: {error}" for r, (error, _) in enumerate(gathered) if error]
    if unreadable:
        raise ConfigError(
            f"reading the base checkpoint failed on {'; '.join(unreadable)}; every rank "
            "must seed from a readable copy of the engines' model path"
        ) from read_error
    prints = [fingerprint for _, fingerprint in gathered]
    if len(set(prints)) > 1:
        ranks = [r for r, p in enumerate(prints) if p != prints[0]]
        raise ConfigError(
            f"ranks {ranks} hold a different base checkpoint than rank 0 (tensor names, "
            "dtypes or sizes differ); every rank must seed from the engines' model path"
        )
    return sources


def decide_seed(
    store: VersionStore,
    sources: dict[str, TensorSource],
    config: PublisherConfig,
    continue_latest: bool,
) -> SeedDecision:
    """Rank 0: read the store and decide the stream (see ``DeltaPublisher.seed``); raises
    :class:`StreamError` on a store with versions unless a setting says what to do."""
    latest = store.latest()
    resume, new_stream = config.resume, config.new_stream
    explicit = continue_latest or resume or new_stream
    if latest and not explicit:
        raise StreamError(
            f"{store.url} already holds versions up to weight_v{latest:06d}; pass "
            "resume=True to continue that stream or new_stream=True to start a new one"
        )
    lineage = None
    if resume and latest and not new_stream:
        lineage = rebuild_lineage(store, latest, sources)
        stream = StreamState(
            lineage.stream_id or new_token(),
            latest,
            latest + 1,
            resumed=True,
            chain_deltas=lineage.deltas,
            chain_wire=lineage.wire_bytes,
        )
    elif continue_latest and latest:
        stream_id = store.index(latest).stream_id or new_token()
        stream = StreamState(stream_id, latest, latest + 1, walk_from_base=False, resumed=True)
    else:
        stream = StreamState(new_token(), 0, latest + 1, resumed=explicit)
    return SeedDecision(None, stream, lineage)


def check_signing(store: VersionStore, config: PublisherConfig) -> None:
    """Rank 0, at seed: unsigned publishing onto a store whose latest version is signed would
    break the engines that trust its key; warn (:class:`UnsignedVersionWarning`), or with
    ``require_signed`` raise :class:`ConfigError` before anything is published."""
    if config.signing_key is not None:
        return
    latest = store.latest()
    if latest == 0 or SIGNATURE_KEY not in store.index(latest).extra:
        return
    message = (
        f"weight_v{latest:06d} in {store.url} is signed but this publisher has no signing key: "
        "the versions it publishes are unsigned, and engines that trust a key (--trust) refuse "
        "them. Pass the trainer's key (signing_key=, --sign-key)"
    )
    if config.require_signed:
        raise ConfigError(f"{message}; refused (require_signed)")
    log.warning(message)
    warnings.warn(message, UnsignedVersionWarning, stacklevel=3)


def _load(
    snapshot: Snapshot,
    coord: Coordinator,
    workers: int,
    preload: bool,
    progress: ProgressCallback | None = None,
) -> None:
    """Load the snapshot now if ``preload`` (phase ``seed``); a failure is raised on every rank
    as the class of the first failing rank's error, naming every failing rank."""
    error: BaseException | None = None
    try:
        meter = ProgressMeter.start(progress, "seed", snapshot.total_bytes if preload else 0)
        if preload:
            snapshot.load_all(workers, meter)
        if meter is not None:
            meter.finish()
    except Exception as exc:
        error = exc
    kind = None if error is None else type(error).__name__
    errors = coord.all_gather((kind, describe(error)), what="seed: load snapshot")
    failed = [(k, f"rank {r}: {e}") for r, (k, e) in enumerate(errors) if e is not None]
    if failed:
        cls = getattr(deltastore.errors, failed[0][0] or "", None)
        if not (isinstance(cls, type) and issubclass(cls, DeltastoreError)):
            cls = PublishError
        message = "; ".join(m for _, m in failed)
        raise cls(f"loading the snapshot failed on {message}") from error


def seed_rank(
    store: VersionStore,
    base_checkpoint: str,
    coord: Coordinator,
    config: PublisherConfig,
    *,
    preload: bool,
    continue_latest: bool,
    progress: ProgressCallback | None = None,
) -> tuple[RankSnapshot, StreamState]:
    """This rank's snapshot and the stream it continues (see ``DeltaPublisher.seed``)."""
    sources = read_bases(base_checkpoint, coord)
    decision: SeedDecision | None = None
    if coord.rank == 0:
        try:
            decision = decide_seed(store, sources, config, continue_latest)
            check_signing(store, config)
        except Exception as exc:
            if not isinstance(exc, DeltastoreError):
                exc = PublishError(f"seeding from {store.url} failed: {describe(exc)}")
            decision = SeedDecision(error=exc)
    decision = coord.broadcast(decision, what="seed: decision")
    if decision.error is not None:
        raise decision.error
    assert decision.stream is not None
    snapshot = Snapshot(dict(sources), store)
    lineage = decision.lineage
    if lineage is not None:
        apply_lineage(snapshot, lineage, sources)
    _load(snapshot, coord, config.threads, preload, progress)
    log.info(
        "rank %d: seeded %d tensors (%d bytes%s) from %s; next version %d of stream %s%s",
        coord.rank,
        len(snapshot),
        snapshot.total_bytes,
        "" if preload else ", loaded on first use",
        base_checkpoint,
        decision.stream.next_version,
        decision.stream.stream_id,
        f" (resumed at v{lineage.version:06d})" if lineage else "",
    )
    device = DeviceSnapshot() if config.device_snapshot else None
    held = RankSnapshot(snapshot, sources, store, workers=config.threads, device=device)
    held.pool()  # the worker threads start here, not in the first publish
    # So are the compiled kernels (numba's import and cache: ~1 s or more): every encoding's
    # snapshot advance XORs its changes in with one; deltastore's own encode with the rest.
    warm_up(
        changes_only=get_encoding(config.encoding).reference_format,
        from_changes=config.device_snapshot,
    )
    return held, decision.stream


T = TypeVar("T")


class Coordinator:
    """The collectives a publisher needs, for one process (each the identity); every rank of a
    group calls each one, in order. ``gather``: every rank's ``obj`` on rank 0 (None elsewhere);
    ``broadcast``: rank 0's on every rank; ``all_gather``: every rank's on every rank."""

    rank = 0
    world_size = 1

    def gather(self, obj: T, *, what: str) -> list[T] | None:
        return [obj]

    def broadcast(self, obj: T | None, *, what: str) -> T:
        assert obj is not None
        return obj

    def all_gather(self, obj: T, *, what: str) -> list[T]:
        return [obj]


class TorchCoordinator(Coordinator):
    """Object collectives over the trainer's ``group`` (None: the default group), through a
    gloo group over the same ranks if it is not one (``new_group`` is a collective of the
    default group: every rank constructs the publisher together). A failed collective (a peer
    died, a timeout) raises :class:`PublishError` naming the step."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        backend = str(dist.get_backend(group)).lower()
        if backend != "gloo":
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            log.info("creating a gloo group for publish coordination (trainer group: %s)", backend)
            group = dist.new_group(ranks=ranks, backend="gloo")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Object collectives take the *global* rank of the source/destination.
        self._root = dist.get_global_rank(group, 0) if group is not None else 0

    def _call(self, what: str, collective: Callable[..., Any], *args: Any, **kw: Any) -> None:
        try:
            collective(*args, group=self.group, **kw)
        except RuntimeError as exc:
            raise PublishError(
                f"rank {self.rank}: the collective step '{what}' failed ({type(exc).__name__}: "
                f"{exc}); a peer rank died or timed out. Check store.latest() and restart every "
                "rank with resume=True"
            ) from exc

    def gather(self, obj: T, *, what: str) -> list[T] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._call(what, self._dist.gather_object, obj, out, dst=self._root)
        return out

    def broadcast(self, obj: T | None, *, what: str) -> T:
        box: list[Any] = [obj if self.rank == 0 else None]
        self._call(what, self._dist.broadcast_object_list, box, src=self._root)
        return box[0]  # type: ignore[no-any-return]

    def all_gather(self, obj: T, *, what: str) -> list[T]:
        out: list[Any] = [None] * self.world_size
        self._call(what, self._dist.all_gather_object, out, obj)
        return out


def make_coordinator(process_group: Any = None, *, collective: bool | None = None) -> Coordinator:
    """``collective=None``: collective when a ``process_group`` is given or
    ``torch.distributed`` is initialised with more than one rank; ``False``: alone (e.g. one
    rank that publishes alone); ``True``: a group is required."""
    if collective is False:
        return Coordinator()
    import torch.distributed as dist

    available = dist.is_available() and dist.is_initialized()
    if process_group is not None or collective:
        if not available:
            raise ConfigError(
                "a collective publish (process_group or collective=True) needs torch.distributed, "
                "which is not initialised; call torch.distributed.init_process_group first"
            )
        return TorchCoordinator(process_group)
    if available and dist.get_world_size() > 1:
        return TorchCoordinator(None)
    return Coordinator()

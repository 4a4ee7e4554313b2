"""``DeltaPublisher``: diff tensors against the last published state and publish a version.

One code path serves one process and many ranks. With ``torch.distributed`` initialised (or a
``process_group`` given) :meth:`DeltaPublisher.publish` is a collective; alone, every collective
below is the identity. The protocol of one publish (docs/publishing.md has the full account):

1. **Diff** (every rank, in parallel): each rank diffs the tensors *it* is passed against its
   snapshot, encoding, compressing and digesting the changed ones into a local payload spool.
2. **Plan** (gather to rank 0, broadcast): rank 0 sees every rank's name → digest map, rejects
   divergent replicas, keeps one copy of equal ones (the lowest rank's), decides delta or full
   (anchors), numbers the shards gap-free across the ranks that write one, and claims the
   version in the store before anyone writes. Any rank's failure so far aborts here.
3. **Write** (every rank): each rank writes its own shard(s).
4. **Commit** (gather to rank 0, broadcast): rank 0 checks that every rank wrote, that the
   version is complete, and writes the index (the commit); on any failure it removes the
   version's files instead and every rank raises naming the failing rank.
5. **Finish** (all-gather, which is also the barrier): every rank advances its snapshot, runs
   the post-write hook and reports; metrics are the global totals.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO

from deltastore.codecs import (
    COMPRESSION_NAME,
    ByteArray,
    compress,
    decompress,
    get_checksum,
    get_encoding,
)
from deltastore.errors import (
    ConfigError,
    DeltastoreError,
    HookError,
    PublishError,
    StreamError,
    VersionConflictError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import delta_shard_name, full_shard_name
from deltastore.format.safetensors_io import TensorLayout, build_header
from deltastore.hooks.context import publishing_rank
from deltastore.publish.coordination import Coordinator, make_coordinator
from deltastore.publish.device import HostStager, StagerStats
from deltastore.publish.lineage import Lineage, apply_lineage, rebuild_lineage
from deltastore.publish.snapshot import (
    Snapshot,
    TensorSource,
    check_layout,
    nbytes_of,
)
from deltastore.storage import VersionStore, new_token

log = logging.getLogger("deltastore.publish")

METRIC_KEYS = (
    "version", "full", "density", "changed_bytes", "total_bytes", "wire_bytes",
    "tensors_changed", "tensors", "world_size", "load_s", "copy_s", "encode_s", "diff_s",
    "write_s", "commit_s", "coord_s", "hook_s", "publish_s",
)  # fmt: skip
"""Keys of :meth:`DeltaPublisher.pop_metrics`; docs/publishing.md gives each one's unit."""
_SECONDS_KEYS = tuple(k for k in METRIC_KEYS if k.endswith("_s"))
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
DEFAULT_MAX_INFLIGHT_BYTES = 1024**3
_COPY_CHUNK = 64 * 1024**2
_MAX_STALE_CLAIMS = 1000


@dataclass(frozen=True)
class PublishResult:
    """What one :meth:`DeltaPublisher.publish` call committed (global totals across ranks)."""

    version: int
    kind: str
    """``delta`` or ``full``."""
    base_version: int | None
    tensors_changed: int
    changed_bytes: int
    total_bytes: int
    wire_bytes: int
    """Bytes of shard files written for this version."""

    @property
    def density(self) -> float:
        return self.changed_bytes / self.total_bytes if self.total_bytes else 0.0


@dataclass(frozen=True)
class _Encoded:
    """One diffed tensor: its new digest and where its compressed payload sits in the spool."""

    name: str
    changed_bytes: int
    digest: str
    offset: int
    length: int


# Messages between ranks (pickled by torch's object collectives): small and plain.
@dataclass(frozen=True)
class _Report:
    """Rank → rank 0 after the diff: what the rank was passed and what changed."""

    rank: int
    error: str | None
    passed: dict[str, tuple[str, int, int] | None]
    """Name → (digest of the new bytes, payload bytes, changed bytes), None if unchanged."""
    full: bool


@dataclass(frozen=True)
class _Plan:
    """Rank 0 → every rank: the version, its kind and which rank writes which shard."""

    error: str | None
    version: int = 0
    token: str = ""
    full: bool = False
    shards: list[list[tuple[str, list[str]]]] = field(default_factory=list)
    """Per rank: (shard file, tensor names) to write."""
    changed: dict[str, int] = field(default_factory=dict)
    """Name → changed bytes of every changed tensor (after dedup)."""


@dataclass(frozen=True)
class _Written:
    """Rank → rank 0 after writing: where each tensor landed."""

    rank: int
    error: str | None
    entries: dict[str, tuple[str, int, int, str]] = field(default_factory=dict)
    """Name → (shard, absolute start, end, digest of the new bytes)."""
    wire: int = 0


@dataclass(frozen=True)
class _Outcome:
    """Rank 0 → every rank: committed or not."""

    error: str | None
    entries: dict[str, tuple[str, int, int, str]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Final:
    """Every rank → every rank after the commit: post-commit failures and timings."""

    rank: int
    advance_error: str | None
    hook_error: str | None
    seconds: dict[str, float]


@dataclass(frozen=True)
class _SeedDecision:
    """Rank 0 → every rank at seed: the stream and where it continues."""

    error: BaseException | None
    stream_id: str | None = None
    base_version: int = 0
    next_version: int = 1
    lineage: Lineage | None = None
    walk_from_base: bool = True
    skip_stale_claims: bool = False


class _PayloadSpool:
    """Compressed payloads kept as they are produced: in memory up to a bound, then on disk.

    Each in-memory frame stays its own ``bytes`` object (no growing buffer to reallocate and
    copy); once ``memory_bytes`` are held, later frames go to an anonymous temp file. Frames
    are addressed by a virtual offset. Thread-safe: encode workers append directly.
    """

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.size = 0
        self._memory: dict[int, bytes] = {}
        self._in_memory = 0
        self._file: Any = None
        self._on_disk: dict[int, int] = {}
        self._lock = threading.Lock()

    def append(self, frame: bytes) -> tuple[int, int]:
        with self._lock:
            offset = self.size
            self.size += len(frame)
            if self._in_memory + len(frame) <= self.memory_bytes:
                self._memory[offset] = frame
                self._in_memory += len(frame)
            else:
                if self._file is None:
                    self._file = tempfile.TemporaryFile(prefix="deltastore-spool-")  # noqa: SIM115
                self._file.seek(0, os.SEEK_END)
                self._on_disk[offset] = self._file.tell()
                self._file.write(frame)
            return offset, len(frame)

    def read(self, offset: int, length: int) -> bytes:
        with self._lock:
            frame = self._memory.get(offset)
            if frame is not None:
                return frame
            self._file.seek(self._on_disk[offset])
            return bytes(self._file.read(length))

    def copy_to(self, out: BinaryIO, offset: int, length: int) -> None:
        with self._lock:
            frame = self._memory.get(offset)
            position = self._on_disk.get(offset)
        if frame is not None:
            view = memoryview(frame)
            for lo in range(0, length, _COPY_CHUNK):
                out.write(view[lo : lo + _COPY_CHUNK])
            return
        assert position is not None
        done = 0
        while done < length:
            with self._lock:
                self._file.seek(position + done)
                chunk = self._file.read(min(length - done, _COPY_CHUNK))
            out.write(chunk)
            done += len(chunk)

    def close(self) -> None:
        self._memory.clear()
        if self._file is not None:
            self._file.close()


def _default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _layout_fingerprint(sources: dict[str, TensorSource]) -> str:
    digest = hashlib.sha256()
    for name, s in sources.items():
        digest.update(f"{name}\0{s.dtype}\0{s.shape}\0{s.nbytes}\n".encode())
    return digest.hexdigest()


class DeltaPublisher:
    """Publishes versions of a model to a :class:`VersionStore`, from one process or many ranks.

    ``base_checkpoint`` is the engines' own model path (version 0): the snapshot is seeded from
    its bytes, not from the trainer's tensors, so a non-byte-exact conversion still diffs
    against what the engines hold. ``encoding`` and ``checksum`` are validated here (an unknown
    name raises :class:`ConfigError` at construction). ``post_write`` is a reference-signature
    hook ``hook(args, version_dir, rollout_engines)``; the publisher binds ``args`` and
    ``rollout_engines`` and hands the store a one-argument hook; it runs on every rank.

    Ranks: with ``torch.distributed`` initialised and more than one rank (or ``process_group``
    given) :meth:`seed` and :meth:`publish` are collectives; construct, seed and publish on
    every rank of the group together. ``collective=False`` forces single-process behaviour.

    ``resume`` / ``new_stream`` decide what :meth:`seed` does on a store that already holds
    versions: by default that is an error (a restarted trainer must not silently restart at
    v1); ``resume=True`` rebuilds the snapshot from the store (newest full version or the base,
    plus the chain, every digest verified) and continues the stream at latest+1;
    ``new_stream=True`` starts a new stream (building on the base) after the latest version.

    ``anchor_every=K`` publishes every K-th version (counting deltas since the last full
    version) as a full version; ``anchor_chain_bytes=f`` publishes a full version once the
    deltas since the last full one would carry more than ``f`` times the model's bytes on the wire.

    ``max_inflight_bytes`` bounds the tensor bytes staged for the encode pool (pinned copy
    buffers for GPU tensors); ``preload`` loads the whole snapshot at :meth:`seed` (default:
    only in a single process; ranks load the tensors they are passed, on first use).
    """

    def __init__(
        self,
        store: VersionStore | str | os.PathLike[str],
        base_checkpoint: str | os.PathLike[str],
        *,
        encoding: str = "xor",
        checksum: str = "xxh3-128",
        workers: int | None = None,
        storage_options: dict[str, Any] | None = None,
        post_write: Callable[[Any, str, Any], None] | None = None,
        args: Any = None,
        rollout_engines: Any = None,
        resume: bool = False,
        new_stream: bool = False,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        spool_memory_bytes: int = 256 * 1024**2,
        process_group: Any = None,
        collective: bool | None = None,
        anchor_every: int | None = None,
        anchor_chain_bytes: float | None = None,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        preload: bool | None = None,
        pin_memory: bool | None = None,
        stage_host_tensors: bool = False,
    ) -> None:
        self.encoding = get_encoding(encoding)
        self.checksum = get_checksum(checksum)
        if not isinstance(store, VersionStore):
            store = VersionStore(store, storage_options)
        self.store = store
        self.base_checkpoint = os.fspath(base_checkpoint)
        if not os.path.isdir(self.base_checkpoint):
            raise ConfigError(
                f"base checkpoint {self.base_checkpoint!r} is not a directory; pass the engines' "
                "model path (an HF safetensors checkpoint)"
            )
        if anchor_every is not None and (not isinstance(anchor_every, int) or anchor_every < 1):
            raise ConfigError(f"anchor_every must be a positive integer, got {anchor_every!r}")
        if anchor_chain_bytes is not None and not anchor_chain_bytes > 0:
            raise ConfigError(
                f"anchor_chain_bytes must be a positive fraction of the model's bytes, got "
                f"{anchor_chain_bytes!r}"
            )
        if max_shard_bytes < 1 or max_inflight_bytes < 1:
            raise ConfigError("max_shard_bytes and max_inflight_bytes must be positive")
        if post_write is not None:
            hook = post_write
            self.store.post_write = lambda version_dir: hook(args, version_dir, rollout_engines)
        self.workers = workers or _default_workers()
        self.resume = resume
        self.new_stream = new_stream
        self.max_shard_bytes = max_shard_bytes
        self.spool_memory_bytes = spool_memory_bytes
        self.anchor_every = anchor_every
        self.anchor_chain_bytes = anchor_chain_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.pin_memory = pin_memory
        self.stage_host_tensors = stage_host_tensors
        self.coordinator: Coordinator = make_coordinator(process_group, collective=collective)
        self.rank = self.coordinator.rank
        self.world_size = self.coordinator.world_size
        self.preload = self.world_size == 1 if preload is None else preload
        self.snapshot: Snapshot | None = None
        self.stream_id: str | None = None
        self.next_version = 1
        self.base_version = 0
        """Version the next delta builds on."""
        self._base_sources: dict[str, TensorSource] = {}
        self._moved: set[str] = set()
        """Tensors changed by another rank since this rank's snapshot of them (re-read first)."""
        self._walk_from_base = True
        self._skip_stale_claims = False
        self._chain_deltas = 0
        """Deltas since the last full version (or the stream's start)."""
        self._chain_wire = 0
        self._last_holder: dict[str, int] = {}
        """Rank 0: the rank that last published each tensor (it holds the tensor's state)."""
        self._metrics: dict[str, float] = dict.fromkeys(METRIC_KEYS, 0.0)
        self.last_staging: StagerStats | None = None
        """Host-staging counters of the last publish (pinned or not, peak bytes in flight)."""

    # ------------------------------------------------------------------ seed
    def seed(self, *, continue_latest: bool = False) -> None:
        """Set up version 0 (the base checkpoint's bytes) or resume; publishes nothing.

        On an empty store a new stream starts at version 1. ``continue_latest=True`` (what
        ``deltastore publish --prev`` uses) continues the latest version's stream, taking the
        base checkpoint as that version's state; the caller is responsible for checking it.
        Collective: rank 0 reads the store and decides, every rank gets the same answer.
        Raises :class:`StreamError` on a non-empty store without resume/new_stream,
        :class:`ConfigError` when ranks hold different base checkpoints, and the store's
        errors (e.g. :class:`IntegrityError` when a resumed tensor fails its digest).
        """
        coord = self.coordinator
        # Read before the first collective, so a rank that cannot read its base reports it
        # through that collective instead of leaving its peers waiting in it.
        sources: dict[str, TensorSource] = {}
        read_error: BaseException | None = None
        try:
            sources = Snapshot.describe_checkpoint(self.base_checkpoint)
        except Exception as exc:
            if self.world_size == 1:
                raise
            read_error = exc
        gathered = coord.all_gather(
            (_describe(read_error), _layout_fingerprint(sources)), what="seed: compare bases"
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
        decision: _SeedDecision | None = None
        if self.rank == 0:
            try:
                decision = self._decide_seed(sources, continue_latest)
            except Exception as exc:
                if not isinstance(exc, DeltastoreError):
                    exc = PublishError(f"seeding from {self.store.url} failed: {_describe(exc)}")
                decision = _SeedDecision(error=exc)
        decision = coord.broadcast(decision, what="seed: decision")
        if decision.error is not None:
            raise decision.error
        snapshot = Snapshot(dict(sources), self.store)
        if decision.lineage is not None:
            apply_lineage(snapshot, decision.lineage, sources)
        error: BaseException | None = None
        if self.preload:
            try:
                snapshot.load_all(self.workers)
            except Exception as exc:
                error = exc
        errors = coord.all_gather(_describe(error), what="seed: load snapshot")
        if error is not None and self.world_size == 1:
            raise error
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if failed:
            raise PublishError(f"loading the snapshot failed on {'; '.join(failed)}") from error
        self.snapshot = snapshot
        self._base_sources = sources
        self._moved = set()
        self.stream_id = decision.stream_id
        self.base_version = decision.base_version
        self.next_version = decision.next_version
        self._walk_from_base = decision.walk_from_base
        self._skip_stale_claims = decision.skip_stale_claims
        lineage = decision.lineage
        self._chain_deltas = lineage.deltas if lineage else 0
        self._chain_wire = lineage.wire_bytes if lineage else 0
        self._last_holder = {}
        log.info(
            "rank %d: seeded %d tensors (%d bytes%s) from %s; next version %d of stream %s%s",
            self.rank,
            len(snapshot),
            snapshot.total_bytes,
            "" if self.preload else ", loaded on first use",
            self.base_checkpoint,
            self.next_version,
            self.stream_id,
            f" (resumed at v{lineage.version:06d})" if lineage else "",
        )

    def _decide_seed(
        self, sources: dict[str, TensorSource], continue_latest: bool
    ) -> _SeedDecision:
        """Rank 0: read the store and decide the stream (see :meth:`seed`)."""
        latest = self.store.latest()
        explicit = continue_latest or self.resume or self.new_stream
        if latest and not explicit:
            raise StreamError(
                f"{self.store.url} already holds versions up to weight_v{latest:06d}; pass "
                "resume=True to continue that stream or new_stream=True to start a new one"
            )
        if self.resume and latest and not self.new_stream:
            lineage = rebuild_lineage(self.store, latest, sources)
            return _SeedDecision(
                error=None,
                stream_id=lineage.stream_id or new_token(),
                base_version=latest,
                next_version=latest + 1,
                lineage=lineage,
                skip_stale_claims=True,
            )
        if continue_latest and latest:
            index = self.store.index(latest)
            return _SeedDecision(
                error=None,
                stream_id=index.stream_id or new_token(),
                base_version=latest,
                next_version=latest + 1,
                walk_from_base=False,
                skip_stale_claims=True,
            )
        return _SeedDecision(
            error=None,
            stream_id=new_token(),
            base_version=0,
            next_version=latest + 1,
            skip_stale_claims=explicit,
        )

    # --------------------------------------------------------------- publish
    def publish(
        self, named_tensors: Iterable[tuple[str, Any]], *, full: bool = False
    ) -> PublishResult:
        """Diff ``named_tensors`` against the snapshot and publish the change as one version.

        Tensors not passed are taken as unchanged. A step where nothing changed is still a
        version. ``full=True`` (on any rank) publishes a complete HF checkpoint (every tensor)
        that resets the chain. The snapshot advances only once the version is committed.
        Collective when ranks are: each rank passes its own tensors. Raises
        :class:`PublishError` (nothing committed; in a collective it names the failing rank)
        or :class:`HookError` (committed, but the post-write hook failed: re-run the hook
        before telling engines). In a single process the original error is raised as is.
        """
        if self.snapshot is None:
            raise PublishError("publish() before seed(): call seed() once first")
        started = time.perf_counter()
        metrics = dict.fromkeys(METRIC_KEYS, 0.0)
        coord = self.coordinator
        spool = _PayloadSpool(self.spool_memory_bytes)
        local_error: BaseException | None = None
        try:
            encoded: dict[str, _Encoded] = {}
            passed: dict[str, _Encoded | None] = {}
            try:
                encoded, passed = self._diff(named_tensors, spool, metrics)
            except Exception as exc:
                local_error = exc
            report = _Report(
                self.rank,
                _describe(local_error),
                {
                    n: None if e is None else (e.digest, e.length, e.changed_bytes)
                    for n, e in passed.items()
                },
                full,
            )
            plan = self._agree_plan(report, metrics)
            if plan.error is not None:
                self._fail(plan.error, local_error)
            try:
                entries, wire = self._write_assigned(plan, encoded, spool, metrics)
                written = _Written(self.rank, None, entries, wire)
            except Exception as exc:
                local_error = exc
                written = _Written(self.rank, _describe(exc))
            outcome = self._agree_outcome(plan, written, metrics)
            if outcome.error is not None:
                self._fail(outcome.error, local_error)
            advance_error: BaseException | None = None
            try:
                self._advance(encoded, spool)
                self._after_commit(plan, outcome, encoded)
            except Exception as exc:
                advance_error = exc
        finally:
            spool.close()
        version = plan.version
        self.next_version = version + 1
        self.base_version = version
        self._skip_stale_claims = False
        if plan.full:
            self._chain_deltas, self._chain_wire = 0, 0
        else:
            self._chain_deltas += 1
            self._chain_wire += outcome.totals["wire_bytes"]
        hook_started = time.perf_counter()
        hook_error: BaseException | None = None
        try:
            with publishing_rank(self.rank):
                self.store.after_write(version)
        except Exception as exc:
            hook_error = exc
        metrics["hook_s"] = time.perf_counter() - hook_started
        metrics["publish_s"] = time.perf_counter() - started
        finals = coord.all_gather(
            _Final(
                self.rank,
                _describe(advance_error),
                _describe(hook_error),
                {k: metrics[k] for k in _SECONDS_KEYS},
            ),
            what=f"finish weight_v{version:06d}",
        )
        result = PublishResult(
            version=version,
            kind="full" if plan.full else "delta",
            base_version=None if plan.full else outcome.totals["base_version"],
            tensors_changed=outcome.totals["tensors_changed"],
            changed_bytes=outcome.totals["changed_bytes"],
            total_bytes=outcome.totals["total_bytes"],
            wire_bytes=outcome.totals["wire_bytes"],
        )
        for key in _SECONDS_KEYS:
            metrics[key] = max(f.seconds[key] for f in finals)
        self._record(metrics, result)
        broken = [f"rank {f.rank}: {f.advance_error}" for f in finals if f.advance_error]
        if broken:
            if advance_error is not None:
                self.snapshot = None
            raise PublishError(
                f"weight_v{version:06d} is committed in {self.store.url}, but advancing the "
                f"snapshot failed on {'; '.join(broken)}; restart every rank with resume=True"
            ) from advance_error
        hooks = [f"rank {f.rank}: {f.hook_error}" for f in finals if f.hook_error]
        if hooks:
            if self.world_size == 1 and hook_error is not None:
                raise HookError(
                    f"weight_v{version:06d} is committed in {self.store.url} but the post-write "
                    f"hook failed: {hook_error}; fix the hook and run it again before engines "
                    "pull"
                ) from hook_error
            raise HookError(
                f"weight_v{version:06d} is committed in {self.store.url} but the post-write "
                f"hook failed on {'; '.join(hooks)}; fix the hook and run it again on those "
                "ranks before engines pull"
            ) from hook_error
        return result

    def _fail(self, message: str, local_error: BaseException | None) -> None:
        """Raise the collective failure (alone: the original error, as the API always did)."""
        if self.world_size == 1 and isinstance(local_error, DeltastoreError):
            raise local_error
        raise PublishError(message) from local_error

    # ------------------------------------------------------------------ diff
    def _old_bytes(self, name: str, *, keep: bool = True) -> ByteArray:
        """The snapshot's bytes of ``name``, re-read from the store if another rank moved it."""
        assert self.snapshot is not None
        self._refresh_source(name)
        return self.snapshot.load(name) if keep else self.snapshot.peek(name)

    def _refresh_source(self, name: str) -> None:
        """Point a tensor another rank changed since this rank held it at the store's chain."""
        assert self.snapshot is not None
        if name in self._moved and not self.snapshot.is_loaded(name):
            if not self._walk_from_base:
                raise PublishError(
                    f"tensor {name!r} was published by another rank since this rank last held "
                    "it, and this stream continues a checkpoint (continue_latest) rather than "
                    "its base: pass each tensor on the same rank, or publish a full version"
                )
            lineage = rebuild_lineage(
                self.store, self.base_version, self._base_sources, names=[name]
            )
            apply_lineage(self.snapshot, lineage, self._base_sources)
            self._moved.discard(name)

    def _diff(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        spool: _PayloadSpool,
        metrics: dict[str, float],
    ) -> tuple[dict[str, _Encoded], dict[str, _Encoded | None]]:
        """Encode, compress and checksum every changed tensor in a thread pool.

        Returns the changed tensors and every passed name (None where unchanged). Host copies
        are staged under the in-flight byte budget, so a slow encode pool holds the producer
        back instead of piling up copies.
        """
        assert self.snapshot is not None
        snapshot = self.snapshot
        encoding, checksum = self.encoding, self.checksum
        stager = HostStager(
            self.max_inflight_bytes,
            pin_memory=self.pin_memory,
            stage_host_tensors=self.stage_host_tensors,
        )
        lock = threading.Lock()

        def encode(name: str, old: ByteArray, staged: Any) -> tuple[str, Any]:
            try:
                new = staged.wait()
                begun = time.perf_counter()
                delta = encoding.encode(old, new)
                changed = delta.changed_bytes
                result = None
                if changed:
                    digest = checksum.hexdigest(new)
                    frame = compress(delta.payload)
                    del delta
                    # Straight into the spool: a finished frame never waits in a future.
                    offset, length = spool.append(frame)
                    del frame
                    result = (changed, digest, offset, length)
                with lock:
                    metrics["encode_s"] += time.perf_counter() - begun
                return name, result
            finally:
                staged.release()

        encoded: dict[str, _Encoded] = {}
        passed: dict[str, _Encoded | None] = {}
        pending: list[cf.Future[tuple[str, Any]]] = []

        def collect(block: bool) -> None:
            waiting = []
            for future in pending:
                if not (block or future.done()):
                    waiting.append(future)
                    continue
                name, result = future.result()
                if result is None:
                    passed[name] = None
                    continue
                changed, digest, offset, length = result
                passed[name] = encoded[name] = _Encoded(name, changed, digest, offset, length)
            pending[:] = waiting

        diff_started = time.perf_counter()
        seen: set[str] = set()
        with cf.ThreadPoolExecutor(self.workers, thread_name_prefix="deltastore-encode") as pool:
            try:
                for name, tensor in named_tensors:
                    if name in seen:
                        raise PublishError(f"tensor {name!r} was passed twice in one publish")
                    seen.add(name)
                    if name not in snapshot:
                        raise PublishError(
                            f"tensor {name!r} is not in the base checkpoint "
                            f"{self.base_checkpoint}; a delta cannot add tensors"
                        )
                    nbytes = nbytes_of(name, tensor)
                    check_layout(name, tensor, nbytes, snapshot.sources[name])
                    encoding.check_size(nbytes, tensor=name)
                    begun = time.perf_counter()
                    old = self._old_bytes(name)
                    loaded = time.perf_counter()
                    waited = stager.stats.budget_wait_s
                    staged = stager.stage(name, tensor)
                    metrics["load_s"] += loaded - begun
                    metrics["copy_s"] += (
                        time.perf_counter() - loaded - (stager.stats.budget_wait_s - waited)
                    )
                    pending.append(pool.submit(encode, name, old, staged))
                    collect(block=False)
                collect(block=True)
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
            finally:
                stager.close()
        self.last_staging = stager.stats
        metrics["copy_s"] += stager.stats.copy_wait_s
        metrics["diff_s"] = time.perf_counter() - diff_started
        return encoded, passed

    # ------------------------------------------------------------------ plan
    def _agree_plan(self, report: _Report, metrics: dict[str, float]) -> _Plan:
        begun = time.perf_counter()
        reports = self.coordinator.gather(report, what="publish: gather diffs")
        plan: _Plan | None = None
        if reports is not None:
            try:
                plan = self._make_plan(reports)
            except Exception as exc:
                if self.world_size == 1 and isinstance(exc, DeltastoreError):
                    raise
                plan = _Plan(
                    error=f"planning weight_v{self.next_version:06d} failed on rank 0: "
                    f"{_describe(exc)}; nothing was committed"
                )
        plan = self.coordinator.broadcast(plan, what="publish: plan")
        metrics["coord_s"] += time.perf_counter() - begun
        return plan

    def _make_plan(self, reports: list[_Report]) -> _Plan:
        """Rank 0: dedup replicas, choose delta/full, assign shards, claim the version."""
        assert self.snapshot is not None
        failed = [f"rank {r.rank}: {r.error}" for r in reports if r.error is not None]
        if failed:
            return _Plan(
                error=f"publishing weight_v{self.next_version:06d} failed on "
                f"{'; '.join(failed)}; nothing was committed and no snapshot advanced"
            )
        holders: dict[str, list[tuple[int, tuple[str, int, int] | None]]] = {}
        for report in reports:
            for name, info in report.passed.items():
                holders.setdefault(name, []).append((report.rank, info))
        divergent = []
        ranks: set[int] = set()
        for name, held in sorted(holders.items()):
            if len({info[0] if info else None for _, info in held}) > 1:
                states = ", ".join(
                    f"rank {rank}: {'digest ' + info[0] if info else 'unchanged'}"
                    for rank, info in held
                )
                divergent.append(f"{name!r} ({states})")
                ranks.update(rank for rank, _ in held)
        if divergent:
            return _Plan(
                error=f"replicated tensors differ across ranks {sorted(ranks)}: "
                f"{'; '.join(divergent[:5])}"
                f"; a tensor passed on several ranks must be identical on each. Nothing was "
                f"committed for weight_v{self.next_version:06d}"
            )
        # Reports arrive in rank order: the first holder is the lowest rank, which keeps it.
        owner = {name: held[0][0] for name, held in holders.items()}
        changed = {n: held[0][1] for n, held in holders.items() if held[0][1] is not None}
        wire_estimate = sum(info[1] for info in changed.values())
        total = self.snapshot.total_bytes
        full = any(r.full for r in reports)
        if not full and self.anchor_every and self._chain_deltas + 1 >= self.anchor_every:
            full = True
        if (
            not full
            and self.anchor_chain_bytes
            and self._chain_wire + wire_estimate > self.anchor_chain_bytes * total
        ):
            full = True
        shards = self._assign_full(owner) if full else self._assign_delta(owner, changed)
        self._last_holder.update(owner)
        version, token = self._claim()
        return _Plan(
            error=None,
            version=version,
            token=token,
            full=full,
            shards=shards,
            changed={n: info[2] for n, info in changed.items()},
        )

    def _assign_delta(
        self, owner: dict[str, int], changed: dict[str, Any]
    ) -> list[list[tuple[str, list[str]]]]:
        per_rank: list[list[str]] = [[] for _ in range(self.world_size)]
        for name in sorted(changed):
            per_rank[owner[name]].append(name)
        writers = [r for r in range(self.world_size) if per_rank[r]]
        shards: list[list[tuple[str, list[str]]]] = [[] for _ in range(self.world_size)]
        for i, rank in enumerate(writers):
            shards[rank].append((delta_shard_name(i, len(writers)), per_rank[rank]))
        return shards

    def _assign_full(self, owner: dict[str, int]) -> list[list[tuple[str, list[str]]]]:
        """Every tensor of the base, each on one rank: its owner, else the rank that last
        published it, else the least loaded; grouped into shards of bounded size."""
        assert self.snapshot is not None
        sources = self.snapshot.sources
        load = [0] * self.world_size
        for name, rank in owner.items():
            load[rank] += sources[name].nbytes
        per_rank: list[list[str]] = [[] for _ in range(self.world_size)]
        for name, source in sources.items():
            held = owner.get(name)
            if held is not None:
                rank = held
            else:
                rank = self._last_holder.get(name, -1)
                if not 0 <= rank < self.world_size:
                    rank = min(range(self.world_size), key=lambda r: load[r])
                load[rank] += source.nbytes
            per_rank[rank].append(name)
        groups: list[list[list[str]]] = []
        for names in per_rank:
            rank_groups: list[list[str]] = []
            size = 0
            for name in names:
                nbytes = sources[name].nbytes
                if not rank_groups or (rank_groups[-1] and size + nbytes > self.max_shard_bytes):
                    rank_groups.append([])
                    size = 0
                rank_groups[-1].append(name)
                size += nbytes
            groups.append(rank_groups)
        count = sum(len(g) for g in groups)
        shards: list[list[tuple[str, list[str]]]] = []
        index = 0
        for rank_groups in groups:
            shards.append([])
            for names in rank_groups:
                shards[-1].append((full_shard_name(index, count), names))
                index += 1
        return shards

    def _claim(self) -> tuple[int, str]:
        """Rank 0: claim the next version before any rank writes.

        Right after a resume (or a new stream) claims left by a crashed writer are skipped:
        the version numbers they hold are never reused, so a zombie writer cannot mix its
        shards with ours.
        """
        token = new_token()
        version = self.next_version
        for _ in range(_MAX_STALE_CLAIMS):
            try:
                self.store.claim(version, token)
                return version, token
            except VersionConflictError:
                if not self._skip_stale_claims or version <= self.store.latest():
                    raise
                log.warning(
                    "weight_v%06d of %s is claimed but was never committed (a crashed writer); "
                    "skipping to the next version",
                    version,
                    self.store.url,
                )
                version += 1
        raise PublishError(f"{_MAX_STALE_CLAIMS} stale claims in a row in {self.store.url}")

    # ----------------------------------------------------------------- write
    def _write_assigned(
        self,
        plan: _Plan,
        encoded: dict[str, _Encoded],
        spool: _PayloadSpool,
        metrics: dict[str, float],
    ) -> tuple[dict[str, tuple[str, int, int, str]], int]:
        begun = time.perf_counter()
        entries: dict[str, tuple[str, int, int, str]] = {}
        wire = 0
        for shard, names in plan.shards[self.rank]:
            if plan.full:
                shard_entries, shard_wire = self._write_full_shard(
                    plan.version, shard, names, encoded, spool
                )
            else:
                shard_entries, shard_wire = self._write_delta_shard(
                    plan.version, shard, names, encoded, spool
                )
            entries.update(shard_entries)
            wire += shard_wire
        metrics["write_s"] = time.perf_counter() - begun
        return entries, wire

    def _write_delta_shard(
        self,
        version: int,
        shard: str,
        names: list[str],
        encoded: dict[str, _Encoded],
        spool: _PayloadSpool,
    ) -> tuple[dict[str, tuple[str, int, int, str]], int]:
        layouts = [TensorLayout(n, "U8", (encoded[n].length,)) for n in names]
        header = build_header(layouts, {n: encoded[n].digest for n in names})
        entries = {}
        offset = len(header)
        with self.store.open_write(version, shard) as out:
            out.write(header)
            for n in names:
                spool.copy_to(out, encoded[n].offset, encoded[n].length)
                entries[n] = (shard, offset, offset + encoded[n].length, encoded[n].digest)
                offset += encoded[n].length
        return entries, offset

    def _write_full_shard(
        self,
        version: int,
        shard: str,
        names: list[str],
        encoded: dict[str, _Encoded],
        spool: _PayloadSpool,
    ) -> tuple[dict[str, tuple[str, int, int, str]], int]:
        """One shard of a complete HF checkpoint: every tensor's new bytes and digest."""
        assert self.snapshot is not None
        sources = self.snapshot.sources
        for name in names:
            self._refresh_source(name)
        snapshot = self.snapshot

        def digest(name: str) -> str:
            if name in encoded:
                return encoded[name].digest
            source = sources[name]
            if (
                source.digest is not None
                and source.checksum == self.checksum.name
                and not snapshot.is_loaded(name)
            ):
                return source.digest
            return self.checksum.hexdigest(self._old_bytes(name, keep=False))

        with cf.ThreadPoolExecutor(self.workers, thread_name_prefix="deltastore-digest") as pool:
            digests = dict(zip(names, pool.map(digest, names)))
        layouts = [TensorLayout(n, sources[n].dtype, sources[n].shape) for n in names]
        header = build_header(layouts, {"format": "pt", **digests})
        entries = {}
        offset = len(header)
        with self.store.open_write(version, shard) as out:
            out.write(header)
            for n in names:
                data = self._new_bytes(n, encoded, spool)
                for lo in range(0, data.size, _COPY_CHUNK):
                    out.write(memoryview(data[lo : lo + _COPY_CHUNK]))
                entries[n] = (shard, offset, offset + int(data.size), digests[n])
                offset += int(data.size)
                del data
        return entries, offset

    def _new_bytes(
        self, name: str, encoded: dict[str, _Encoded], spool: _PayloadSpool
    ) -> ByteArray:
        """A tensor's bytes after this publish: snapshot + payload, snapshot untouched."""
        current = self._old_bytes(name, keep=False)
        if name not in encoded:
            return current
        result = current.copy()
        self._apply_payload(name, result, encoded[name], spool)
        return result

    def _apply_payload(
        self, name: str, target: ByteArray, entry: _Encoded, spool: _PayloadSpool
    ) -> None:
        payload = decompress(
            spool.read(entry.offset, entry.length),
            max_size=self.encoding.max_payload_size(target.size),
            what=f"payload of tensor {name!r}",
        )
        self.encoding.apply(target, payload, tensor=name)

    # ---------------------------------------------------------------- commit
    def _agree_outcome(self, plan: _Plan, written: _Written, metrics: dict[str, float]) -> _Outcome:
        begun = time.perf_counter()
        writes = self.coordinator.gather(
            written, what=f"publish: gather weight_v{plan.version:06d}"
        )
        outcome: _Outcome | None = None
        if writes is not None:
            commit_started = time.perf_counter()
            try:
                outcome = self._commit(plan, writes)
            except Exception as exc:
                self.store.abort(plan.version)
                if self.world_size == 1 and isinstance(exc, DeltastoreError):
                    raise
                outcome = _Outcome(
                    error=f"committing weight_v{plan.version:06d} to {self.store.url} failed on "
                    f"rank 0: {_describe(exc)}; nothing was committed and no snapshot advanced"
                )
            metrics["commit_s"] = time.perf_counter() - commit_started
        outcome = self.coordinator.broadcast(
            outcome, what=f"publish: commit weight_v{plan.version:06d}"
        )
        metrics["coord_s"] += time.perf_counter() - begun - metrics["commit_s"]
        return outcome

    def _commit(self, plan: _Plan, writes: list[_Written]) -> _Outcome:
        """Rank 0: check every rank's shards and write the index, or remove the version."""
        assert self.snapshot is not None
        version = plan.version
        failed = [f"rank {w.rank}: {w.error}" for w in writes if w.error is not None]
        if failed:
            self.store.abort(version)
            return _Outcome(
                error=f"writing weight_v{version:06d} to {self.store.url} failed on "
                f"{'; '.join(failed)}; nothing was committed (its files were removed) and no "
                "snapshot advanced"
            )
        entries: dict[str, tuple[str, int, int, str]] = {}
        for w in writes:
            twice = set(entries) & set(w.entries)
            if twice:
                raise PublishError(f"tensors {sorted(twice)[:5]} were written by two ranks")
            entries.update(w.entries)
        sources = self.snapshot.sources
        expected = set(sources) if plan.full else set(plan.changed)
        if set(entries) != expected:
            missing = sorted(expected - set(entries))[:5]
            extra = sorted(set(entries) - expected)[:5]
            raise PublishError(
                f"weight_v{version:06d} is incomplete: missing {missing}, unexpected {extra}"
            )
        if plan.full:
            wrong = [n for n, e in entries.items() if e[2] - e[1] != sources[n].nbytes]
            if wrong:
                raise PublishError(f"full weight_v{version:06d} has wrong sizes for {wrong[:5]}")
        total = self.snapshot.total_bytes
        wire = sum(w.wire for w in writes)
        changed = sum(plan.changed.values())
        index = VersionIndex(
            version=version,
            weight_map={n: e[0] for n, e in entries.items()},
            base_version=None if plan.full else self.base_version,
            encoding=None if plan.full else self.encoding.name,
            compression=None if plan.full else COMPRESSION_NAME,
            checksum=self.checksum.name,
            stream_id=self.stream_id,
            commit_token=plan.token,
            totals={
                "total_bytes": total,
                "changed_bytes": changed,
                "wire_bytes": wire,
                "tensor_count": len(entries),
            },
            extra={"total_size": total} if plan.full else {},
        )
        try:
            self.store.commit(version, index)
        except VersionConflictError:
            raise
        except Exception as exc:
            # The index may have landed before the failure (a check after it failed): if
            # readers see it with this writer's token, the commit stands.
            if not self._commit_stands(version, plan.token):
                raise
            log.warning(
                "committing weight_v%06d reported %s, but its index with this writer's token is "
                "published: the commit stands",
                version,
                exc,
            )
        return _Outcome(
            error=None,
            entries=entries,
            totals={
                "total_bytes": total,
                "changed_bytes": changed,
                "wire_bytes": wire,
                "tensors_changed": len(plan.changed),
                "base_version": self.base_version,
            },
        )

    def _commit_stands(self, version: int, token: str) -> bool:
        """True if readers see ``version`` committed with ``token`` (and not fenced)."""
        try:
            self.store.refresh()
            return (
                version in self.store.versions() and self.store.index(version).commit_token == token
            )
        except Exception:
            return False

    # --------------------------------------------------------------- advance
    def _advance(self, encoded: dict[str, _Encoded], spool: _PayloadSpool) -> None:
        """Apply the committed payloads to the snapshot (only after the commit).

        Replicas this rank did not write advance too: their state is the one committed.
        """
        assert self.snapshot is not None
        for name, entry in encoded.items():
            self._apply_payload(name, self.snapshot.load(name), entry, spool)

    def _after_commit(self, plan: _Plan, outcome: _Outcome, encoded: dict[str, _Encoded]) -> None:
        """Forget tensors another rank changed; after a full version, read from it."""
        assert self.snapshot is not None
        for name in plan.changed:
            if name not in encoded:
                self.snapshot.evict(name)
                self._moved.add(name)
        if plan.full:
            for name, (shard, start, _end, digest) in outcome.entries.items():
                source = replace(
                    self._base_sources[name],
                    file=None,
                    full_version=plan.version,
                    shard=shard,
                    offset=start,
                    deltas=(),
                    checksum=self.checksum.name,
                    digest=digest,
                )
                self.snapshot.set_source(name, source, keep_loaded=True)
            self._moved.clear()
            self._walk_from_base = True

    # --------------------------------------------------------------- metrics
    def _record(self, metrics: dict[str, float], result: PublishResult) -> None:
        metrics.update(
            version=result.version,
            full=1.0 if result.kind == "full" else 0.0,
            density=result.density,
            changed_bytes=result.changed_bytes,
            total_bytes=result.total_bytes,
            wire_bytes=result.wire_bytes,
            tensors_changed=result.tensors_changed,
            tensors=len(self.snapshot or ()),
            world_size=self.world_size,
        )
        self._metrics = metrics

    def pop_metrics(self) -> dict[str, float]:
        """Metrics of the last publish (all keys of :data:`METRIC_KEYS`), then cleared to zero.

        In a collective publish every rank returns the same global figures: byte and tensor
        counts are totals over ranks, seconds are the slowest rank's.
        """
        metrics, self._metrics = self._metrics, dict.fromkeys(METRIC_KEYS, 0.0)
        return metrics

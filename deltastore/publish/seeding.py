"""``seed()`` as a collective: every rank reads its base, ranks compare them, rank 0 decides
the stream, every rank builds (and maybe loads) its snapshot.

One error contract for every world size: each failure is raised on every rank, as the same
class, naming the ranks at fault.
"""

from __future__ import annotations

import hashlib
import logging
import warnings

import deltastore.errors
from deltastore.codecs import get_encoding, warm_up
from deltastore.errors import ConfigError, DeltastoreError, PublishError, UnsignedVersionWarning
from deltastore.progress import ProgressCallback, ProgressMeter
from deltastore.publish.config import PublisherConfig
from deltastore.publish.coordination import Coordinator
from deltastore.publish.lineage import apply_lineage
from deltastore.publish.messages import describe
from deltastore.publish.rank_state import RankSnapshot
from deltastore.publish.snapshot import Snapshot, TensorSource
from deltastore.publish.stream import SeedDecision, StreamState, decide_seed
from deltastore.storage import VersionStore
from deltastore.trust import SIGNATURE_KEY

log = logging.getLogger("deltastore.publish")


def layout_fingerprint(sources: dict[str, TensorSource]) -> str:
    """A digest of every tensor's name, dtype, shape and size (what ranks must agree on)."""
    digest = hashlib.sha256()
    for name, s in sources.items():
        digest.update(f"{name}\0{s.dtype}\0{s.shape}\0{s.nbytes}\n".encode())
    return digest.hexdigest()


def read_bases(base_checkpoint: str, coord: Coordinator) -> dict[str, TensorSource]:
    """Every rank's base checkpoint, described and compared.

    Raises :class:`ConfigError` (on every rank) naming the ranks that cannot read theirs or
    hold a different one.
    """
    sources: dict[str, TensorSource] = {}
    read_error: BaseException | None = None
    try:
        sources = Snapshot.describe_checkpoint(base_checkpoint)
    except Exception as exc:
        read_error = exc
    # Exchanged even on failure, so a rank that cannot read its base reports it through the
    # collective instead of leaving its peers waiting in it.
    gathered = coord.all_gather(
        (describe(read_error), layout_fingerprint(sources)), what="seed: compare bases"
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


def _decision(
    store: VersionStore,
    sources: dict[str, TensorSource],
    coord: Coordinator,
    config: PublisherConfig,
    continue_latest: bool,
) -> SeedDecision:
    decision: SeedDecision | None = None
    if coord.rank == 0:
        try:
            decision = decide_seed(
                store,
                sources,
                resume=config.resume,
                new_stream=config.new_stream,
                continue_latest=continue_latest,
            )
            check_signing(store, config)
        except Exception as exc:
            if not isinstance(exc, DeltastoreError):
                exc = PublishError(f"seeding from {store.url} failed: {describe(exc)}")
            decision = SeedDecision(error=exc)
    decision = coord.broadcast(decision, what="seed: decision")
    if decision.error is not None:
        raise decision.error
    return decision


def check_signing(store: VersionStore, config: PublisherConfig) -> None:
    """Rank 0, at seed: a publisher without a signing key on a store whose latest version is
    signed would break the engines that trust that key; it warns
    (:class:`~deltastore.errors.UnsignedVersionWarning`), or with ``require_signed`` raises
    :class:`ConfigError` before anything is published."""
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
    warnings.warn(message, UnsignedVersionWarning, stacklevel=4)


def _load(
    snapshot: Snapshot,
    coord: Coordinator,
    workers: int,
    preload: bool,
    progress: ProgressCallback | None = None,
) -> None:
    """Load the snapshot now if ``preload`` (reported as phase ``seed``); a failure is raised
    on every rank as the class of the first failing rank's error (e.g.
    :class:`IntegrityError`), naming every failing rank."""
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
    decision = _decision(store, sources, coord, config, continue_latest)
    assert decision.stream is not None
    snapshot = Snapshot(dict(sources), store)
    if decision.lineage is not None:
        apply_lineage(snapshot, decision.lineage, sources)
    _load(snapshot, coord, config.threads, preload, progress)
    lineage = decision.lineage
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
    held = RankSnapshot(snapshot, sources, store, workers=config.threads)
    held.pool()  # the worker threads start here, not in the first publish
    # So are the compiled kernels (numba's import and cache: ~1 s or more): every encoding's
    # snapshot advance XORs its changes in with one; deltastore's own encode with the rest.
    warm_up(changes_only=get_encoding(config.encoding).reference_format)
    return held, decision.stream

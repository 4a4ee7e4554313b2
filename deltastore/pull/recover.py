"""Before planning a pull: finish or repair an interrupted transition, and decide whether the
recorded state can be trusted without hashing the checkpoint."""

from __future__ import annotations

import logging

from deltastore.errors import (
    ConfigError,
    DeltastoreError,
    FormatError,
    IntegrityError,
    NameMismatchError,
)
from deltastore.format.state import AppliedState, PendingTransition
from deltastore.pull.chain import Chain, plan_pull
from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.repair import RepairSummary, repair_pending
from deltastore.pull.stats import ApplyStats
from deltastore.pull.verify import verify_checkpoint
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.pull")


def recover(
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


def trusted_state(
    store: VersionStore,
    local: LocalCheckpoint,
    state: AppliedState | None,
    chain: Chain,
    base: str | None,
    workers: int,
    *,
    suspect: bool,
) -> AppliedState | None:
    """``state`` if the checkpoint's bytes can be taken to hold it, else None (reseed).

    Cheap when the weight files' fingerprints (size, mtime) match those the state recorded.
    Otherwise — files changed behind the state's back, a state written by another tool, or
    ``suspect`` (an interrupted pull was found) — every tensor is hashed against the state's
    version first (one full read of the checkpoint). A state the plan would not build on
    anyway (not on the target's chain) is returned as is: it reseeds without a check.
    """
    if state is None or chain.suffix_after(state.version) is None:
        return state
    if not suspect and local.unchanged_since(state):
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
        verify_checkpoint(store, local.dir, state.version, base, workers)
    except (IntegrityError, NameMismatchError, FormatError, ConfigError) as exc:
        log.warning("%s does not hold v%06d (%s); reseeding", local.dir, state.version, exc)
        local.invalidate_state()
        return None
    local.write_state(state)  # fresh fingerprints: the next pull is cheap again
    return state

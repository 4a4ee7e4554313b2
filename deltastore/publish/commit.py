"""Rank 0's claim and commit of a version, and the post-write hook after it, through the
store's :class:`~deltastore.storage.VersionWriter` (the one owner of the commit protocol).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from deltastore.errors import VersionConflictError
from deltastore.format.index import VersionIndex
from deltastore.hooks.context import publishing_rank
from deltastore.publish.config import Settings
from deltastore.publish.messages import Failure, Outcome, Plan, StreamState, Written, describe
from deltastore.publish.planning import (
    build_index,
    check_written,
    version_totals,
    written_failure,
)
from deltastore.storage import VersionStore
from deltastore.storage.writer import VersionWriter
from deltastore.trust import SigningKey, build_manifest, sign_manifest, signed_index
from deltastore.trust.manifest import BASE_DIGESTS_KEY, ShardFact

BaseRecord = Callable[[], dict[str, Any]]  # rank 0: every base tensor's digest, once asked

log = logging.getLogger("deltastore.publish")


def claim(
    store: VersionStore, stream: StreamState
) -> tuple[VersionWriter, None] | tuple[None, Failure]:
    """Rank 0: claim the stream's next version before any rank writes, or why it cannot; after
    a resume or an abort the first claimable one after the base (the store skips, never
    reuses, claims a crashed writer left)."""
    try:
        if stream.resumed:
            return store.begin(after=stream.next_version - 1), None
        return store.begin(stream.next_version), None
    except Exception as exc:
        kind = "conflict" if isinstance(exc, VersionConflictError) else "publish"
        return None, Failure(
            f"claiming weight_v{stream.next_version:06d} in {store.url} failed on rank 0: "
            f"{describe(exc)}; nothing was committed",
            kind=kind,
        )


def commit_version(
    writer: VersionWriter,
    plan: Plan,
    writes: Sequence[Written],
    stream: StreamState,
    sizes: Mapping[str, int],
    settings: Settings,
    *,
    signing_key: SigningKey | None = None,
    base_record: BaseRecord | None = None,
) -> Outcome:
    """Rank 0: check every rank's shards and commit the index, or abort the version. Never
    raises: the outcome's failure says whether anything may have landed."""
    assert plan.layout is not None
    version, url = plan.version, writer.store_url
    failure = written_failure(writes, version, url)
    if failure is not None:
        writer.abort()
        return Outcome(failure)
    reason = f"committing weight_v{version:06d} to {url} failed on rank 0"
    try:
        entries = check_written(plan.layout, writes, sizes, version)
        totals = version_totals(plan.layout, writes, stream, sum(sizes.values()), version)
        index = build_index(
            plan.token,
            plan.layout,
            entries,
            totals,
            stream,
            encoding=settings.encoding.name,
            checksum=settings.checksum.name,
        )
        index = seal_index(index, writes, signing_key, base_record)
    except Exception as exc:
        writer.abort()
        return Outcome(Failure(f"{reason}: {describe(exc)}; nothing was committed"))
    try:
        writer.commit(index)
        return Outcome(None, entries, totals)
    except VersionConflictError as exc:
        writer.abort()
        return Outcome(Failure(f"{reason}: {describe(exc)}; nothing was committed", "conflict"))
    except Exception as exc:
        reason = f"{reason}: {describe(exc)}"
        landed = writer.landed()
    if landed is None:
        # The index may stand (a check after it failed): never say nothing was committed.
        return Outcome(Failure(f"{reason}; whether it landed is unknown", "uncertain"))
    if landed:
        log.warning("%s, but readers see its index with this token: it stands", reason)
        return Outcome(None, entries, totals)
    writer.abort()
    return Outcome(Failure(f"{reason}; nothing was committed and no snapshot advanced"))


def seal_index(
    index: VersionIndex,
    writes: Sequence[Written],
    signing_key: SigningKey | None,
    base_record: BaseRecord | None,
) -> VersionIndex:
    """``index`` with the base-model record (on a delta built on version 0) and, given a key,
    the signature over its manifest; shard sizes and digests come from the ranks' writes.

    The record keeps only the base tensors this delta does not carry: a host checks each one it
    carries against the tensor's published digest once applied, which a wrong base fails too,
    so their base digests would be bytes on the wire that no check needs."""
    if base_record is not None and index.is_delta and index.base_version == 0:
        record = base_record()
        untouched = {n: d for n, d in record["tensors"].items() if n not in index.weight_map}
        record = {**record, "tensors": untouched}
        index = dataclasses.replace(index, extra={**index.extra, BASE_DIGESTS_KEY: record})
    if signing_key is None:
        return index
    facts: dict[str, ShardFact] = {}
    digests: dict[str, dict[str, str]] = {}
    for w in writes:
        facts.update(w.shards)
        for name, placed in w.entries.items():
            digests.setdefault(placed.shard, {})[name] = placed.digest
    manifest = build_manifest(index, digests, facts)
    return signed_index(index, sign_manifest(signing_key, manifest))


def run_post_write(
    writer: VersionWriter,
    post_write: Callable[[str], None] | None,
    rank: int,
    metrics: dict[str, float],
) -> BaseException | None:
    """Run ``post_write`` (else the store's own hook) for ``writer``'s version and add
    ``hook_s`` to ``metrics``. The error is returned, not raised, so every rank reports it
    through the finish collective instead of leaving its peers waiting there."""
    begun = time.perf_counter()
    try:
        with publishing_rank(rank):
            if post_write is not None:
                post_write(writer.url)
            else:
                writer.after_write()
    except Exception as exc:
        return exc
    finally:
        metrics["hook_s"] = time.perf_counter() - begun
    return None

"""Rank 0's claim of a version and the other ranks' join, through the store's
:class:`~deltastore.storage.VersionWriter` (the one owner of the commit protocol: claim,
fence checks, successor, index, "does the commit stand").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from deltastore.errors import VersionConflictError
from deltastore.format.index import VersionIndex
from deltastore.publish.messages import Failure, Outcome, Plan, Written, describe
from deltastore.publish.planning import (
    build_index,
    check_written,
    version_totals,
    written_failure,
)
from deltastore.publish.stream import StreamState
from deltastore.storage import VersionStore
from deltastore.storage.writer import VersionWriter

log = logging.getLogger("deltastore.publish")


def claim(
    store: VersionStore, stream: StreamState
) -> tuple[VersionWriter, None] | tuple[None, Failure]:
    """Rank 0: claim the stream's next version before any rank writes; or why it cannot.

    Right after a resume (or a new stream) the first claimable version after the base is
    taken (claims left by a crashed writer are skipped by the store, never reused). Another
    writer holding the version is a ``conflict`` failure.
    """
    try:
        if stream.resumed:
            return store.begin_next(stream.next_version - 1), None
        return store.begin(stream.next_version), None
    except Exception as exc:
        kind = "conflict" if isinstance(exc, VersionConflictError) else "publish"
        return None, Failure(
            f"claiming weight_v{stream.next_version:06d} in {store.url} failed on rank 0: "
            f"{describe(exc)}; nothing was committed",
            kind=kind,
        )


def join(store: VersionStore, version: int, token: str) -> VersionWriter:
    """Another rank: write files of the version rank 0 claimed."""
    return store.join(version, token)


def index_landed(store: VersionStore, version: int, token: str) -> bool | None:
    """Whether readers see ``version`` committed with ``token``: True, False, or None when the
    store cannot tell right now."""
    try:
        store.refresh()
        if version not in store.versions():
            return False
        return store.index(version).commit_token == token
    except Exception:
        return None


def commit_version(
    writer: VersionWriter,
    plan: Plan,
    writes: Sequence[Written],
    stream: StreamState,
    sizes: Mapping[str, int],
    *,
    encoding: str,
    checksum: str,
) -> Outcome:
    """Rank 0: check every rank's shards and commit the index, or abort the version.

    Never raises: the outcome's failure says whether anything may have landed.
    """
    assert plan.layout is not None
    version, url = plan.version, writer.store.url
    failure = written_failure(writes, version, url)
    if failure is not None:
        writer.abort()
        return Outcome(failure)
    reason = f"committing weight_v{version:06d} to {url} failed on rank 0"
    try:
        entries = check_written(plan.layout, writes, sizes, version)
        totals = version_totals(plan.layout, writes, stream, sum(sizes.values()))
        index = build_index(
            version,
            plan.token,
            plan.layout,
            entries,
            totals,
            stream,
            encoding=encoding,
            checksum=checksum,
        )
    except Exception as exc:
        writer.abort()
        return Outcome(Failure(f"{reason}: {describe(exc)}; nothing was committed"))
    failure = _commit_index(writer, index, reason)
    return Outcome(failure) if failure is not None else Outcome(None, entries, totals)


def _commit_index(writer: VersionWriter, index: VersionIndex, reason: str) -> Failure | None:
    """Commit through the writer; a failure says whether anything may have landed."""
    try:
        writer.commit(index)
        return None
    except VersionConflictError as exc:
        writer.abort()
        return Failure(f"{reason}: {describe(exc)}; nothing was committed", "conflict")
    except Exception as exc:
        reason = f"{reason}: {describe(exc)}"
        landed = index_landed(writer.store, writer.version, writer.token)
    if landed is None:
        # The index may stand (a check after it failed): never say nothing was committed.
        return Failure(f"{reason}; whether it landed is unknown", "uncertain")
    if landed:
        log.warning("%s, but readers see its index with this token: it stands", reason)
        return None
    writer.abort()
    return Failure(f"{reason}; nothing was committed and no snapshot advanced")

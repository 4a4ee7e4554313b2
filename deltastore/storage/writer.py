"""``VersionWriter``: the one transaction that writes a version into a :class:`VersionStore`.

Every writer of versions (the publisher, the mirror hooks, the test helpers) goes through it;
nothing else creates an index. The protocol, in order:

1. **Claim** (:meth:`VersionStore.begin`): a create-only ``_claims/weight_vNNNNNN.json``
   holding a unique token, so a second writer of the version never touches the winner's files.
   A version carrying a tombstone (``_claims/weight_vNNNNNN.abort``) is never claimed again.
2. **Files**: shards and any other non-index file, streamed (:meth:`VersionWriter.open_write`).
3. **Fence check**: no tombstone, and the claim still holds this writer's token.
4. **Successor** (deltas on a published version): a create-only
   ``_claims/weight_vBBBBBB.successor-G`` naming this version, for the base version B.
   Exactly one writer can extend a given version: two resumed publishers that both build on B
   race for this one object. Generation G moves on only past a void successor: its version
   carries a tombstone, or its claim no longer holds its token (its writer aborted).
5. **Index**: create-only, carrying the token. ``FileExistsError`` is answered by reading the
   index back: this writer's token means a lost acknowledgement (the commit may stand),
   another token a :class:`VersionConflictError`.
6. **Does the commit stand**: the fence check again. A pruner writes its tombstone, then looks
   for the index; the writer writes its index, then looks for the tombstone: one of the two
   always sees the other. A writer that sees a tombstone withdraws its index and raises.

Readers (:meth:`VersionStore.versions`, :meth:`VersionStore.index`) treat a version with a
tombstone as invisible, and tombstones are permanent, so an index that lands late (a writer
that stalled, or died right after writing it) never makes a pruned version visible again.

The protocol's objects are a :class:`StoreObjects` every :class:`VersionStore` holds (not
inherits, so the store's public face stays small); outside ``deltastore.storage`` only
:func:`~deltastore.storage.store.store_objects` reaches it (the conformance suite, fault tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import posixpath
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, BinaryIO, Protocol

from deltastore.errors import (
    ConfigError,
    DeltastoreError,
    StoreError,
    TransientStoreError,
    VersionConflictError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.storage.backends import RetryPolicy
from deltastore.storage.listing import (
    ABORT_SUFFIX,
    CLAIM_SUFFIX,
    CLAIMS_DIR,
    PROBE_PREFIX,
    SUCCESSOR_SUFFIX,
)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from deltastore.storage.backends import Backend, Guard
    from deltastore.storage.listing import StoreListing

log = logging.getLogger("deltastore.storage")


def new_token() -> str:
    """A unique commit/claim token."""
    return uuid.uuid4().hex


def json_field(data: bytes, *keys: str) -> str | int | None:
    """A nested field of a JSON object, or None when absent or malformed."""
    with contextlib.suppress(ValueError, AttributeError, UnicodeDecodeError):
        value = json.loads(data)
        for key in keys:
            value = value.get(key)
        return value if isinstance(value, (str, int)) else None
    return None


class ObjectsOwner(Protocol):
    """What :class:`StoreObjects` needs of the store that holds it."""

    url: str
    root: str
    block_size: int
    retry: RetryPolicy
    post_write: Callable[[str], None] | None
    supports_exclusive_create: bool | None

    @property
    def fs(self) -> AbstractFileSystem: ...

    def index(self, version: int) -> VersionIndex: ...

    def listing(self) -> StoreListing: ...

    def refresh(self, version: int | None = None) -> None: ...


class StoreObjects:
    """Claims, tombstones, successors and file writes of one store (see the module docstring);
    ``guard`` is the store's retried, translated call of every idempotent step."""

    def __init__(self, store: ObjectsOwner, backend: Backend, guard: Guard) -> None:
        self.store, self.backend, self._guard = store, backend, guard
        self.url, self.root = store.url, store.root
        self.index, self.listing, self.refresh = store.index, store.listing, store.refresh

    @property
    def fs(self) -> AbstractFileSystem:
        return self.store.fs

    def translate(self, what: str, exc: Exception) -> DeltastoreError:
        """A failed step's exception as an error of the tree, naming the store."""
        return self.backend.translate(self.url, self.store.retry, what, exc)

    def missing_root_error(self) -> ConfigError:
        """The error for a remote root whose bucket does not exist (or is not visible)."""
        bucket = self.root.lstrip("/").split("/", 1)[0]
        return ConfigError(
            f"bucket {bucket!r} of {self.url} does not exist or is not visible with these "
            f"credentials; create it, or check the URL and {self.backend.endpoint_hint()}"
        )

    def check_exclusive_create(self) -> bool:
        """Whether create-only writes are exclusive on this backend, probed once (a probe
        object under ``_claims/`` written twice: the second write must fail; where it does
        not, a warning says so). Raises :class:`ConfigError` if the bucket does not exist."""
        if self.store.supports_exclusive_create is not None:
            return self.store.supports_exclusive_create
        token = uuid.uuid4().hex
        path = posixpath.join(self.root, CLAIMS_DIR, f"{PROBE_PREFIX}{token}")
        try:
            self.create_or_read(path, json.dumps({"probe": True, "token": token}).encode())
            try:
                self.create_only(path, b"second")
                exclusive = False
            except FileExistsError:
                exclusive = True
        except FileNotFoundError:
            raise self.missing_root_error() from None
        finally:
            with contextlib.suppress(Exception):
                self.remove(path)
        if not exclusive:
            message = (
                f"{self.url}: create-only writes are NOT exclusive on this backend (a second "
                "create-only write of a probe object succeeded); two concurrent publishers "
                "could both commit one version. Run exactly one publisher per store"
            )
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        self.store.supports_exclusive_create = exclusive
        return exclusive

    def version_path(self, version: int) -> str:
        return posixpath.join(self.root, version_dir_name(version))

    def version_url(self, version: int) -> str:
        if self.backend.is_local:
            return self.version_path(version)
        return posixpath.join(self.url, version_dir_name(version))

    def file_path(self, version: int, name: str) -> str:
        return posixpath.join(self.version_path(version), name)

    def claim_path(self, version: int) -> str:
        return posixpath.join(self.root, CLAIMS_DIR, version_dir_name(version) + CLAIM_SUFFIX)

    def abort_path(self, version: int) -> str:
        return posixpath.join(self.root, CLAIMS_DIR, version_dir_name(version) + ABORT_SUFFIX)

    def successor_path(self, base: int, generation: int) -> str:
        return posixpath.join(
            self.root, CLAIMS_DIR, f"{version_dir_name(base)}{SUCCESSOR_SUFFIX}{generation}"
        )

    def create_only(self, path: str, data: bytes) -> None:
        """Write ``path`` only if it does not exist; raises ``FileExistsError`` otherwise (one
        attempt, no retry: the low-level exclusive create every protocol object relies on)."""
        self.backend.create_only(path, data)

    def create_or_read(self, path: str, data: bytes) -> bytes | None:
        """Create-only write of ``path``, retried as one unit: None if written now, else the
        existing object's bytes (perhaps the caller's own, after a lost acknowledgement)."""

        def attempt() -> bytes | None:
            try:
                self.create_only(path, data)
                return None
            except FileExistsError:
                self.fs.invalidate_cache(posixpath.dirname(path))
                try:
                    return bytes(self.fs.cat_file(path))
                except FileNotFoundError:
                    # Reported as existing, yet gone: removed meanwhile. Try again.
                    raise TransientStoreError(
                        f"{path} was reported as existing but cannot be read"
                    ) from None

        return self._guard(f"create-only write of {path}", attempt)

    def is_fenced(self, version: int) -> bool:
        """Whether ``version`` carries a tombstone (fenced or unpublished by prune, or aborted
        after taking its base's successor): it is never visible nor claimed again."""
        # Asked on every index read. A one-byte ranged GET answers in one request; s3fs's
        # existence check costs two when the object is absent, as it nearly always is (a
        # HEAD, then a listing in case the path is a directory), and its unranged cat_file
        # sends a HEAD first.
        path = self.abort_path(version)
        try:
            self._guard(f"checking {path}", lambda: self.fs.cat_file(path, start=0, end=1))
        except FileNotFoundError:
            return False
        except StoreError:
            return self.exists(path)  # a store that refuses a range of an empty object (416)
        return True

    def write_tombstone(self, version: int, reason: str) -> str:
        """Create ``version``'s tombstone (create-only); returns the token of the one that
        stands (ours, or an earlier one's)."""
        token = new_token()
        body = json.dumps(
            {"version": version, "reason": reason, "token": token, "time": time.time()}
        ).encode()
        existing = self.create_or_read(self.abort_path(version), body)
        if existing is None:
            return token
        found = json_field(existing, "token")
        return found if isinstance(found, str) else ""

    def exists(self, path: str) -> bool:
        return bool(self._guard(f"checking {path}", lambda: self.fs.exists(path)))

    def read_optional(self, path: str) -> bytes | None:
        try:
            return bytes(self._guard(f"reading {path}", lambda: self.fs.cat_file(path)))
        except FileNotFoundError:
            return None

    def claim_token(self, version: int) -> str | int | None:
        """The token ``version``'s claim holds; None when it has no (well-formed) claim."""
        return json_field(self.read_optional(self.claim_path(version)) or b"{}", "token")

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete ``path`` (a file, or a directory with ``recursive``); absent is fine."""
        with contextlib.suppress(FileNotFoundError):
            self._guard(f"deleting {path}", lambda: self.fs.rm(path, recursive=recursive))

    def write_file(self, version: int, name: str, data: bytes | memoryview) -> None:
        """Write one whole non-index file of a claimed version (retried as a whole)."""
        if name == INDEX_NAME:
            raise StoreError(f"{name} is written only by commit()")
        self.backend.write_file(self.file_path(version, name), data, self._guard)

    @contextlib.contextmanager
    def open_write(self, version: int, name: str) -> Iterator[BinaryIO]:
        """A writable stream for one non-index file of a claimed, uncommitted version: a temp
        file renamed into place locally; remotely at most ``block_size`` bytes buffered, larger
        files a multipart (S3) or resumable (GCS) upload that completes on close (abandoned,
        never completed, if the caller raises)."""
        if name == INDEX_NAME:
            raise StoreError(f"{name} is written only by commit()")
        path = self.file_path(version, name)
        body_done = False
        try:
            with self.backend.open_write(path, self.store.block_size, self._guard) as fh:
                yield fh
                body_done = True
        except (FileNotFoundError, DeltastoreError):
            raise
        except Exception as exc:
            if not body_done:
                raise
            raise self.translate(f"uploading {path}", exc) from exc


MAX_SUCCESSOR_GENERATIONS = 64
"""Successor objects tried per base version (each earlier one voided by a tombstone)."""

StepHook = Callable[[str], object]
"""``hook(step)``: called before each protocol step (``"fence-check"``, ``"successor"``,
``"index"``, ``"recheck"``); tests pause the writer there while another party runs."""


class VersionWriter:
    """Writes the files of one claimed version and commits it (:meth:`VersionStore.begin`, or
    :meth:`VersionStore.join`); a context manager that aborts on an exception unless committed."""

    def __init__(
        self, objects: StoreObjects, version: int, token: str, *, claimant: bool = True
    ) -> None:
        self.objects = objects
        self.version = version
        self.token = token
        self.claimant = claimant  # the writer that took the claim: only it commits or aborts
        self.committed = False
        self.step_hook: StepHook | None = None
        self._name = f"weight_v{version:06d}"

    def __repr__(self) -> str:
        return f"VersionWriter({self.objects.url!r}, {self._name})"

    @property
    def url(self) -> str:
        """URL of this version's directory (what hooks receive)."""
        return self.objects.version_url(self.version)

    @property
    def store_url(self) -> str:
        return self.objects.url

    def __enter__(self) -> VersionWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if exc_type is not None and not self.committed and self.claimant:
            self.abort()

    def _step(self, name: str) -> None:
        if self.step_hook is not None:
            self.step_hook(name)

    def open_write(self, name: str) -> AbstractContextManager[BinaryIO]:
        """A writable stream for one non-index file (see :meth:`StoreObjects.open_write`)."""
        return self.objects.open_write(self.version, name)

    def write_file(self, name: str, data: bytes | memoryview) -> None:
        """Write one whole non-index file of this version (retried as a whole)."""
        self.objects.write_file(self.version, name, data)

    def after_write(self) -> None:
        """Run the store's post-write hook for this version (its files are all written)."""
        if self.objects.store.post_write is not None:
            self.objects.store.post_write(self.url)

    def commit(self, index: VersionIndex) -> VersionIndex:
        """Publish this version by creating its index stamped with this writer's token; returns
        the committed index. Raises :class:`ConfigError` for an index of another version or a
        writer that did not claim, :class:`StoreError` if a shard it names is not written,
        :class:`VersionConflictError` if another writer committed this version or already
        extended its base, or prune fenced it."""
        if not self.claimant:
            raise ConfigError(
                f"{self._name}: only the writer that claimed it (rank 0) commits; this writer "
                "joined with the claimant's token"
            )
        if index.version != self.version:
            raise ConfigError(f"commit() of {self._name} got the index of v{index.version:06d}")
        index = dataclasses.replace(index, commit_token=self.token)
        store = self.objects
        for shard in index.shards():
            if not store.exists(store.file_path(self.version, shard)):
                raise StoreError(f"cannot commit {self._name}: shard {shard} is not written")
        self._step("fence-check")
        self._check_fence()
        if index.is_delta and index.base_version:
            # Version 0 (the base weights) is not in the store: every new stream starts on it.
            self._step("successor")
            self._take_successor(index.base_version)
        self._step("index")
        # The directory's names made durable first (an empty delta's may not exist yet).
        store.backend.make_durable(store.version_path(self.version))
        path = store.file_path(self.version, INDEX_NAME)
        existing = store.create_or_read(path, index.to_json())
        if existing is not None and json_field(existing, "metadata", "commit_token") != self.token:
            raise VersionConflictError(
                f"{self._name} was committed by another writer in {store.url}; this writer's "
                "version was not published (resume the stream from the latest version)"
            )
        self._step("recheck")
        self._recheck(path)
        self.committed = True
        store.backend.make_durable(store.root)
        store.fs.invalidate_cache(store.version_path(self.version))
        return index

    def _recheck(self, index_path: str) -> None:
        """Does the commit stand: no tombstone was written meanwhile (a claim is removed or
        replaced only after one). A fenced commit withdraws its index. If the check itself
        fails, the index is left in place, which is safe: readers never see a version with a
        tombstone, and prune deletes data only after writing one; the readers' view decides."""
        try:
            fenced = self.objects.is_fenced(self.version)
        except Exception as exc:
            if self.landed():
                log.warning(
                    "checking %s for a tombstone failed (%s), but readers see it: "
                    "the commit stands",
                    self._name,
                    exc,
                )
                return
            raise StoreError(
                f"{self._name} in {self.objects.url}: the check after writing its index failed "
                f"({exc}); whether it is published is undetermined: check with `deltastore ls`"
            ) from exc
        if fenced:
            with contextlib.suppress(Exception):
                self.objects.remove(index_path)
            raise VersionConflictError(
                f"{self._name} in {self.objects.url} was fenced by prune while its index was "
                "being written; it was not committed. Publish the next version instead"
            )

    def landed(self) -> bool | None:
        """Whether readers see this version committed with this writer's token: True, False,
        or None when the store cannot tell right now (after a commit that raised)."""
        try:
            self.objects.refresh()
            if self.version not in self.objects.listing().committed:
                return False
            return self.objects.index(self.version).commit_token == self.token
        except Exception:
            return None

    def _check_fence(self) -> None:
        """Refuse a version with a tombstone, or whose claim is missing or another writer's."""
        store = self.objects
        if store.is_fenced(self.version):
            raise VersionConflictError(
                f"{self._name} in {store.url} is fenced by a tombstone "
                f"({store.abort_path(self.version)}): prune found its claim stale; this writer "
                "must not commit it. Publish the next version instead"
            )
        if store.claim_token(self.version) != self.token:
            raise VersionConflictError(
                f"{self._name} in {store.url} is not claimed by this writer (its claim is "
                "missing or another writer's); publish the next version instead"
            )

    def _take_successor(self, base: int) -> None:
        """Become the one successor of ``base``, or raise :class:`VersionConflictError`."""
        store = self.objects
        body = json.dumps({"base": base, "version": self.version, "token": self.token}).encode()
        for generation in range(MAX_SUCCESSOR_GENERATIONS):
            path = store.successor_path(base, generation)
            existing = store.create_or_read(path, body)
            if existing is None or json_field(existing, "token") == self.token:
                return
            other = json_field(existing, "version")
            if isinstance(other, int) and self._successor_void(other, existing):
                continue
            raise VersionConflictError(
                f"weight_v{base:06d} in {store.url} is already extended by weight_v"
                f"{other:06d} (another writer); this writer's {self._name} was not committed. "
                "Two publishers extend one stream: stop one and resume the other "
                "(resume=True) from the latest version"
                if isinstance(other, int)
                else f"successor object {path} of {store.url} is malformed; remove it"
            )
        raise VersionConflictError(
            f"weight_v{base:06d} in {store.url} has {MAX_SUCCESSOR_GENERATIONS} fenced "
            "successors; resume the stream from the latest version"
        )

    def _successor_void(self, version: int, successor: bytes) -> bool:
        """Whether another writer's successor object can never lead to a commit: its version
        has a tombstone, or its claim no longer holds its token (the writer aborted, which
        removes the claim; a commit needs the claim)."""
        store = self.objects
        if store.is_fenced(version):
            return True
        token = store.claim_token(version)
        return token is None or token != json_field(successor, "token")

    def abort(self) -> None:
        """Remove this uncommitted version's files and claim (best effort, never a commit).

        A version whose index exists or cannot be checked is left alone (after a lost
        acknowledgement its commit may have landed; prune fences it later if it is garbage).
        Removing the claim voids a successor object this writer took."""
        if self.committed or not self.claimant:
            return
        store = self.objects
        try:
            if store.exists(store.file_path(self.version, INDEX_NAME)):
                return
        except Exception as exc:
            log.warning(
                "not removing %s of %s: cannot check whether it is committed (%s); prune "
                "removes it later if it is not",
                self._name,
                store.url,
                exc,
            )
            return
        with contextlib.suppress(Exception):
            store.remove(store.version_path(self.version), recursive=True)
        with contextlib.suppress(Exception):
            store.remove(store.claim_path(self.version))


def _try_claim(store: StoreObjects, version: int, token: str) -> str | None:
    """Take ``version``'s claim: None on success, else why not (a key of ``_REFUSED``)."""
    store.check_exclusive_create()
    if store.exists(store.file_path(version, INDEX_NAME)):
        return "fenced" if store.is_fenced(version) else "committed"
    if store.is_fenced(version):
        return "fenced"
    claim = json.dumps({"version": version, "token": token, "time": time.time()}).encode()
    existing = store.create_or_read(store.claim_path(version), claim)
    if existing is None or json_field(existing, "token") == token:
        return None
    return "claimed"


_REFUSED = {
    "committed": "is already committed; publish the next version (or resume the stream)",
    "fenced": "is fenced by prune (a tombstone); publish the next version",
    "claimed": "is claimed by another writer; two publishers target one store (stop the "
    "other, or resume the stream with resume=True)",
}


def begin_version(
    store: StoreObjects, version: int | None, after: int | None, token: str, max_skip: int
) -> VersionWriter:
    """Claim ``version``, or the first claimable version above ``after`` (see
    :meth:`VersionStore.begin`)."""
    if (version is None) == (after is None):
        raise ConfigError("begin() takes a version, or after= (the version to follow)")
    if version is not None:
        why = _try_claim(store, version, token)
        if why is not None:
            raise VersionConflictError(f"weight_v{version:06d} in {store.url} {_REFUSED[why]}")
        return VersionWriter(store, version, token)
    assert after is not None
    for version in range(after + 1, after + 1 + max_skip):
        why = _try_claim(store, version, token)
        if why is None:
            return VersionWriter(store, version, token)
        if why == "committed":
            raise VersionConflictError(
                f"weight_v{version:06d} in {store.url} is already committed above "
                f"weight_v{after:06d}: another writer moved the store on; resume the stream "
                "(resume=True) from the latest version"
            )
        log.warning(
            "weight_v%06d of %s is %s and not committed; skipping to the next version",
            version,
            store.url,
            why,
        )
    raise VersionConflictError(
        f"{max_skip} versions after weight_v{after:06d} in {store.url} are claimed or "
        "fenced; run `deltastore prune` to fence stale claims, then resume"
    )

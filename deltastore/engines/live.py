"""``LiveWeights``: a published version into a running model's tensors, transactionally.

Two steps, so the engine pauses only for the second: :meth:`LiveWeights.stage` (while it
serves) pulls the version into the host-local checkpoint with
:func:`~deltastore.pull.pull_weights`, exactly as a reload would, and prepares a patch per
changed tensor (:mod:`deltastore.engines.patches`); :meth:`LiveWeights.commit` (in the pause)
writes the patches (:mod:`deltastore.engines.commit`), or hands the changed tensors to the
engine's own ``loader=``. The verified checkpoint on disk stays the source of truth: what a
restarted engine loads, and where the new values come from.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deltastore.codecs import Digest, get_checksum
from deltastore.engines.commit import write_patches
from deltastore.engines.patches import TensorPatch, delta_patches, whole_patches
from deltastore.engines.targets import (
    CheckpointViews,
    NameMap,
    Target,
    can_pin,
    resolve_targets,
    target_tensors,
)
from deltastore.errors import (
    ApplyError,
    ConfigError,
    IntegrityError,
    OutOfOrderError,
    StreamError,
)
from deltastore.format.checkpoint import CheckpointTensor, scan_checkpoint
from deltastore.format.state import AppliedState
from deltastore.progress import ProgressCallback
from deltastore.pull import LocalCheckpoint, PullResult, pull_weights
from deltastore.pull.chain import TensorHistory, check_contiguous, collect_history, resolve_onto
from deltastore.pull.source import PreRead, PullSource, StoreSpec, open_store
from deltastore.trust.keys import TrustedKeys

log = logging.getLogger("deltastore.engines")

Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], object]
"""An engine's own weight loader: called with (checkpoint name, new tensor) pairs."""
VERIFY_MODES = ("patched", "full", None)
FALLBACK_CHECKSUM = "xxh3-128"
"""Hashes a tensor whose digest the chain does not record (``verify="full"`` after a full
version), from the verified checkpoint's bytes."""
CHECK_CHUNK = 64 * 1024 * 1024


@dataclass(frozen=True, eq=False)
class StagedUpdate:
    """A version prepared for :meth:`LiveWeights.commit`: the live weights are untouched."""

    version: int
    """The version a commit brings the live weights to."""
    base_version: int
    """The version the live weights held when it was staged (a commit needs them there)."""
    tensors: int
    """Tensors a commit writes (or hands to the loader)."""
    elements: int
    """Elements a commit writes (words of the checkpoint dtype's size)."""
    bytes: int
    """Host memory the patches hold (positions, new and old values; a whole tensor's new bytes
    are read from the checkpoint's map and not counted)."""
    seconds: float
    """Wall time of :meth:`LiveWeights.stage`, the pull included."""
    pull: PullResult
    """What the pull into the local checkpoint did (its own figures)."""
    whole: bool
    """True when some tensor is patched whole (a full version or a reseed on the way)."""
    stream_id: str | None = None
    patches: tuple[TensorPatch, ...] = field(default=(), repr=False)
    loads: tuple[tuple[str, torch.Tensor], ...] = field(default=(), repr=False)
    """``loader=`` mode: the changed tensors, over the checkpoint's map."""
    views: CheckpointViews | None = field(default=None, repr=False)
    checkpoint: Mapping[str, CheckpointTensor] = field(default_factory=dict, repr=False)
    owner: object = field(default=None, repr=False)
    token: object = field(default=None, repr=False)

    # The pull's figures under the names of PullResult and deltastore serve's /metrics.
    @property
    def wire_bytes(self) -> int:
        return self.pull.bytes_read

    @property
    def bytes_reconstructed(self) -> int:
        return self.pull.bytes_reconstructed

    @property
    def tensors_skipped(self) -> int:
        return self.pull.tensors_skipped

    @property
    def reseeds(self) -> int:
        return self.pull.reseeds

    @property
    def phase_seconds(self) -> dict[str, float]:
        """The pull's phases, and ``patches``: the rest of the stage (building the patches)."""
        return {**self.pull.phase_seconds, "patches": max(0.0, self.seconds - self.pull.seconds)}


@dataclass(frozen=True)
class CommitResult:
    """What one :meth:`LiveWeights.commit` did."""

    version: int
    """The version the live weights hold now."""
    seconds: float
    """Wall time of the commit (the pause), verification included."""
    tensors: int
    elements: int
    verified: str | None
    """``"patched"`` or ``"full"`` when that verification ran and passed, else None."""
    bytes_written: int = 0
    """Bytes written into the live weights (``loader=`` mode: handed to the loader)."""


class LiveWeights:
    """Keeps one process's model weights at a published version, element by element.

    ``model`` is an ``nn.Module`` (its ``state_dict(keep_vars=True)`` names) or a mapping of
    name to tensor, on any device and of any dtype; ``name_map`` (a dict or a function) maps
    checkpoint names to the target's. Every checkpoint tensor needs a target of the same byte
    size (else :class:`ConfigError`, naming it), unless ``loader`` is given: then ``model`` may
    be None and :meth:`commit` calls ``loader`` with the changed tensors instead of writing
    (the ``load_weights`` contract of vLLM and sglang; no rollback, the engine owns the copy).

    ``version`` is the version the live weights hold now (default: the local checkpoint's
    verified version, 0 without one); ``check=True`` compares the live weights once with the
    local checkpoint at that version (:class:`IntegrityError` naming a tensor that differs).
    ``local_checkpoint_dir``, ``source_dir``, ``base_dir`` and the keyword arguments after
    ``loader`` are :func:`~deltastore.pull.pull_weights`'s.
    """

    def __init__(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor] | None,
        local_checkpoint_dir: str | os.PathLike[str],
        source_dir: StoreSpec | Sequence[StoreSpec],
        base_dir: str | os.PathLike[str] | None = None,
        *,
        name_map: NameMap | None = None,
        version: int | None = None,
        check: bool = False,
        loader: Loader | None = None,
        storage_options: dict[str, Any] | None = None,
        pre_read: PreRead | None = None,
        trusted_keys: TrustedKeys | None = None,
        workers: int = 4,
        lock_timeout_s: float = 3600.0,
        progress: ProgressCallback | None = None,
    ) -> None:
        self._local = LocalCheckpoint(local_checkpoint_dir)
        self._base = os.fspath(base_dir) if base_dir is not None else None
        self._store = open_store(source_dir, storage_options)
        self._source = PullSource(self._store, pre_read)
        self._loader = loader
        self._pull_options: dict[str, Any] = {
            "pre_read": pre_read,
            "trusted_keys": trusted_keys,
            "workers": workers,
            "lock_timeout_s": lock_timeout_s,
            "progress": progress,
        }
        self._workers = workers
        self._lock_timeout_s = lock_timeout_s
        checkpoint, where = self._checkpoint_model()
        if loader is None:
            if model is None:
                raise ConfigError("LiveWeights needs the model's tensors, or a loader=")
            self._targets = resolve_targets(target_tensors(model), checkpoint, name_map, where)
        else:
            self._targets = {}
        self._pin = can_pin(self._targets.values())
        state = self._local.read_state() if self._local.read_pending() is None else None
        if version is None:
            version = state.version if state is not None else 0
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"version={version!r} is not a version number")
        self._version = version
        self._stream = state.stream_id if state is not None and state.version == version else None
        self._latest: object | None = None
        if check:
            self._check_live(state)

    @property
    def version(self) -> int:
        """The version the live weights hold."""
        return self._version

    @property
    def targets(self) -> Mapping[str, Target]:
        """Checkpoint name → where it lives in the model (empty in ``loader=`` mode)."""
        return self._targets

    def _checkpoint_model(self) -> tuple[dict[str, CheckpointTensor], str]:
        """The tensors the live weights hold: the local checkpoint's, else the base's."""
        for directory in (self._local.dir, self._base):
            if directory is None:
                continue
            try:
                return scan_checkpoint(directory), directory
            except ConfigError:
                continue
        raise ConfigError(
            f"neither the local checkpoint {self._local.dir} nor the base {self._base} holds a "
            "safetensors checkpoint; pass base_dir= (the model the engine loaded)"
        )

    def _check_live(self, state: AppliedState | None) -> None:
        if state is None or state.version != self._version:
            held = f"v{state.version:06d}" if state is not None else "no verified version"
            raise ConfigError(
                f"check=True compares the live weights with the local checkpoint at "
                f"v{self._version:06d}, but {self._local.dir} holds {held}; pull it first"
            )
        views = CheckpointViews()
        checkpoint = scan_checkpoint(self._local.dir)
        for name, target in self._targets.items():
            expected = torch.from_numpy(views.array(checkpoint[name]))
            live = target.bytes
            for start in range(0, live.numel(), CHECK_CHUNK):
                piece = live[start : start + CHECK_CHUNK]
                if not torch.equal(piece.cpu(), expected[start : start + CHECK_CHUNK]):
                    raise IntegrityError(
                        f"live tensor {target.target_name!r} differs from checkpoint tensor "
                        f"{name!r} at v{self._version:06d} in {self._local.dir}; load the "
                        "model from that checkpoint, or pass the version it holds"
                    )

    # ------------------------------------------------------------------ stage
    def stage(self, version: int | str = "latest") -> StagedUpdate:
        """Pull ``version`` (a number or ``"latest"``) into the local checkpoint and prepare
        the patches that bring the live weights there; the live weights are untouched.

        Run it while the engine serves (from a thread of its own: the pull and the patch
        building run on worker threads and release the GIL in their heavy parts). A stage
        supersedes any earlier one. Raises what the pull raises (the live weights and the
        local checkpoint stay as they were), :class:`OutOfOrderError` for a version older than
        the live one and :class:`StreamError` for a version of another stream, both before
        anything is read.
        """
        started = time.perf_counter()
        base, stream = self._version, self._stream
        target = self._source.resolve_target(version)
        self._refuse_foreign(base, stream, target)
        pulled = pull_weights(
            self._local.dir, self._store, target, self._base, **self._pull_options
        )
        with self._local.lock(self._lock_timeout_s):
            staged = self._prepare(base, stream, target, pulled, started)
        self._latest = staged.token
        log.info(
            "staged v%06d over v%06d: %d tensors, %d elements, %d bytes, %.3f s",
            target,
            base,
            staged.tensors,
            staged.elements,
            staged.bytes,
            staged.seconds,
        )
        return staged

    def _prepare(
        self, base: int, stream: str | None, target: int, pulled: PullResult, started: float
    ) -> StagedUpdate:
        """The patches (or loads) from ``base`` to ``target``, under the checkpoint's lock."""
        state = self._local.read_state()
        if state is None or state.version != target:
            raise ApplyError(
                f"{self._local.dir} does not hold v{target:06d} right after pulling it "
                "(another pull moved it); stage again"
            )
        checkpoint = scan_checkpoint(self._local.dir)
        views = CheckpointViews()
        history = self._history(base, stream, target)
        names = sorted(checkpoint if history is None else history)
        patches: list[TensorPatch] = []
        loads: list[tuple[str, torch.Tensor]] = []
        if self._loader is not None:
            loads = [(n, views.tensor(checkpoint[n])) for n in names]
        elif history is None:
            patches = whole_patches(names, checkpoint, self._targets, views, pin=self._pin)
        elif history:
            patches = delta_patches(
                self._store,
                history,
                checkpoint,
                self._targets,
                views,
                pin=self._pin,
                workers=self._workers,
            )
        return StagedUpdate(
            version=target,
            base_version=base,
            tensors=len(patches) + len(loads),
            elements=sum(p.elements for p in patches) + sum(t.numel() for _, t in loads),
            bytes=sum(p.nbytes for p in patches),
            seconds=time.perf_counter() - started,
            pull=pulled,
            whole=history is None or any(p.positions is None for p in patches),
            stream_id=state.stream_id,
            patches=tuple(patches),
            loads=tuple(loads),
            views=views,
            checkpoint=checkpoint,
            owner=self,
            token=object(),
        )

    def _refuse_foreign(self, base: int, stream: str | None, target: int) -> None:
        if target < base:
            raise OutOfOrderError(
                f"the live weights hold v{base:06d}; v{target:06d} is older. Stage a newer "
                "version, or reload the engine from a pull of the older one"
            )
        if target == base or target == 0 or stream is None:
            return
        self._store.refresh(target)
        theirs = self._store.index(target).stream_id
        if theirs != stream:
            raise StreamError(
                f"the live weights hold v{base:06d} of stream {stream}; v{target:06d} in "
                f"{self._store.url} is of stream {theirs}. To follow that stream, reload the "
                "engine from a pull of it and make a new LiveWeights"
            )

    def _history(
        self, base: int, stream: str | None, target: int
    ) -> dict[str, TensorHistory] | None:
        """What the deltas from ``base`` to ``target`` change, tensor by tensor; None when a
        full version lies on the way (then every tensor is written whole)."""
        if target == base:
            return {}
        chain = resolve_onto(self._store, target, AppliedState(base, stream))
        deltas = chain.deltas if chain.partial else chain.suffix_after(base)
        if deltas is None or (base > 0 and stream is not None and chain.stream_at(base) != stream):
            return None
        check_contiguous(deltas, base)
        return collect_history(self._store, deltas)

    # ------------------------------------------------------------------ commit
    def commit(self, staged: StagedUpdate, *, verify: str | None = "patched") -> CommitResult:
        """Write ``staged`` into the live weights (or hand it to the loader); call it in the
        engine's pause.

        Only the staged elements are written, a few vectorised calls per tensor on its own
        device. If anything fails part way (an exception from the device, a failed
        verification, an interrupt) the old values go back, the live weights are bit-exact at
        :attr:`version` (unchanged) and the error is raised. ``verify``: ``"patched"`` reads
        the written positions back, ``"full"`` hashes every committed tensor against the
        version's digests, None skips it. A stage that no longer applies (another commit or
        stage since, another ``LiveWeights``) raises :class:`OutOfOrderError` before any write.
        """
        started = time.perf_counter()
        if verify not in VERIFY_MODES:
            raise ConfigError(f"verify={verify!r}; use 'patched', 'full' or None")
        self._refuse_stale(staged)
        if self._loader is not None:
            if staged.loads:
                self._loader(iter(staged.loads))
            verified = None
        else:
            write_patches(
                staged.patches,
                self._targets,
                verify=verify,
                expected=lambda patch: _expected(staged, patch),
                version=staged.version,
                workers=self._workers,
            )
            verified = verify if staged.patches else None
        self._version, self._stream, self._latest = staged.version, staged.stream_id, None
        written = sum(t.numel() * t.element_size() for _, t in staged.loads) + sum(
            p.new.numel() * p.new.element_size() for p in staged.patches
        )
        return CommitResult(
            staged.version,
            time.perf_counter() - started,
            staged.tensors,
            staged.elements,
            verified,
            bytes_written=written,
        )

    def _refuse_stale(self, staged: StagedUpdate) -> None:
        if staged.owner is not self:
            raise OutOfOrderError(
                f"this v{staged.version:06d} was staged by another LiveWeights; stage it here"
            )
        if staged.base_version != self._version or staged.token is not self._latest:
            raise OutOfOrderError(
                f"stale stage: v{staged.version:06d} was staged over v{staged.base_version:06d}, "
                f"the live weights hold v{self._version:06d}"
                + ("" if staged.token is self._latest else " and a later stage superseded it")
                + "; stage again"
            )
        if staged.whole or staged.loads:  # they read the checkpoint's map at commit
            state = self._local.read_state()
            if state is None or state.version != staged.version:
                raise OutOfOrderError(
                    f"stale stage: v{staged.version:06d} reads {self._local.dir}, which no "
                    "longer holds it (another pull moved it); stage again"
                )


def _expected(staged: StagedUpdate, patch: TensorPatch) -> Digest:
    if patch.digest is not None:
        return patch.digest
    assert staged.views is not None
    return Digest.of(
        get_checksum(FALLBACK_CHECKSUM), staged.views.array(staged.checkpoint[patch.name])
    )


__all__ = ["CommitResult", "LiveWeights", "StagedUpdate"]

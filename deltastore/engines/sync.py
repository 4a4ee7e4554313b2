"""``EngineSync``: the trainer brings one inference engine (all its hosts) to a published
version through the engine's own HTTP interface.

Every sync runs the same four steps, in this order, and times each:

1. **pull** (the engine serves on): every host brings its host-local checkpoint to the version,
   verified. vLLM: the ``deltastore`` weight-transfer backend stages the version in each worker
   (``/update_weights`` with ``phase: "stage"``). sglang: the engine's own ``/pull_weights``
   (it fans out to every host), or one ``deltastore serve`` per host.
2. **pause**: vLLM ``/pause``; sglang ``/pause_generation`` then ``/flush_cache``.
3. **reload**: vLLM ``/update_weights`` with ``phase: "commit"`` (the changed tensors into the
   engine's ``load_weights``); sglang ``/update_weights_from_disk`` of the local checkpoint.
4. **resume**: vLLM ``/resume``; sglang ``/continue_generation``.

A failed pull never pauses the engine. A version that changes nothing (every delta on the way
from the engine's version lists no tensor: read from the store's indexes) skips steps 2 to 4.
A failed reload is retried once from the verified checkpoint (vLLM: ``phase: "reload"`` loads
every tensor of it; sglang: the hosts' checkpoints are pulled, i.e. verified, again and loaded
again); if that fails too the engine is **left paused** and :class:`EngineLeftPausedError` says
so: it is never resumed on partly updated weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from deltastore.engines.drivers import Driver, SglangDriver, VllmDriver
from deltastore.errors import ConfigError, EngineLeftPausedError, EngineSyncError
from deltastore.pull.client import EndpointReply
from deltastore.pull.source import open_store
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.engines")

ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class Changes:
    """What the versions from the engine's version to the target change (from the indexes)."""

    changed: bool
    """False only when every version on the way is a delta listing no tensor."""
    tensors: int = 0
    """Distinct tensors the deltas on the way change."""
    changed_bytes: int = 0
    wire_bytes: int = 0
    """Payload bytes of the versions on the way (what a host catching up reads)."""


def changes_between(store: VersionStore, held: int | None, target: int) -> Changes:
    """Walk ``target``'s ``base_version`` links back to ``held``, summing what they change.

    Anything that is not a plain run of deltas from ``held`` (unknown ``held``, a full version,
    a link that skips past ``held``, a backward target) counts as changed.
    """
    if held == target:
        return Changes(False)
    names: set[str] = set()
    changed_bytes = wire = 0
    linear = held is not None and target > held
    version: int | None = target
    while linear and version is not None and held is not None and version > held:
        index = store.index(version)
        names |= set(index.weight_map)
        changed_bytes += int(index.totals.get("changed_bytes", 0))
        wire += int(index.totals.get("wire_bytes", 0))
        linear = index.is_delta
        version = index.base_version
    linear = linear and version == held
    return Changes(not linear or bool(names), len(names), changed_bytes, wire)


@dataclass(frozen=True)
class SyncResult:
    """What one :meth:`EngineSync.sync` did, with the time of each step (seconds)."""

    version: int
    engine: str
    changed: bool
    """False: nothing changed, so the engine was neither paused nor reloaded."""
    pull_s: float = 0.0
    pause_s: float = 0.0
    """The pause call (sglang: with the cache flush)."""
    reload_s: float = 0.0
    """The reload or apply in the pause (with the retry, if there was one)."""
    resume_s: float = 0.0
    total_s: float = 0.0
    retried: bool = False
    """The first reload failed and the retry from the verified checkpoint succeeded."""
    tensors_changed: int = 0
    changed_bytes: int = 0
    wire_bytes: int = 0
    """Payload bytes of the versions each host read (from the store's index totals)."""
    hosts: tuple[EndpointReply, ...] = ()
    """Each host's pull reply (sglang); vLLM workers answer as one engine."""

    @property
    def paused_s(self) -> float:
        """How long generation was paused (pause + reload + resume)."""
        return self.pause_s + self.reload_s + self.resume_s

    def metrics(self) -> dict[str, float]:
        """The figures as :meth:`EngineSync.pop_metrics` reports them."""
        return {
            "pull_s": self.pull_s,
            "pause_s": self.pause_s,
            "reload_s": self.reload_s,
            "resume_s": self.resume_s,
            "paused_s": self.paused_s,
            "sync_s": self.total_s,
            "tensors_changed": self.tensors_changed,
            "changed_bytes": self.changed_bytes,
            "wire_bytes": self.wire_bytes,
        }


@dataclass
class _Tally:
    """What :meth:`EngineSync.pop_metrics` sums until it is called."""

    figures: dict[str, float] = field(default_factory=dict)
    syncs: int = 0
    skipped: int = 0
    retries: int = 0
    failed: int = 0
    version: int | None = None


class EngineSync:
    """Keep one engine at the trainer's versions through its HTTP interface.

    ``engine`` is ``"vllm"`` (started with ``--weight-transfer-config '{"backend":
    "deltastore"}'``) or ``"sglang"``; ``url`` is the engine's HTTP server. ``source_dir`` is
    the store as the engine hosts read it; ``store`` is the same store as this process reads
    it (default: ``source_dir``), used to tell versions that change nothing.
    ``local_checkpoint_dir`` is the host-local checkpoint on every engine host (with
    ``serve_urls``, a mapping serve URL → path when the pullers see it under different paths);
    ``engine_checkpoint_dir`` is that checkpoint as the engine names it, when it differs (a
    ``deltastore serve`` in another container that mounts it elsewhere).

    vLLM: ``base_dir`` (default: the engine's model path), ``storage_options``,
    ``trusted_keys`` (key file paths on the engine hosts) and ``engine_version`` go to the
    backend's init info once. sglang: ``serve_urls`` (one ``deltastore serve`` per host) pulls
    through those instead of the engine's ``/pull_weights``; ``serve_token`` is their bearer
    token. ``engine_token`` is sent as ``Authorization: Bearer`` to the engine (its API key).

    ``engine_version`` is the version the engine's weights hold now: 0 when it serves the
    base, None when unknown (e.g. vLLM's ``--load-format dummy``): the first sync then
    reloads every tensor. ``pause_mode`` is passed to the engine's pause (vLLM: ``abort``,
    ``wait`` or ``keep``; sglang: ``abort``, ``retract`` or ``in_place``; None: its default).
    """

    def __init__(
        self,
        engine: str,
        url: str,
        source_dir: str | Sequence[str],
        local_checkpoint_dir: str | Mapping[str, str],
        *,
        engine_checkpoint_dir: str | None = None,
        store: str | VersionStore | Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        base_dir: str | None = None,
        trusted_keys: Sequence[str] | None = None,
        serve_urls: Sequence[str] | None = None,
        serve_token: str | None = None,
        engine_token: str | None = None,
        engine_version: int | None = 0,
        pause_mode: str | None = None,
        timeout_s: float = 3600.0,
    ) -> None:
        if engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, not {engine!r}")
        if serve_urls is not None and engine != "sglang":
            raise ConfigError("serve_urls is for engine='sglang' (vLLM pulls in its backend)")
        if serve_urls is not None and not serve_urls:
            raise ConfigError("serve_urls is empty; give one deltastore serve URL per host")
        if not local_checkpoint_dir:
            raise ConfigError("local_checkpoint_dir is empty: the host-local checkpoint path")
        if not isinstance(local_checkpoint_dir, str) and serve_urls is None:
            raise ConfigError("a local_checkpoint_dir per host needs serve_urls (its keys)")
        engine_dir = engine_checkpoint_dir or local_checkpoint_dir
        if not isinstance(engine_dir, str):
            raise ConfigError(
                "with a local_checkpoint_dir per serve URL, pass engine_checkpoint_dir: the "
                "local checkpoint's path as the engine's hosts see it"
            )
        self.engine = engine
        self.url = url
        self.store = open_store(store if store is not None else source_dir, storage_options)
        self._version = engine_version
        self._tally = _Tally()
        sources = source_dir if isinstance(source_dir, str) else list(source_dir)
        self.driver: Driver
        if engine == "vllm":
            init_info: dict[str, Any] = {
                "source_dir": sources,
                "local_checkpoint_dir": engine_dir,
                "base_dir": base_dir,
                "storage_options": storage_options,
                "trusted_keys": list(trusted_keys) if trusted_keys is not None else None,
                "engine_version": engine_version,
            }
            self.driver = VllmDriver(url, init_info, engine_token, pause_mode, timeout_s)
        else:
            self.driver = SglangDriver(
                url,
                sources,
                engine_dir,
                engine_token,
                pause_mode,
                timeout_s,
                serve_urls=list(serve_urls) if serve_urls is not None else None,
                serve_dirs=local_checkpoint_dir,
                serve_token=serve_token,
            )

    @property
    def version(self) -> int | None:
        """The version the engine's weights hold, as far as this object knows."""
        return self._version

    def sync(self, version: int | str) -> SyncResult:
        """Bring the engine to ``version`` (a number or ``"latest"``); see the module doc.

        Raises :class:`EngineSyncError` naming the step that failed and the engine's state
        (:class:`EngineLeftPausedError` when it is left paused).
        """
        target = self._resolve(version)
        try:
            result = self._sync(target)
        except EngineSyncError:
            self._tally.failed += 1
            raise
        self._count(result)
        return result

    def _resolve(self, version: int | str) -> int:
        if version == "latest":
            self.store.refresh()
            return self.store.latest()
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"version must be a number >= 0 or 'latest', not {version!r}")
        return version

    def _sync(self, target: int) -> SyncResult:
        started = time.perf_counter()
        held = self._version
        where = f"{self.engine} engine {self.url}"
        self.store.refresh(target if target > 0 else None)
        changes = changes_between(self.store, held, target)
        try:
            hosts = self.driver.pull(target)
        except EngineSyncError as exc:
            raise EngineSyncError(
                f"{where}: the pull of v{target:06d} failed, so the engine was not paused and "
                f"still serves {_shown(held)}: {exc}"
            ) from None
        pulled = time.perf_counter()
        figures = SyncResult(
            target,
            self.engine,
            changes.changed,
            tensors_changed=changes.tensors,
            changed_bytes=changes.changed_bytes,
            wire_bytes=changes.wire_bytes,
            hosts=tuple(hosts),
        )
        if not changes.changed:
            self._version = target
            log.info("%s: v%06d changes nothing; not paused", where, target)
            return replace(figures, pull_s=pulled - started, total_s=pulled - started)
        try:
            self.driver.pause()
        except EngineSyncError as exc:
            raise EngineSyncError(
                f"{where}: pausing for v{target:06d} failed; nothing was reloaded and the "
                f"engine holds {_shown(held)}: {exc}"
            ) from None
        paused = time.perf_counter()
        retried = self._reload(target, where)
        reloaded = time.perf_counter()
        self._version = target
        try:
            self.driver.resume()
        except EngineSyncError as exc:
            raise EngineSyncError(
                f"{where}: v{target:06d} is loaded but resuming failed; the engine is paused: "
                f"resume it by hand: {exc}"
            ) from None
        done = time.perf_counter()
        return replace(
            figures,
            pull_s=pulled - started,
            pause_s=paused - pulled,
            reload_s=reloaded - paused,
            resume_s=done - reloaded,
            total_s=done - started,
            retried=retried,
        )

    def _reload(self, target: int, where: str) -> bool:
        """Reload in the pause; once more from the verified checkpoint if that fails.

        Returns whether the retry was needed; raises :class:`EngineLeftPausedError`."""
        try:
            self.driver.reload(target, retry=False)
            return False
        except EngineSyncError as first:
            log.warning("%s: reloading v%06d failed (%s); retrying once", where, target, first)
            try:
                self.driver.reload(target, retry=True)
            except EngineSyncError as second:
                self._version = None  # partly loaded: unknown until a reload succeeds
                raise EngineLeftPausedError(
                    f"{where}: reloading v{target:06d} failed ({first}) and so did the retry "
                    f"from the verified checkpoint ({second}); the engine is LEFT PAUSED, not "
                    "resumed on partly updated weights: fix the engine and sync again (the "
                    "next sync reloads every tensor), or restart it from the local checkpoint"
                ) from None
            return True

    def _count(self, result: SyncResult) -> None:
        tally = self._tally
        tally.syncs += 1
        tally.skipped += int(not result.changed)
        tally.retries += int(result.retried)
        tally.version = result.version
        for key, value in result.metrics().items():
            tally.figures[key] = tally.figures.get(key, 0.0) + value

    def pop_metrics(self) -> dict[str, float]:
        """The figures of the syncs since the last call, summed, then cleared.

        Keys: ``version`` (the last one), ``syncs``, ``skipped`` (changed nothing),
        ``retries``, ``failed``, and the sums of ``pull_s``, ``pause_s``, ``reload_s``,
        ``resume_s``, ``paused_s``, ``sync_s``, ``tensors_changed``, ``changed_bytes``,
        ``wire_bytes`` (the names ``deltastore serve`` uses at ``GET /metrics`` and the
        publisher in its own ``pop_metrics``, where the quantity is the same).
        """
        tally, self._tally = self._tally, _Tally()
        out: dict[str, float] = dict(tally.figures)
        out.update(syncs=tally.syncs, skipped=tally.skipped, retries=tally.retries)
        out["failed"] = tally.failed
        if tally.version is not None:
            out["version"] = tally.version
        return out


def _shown(version: int | None) -> str:
    return f"v{version:06d}" if version is not None else "an unknown version"


__all__ = ["ENGINES", "Changes", "EngineSync", "SyncResult", "changes_between"]

"""The ``deltastore`` weight-transfer backend for vLLM.

An engine host needs only ``pip install deltastore`` and
``vllm serve MODEL --weight-transfer-config '{"backend": "deltastore"}'``: vLLM loads the
``vllm.general_plugins`` entry point :func:`register` in every process, which registers
``DeltastoreWeightTransferEngine`` with vLLM's ``WeightTransferEngineFactory`` under the name
``deltastore``. vLLM then creates one per worker, with the worker's model.

The logic lives in :class:`DeltastoreReceiver`, which imports no vLLM (it is tested with a
real ``transformers`` model and a ``load_weights`` of vLLM's contract); the vLLM subclass is a
thin shell built on first use (so importing this module never needs vLLM).

What the trainer sends (``EngineSync(engine="vllm")`` does it):

- ``/init_weight_transfer_engine {"init_info": {...}}`` once: :class:`DeltastoreInitInfo`.
- ``/update_weights {"update_info": {"version": N, "phase": ...}}`` inside
  ``/start_weight_update`` … ``/finish_weight_update``, :class:`DeltastoreUpdateInfo`:
  ``"stage"`` before the pause (pull into the host-local checkpoint and prepare: the served
  weights are untouched; a version that changes nothing is committed at once, as it writes
  nothing), ``"commit"`` in the pause (the changed tensors into vLLM's ``load_weights``),
  ``"reload"`` (every tensor of the verified local checkpoint, the retry after a failed
  commit, or the first load of an engine whose weights are unknown).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from safetensors import safe_open

from deltastore.engines.live import LiveWeights, StagedUpdate
from deltastore.errors import ApplyError, ConfigError
from deltastore.format.checkpoint import checkpoint_files
from deltastore.pull import pull_weights

log = logging.getLogger("deltastore.engines.vllm")

BACKEND = "deltastore"
"""The name in ``--weight-transfer-config '{"backend": "deltastore"}'``."""
PHASES = ("stage", "commit", "reload")


@dataclass
class DeltastoreInitInfo:
    """``init_info`` of ``/init_weight_transfer_engine`` (JSON object keys)."""

    source_dir: str | list[str]
    """The store as the engine hosts read it (a list: copies of one run, nearest first)."""
    local_checkpoint_dir: str
    """The host-local checkpoint (same path on every host; workers of a host share it)."""
    base_dir: str | None = None
    """Version 0: the model vLLM was started with (default: its model path when that is a
    local directory)."""
    storage_options: dict[str, Any] | None = None
    trusted_keys: list[str] | None = None
    """Public key files on the engine hosts; versions must be signed by one of them."""
    engine_version: int | None = 0
    """The version the served weights hold: 0 for the base as loaded, None when unknown
    (``--load-format dummy``): the first update then loads every tensor."""


@dataclass
class DeltastoreUpdateInfo:
    """``update_info`` of ``/update_weights``."""

    version: int | str
    """The target version (or ``"latest"``)."""
    phase: str = "commit"
    """``stage``, ``commit`` or ``reload`` (see the module doc)."""


def _parse(cls: type[Any], raw: Mapping[str, Any], what: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{what} must be a JSON object, not {type(raw).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{what}: unknown key(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**raw)
    except TypeError as exc:
        raise ConfigError(f"{what}: {exc}") from None


class DeltastoreReceiver:
    """One worker's side of the backend: stage, commit or reload a version into ``model``.

    ``model`` is anything with vLLM's ``load_weights(iterable of (checkpoint_name, tensor))``
    (it may fuse q/k/v or shard for tensor parallelism: the checkpoint's names go in).
    ``default_base_dir`` is used when the init info names no base. The method names and
    arguments are those of vLLM's ``WeightTransferEngine``.
    """

    init_info_cls = DeltastoreInitInfo
    update_info_cls = DeltastoreUpdateInfo

    def __init__(self, model: Any, *, default_base_dir: str | None = None, workers: int = 4):
        self.model = model
        self.default_base_dir = default_base_dir
        self.workers = workers
        self.info: DeltastoreInitInfo | None = None
        self.live: LiveWeights | None = None
        self.staged: StagedUpdate | None = None
        self.known: int | None = None
        """The version the model's weights hold; None: unknown (not loaded, or a load
        failed part way)."""

    # -- vLLM's WeightTransferEngine methods ---------------------------------------------
    def parse_init_info(self, init_dict: Mapping[str, Any]) -> DeltastoreInitInfo:
        info: DeltastoreInitInfo = _parse(DeltastoreInitInfo, init_dict, "init_info")
        if not info.local_checkpoint_dir or not info.source_dir:
            raise ConfigError("init_info needs 'source_dir' and 'local_checkpoint_dir'")
        version = info.engine_version
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ConfigError(f"init_info: engine_version {version!r} is not a version or null")
        return info

    def parse_update_info(self, update_dict: Mapping[str, Any]) -> DeltastoreUpdateInfo:
        info: DeltastoreUpdateInfo = _parse(DeltastoreUpdateInfo, update_dict, "update_info")
        if info.phase not in PHASES:
            raise ConfigError(f"update_info: phase {info.phase!r} is not one of {PHASES}")
        ok = info.version == "latest" or (
            isinstance(info.version, int) and not isinstance(info.version, bool)
        )
        if not ok or (isinstance(info.version, int) and info.version < 0):
            raise ConfigError(f"update_info: version {info.version!r} is not N or 'latest'")
        return info

    def init_transfer_engine(self, init_info: DeltastoreInitInfo) -> None:
        """Record where versions come from. A second init (a restarted trainer) with the same
        checkpoint keeps what this worker knows it holds."""
        same = self.info is not None and (
            self.info.local_checkpoint_dir == init_info.local_checkpoint_dir
            and self.info.source_dir == init_info.source_dir
        )
        self.info = init_info
        if not same:
            self.live, self.staged = None, None
            self.known = init_info.engine_version

    def start_weight_update(self) -> None:
        """Nothing to prepare: the changed tensors go straight into ``load_weights``."""

    def finish_weight_update(self) -> None:
        """Nothing to finish (no layerwise reload; see docs/engines.md for quantized models)."""

    def update_weights(self, update_info: Mapping[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DeltastoreUpdateInfo) -> None:
        if self.info is None:
            raise ConfigError(
                "the deltastore backend has no init info: POST /init_weight_transfer_engine first"
            )
        if update_info.phase == "stage":
            self.stage(update_info.version)
        elif update_info.phase == "commit":
            self.commit(update_info.version)
        else:
            self.reload(update_info.version)

    def shutdown(self) -> None:
        self.live, self.staged = None, None

    # -- the logic -------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The version this worker's weights hold; None when unknown."""
        return self.known

    def _base(self) -> str | None:
        assert self.info is not None
        return self.info.base_dir or self.default_base_dir

    def _live(self, version: int) -> LiveWeights:
        assert self.info is not None
        if self.live is None or self.live.version != version:
            self.live = LiveWeights(
                None,
                self.info.local_checkpoint_dir,
                self.info.source_dir,
                self._base(),
                version=version,
                loader=self._load,
                storage_options=self.info.storage_options,
                trusted_keys=self.info.trusted_keys,
                workers=self.workers,
            )
        return self.live

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(weights)

    def stage(self, version: int | str) -> StagedUpdate | None:
        """Pull ``version`` and prepare it; the served weights are untouched (a version that
        changes nothing is committed here: it writes nothing). Returns None when the weights
        are unknown: the pull ran, and :meth:`commit` loads every tensor."""
        if self.known is None:
            self._pull(version)
            self.staged = None
            return None
        staged = self._live(self.known).stage(version)
        self.staged = staged
        if staged.tensors == 0:
            self._commit_staged(staged)
        return staged

    def commit(self, version: int | str) -> None:
        """In the pause: hand the staged changed tensors of ``version`` to ``load_weights``
        (staging it first if that was not done); all of them when the weights are unknown."""
        if self.known is None:
            self.reload(version)
            return
        staged = self.staged
        if staged is None or (version != "latest" and staged.version != version):
            log.warning("v%s was not staged before the pause; staging it now", version)
            staged = self.stage(version)
        if staged is not None and self.known != staged.version:
            self._commit_staged(staged)

    def _commit_staged(self, staged: StagedUpdate) -> None:
        live = self.live
        assert live is not None  # the LiveWeights that staged it
        try:
            live.commit(staged)
        except Exception as exc:
            self.known, self.live, self.staged = None, None, None
            raise ApplyError(
                f"loading v{staged.version:06d} into the engine failed part way ({exc!r}); "
                "its weights are partly updated: reload the verified checkpoint (update_info "
                f'{{"version": {staged.version}, "phase": "reload"}})'
            ) from exc
        self.known, self.staged = staged.version, None

    def reload(self, version: int | str) -> None:
        """Load every tensor of the verified local checkpoint at ``version``."""
        assert self.info is not None
        target = self._pull(version)
        self.known, self.live, self.staged = None, None, None
        try:
            self._load(_checkpoint_tensors(self.info.local_checkpoint_dir))
        except Exception as exc:
            raise ApplyError(
                f"reloading v{target:06d} from {self.info.local_checkpoint_dir} failed ({exc!r})"
            ) from exc
        self.known = target

    def _pull(self, version: int | str) -> int:
        assert self.info is not None
        result = pull_weights(
            self.info.local_checkpoint_dir,
            self.info.source_dir,
            version,
            self._base(),
            storage_options=self.info.storage_options,
            trusted_keys=self.info.trusted_keys,
            workers=self.workers,
        )
        return result.version


def _checkpoint_tensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint, one file open at a time."""
    for file in checkpoint_files(directory):
        with safe_open(file, framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, fh.get_tensor(name)


def _model_dir(vllm_config: Any) -> str | None:
    """vLLM's model path, when it is a local directory (a hub id is not a base dir)."""
    path = getattr(getattr(vllm_config, "model_config", None), "model", None)
    return path if isinstance(path, str) and os.path.isdir(path) else None


@functools.cache
def engine_class() -> type:
    """The vLLM ``WeightTransferEngine`` subclass (imports vLLM)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class DeltastoreWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]
        """vLLM's face of :class:`DeltastoreReceiver` (one per worker)."""

        init_info_cls = DeltastoreInitInfo
        update_info_cls = DeltastoreUpdateInfo

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            super().__init__(config, vllm_config, device, model)
            self.receiver = DeltastoreReceiver(model, default_base_dir=_model_dir(vllm_config))

        def parse_init_info(self, init_dict: dict[str, Any]) -> DeltastoreInitInfo:
            return self.receiver.parse_init_info(init_dict)

        def parse_update_info(self, update_dict: dict[str, Any]) -> DeltastoreUpdateInfo:
            return self.receiver.parse_update_info(update_dict)

        def init_transfer_engine(self, init_info: DeltastoreInitInfo) -> None:
            self.receiver.init_transfer_engine(init_info)

        def start_weight_update(self) -> None:
            self.receiver.start_weight_update()

        def finish_weight_update(self) -> None:
            self.receiver.finish_weight_update()

        def receive_weights(self, update_info: DeltastoreUpdateInfo) -> None:
            self.receiver.model = self.model  # vLLM may retarget (a draft model)
            self.receiver.receive_weights(update_info)

        def shutdown(self) -> None:
            self.receiver.shutdown()

    DeltastoreWeightTransferEngine.__module__ = __name__
    return DeltastoreWeightTransferEngine


def __getattr__(name: str) -> Any:
    # vLLM's factory loads the class by module path and name: build it then, not at import.
    if name == "DeltastoreWeightTransferEngine":
        return engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the backend (idempotent: vLLM may
    load plugins several times per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, __name__, "DeltastoreWeightTransferEngine"
        )


__all__ = [
    "BACKEND",
    "DeltastoreInitInfo",
    "DeltastoreReceiver",
    "DeltastoreUpdateInfo",
    "engine_class",
    "register",
]

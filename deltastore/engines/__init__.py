"""A published version into a running engine.

:class:`LiveWeights` keeps one process's model at a version: :meth:`~LiveWeights.stage` pulls
and prepares while the engine serves, :meth:`~LiveWeights.commit` writes only the changed
elements in the pause, transactionally (or hands the changed tensors to the engine's own
``loader=``). Modules: ``live`` (the API), ``patches`` (stage: positions and values from the
chain's payloads), ``commit`` (the writes, verification, rollback), ``targets`` (the model's
tensors by checkpoint name, zero-copy checkpoint views).

:class:`EngineSync` is the trainer's side: it brings a vLLM or sglang engine to a version over
the engine's own HTTP interface (``sync``; the calls per engine in ``drivers``). ``vllm`` is
the ``deltastore`` weight-transfer backend vLLM loads by its plugin entry point.
"""

from deltastore.engines.live import CommitResult, LiveWeights, StagedUpdate
from deltastore.engines.sync import EngineSync, SyncResult

__all__ = ["CommitResult", "EngineSync", "LiveWeights", "StagedUpdate", "SyncResult"]

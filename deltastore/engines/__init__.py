"""A published version into a running engine.

:class:`LiveWeights` keeps one process's model at a version: :meth:`~LiveWeights.stage` pulls
and prepares while the engine serves, :meth:`~LiveWeights.commit` writes only the changed
elements in the pause, transactionally (or hands the changed tensors to the engine's own
``loader=``). Modules: ``live`` (the API), ``patches`` (stage: positions and values from the
chain's payloads), ``commit`` (the writes, verification, rollback), ``targets`` (the model's
tensors by checkpoint name, zero-copy checkpoint views).
"""

from deltastore.engines.live import CommitResult, LiveWeights, StagedUpdate

__all__ = ["CommitResult", "LiveWeights", "StagedUpdate"]

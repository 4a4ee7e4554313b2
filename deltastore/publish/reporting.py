"""Byte progress of a publish: what the ``diff`` and ``write`` phases count, and their totals.

``diff`` counts the model bytes passed to ``publish()`` as the pipeline takes them (its
backpressure keeps that within the in-flight budget of what is encoded); its total is the
whole model, and tensors not passed count as done when the diff ends (they are unchanged).
``write`` counts the payload bytes (delta) or tensor bytes (full) this rank writes into its
shards; shard headers are not counted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from deltastore.progress import ProgressCallback, ProgressMeter
from deltastore.publish.diff import NamedTensors, named_pairs
from deltastore.publish.messages import ShardJob
from deltastore.publish.rank_state import Encoded
from deltastore.publish.snapshot import Snapshot, TensorSource


def counted(
    named_tensors: NamedTensors, snapshot: Snapshot, progress: ProgressCallback | None
) -> NamedTensors:
    """``named_tensors``, reported as phase ``diff``: each tensor's size counted once the
    pipeline has taken it; once it has taken them all, the rest of the model counts as done."""
    if progress is None:
        return named_tensors

    def pairs() -> Iterator[tuple[str, object]]:
        meter = ProgressMeter.start(progress, "diff", snapshot.total_bytes)
        assert meter is not None
        for name, tensor in named_pairs(named_tensors):
            yield name, tensor
            source = snapshot.sources.get(name)
            meter.advance(0 if source is None else source.nbytes)
        meter.finish(complete=True)

    return pairs()


def write_meter(
    progress: ProgressCallback | None,
    jobs: Sequence[ShardJob],
    full: bool,
    encoded: Mapping[str, Encoded],
    sources: Mapping[str, TensorSource],
) -> ProgressMeter | None:
    """The ``write`` phase's meter: its total is what this rank's shards hold."""
    if progress is None:
        return None
    names = [name for job in jobs for name in job.names]
    if full:
        total = sum(sources[name].nbytes for name in names)
    else:
        total = sum(encoded[name].length for name in names)
    return ProgressMeter.start(progress, "write", total)

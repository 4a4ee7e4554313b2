"""Grouping a run's changed tensors into windows read with few requests, and into tasks.

A delta is about 1 % of the model, so its payloads are read in long ranges, not one request
each: the changed tensors are ordered by where their first payload lies, cut into windows of
about :data:`WINDOW_BYTES` compressed bytes, and each window's payloads in one shard are read
as one ranged request per run of nearby payloads (gaps up to :data:`MAX_GAP` are read and
dropped). A one-step pull whose delta shards are under a window each thus costs one request
per shard, whatever its tensor count. Each window is then cut into tasks of about
:data:`TASK_BYTES` of model bytes, so a thread pool shares thousands of small tensors in a few
dozen tasks instead of one task each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deltastore.pull.history import TensorHistory

WINDOW_BYTES = 32 * 1024**2
"""Compressed payload bytes one window reads at most (one tensor's own payloads excepted)."""
MAX_GAP = 1024**2
"""Bytes between two payloads of a shard that are read (and dropped) to save a request."""
TASK_BYTES = 8 * 1024**2
"""Model bytes one apply task covers at most (a larger tensor is a task of its own)."""


@dataclass(frozen=True)
class Span:
    """One ranged read: bytes ``[start, end)`` of a shard of a version."""

    version: int
    shard: str
    start: int
    end: int


@dataclass(frozen=True)
class Window:
    """Tensors whose payloads are read together, and the reads that fetch them.

    ``where[i][j]`` is ``(span index, start, end)`` of tensor ``i``'s ``j``-th payload inside
    that span's bytes.
    """

    tensors: tuple[TensorHistory, ...]
    spans: tuple[Span, ...]
    where: tuple[tuple[tuple[int, int, int], ...], ...]

    @property
    def wire_bytes(self) -> int:
        """Bytes this window's reads move."""
        return sum(s.end - s.start for s in self.spans)

    def frames(self, data: Sequence[bytes]) -> list[list[memoryview]]:
        """Each tensor's compressed frames, as views into the spans' bytes (``data``)."""
        views = [memoryview(d) for d in data]
        return [[views[s][a:b] for s, a, b in loc] for loc in self.where]


def _first_payload(tensor: TensorHistory) -> tuple[int, str, int]:
    first = tensor.payloads[0]
    return first.version, first.shard, first.start


def plan_windows(
    tensors: Sequence[TensorHistory],
    *,
    window_bytes: int = WINDOW_BYTES,
    max_gap: int = MAX_GAP,
) -> list[Window]:
    """``tensors`` (each with at least one payload) cut into windows, in file order."""
    ordered = sorted(tensors, key=_first_payload)
    windows: list[Window] = []
    batch: list[TensorHistory] = []
    size = 0
    for tensor in ordered:
        batch.append(tensor)
        size += sum(p.size for p in tensor.payloads)
        if size >= window_bytes:
            windows.append(_window(batch, max_gap, window_bytes))
            batch, size = [], 0
    if batch:
        windows.append(_window(batch, max_gap, window_bytes))
    return windows


def _window(tensors: list[TensorHistory], max_gap: int, window_bytes: int) -> Window:
    """The spans covering ``tensors``' payloads: one per run of payloads of a shard that lie
    within ``max_gap`` of each other (and span at most twice ``window_bytes``)."""
    refs = sorted(
        (p.version, p.shard, p.start, p.end, i, j)
        for i, tensor in enumerate(tensors)
        for j, p in enumerate(tensor.payloads)
    )
    where: list[list[tuple[int, int, int]]] = [[(0, 0, 0)] * len(t.payloads) for t in tensors]
    spans: list[Span] = []
    first = 0  # index in refs of the open span's first payload
    while first < len(refs):
        version, shard, begin, end = refs[first][:4]
        last = first + 1
        while last < len(refs):
            v, s, start, stop = refs[last][:4]
            if (
                v != version
                or s != shard
                or start - end > max_gap
                or stop - begin > 2 * window_bytes
            ):
                break
            end = max(end, stop)
            last += 1
        for _, _, start, stop, i, j in refs[first:last]:
            where[i][j] = (len(spans), start - begin, stop - begin)
        spans.append(Span(version, shard, begin, end))
        first = last
    return Window(tuple(tensors), tuple(spans), tuple(tuple(w) for w in where))


def read_window(window: Window, read: Callable[[Span], bytes]) -> list[bytes]:
    """Each span's bytes, one ``read`` (ranged request) per span, in order."""
    return [read(span) for span in window.spans]


def tasks_of(sizes: Sequence[int], task_bytes: int = TASK_BYTES) -> list[range]:
    """Indexes of ``sizes`` (model bytes per tensor) cut into consecutive runs of about
    ``task_bytes`` bytes each."""
    runs: list[range] = []
    count = len(sizes)
    begin, size = 0, 0
    for i in range(count):
        size += sizes[i]
        if size >= task_bytes:
            runs.append(range(begin, i + 1))
            begin, size = i + 1, 0
    if begin < count:
        runs.append(range(begin, count))
    return runs


__all__ = ["Span", "Window", "plan_windows", "read_window", "tasks_of"]

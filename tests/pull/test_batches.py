"""Windows and tasks of a pull: few reads for many payloads, every payload found again."""

from __future__ import annotations

from deltastore.codecs import Digest, get_checksum
from deltastore.format.payload import PayloadRef
from deltastore.pull.apply import Span, plan_windows, tasks_of
from deltastore.pull.chain import TensorHistory

_DIGEST = Digest(get_checksum("xxh3-128"), "0" * 32)


def _tensor(name: str, *payloads: tuple[int, str, int, int]) -> TensorHistory:
    tensor = TensorHistory(name)
    for version, shard, start, end in payloads:
        tensor.payloads.append(PayloadRef(version, shard, start, end, "xor"))
        tensor.digests[version] = _DIGEST
    return tensor


def _files() -> dict[tuple[int, str], bytes]:
    return {(v, s): bytes((v * 31 + i) % 251 for i in range(4096)) for v in (1, 2) for s in "ab"}


def _check_frames(windows, files) -> int:
    """Every payload's frame is exactly its bytes in its file; returns the reads made."""
    reads = 0
    for window in windows:

        def read(span: Span) -> bytes:
            nonlocal reads
            reads += 1
            return files[span.version, span.shard][span.start : span.end]

        frames = window.frames([read(span) for span in window.spans])
        for tensor, tensor_frames in zip(window.tensors, frames, strict=True):
            for payload, frame in zip(tensor.payloads, tensor_frames, strict=True):
                assert (
                    bytes(frame)
                    == files[payload.version, payload.shard][payload.start : payload.end]
                )
    return reads


def test_adjacent_payloads_of_a_shard_are_one_read() -> None:
    tensors = [_tensor(f"t{i}", (1, "a", 100 + 10 * i, 110 + 10 * i)) for i in range(50)]
    windows = plan_windows(tensors[::-1])  # any order in: file order out
    assert len(windows) == 1 and windows[0].spans == (Span(1, "a", 100, 600),)
    assert _check_frames(windows, _files()) == 1


def test_reads_are_per_shard_and_version_and_split_at_wide_gaps() -> None:
    tensors = [
        _tensor("x", (1, "a", 0, 10), (2, "b", 50, 60)),
        _tensor("y", (1, "a", 10, 30), (2, "b", 60, 70)),
        _tensor("z", (1, "b", 0, 5)),
        _tensor("far", (1, "a", 3000, 3100)),
    ]
    windows = plan_windows(tensors, max_gap=1000)
    spans = {s for w in windows for s in w.spans}
    assert spans == {
        Span(1, "a", 0, 30),
        Span(1, "a", 3000, 3100),
        Span(1, "b", 0, 5),
        Span(2, "b", 50, 70),
    }
    assert _check_frames(windows, _files()) == 4


def test_windows_are_cut_by_compressed_bytes() -> None:
    tensors = [_tensor(f"t{i:02d}", (1, "a", 100 * i, 100 * i + 100)) for i in range(30)]
    windows = plan_windows(tensors, window_bytes=1000)
    assert [len(w.tensors) for w in windows] == [10, 10, 10]
    assert all(sum(s.end - s.start for s in w.spans) == 1000 for w in windows)
    assert _check_frames(windows, _files()) == 3


def test_tasks_cover_every_tensor_once_in_runs_of_about_task_bytes() -> None:
    runs = tasks_of([4, 4, 4, 20, 1, 1], task_bytes=8)
    assert runs == [range(0, 2), range(2, 4), range(4, 6)]
    assert tasks_of([], task_bytes=8) == []

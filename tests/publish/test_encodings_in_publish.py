"""The publisher with deltastore's own encodings: the element size reaches the encoding from the
base checkpoint's header, ``auto`` and ``sparse-v2`` round-trip through a store, and small
tensors encoded several per pool task (with a tiny in-flight budget) neither hang nor mix up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import deltastore as ds
from deltastore.codecs import ENCODINGS, ByteArray, EncodedDelta, Encoding
from deltastore.codecs.sparse import CompactSparseEncoding
from tests.conftest import checkpoint_bytes, make_checkpoint, perturb, raw_bytes


class RecordingSparse(CompactSparseEncoding):
    """sparse-v2 under another name, encoding one tensor at a time and recording the element
    size it was given per call."""

    name = "test-recording-sparse"
    seen: list[int] = []
    encode_framed = Encoding.encode_framed

    def encode(self, old: ByteArray, new: ByteArray, *, itemsize: int = 1) -> EncodedDelta:
        type(self).seen.append(itemsize)
        return super().encode(old, new, itemsize=itemsize)


@pytest.fixture
def recording() -> Iterator[type[RecordingSparse]]:
    ENCODINGS[RecordingSparse.name] = RecordingSparse()
    RecordingSparse.seen = []
    try:
        yield RecordingSparse
    finally:
        del ENCODINGS[RecordingSparse.name]


def _publish_and_pull(
    tmp_path: Path, base_dir: Path, steps: list[dict[str, torch.Tensor]], **settings: object
) -> dict[str, bytes]:
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, **settings)  # type: ignore[arg-type]
    publisher.seed()
    for model in steps:
        version = publisher.publish(model).version
    host = tmp_path / "host"
    ds.pull_weights(host, store, version, base_dir=base_dir)
    return checkpoint_bytes(host)


def test_element_size_comes_from_the_base_header(
    tmp_path: Path, base_dir: Path, small_model: dict[str, torch.Tensor], recording: type
) -> None:
    # Every tensor of small_model, changed, so each is encoded: bf16 and fp16 are 2 bytes,
    # fp32 4, fp8 / int8 / bool 1.
    changed = {n: t.clone() for n, t in small_model.items()}
    for tensor in changed.values():
        if tensor.numel():
            tensor.reshape(-1).view(torch.uint8)[0] ^= 1
    expected = sorted(t.element_size() for t in small_model.values())
    pulled = _publish_and_pull(tmp_path, base_dir, [changed], encoding=recording.name)
    assert sorted(recording.seen) == expected
    assert pulled == {n: raw_bytes(t) for n, t in changed.items()}


@pytest.mark.parametrize("encoding", ["auto", "sparse-v2"])
def test_own_encodings_round_trip_through_a_store(
    tmp_path: Path, base_dir: Path, small_model: dict[str, torch.Tensor], encoding: str
) -> None:
    steps = [perturb(small_model, step) for step in range(1, 4)]
    pulled = _publish_and_pull(tmp_path, base_dir, steps, encoding=encoding)
    assert pulled == {n: raw_bytes(t) for n, t in steps[-1].items()}


def test_many_small_tensors_in_batches_under_a_tiny_budget(tmp_path: Path) -> None:
    # 600 tensors of 2 KB with a 64 KB in-flight budget copied through the stager: batches must
    # be cut before they hold the budget the next tensor needs.
    g = torch.Generator().manual_seed(3)
    model = {f"experts.{i}.w": torch.randn(1024, generator=g).bfloat16() for i in range(600)}
    base_dir = make_checkpoint(tmp_path / "base", model, shards=2)
    after = {n: t.clone() for n, t in model.items()}
    for i, tensor in enumerate(after.values()):
        if i % 3 == 0:
            tensor[i % 1024] += 1.0
    pulled = _publish_and_pull(
        tmp_path,
        base_dir,
        [after],
        encoding="auto",
        workers=2,
        max_inflight_bytes=64 * 1024,
        stage_host_tensors=True,
    )
    assert pulled == {n: raw_bytes(t) for n, t in after.items()}

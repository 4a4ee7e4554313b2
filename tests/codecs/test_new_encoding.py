"""Adding an encoding touches only codecs/: a toy encoding defined here is registered, then
published and pulled end to end (catch-up with folding, a failure put back, repair-free).

``add`` stores ``new - old`` per byte (mod 256): foldable (payloads add up), not self-inverse
(so a put-back must use the recorded old bytes), exact payload size. Nothing in pull/ or
publish/ knows its name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import deltastore as ds
from deltastore.codecs import ENCODINGS, ByteArray, EncodedDelta, Encoding, register_encoding
from deltastore.errors import ConfigError, FormatError
from tests.conftest import checkpoint_bytes, perturb, raw_bytes


class AddEncoding(Encoding):
    """``new - old`` per byte, modulo 256."""

    name = "toy-add"
    idempotent = False
    self_inverse = False
    foldable = True
    exact_payload_size = True
    folds = 0

    def encode(self, old: ByteArray, new: ByteArray, *, itemsize: int = 1) -> EncodedDelta:
        delta = (new.astype(np.int16) - old.astype(np.int16)).astype(np.uint8)
        return EncodedDelta(memoryview(delta), int(np.count_nonzero(delta)))

    def max_payload_size(self, nbytes: int) -> int:
        return nbytes

    def apply(self, target: ByteArray, payload: bytes | memoryview, *, tensor: str) -> None:
        delta = np.frombuffer(payload, dtype=np.uint8)
        if delta.size != target.size:
            raise FormatError(f"toy-add payload of {tensor!r} has the wrong size")
        np.add(target, delta, out=target)

    def fold(self, folded: ByteArray, later: bytes | memoryview, *, tensor: str) -> ByteArray:
        type(self).folds += 1
        np.add(folded, np.frombuffer(later, dtype=np.uint8), out=folded)
        return folded


@pytest.fixture
def toy() -> Iterator[AddEncoding]:
    encoding = AddEncoding()
    register_encoding(encoding)
    AddEncoding.folds = 0
    try:
        yield encoding
    finally:
        ENCODINGS.pop(encoding.name, None)


def _bytes(model: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: raw_bytes(t) for n, t in model.items()}


def test_a_registered_encoding_publishes_and_pulls_end_to_end(
    tmp_path: Path, base_dir: Path, small_model: dict[str, torch.Tensor], toy: AddEncoding
):
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, encoding=toy.name)
    publisher.seed()
    model, states = small_model, {0: _bytes(small_model)}
    for version, step in ((1, 1), (2, 7), (3, 14)):  # steps 7 and 14 change the same tensors
        model = perturb(model, step)
        publisher.publish(model.items())
        states[version] = _bytes(model)
    assert store.index(3).encoding == toy.name

    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    assert checkpoint_bytes(host) == states[1]
    result = ds.pull_weights(host, store, 3, base_dir=base_dir)
    assert result.action == "applied" and result.versions_applied == [2, 3]
    assert checkpoint_bytes(host) == states[3]
    assert ds.verify_local(host, store, base_dir=base_dir) == 3
    assert AddEncoding.folds > 0, "consecutive payloads of a foldable encoding are folded"


def test_a_registered_encoding_is_put_back_from_recorded_bytes(
    tmp_path: Path, base_dir: Path, small_model: dict[str, torch.Tensor], toy: AddEncoding
):
    """A failed apply restores a non-self-inverse encoding's writes from the old bytes."""
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, encoding=toy.name)
    publisher.seed()
    # Change every tensor so some are written before the corrupt one fails.
    model = {n: t.clone() for n, t in small_model.items()}
    for tensor in model.values():
        if tensor.numel():
            tensor.reshape(-1).view(torch.uint8)[0] ^= 1 if tensor.dtype == torch.bool else 0x11
    publisher.publish(model.items())
    host = tmp_path / "host"
    ds.pull_weights(host, store, 0, base_dir=base_dir)
    before = checkpoint_bytes(host)
    # Corrupt the digest-checked result of the last tensor (sorted) by flipping its payload.
    index = store.index(1)
    last = sorted(index.weight_map)[-1]
    shard = index.weight_map[last]
    header = store.read_shard_header(1, shard)
    entry = header.tensors[last]
    path = Path(store.root) / "weight_v000001" / shard
    raw = bytearray(path.read_bytes())
    raw[entry.end - 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ds.DeltastoreError):
        ds.pull_weights(host, store, 1, base_dir=base_dir, workers=1)
    assert checkpoint_bytes(host) == before
    assert ds.verify_local(host, store, base_dir=base_dir) == 0


def test_registering_a_second_encoding_under_a_taken_name_is_refused(toy: AddEncoding):
    with pytest.raises(ConfigError, match="already registered"):
        register_encoding(AddEncoding())
    register_encoding(toy)  # the same object again is fine

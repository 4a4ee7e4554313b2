"""A one-step pull applies its small tensors in batches, straight into the mapped files.

Each apply task hands the one payload of each of its tensors to the codec in one call
(``Encoding.apply_batch``; one compiled call for ``sparse-v2`` and ``auto``), decompressed in
one call, then verifies each tensor. The safety rules are those of the per-tensor path: a
payload that does not fit is refused (a FormatError naming the tensor and version) before its
tensor is written, a tensor that does not verify is put back, and on any failure every tensor
already written is put back, so the host stays verifiably at its version. The collector is
paused while a pull runs.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

import deltastore as ds
from deltastore.codecs import compress, decompress, sparse
from deltastore.codecs.sparse import AutoEncoding
from deltastore.errors import FormatError, IntegrityError
from deltastore.pull.apply import Window
from tests.conftest import HAVE_NUMBA, checkpoint_bytes, make_checkpoint, raw_bytes

Model = dict[str, torch.Tensor]

PATHS = [
    "numpy",
    pytest.param("compiled", marks=pytest.mark.skipif(not HAVE_NUMBA, reason="no numba")),
]


def _experts(count: int, step: int) -> Model:
    """``count`` bf16 tensors of 1 KB (``step`` 0: the base; else a few elements moved a ulp)."""
    generator = torch.Generator().manual_seed(0)
    model = {
        f"experts.{i:03d}.weight": torch.randn(512, generator=generator).to(torch.bfloat16)
        for i in range(count)
    }
    if step:
        for i, tensor in enumerate(model.values()):
            tensor.view(torch.int16)[[(7 * i + 3 * step) % 512, (11 * i + step) % 512]] += 1
    return model


@pytest.fixture
def published(tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """(store, base dir, host at v0): v1 (every tensor changed) published with ``auto``."""
    if request.param == "numpy":
        monkeypatch.setenv(sparse.NO_JIT_VARIABLE, "1")
    base = make_checkpoint(tmp_path / "base", _experts(40, 0))
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base, encoding="auto")
    publisher.seed()
    publisher.publish(_experts(40, 1).items())
    host = tmp_path / "host"
    ds.pull_weights(host, store, 0, base_dir=base)
    return store, base, host


def _state(host: Path) -> str:
    return json.loads((host / ".weight_sync" / "state.json").read_text())["version"]


def _tampered(monkeypatch: pytest.MonkeyPatch, change) -> None:  # type: ignore[no-untyped-def]
    """Make the frames the pull reads pass through ``change(frames, names)``, as if the store
    held them (a payload that survives zstd but not the codec, or made for other bytes)."""
    real = Window.frames

    def tampered(self: Window, data):  # type: ignore[no-untyped-def]
        frames = [[bytes(f) for f in fs] for fs in real(self, data)]
        change(frames, [t.name for t in self.tensors])
        return [[memoryview(f) for f in fs] for fs in frames]

    monkeypatch.setattr(Window, "frames", tampered)


def _stays_at_v0(store: ds.VersionStore, base: Path, host: Path) -> None:
    assert _state(host) == "000000"
    assert ds.verify_local(host, store, version=0, base_dir=base) == 0
    assert checkpoint_bytes(host) == {n: raw_bytes(t) for n, t in _experts(40, 0).items()}


@pytest.mark.parametrize("published", PATHS, indirect=True)
@pytest.mark.parametrize("where", [0, 17, 39])
def test_a_corrupt_payload_in_a_batch_is_refused(published, monkeypatch, where: int):
    """A payload in the middle (or at either end) of a batch whose header is corrupt: a
    FormatError names its tensor and version, and every tensor is back at v0."""
    store, base, host = published
    victim = f"experts.{where:03d}.weight"

    def corrupt(frames: list[list[bytes]], names: list[str]) -> None:
        i = names.index(victim)
        payload = decompress(frames[i][0], max_size=2048, what="")
        frames[i][0] = compress(payload[:1] + b"\x30" + payload[2:])  # not a sparse-v2 header

    _tampered(monkeypatch, corrupt)
    with pytest.raises(FormatError) as caught:
        ds.pull_weights(host, store, 1, base_dir=base, workers=1)
    assert victim in str(caught.value) and "weight_v000001" in str(caught.value)
    _stays_at_v0(store, base, host)


@pytest.mark.parametrize("published", PATHS, indirect=True)
def test_a_payload_that_applies_but_does_not_verify_is_put_back(published, monkeypatch):
    """Two tensors' payloads swapped (each well-formed, for a tensor of the same size): the
    first to be verified fails its digest, is put back, and the pull puts back the rest."""
    store, base, host = published
    swapped = ["experts.005.weight", "experts.006.weight"]

    def swap(frames: list[list[bytes]], names: list[str]) -> None:
        i, j = names.index(swapped[0]), names.index(swapped[1])
        frames[i], frames[j] = frames[j], frames[i]

    _tampered(monkeypatch, swap)
    with pytest.raises(IntegrityError, match="put back as it was") as caught:
        ds.pull_weights(host, store, 1, base_dir=base, workers=1)
    assert swapped[0] in str(caught.value)
    _stays_at_v0(store, base, host)


@pytest.mark.parametrize("published", PATHS, indirect=True)
def test_a_one_step_pull_makes_one_codec_call_per_task(published, monkeypatch):
    """40 changed tensors in one apply task: one batch call into the codec, no per-tensor
    apply, and the host ends at v1, verified."""
    store, base, host = published
    calls = {"batch": 0, "one": 0}
    batch, one = AutoEncoding.apply_batch, AutoEncoding.apply

    def counted_batch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["batch"] += 1
        return batch(self, *args, **kwargs)

    def counted_one(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["one"] += 1
        return one(self, *args, **kwargs)

    monkeypatch.setattr(AutoEncoding, "apply_batch", counted_batch)
    monkeypatch.setattr(AutoEncoding, "apply", counted_one)
    ds.pull_weights(host, store, 1, base_dir=base, workers=2)
    assert calls["batch"] == 1
    # numpy: the base class's loop applies one by one inside that one call
    assert calls["one"] == (0 if sparse.compiled_backend(None) is not None else 40)
    assert _state(host) == "000001"
    assert ds.verify_local(host, store, version=1, base_dir=base) == 1
    assert checkpoint_bytes(host) == {n: raw_bytes(t) for n, t in _experts(40, 1).items()}


@pytest.mark.parametrize("published", ["numpy"], indirect=True)
def test_the_collector_is_paused_while_a_pull_runs(published):
    """Every few hundred objects the collector would walk the whole process (an engine's
    millions of objects) during a pull of many tensors; it is paused and then resumed."""
    store, base, host = published
    seen: list[bool] = []
    assert gc.isenabled()
    ds.pull_weights(
        host, store, 1, base_dir=base, pre_read=lambda root, v: seen.append(gc.isenabled())
    )
    assert seen and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:  # a collector the caller turned off stays off
        ds.pull_weights(host, store, 0, base_dir=base)
        assert not gc.isenabled()
    finally:
        gc.enable()

"""``device_snapshot=True``: the diff runs in torch ops against a copy of each tensor kept on
its device, and only the changed elements reach the host. On CPU tensors here (the same ops run
on CUDA ones: ``benchmarks/device_diff.py`` measures them on a GPU). Every version must be the
one the staged path publishes: the same tensors, the same digests, the same payloads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import deltastore as ds
from deltastore.codecs import (
    CHECKSUMS,
    ENCODINGS,
    AutoEncoding,
    CompactSparseEncoding,
    XorChanges,
    decompress,
)
from deltastore.errors import PublishError
from deltastore.publish import device
from deltastore.publish.device import DeviceSnapshot, StagerStats, hexdigest_after
from tests.conftest import HAVE_NUMBA, checkpoint_bytes, make_checkpoint, raw_bytes

STEPS = 5
NEEDS_NUMBA = pytest.mark.skipif(not HAVE_NUMBA, reason="the compiled backend needs numba")


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(256, 64, generator=g).to(torch.bfloat16),
        "mlp.up": torch.randn(128, 96, generator=g),
        "mlp.scale": torch.randint(-128, 128, (333,), generator=g, dtype=torch.int8),
        "norm": torch.randn(64, generator=g).half(),
        "odd": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(0.5),
        "empty": torch.zeros(0, dtype=torch.bfloat16),
    }


def _steps(base: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """Sparse steps of an optimizer's kind, one where ``embed`` changes everywhere (the dense
    fallback stages it) and one where nothing changes."""
    g = torch.Generator().manual_seed(1)
    model = {n: t.clone() for n, t in base.items()}
    for step in range(1, STEPS + 1):
        for name, tensor in model.items():
            flat = tensor.reshape(-1)
            if step == 4 or not flat.numel():
                continue  # nothing changes
            if step == 2 and name == "embed":
                flat.add_(1.0)
                continue
            chosen = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 200)]
            if tensor.dtype == torch.int8:
                flat[chosen] = flat[chosen] ^ 1
            else:
                flat[chosen] = flat[chosen] * 1.01 + 0.001
        yield {n: t.clone() for n, t in model.items()}


def _publish(
    tmp_path: Path, label: str, base_dir: Path, encoding: str, on_device: bool
) -> tuple[ds.VersionStore, dict[int, dict[str, torch.Tensor]], list[StagerStats]]:
    store = ds.VersionStore(tmp_path / label)
    publisher = ds.DeltaPublisher(
        store, base_dir, encoding=encoding, device_snapshot=on_device, workers=2
    )
    publisher.seed()
    models, stats = {}, []
    for step, model in enumerate(_steps(_model()), start=1):
        if step == 3:  # a publish that fails after some tensors were diffed changes nothing
            pairs = [*model.items(), ("embed", model["embed"])]
            with pytest.raises(PublishError, match="passed twice"):
                publisher.publish(pairs)
        version = publisher.publish(model, full=step == 5).version
        models[version] = model
        assert publisher.last_staging is not None
        stats.append(publisher.last_staging)
    return store, models, stats


def _files(store: ds.VersionStore, version: int) -> dict[str, bytes]:
    """Every file of a version but its index (which holds the stream's own id and token)."""
    root = Path(store.url) / f"weight_v{version:06d}"
    return {p.name: p.read_bytes() for p in root.iterdir() if p.suffix == ".safetensors"}


@pytest.mark.filterwarnings("ignore:weight_v000002 changed")
@pytest.mark.parametrize("encoding", ["xor", "overwrite", "sparse-v2", "auto"])
def test_versions_are_those_of_the_staged_path(tmp_path: Path, encoding: str) -> None:
    base_dir = make_checkpoint(tmp_path / "base", _model())
    staged, models, _ = _publish(tmp_path, "staged", base_dir, encoding, on_device=False)
    on_device, device_models, stats = _publish(tmp_path, "device", base_dir, encoding, True)
    assert staged.versions() == on_device.versions() == [1, 2, 3, 4, 5]
    for version in staged.versions():
        assert _files(on_device, version) == _files(staged, version), version
        host = tmp_path / f"host{version}"
        ds.pull_weights(host, on_device, version, base_dir=base_dir)  # digests checked
        expected = {n: raw_bytes(t) for n, t in device_models[version].items()}
        assert checkpoint_bytes(host) == expected
    assert models.keys() == device_models.keys()
    # A change that takes more bytes than its tensor is staged whole: embed at step 2 (every
    # element) and the 4-byte scalar whenever it changes (not at step 4).
    assert [s.device_diffed for s in stats] == [len(_model())] * 5
    assert [s.staged for s in stats] == [1, 2, 1, 0, 1]


def test_only_the_changes_cross_to_the_host(tmp_path: Path) -> None:
    model = {"w": torch.randn(512, 512).to(torch.bfloat16)}
    base_dir = make_checkpoint(tmp_path / "base", model)
    publisher = ds.DeltaPublisher(
        tmp_path / "store", base_dir, encoding="auto", device_snapshot=True
    )
    publisher.seed()
    new = model["w"].clone()
    new.view(-1)[::1000] += 1.0  # 263 changed elements
    changed = int((new.view(torch.int16) != model["w"].view(torch.int16)).sum())
    publisher.publish({"w": new})
    stats = publisher.last_staging
    assert stats is not None
    assert (stats.staged, stats.copied, stats.device_uploads) == (0, 0, 1)
    # An int64 position, the XOR value and the copy's old value (checked against the host's).
    assert stats.device_bytes_to_host == changed * (8 + 2 + 2)
    publisher.publish({"w": new})  # unchanged: the device copy followed the commit
    assert publisher.last_staging is not None
    assert publisher.last_staging.device_uploads == 0
    assert publisher.last_staging.device_bytes_to_host == 0


def test_the_device_copy_is_made_again_once_dropped() -> None:
    held = DeviceSnapshot()
    stats = StagerStats()
    old = np.arange(64, dtype=np.uint8)
    tensor = torch.from_numpy(old.copy())
    tensor[5] ^= 3
    changes = held.changes("t", tensor, old, 1, stats)
    assert changes is not None
    assert changes.positions.tolist() == [5] and changes.values.tolist() == [3]
    held.advance("t", changes)
    again = held.changes("t", tensor, old, 1, stats)
    assert again is not None and again.positions.size == 0  # the copy is at the new state
    held.advance("t", None)  # a change it was not given: dropped, made again from the host
    assert held.held_bytes == 0
    again = held.changes("t", tensor, old, 1, stats)
    assert again is not None and again.positions.tolist() == [5]
    assert stats.device_uploads == 2
    assert held.changes("numpy", old, old, 1, stats) is None  # not a torch tensor: staged


def test_a_copy_that_is_not_the_published_state_is_staged_instead(
    caplog: pytest.LogCaptureFixture,
) -> None:
    held = DeviceSnapshot()
    stats = StagerStats()
    old = np.arange(64, dtype=np.uint8)
    tensor = torch.from_numpy(old.copy())
    assert held.changes("t", tensor, old, 1, stats) is not None  # the copy is made
    held.advance("t", XorChanges(np.array([7], np.int64), np.array([1], np.uint8)))  # wrongly
    tensor[9] ^= 1  # the trainer's step; element 7 differs from the copy too, not from old
    with caplog.at_level("WARNING", logger="deltastore.publish"):
        assert held.changes("t", tensor, old, 1, stats) is None
    assert "is not the published state" in caplog.text
    assert held.held_bytes == 0  # dropped: made again from the host snapshot next time
    changes = held.changes("t", tensor, old, 1, stats)
    assert changes is not None and changes.positions.tolist() == [9]


@pytest.mark.parametrize("checksum", sorted(CHECKSUMS))
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_the_digest_after_the_changes_is_that_of_the_new_bytes(
    checksum: str, itemsize: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device, "DIGEST_CHUNK", 64)  # many chunks, one ending mid-tensor
    rng = np.random.default_rng(itemsize)
    old = rng.integers(0, 256, 1000 * itemsize - 8 * (itemsize > 1), dtype=np.uint8)
    dtype = np.dtype(f"<u{itemsize}")
    count = old.size // itemsize
    positions = np.sort(rng.choice(count, count // 7, replace=False)).astype(np.int64)
    positions = np.concatenate(([0], positions[(positions > 0) & (positions < count - 1)]))
    positions = np.append(positions, count - 1)
    values = rng.integers(1, 255, positions.size).astype(dtype)
    new = old.copy()
    new.view(dtype)[positions] ^= values
    digest = hexdigest_after(CHECKSUMS[checksum], old, XorChanges(positions, values))
    assert digest == CHECKSUMS[checksum].hexdigest(new)


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
@pytest.mark.parametrize(
    ("itemsize", "density", "size"),
    [(2, 0.004, 1 << 16), (2, 0.5, 4096), (4, 0.01, 1000), (1, 0.1, 333), (8, 0.9, 64), (2, 0, 64)],
)
@pytest.mark.parametrize("use_jit", [False, pytest.param(True, marks=NEEDS_NUMBA)])
def test_encoding_the_changes_gives_the_payload_of_the_bytes(
    encoding: str, itemsize: int, density: float, size: int, use_jit: bool
) -> None:
    rng = np.random.default_rng(size)
    old = rng.integers(0, 256, size, dtype=np.uint8)
    dtype = np.dtype(f"<u{itemsize}")
    new = old.copy()
    elements = new.view(dtype)
    chosen = rng.random(elements.size) < density
    elements[chosen] += dtype.type(1)
    positions = np.flatnonzero(old.view(dtype) != elements).astype(np.int64)
    changes = XorChanges(positions, old.view(dtype)[positions] ^ elements[positions])
    chosen = ENCODINGS[encoding]
    if isinstance(chosen, AutoEncoding | CompactSparseEncoding):
        chosen = type(chosen)(use_jit=use_jit)
    (framed,) = chosen.encode_framed([old], [new], [itemsize])
    from_changes = chosen.encode_changes(old, changes, itemsize=itemsize)
    assert from_changes.changed_bytes == framed.changed_bytes
    if framed.changed_bytes:
        what = f"{encoding} payload"
        assert decompress(from_changes.frame, max_size=1 << 30, what=what) == decompress(
            framed.frame, max_size=1 << 30, what=what
        )
    else:
        assert from_changes.frame == b""

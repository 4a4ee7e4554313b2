"""``device_snapshot=True``: the diff runs in torch ops against a copy of each tensor kept on
its device, and only the changed elements reach the host. On CPU tensors here (the same ops run
on CUDA ones: ``benchmarks/device_diff.py`` measures them on a GPU). Every version must be the
one the staged path publishes: the same tensors, the same digests, the same payloads."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
from deltastore.publish import device, diff
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
    tmp_path: Path, label: str, base_dir: Path, encoding: str, on_device: bool, pooled: bool
) -> tuple[ds.VersionStore, dict[int, dict[str, torch.Tensor]], list[StagerStats]]:
    store = ds.VersionStore(tmp_path / label)
    publisher = ds.DeltaPublisher(
        store,
        base_dir,
        encoding=encoding,
        device_snapshot=on_device,
        workers=2,
        stage_host_tensors=pooled,  # what is staged goes through the pool, as from a GPU
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


GROUPING = {
    "grouped": {},  # every tensor here is small: all in one group
    "groups-of-3": {"BATCH_TENSORS": 3},  # a group closed by its count, mid-model
    "one-by-one": {"GROUP_TENSOR_BYTES": 0},  # none grouped: each diffed alone
}


@pytest.mark.filterwarnings("ignore:weight_v000002 changed")
@pytest.mark.parametrize("pooled", [False, True], ids=["viewed", "pooled"])
@pytest.mark.parametrize("grouping", sorted(GROUPING))
@pytest.mark.parametrize("encoding", ["xor", "overwrite", "sparse-v2", "auto"])
def test_versions_are_those_of_the_staged_path(
    tmp_path: Path, encoding: str, grouping: str, pooled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for constant, value in GROUPING[grouping].items():
        monkeypatch.setattr(device, constant, value, raising=False)
        monkeypatch.setattr(diff, constant, value, raising=False)
    base_dir = make_checkpoint(tmp_path / "base", _model())
    staged, models, _ = _publish(tmp_path, "staged", base_dir, encoding, False, pooled)
    on_device, device_models, stats = _publish(tmp_path, "device", base_dir, encoding, True, pooled)
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


def _group_case() -> tuple[list[tuple[str, torch.Tensor, np.ndarray, int]], list[np.ndarray]]:
    """Tensors of three element sizes, interleaved, each with its published bytes: a sparse
    change, an unchanged one, a dense one and a 4-byte scalar (one change is dense there)."""
    g = torch.Generator().manual_seed(3)
    published = {
        "a": torch.randn(300, generator=g).to(torch.bfloat16),
        "b": torch.randn(50, generator=g),
        "c": torch.randn(200, generator=g).to(torch.bfloat16),
        "d": torch.randint(-128, 128, (77,), generator=g, dtype=torch.int8),
        "dense": torch.randn(40, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(1.5),
    }
    new = {name: tensor.clone() for name, tensor in published.items()}
    new["a"][[0, 17, 299]] += 1.0
    new["b"][[3, 49]] *= 2.0
    new["d"][[5]] ^= 1
    new["dense"] += 1.0
    new["scalar"] += 1.0
    tensors = [
        (
            n,
            new[n],
            np.frombuffer(raw_bytes(published[n]), np.uint8).copy(),
            published[n].element_size(),
        )
        for n in new
    ]
    return tensors, [np.frombuffer(raw_bytes(new[n]), np.uint8) for n in new]


def _expected(old: np.ndarray, new: np.ndarray, itemsize: int) -> XorChanges | None:
    dtype = np.dtype(f"<u{itemsize}")
    positions = np.flatnonzero(old.view(dtype) != new.view(dtype))
    if positions.size * (8 + itemsize) > old.size:
        return None
    return XorChanges(positions, old.view(dtype)[positions] ^ new.view(dtype)[positions])


def test_a_group_finds_each_tensors_changes_in_one_transfer() -> None:
    tensors, news = _group_case()
    held, stats = DeviceSnapshot(), StagerStats()
    found = held.changes_of_group(tensors, stats)
    for (name, _, old, itemsize), new, got in zip(tensors, news, found, strict=True):
        want = _expected(old, new, itemsize)
        if want is None:
            assert got is None, name
            continue
        assert got is not None, name
        assert got.positions.tolist() == want.positions.tolist(), name
        assert got.values.dtype == want.values.dtype and got.values.tolist() == want.values.tolist()
    assert [f is None for f in found] == [False, False, False, False, True, True]
    assert stats.device_diffed == 6 and stats.device_uploads == 6
    # Every change of the group crossed once, the dense members' too: a position, the XOR
    # value and the copy's old value each.
    sent = 0
    for (_, _, old, itemsize), new in zip(tensors, news, strict=True):
        dtype = np.dtype(f"<u{itemsize}")
        sent += int((old.view(dtype) != new.view(dtype)).sum()) * (8 + 2 * itemsize)
    assert stats.device_bytes_to_host == sent > 0


def test_a_dense_group_goes_tensor_by_tensor() -> None:
    """A group whose changes would outweigh its tensors sends no more than each alone would:
    the dense member's change stays on its device."""
    sparse = np.arange(600, dtype=np.uint8)
    dense = np.arange(2000, dtype=np.uint8)
    tensors = [
        ("sparse", torch.from_numpy(sparse ^ (np.arange(600) % 200 == 0)), sparse, 2),
        ("dense", torch.from_numpy(dense ^ 1), dense, 2),
    ]
    held, stats = DeviceSnapshot(), StagerStats()
    found = held.changes_of_group(tensors, stats)
    assert found[0] is not None and found[0].positions.tolist() == [0, 100, 200]
    assert found[1] is None
    assert stats.device_bytes_to_host == 3 * 12  # only the sparse member's changes crossed
    assert stats.device_diffed == 2


def test_a_stale_copy_in_a_group_is_staged_alone(caplog: pytest.LogCaptureFixture) -> None:
    tensors, _ = _group_case()
    held, stats = DeviceSnapshot(), StagerStats()
    held.changes_of_group(tensors, stats)  # the copies are made
    # Copy "c" moved wrongly at element 5, which the step leaves alone: the diff sees element
    # 5 as changed, with an old value that is not the host snapshot's.
    held.advance("c", XorChanges(np.array([5], np.int64), np.array([1], np.uint16)))
    with caplog.at_level("WARNING", logger="deltastore.publish"):
        found = held.changes_of_group(tensors, stats)
    assert "'c'" in caplog.text and "is not the published state" in caplog.text
    assert found[2] is None and found[0] is not None and found[1] is not None
    assert stats.device_uploads == 6  # only "c" lost its copy, made again on its next use
    held.changes_of_group(tensors, stats)
    assert stats.device_uploads == 7


class _CountedOps(TorchDispatchMode):
    """Counts the aten ops run under it by name (``nonzero``, ``_local_scalar_dense``: the
    ops that make a GPU wait for the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_group_waits_for_its_device_a_fixed_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device's waits and transfers per group do not grow with its tensors: each one a
    GPU would pay per tensor is what grouping removes (on CPU the count is what is checked)."""
    g = torch.Generator().manual_seed(4)
    published = {f"e{i}": torch.randn(64, generator=g).to(torch.bfloat16) for i in range(200)}
    published |= {f"n{i}": torch.randn(8, generator=g) for i in range(20)}
    olds = {n: np.frombuffer(raw_bytes(t), np.uint8).copy() for n, t in published.items()}
    new = {n: t.clone() for n, t in published.items()}
    for tensor in new.values():
        tensor[3] += 1.0
    tensors = [(n, new[n], olds[n], published[n].element_size()) for n in new]
    held, stats = DeviceSnapshot(), StagerStats()
    held.changes_of_group(tensors, stats)  # the copies are made
    transfers: Counter[str] = Counter()
    for method in ("cpu", "to"):
        real = getattr(torch.Tensor, method)

        def counted(self, *args, _real=real, _method=method, **kwargs):  # type: ignore[no-untyped-def]
            transfers[_method] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    with _CountedOps() as ops:
        found = held.changes_of_group(tensors, stats)
    assert all(f is not None and f.positions.tolist() == [3] for f in found)
    # Two kinds (bf16, fp32): per kind one count, one nonzero and one transfer to the host.
    assert (ops.counts["_local_scalar_dense"], ops.counts["nonzero"]) == (2, 2)
    assert transfers == {"cpu": 2}
    held.advance_all([(n, f) for (n, *_), f in zip(tensors, found, strict=True)])
    assert transfers == {"cpu": 2, "to": 2}  # the commit's changes: one transfer per kind
    again = held.changes_of_group(tensors, stats)
    assert all(f is not None and not f.positions.size for f in again)  # the copies moved
    # A tensor diffed alone (a large one) waits as often as a group: one transfer, not three.
    name, tensor, old, itemsize = tensors[0]
    tensor[5] += 1.0
    assert transfers == {"cpu": 4, "to": 2}
    with _CountedOps() as ops:
        alone = held.changes(name, tensor, old, itemsize, stats)
    assert alone is not None and alone.positions.tolist() == [5]
    assert (ops.counts["_local_scalar_dense"], ops.counts["nonzero"]) == (1, 1)
    assert transfers == {"cpu": 5, "to": 2}


def test_the_copies_advance_from_changes_of_any_index_type() -> None:
    """Changes reach the commit from several places (the device diff, the encoder, a word
    compare): int32 positions or strided values move the copy as int64 contiguous ones do."""
    held, stats = DeviceSnapshot(), StagerStats()
    old = np.arange(32, dtype=np.uint8)
    tensor = torch.from_numpy(old.copy())
    held.changes("t", tensor, old, 2, stats)  # the copy is made
    values = np.array([[9, 0], [5, 0]], np.uint16)[:, 0]  # strided
    held.advance_all([("t", XorChanges(np.array([1, 4], np.int32), values))])
    moved = old.copy()
    moved.view(np.uint16)[[1, 4]] ^= np.array([9, 5], np.uint16)
    found = held.changes("t", torch.from_numpy(moved), old, 2, stats)
    assert found is not None and found.positions.size == 0  # the copy is at the moved state

"""The diff pipeline encodes each pool task's tensors with one ``encode_framed`` call, and the
producer stages plain CPU tensors without a torch call that releases the GIL.

With numba the batch's frames come from one compiled call; without it (``DELTASTORE_NO_JIT``)
from numpy one tensor at a time. Both must publish versions that pull to the same bytes, over
several steps (the snapshot advances by the batch's changes), with the same wire bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType

import numpy as np
import pytest
import torch

import deltastore as ds
from deltastore.codecs import sparse
from deltastore.codecs.base import Encoding
from deltastore.codecs.sparse import AutoEncoding, CompactSparseEncoding
from deltastore.publish.device import plain_host_view
from tests.conftest import checkpoint_bytes, make_checkpoint, raw_bytes

Model = dict[str, torch.Tensor]


def many_small(seed: int) -> Model:
    """120 bf16 tensors of 0.5-16 KB and a few of other dtypes: several pool tasks' worth."""
    g = torch.Generator().manual_seed(seed)
    model = {
        f"experts.{i}.weight": (torch.randn(256 * (1 + i % 32), generator=g) * 0.02).to(
            torch.bfloat16
        )
        for i in range(120)
    }
    model["norm.weight"] = torch.randn(77, generator=g)
    model["mask"] = torch.rand(33, generator=g) > 0.5
    return model


def step(model: Model, seed: int) -> Model:
    """±1 ulp on about 1 % of each bf16 tensor's elements; the others untouched."""
    rng = np.random.default_rng(seed)
    out = {name: t.clone() for name, t in model.items()}
    for tensor in out.values():
        if tensor.dtype != torch.bfloat16:
            continue
        flat = tensor.view(torch.int16).numpy()
        where = rng.integers(0, flat.size, max(1, flat.size // 100))
        flat[where] += rng.choice(np.array([-1, 1], dtype=np.int16), where.size)
    return out


def publish_three(tmp_path: Path, base: Path, encoding: str, tag: str) -> tuple[list[int], Path]:
    store = ds.VersionStore(tmp_path / f"store-{tag}")
    publisher = ds.DeltaPublisher(store, base, encoding=encoding, workers=2)
    publisher.seed()
    model, wires = many_small(0), []
    for version in (1, 2, 3):
        model = step(model, version)
        wires.append(publisher.publish(model.items()).wire_bytes)
    host = tmp_path / f"host-{tag}"
    ds.pull_weights(str(host), str(store.root), 3, base_dir=str(base))
    assert checkpoint_bytes(host) == {n: raw_bytes(t) for n, t in model.items()}
    return wires, host


@pytest.mark.parametrize("encoding", ["auto", "sparse-v2", "xor"])
def test_compiled_and_numpy_publishes_pull_to_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encoding: str
):
    base = make_checkpoint(tmp_path / "base", many_small(0))
    monkeypatch.setenv(sparse.NO_JIT_VARIABLE, "1")
    numpy_wires, numpy_host = publish_three(tmp_path, base, encoding, "numpy")
    monkeypatch.setenv(sparse.NO_JIT_VARIABLE, "0")
    wires, host = publish_three(tmp_path, base, encoding, "default")
    assert wires == numpy_wires  # ±1-ulp payloads: the same frames, byte for byte
    assert checkpoint_bytes(host) == checkpoint_bytes(numpy_host)


@pytest.mark.parametrize("pooled", [False, True], ids=["viewed", "pooled"])
def test_a_pool_task_encodes_its_tensors_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pooled: bool
):
    """Small tensors go to the encoding as batches, not one ``encode`` call each; also when
    they are copied through the buffer pool, as from a GPU (each took a whole 1 MiB buffer of
    the batch's bytes there, so a batch held four)."""
    model = many_small(0)
    base = make_checkpoint(tmp_path / "base", model)
    batches: list[int] = []
    framed = Encoding.encode_framed

    def counting(self: Encoding, olds: list, news: list, itemsizes: list) -> list:
        batches.append(len(olds))
        return framed(self, olds, news, itemsizes)

    monkeypatch.setattr(Encoding, "encode_framed", counting)
    for cls in (CompactSparseEncoding, AutoEncoding):  # both override it
        monkeypatch.setattr(cls, "encode_framed", counting)
    publisher = ds.DeltaPublisher(
        ds.VersionStore(tmp_path / "s"), base, encoding="auto", stage_host_tensors=pooled
    )
    publisher.seed()
    batches.clear()  # (seed() warms the compiled kernels up with a few calls of its own)
    publisher.publish(step(model, 1).items())
    assert sum(batches) == len(model)
    assert len(batches) < len(model) // 10


def test_plain_host_view_calls_no_torch_method_that_releases_the_gil():
    """``is_neg()`` is a dispatched operator: it releases the GIL, and under a busy encode
    pool taking it back cost ~100 us a tensor. The negative bit is read another way."""
    tensor = torch.zeros(64, dtype=torch.bfloat16)
    called: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "c_call":
            called.append(getattr(arg, "__name__", "?"))

    sys.setprofile(profile)
    try:
        view = plain_host_view(tensor)
    finally:
        sys.setprofile(None)
    assert view is not None and view.tobytes() == raw_bytes(tensor)
    assert "is_neg" not in called
    negative = torch.tensor([1 + 2j], dtype=torch.complex64).conj().imag
    assert negative.is_neg() and plain_host_view(negative) is None

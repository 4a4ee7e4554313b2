"""The publish pipeline's per-tensor work: host views without torch operators, the collector
paused during a publish, the base record hashed at seed, the snapshot advanced by many threads.

Speed itself is measured in benchmarks (docs/benchmarks.md); these tests pin the behaviour the
speed depends on, each of which fails without it.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deltastore as ds
import deltastore.publish.publisher as publisher_module
import deltastore.publish.rank_state as rank_state
from deltastore.codecs import ENCODINGS
from deltastore.codecs.encodings import XorEncoding
from deltastore.gc_pause import gc_paused
from deltastore.publish.device import HostStager, host_bytes, plain_host_view
from tests.conftest import checkpoint_bytes, make_checkpoint, perturb, raw_bytes

Model = dict[str, torch.Tensor]


class _CountOps(TorchDispatchMode):
    """Counts the torch operators dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _plain_tensors() -> dict[str, torch.Tensor]:
    big = torch.arange(4 * 96, dtype=torch.float32).reshape(4, 96).to(torch.bfloat16)
    return {
        "bf16 matrix": big,
        "row view with a storage offset": big[2],
        "parameter that requires grad": torch.nn.Parameter(torch.linspace(-1, 1, 33)),
        "int64 one element": torch.tensor([7], dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
    }


def test_a_plain_cpu_tensor_is_viewed_as_its_bytes_without_any_torch_operator():
    stager = HostStager(1 << 30)
    for name, tensor in _plain_tensors().items():
        with _CountOps() as counted:
            staged = stager.stage(name, tensor)
            view = staged.wait()
        assert counted.ops == [], f"{name}: staging dispatched {counted.ops}"
        assert view.dtype == np.uint8 and view.ndim == 1
        assert view.tobytes() == raw_bytes(tensor.detach()), name
        staged.release()
    assert stager.in_flight_bytes == 0


def test_tensors_whose_bytes_are_not_plain_memory_take_the_general_path():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    conjugate = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    odd = {
        "transposed": base.t(),
        "strided slice": base[:, ::2],
        "conjugate view": conjugate,
        "negative view": conjugate.imag,
        "complex": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        "empty": torch.empty(0, dtype=torch.bfloat16),
        "numpy": np.arange(5, dtype=np.int16),
    }
    assert [n for n, t in odd.items() if plain_host_view(t) is not None] == []
    stager = HostStager(1 << 30)
    for name, tensor in {**odd, "0-d scalar": torch.tensor(3.5)}.items():
        staged = stager.stage(name, tensor)
        expected = (
            tensor.tobytes() if isinstance(tensor, np.ndarray) else raw_bytes(tensor.resolve_conj())
        )
        assert staged.wait().tobytes() == expected, name
        staged.release()


def test_the_view_keeps_its_tensor_alive():
    tensor = torch.arange(1 << 16, dtype=torch.int32)
    expected = raw_bytes(tensor)
    view = plain_host_view(tensor)
    del tensor
    gc.collect()
    junk = [torch.full((1 << 16,), -1, dtype=torch.int32) for _ in range(8)]
    assert view is not None and view.tobytes() == expected
    rebuilt = torch.frombuffer(bytearray(expected), dtype=torch.int32)
    assert host_bytes("same", rebuilt).tobytes() == expected
    del junk


def test_the_collector_is_paused_while_a_publish_runs_and_resumed_after(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    publisher = ds.DeltaPublisher(ds.VersionStore(tmp_path / "store"), base_dir)
    publisher.seed()
    seen: list[bool] = []

    def pairs(model: Model) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in model.items():
            seen.append(gc.isenabled())
            yield name, tensor

    assert gc.isenabled()
    publisher.publish(pairs(perturb(small_model, 1)))
    assert seen and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        publisher.publish(pairs(perturb(small_model, 2)))
        assert not gc.isenabled(), "a collector the caller turned off stays off"
    finally:
        gc.enable()


def test_the_worker_threads_are_kept_across_publishes_and_a_failed_one(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    """Encode threads are started once, by seed(), not per publish (each start waited for the
    GIL), and a publish refused midway leaves none of its encodes running."""

    def workers() -> set[threading.Thread]:
        # Thread objects, not idents: an ended thread's ident is given to the next one.
        return {t for t in threading.enumerate() if t.name.startswith("deltastore-publish")}

    # Publishers of earlier tests in this process may still hold their threads (until they are
    # collected): only threads started since count, and those of earlier ones may only end.
    earlier = workers()
    publisher = ds.DeltaPublisher(ds.VersionStore(tmp_path / "store"), base_dir, workers=2)
    publisher.seed()
    kept = workers() - earlier
    assert len(kept) == 2, "seed() starts both threads"
    publisher.publish(perturb(small_model, 1))
    assert workers() - earlier == kept
    stepped = perturb(small_model, 2)
    with pytest.raises(ds.PublishError, match="not in the base checkpoint"):
        publisher.publish([*stepped.items(), ("not.a.tensor.of.the.base", torch.zeros(4))])
    publisher.publish(stepped)
    assert workers() - earlier == kept
    assert publisher.snapshot is not None
    assert {n: publisher.snapshot.load(n).tobytes() for n in stepped} == {
        n: raw_bytes(t) for n, t in stepped.items()
    }


def test_nested_pauses_resume_the_collector_once_the_last_ends():
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_base_record_is_hashed_by_seed_not_by_the_first_publish(
    tmp_path: Path, base_dir: Path, small_model: Model, monkeypatch: pytest.MonkeyPatch
):
    calls: list[str] = []
    real = publisher_module.base_digests_record

    def counted(base: str, checksum: str, **kwargs: Any) -> dict[str, Any]:
        calls.append(base)
        return real(base, checksum, **kwargs)

    monkeypatch.setattr(publisher_module, "base_digests_record", counted)
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir)
    publisher.seed()
    assert len(calls) == 1
    publisher.publish(perturb(small_model, 1))
    assert len(calls) == 1
    index = store.index(1)
    untouched = small_model.keys() - index.weight_map.keys()  # those v1 carries are left out
    assert untouched and index.extra["base_digests"]["tensors"].keys() == untouched


def test_a_snapshot_advanced_by_many_threads_matches_every_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(rank_state, "PARALLEL_BYTES", 0)  # the pool even for a small model
    monkeypatch.setattr(rank_state, "PARALLEL_TENSOR_BYTES", 0)
    generator = torch.Generator().manual_seed(3)
    model = {
        f"t{i:03d}": torch.randn(64 + 37 * i, generator=generator).to(torch.bfloat16)
        for i in range(120)
    }
    base = make_checkpoint(tmp_path / "base", model, shards=1)
    store = ds.VersionStore(tmp_path / "store")
    for encoding in ("xor", "auto"):
        publisher = ds.DeltaPublisher(
            ds.VersionStore(tmp_path / f"store-{encoding}"), base, encoding=encoding, workers=3
        )
        publisher.seed()
        current = model
        for step in range(1, 4):
            current = {n: t.clone() for n, t in current.items()}
            for i, tensor in enumerate(current.values()):
                if (i + step) % 3:
                    tensor.view(torch.int16)[(7 * i + step) % tensor.numel()] += 1
            publisher.publish(current)
            snapshot = publisher.snapshot
            assert snapshot is not None
            assert {n: snapshot.load(n).tobytes() for n in current} == {
                n: raw_bytes(t) for n, t in current.items()
            }
        host = tmp_path / f"host-{encoding}"
        ds.pull_weights(host, publisher.store, 3, base_dir=base)
        assert checkpoint_bytes(host) == {n: raw_bytes(t) for n, t in current.items()}
    del store


@pytest.mark.parametrize("tensor_bytes", [0, rank_state.PARALLEL_TENSOR_BYTES])
def test_many_small_tensors_advance_the_snapshot_on_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tensor_bytes: int
):
    """Small tensors' XORs are not handed to the pool (the threads would trade the GIL for
    every numpy call); with a lower bar the same publish is split."""
    monkeypatch.setattr(rank_state, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(rank_state, "PARALLEL_TENSOR_BYTES", tensor_bytes)
    model = {f"expert.{i}": torch.zeros(512, dtype=torch.bfloat16) for i in range(64)}
    base = make_checkpoint(tmp_path / "base", model, shards=1)
    publisher = ds.DeltaPublisher(ds.VersionStore(tmp_path / "store"), base, workers=2)
    publisher.seed()
    held = publisher._held
    assert held is not None
    pool = held.pool()
    maps: list[int] = []
    real_map = pool.map

    def counted_map(fn: Any, *iterables: Any, **kwargs: Any) -> Any:
        maps.append(1)
        return real_map(fn, *iterables, **kwargs)

    monkeypatch.setattr(pool, "map", counted_map)
    stepped = {n: t.clone() for n, t in model.items()}
    for tensor in stepped.values():
        tensor.view(torch.int16)[::7] += 1
    publisher.publish(stepped)
    assert len(maps) == (1 if tensor_bytes == 0 else 0)
    assert publisher.snapshot is not None
    assert {n: publisher.snapshot.load(n).tobytes() for n in stepped} == {
        n: raw_bytes(t) for n, t in stepped.items()
    }


def test_spooled_frames_are_written_back_to_back_in_order_whatever_their_home(
    monkeypatch: pytest.MonkeyPatch,
):
    import io

    import deltastore.publish.spool as spool_module

    monkeypatch.setattr(spool_module, "JOIN_BYTES", 64)
    rng = np.random.default_rng(5)
    frames = [rng.bytes(int(n)) for n in rng.integers(0, 150, 60)]
    with spool_module.PayloadSpool(memory_bytes=1500) as spool:
        spans = [spool.append(frame) for frame in frames]
        assert spool._on_disk and spool._memory, "the test needs frames in memory and on disk"
        order = spans[::2] + spans[1::2]
        out = io.BytesIO()
        spool.copy_many_to(out, order)
    by_offset = dict(zip((offset for offset, _ in spans), frames))
    assert out.getvalue() == b"".join(by_offset[offset] for offset, _ in order)


def test_a_sparse_xor_change_advances_the_snapshot_without_decoding_its_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    generator = torch.Generator().manual_seed(8)
    model = {f"w{i}": torch.randn(4096, generator=generator).to(torch.bfloat16) for i in range(6)}
    model["odd"] = torch.arange(7, dtype=torch.uint8)  # not whole 8-byte words
    base = make_checkpoint(tmp_path / "base", model, shards=1)
    publisher = ds.DeltaPublisher(ds.VersionStore(tmp_path / "store"), base, encoding="xor")
    publisher.seed()
    decoded: list[str] = []
    real = rank_state.apply_frame

    def counted(encoding: Any, name: str, *args: Any) -> None:
        decoded.append(name)
        real(encoding, name, *args)

    monkeypatch.setattr(rank_state, "apply_frame", counted)
    step = {n: t.clone() for n, t in model.items()}
    for i, tensor in enumerate(step.values()):
        tensor.view(torch.uint8)[(5 * i) % tensor.numel()] ^= 1  # one byte per tensor
    step["w5"] = -step["w5"]  # every element: dense, so its payload is applied instead
    publisher.publish(step)
    assert sorted(decoded) == ["odd", "w5"]
    snapshot = publisher.snapshot
    assert snapshot is not None
    assert {n: snapshot.load(n).tobytes() for n in step} == {
        n: raw_bytes(t) for n, t in step.items()
    }


class _SlowXor(XorEncoding):
    """xor under another name whose every encode call takes 40 ms: a busy pool."""

    name = "test-slow-xor"

    def encode_framed(self, olds: Any, news: Any, itemsizes: Any) -> Any:
        time.sleep(0.04)
        return super().encode_framed(olds, news, itemsizes)


@pytest.mark.filterwarnings("ignore:weight_v000001 changed")
@pytest.mark.parametrize("pooled", [False, True], ids=["viewed", "pooled"])
def test_copy_time_leaves_out_the_wait_for_a_busy_pool(tmp_path: Path, pooled: bool) -> None:
    """``copy_s`` is the staging of tensors (views, or copies through the pool in groups, as
    for CUDA tensors): the producer's wait for the encode pool when the window of pending
    batches is full is the encoders' time, not it."""
    # 160 KB each against a batch limit of 256 KB: each next tensor submits the batch before
    # it is staged, and that submit waits while two batches are pending.
    model = {f"t{i}": torch.randn(40 * 1024) for i in range(16)}
    base_dir = make_checkpoint(tmp_path / "base", model)
    ENCODINGS[_SlowXor.name] = _SlowXor()
    try:
        publisher = ds.DeltaPublisher(
            tmp_path / "store",
            base_dir,
            encoding=_SlowXor.name,
            workers=1,
            max_inflight_bytes=512 * 1024,
            stage_host_tensors=pooled,
        )
        publisher.seed()
        publisher.publish({name: tensor + 1 for name, tensor in model.items()})
        metrics = publisher.pop_metrics()
    finally:
        del ENCODINGS[_SlowXor.name]
    assert metrics["encode_s"] >= 16 * 0.04
    # The producer waited for most of the encoders' 0.64 s; the copies themselves (2.6 MB
    # through the pool when pooled) take a fraction of that.
    assert metrics["copy_s"] < (0.3 if pooled else 0.1), metrics


class _SlowerXor(_SlowXor):
    """As :class:`_SlowXor`, 200 ms an encode call in all: waits that dwarf a diff on a busy
    machine."""

    name = "test-slower-xor"

    def encode_framed(self, olds: Any, news: Any, itemsizes: Any) -> Any:
        time.sleep(0.16)
        return super().encode_framed(olds, news, itemsizes)


@pytest.mark.filterwarnings("ignore:weight_v000001 changed")
def test_copy_time_of_a_device_diff_leaves_out_the_group_flushed_before_it(
    tmp_path: Path,
) -> None:
    """With ``device_snapshot``, a large tensor's diff is timed alone: the small tensors'
    group flushed just before it (whose batches wait for a busy pool) is not counted again."""
    # Small (160 KB, grouped) and large (1.25 MB, diffed alone) tensors alternate: each large
    # one flushes the group, and the flush's batches wait while two are pending.
    model = {}
    for i in range(6):
        model[f"s{i}"] = torch.randn(40 * 1024)
        model[f"l{i}"] = torch.randn(320 * 1024)
    base_dir = make_checkpoint(tmp_path / "base", model)
    ENCODINGS[_SlowerXor.name] = _SlowerXor()
    try:
        publisher = ds.DeltaPublisher(
            tmp_path / "store",
            base_dir,
            encoding=_SlowerXor.name,
            workers=1,
            max_inflight_bytes=512 * 1024,
            device_snapshot=True,
        )
        publisher.seed()
        publisher.publish({name: tensor + 1 for name, tensor in model.items()})
        metrics = publisher.pop_metrics()
    finally:
        del ENCODINGS[_SlowerXor.name]
    assert metrics["encode_s"] >= 12 * 0.2
    # The diffs take a few hundredths of a second (a few tenths on a loaded machine); with the
    # flushes' waits counted, about 1 s.
    assert metrics["copy_s"] < 0.4, metrics

"""The host-staging path (pinned-buffer pool, bytes-in-flight bound, pageable fallback) on CPU.

``stage_host_tensors=True`` sends CPU tensors through the same buffer pool that CUDA tensors
use, so the pool, the budget and the fallback are exercised without a GPU; the CUDA-only part
(non-blocking copies, events) is checked by ``benchmarks/gpu_check.py`` on a GPU machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deltastore as ds
from deltastore.publish.device import HostStager, flat_bytes
from tests.conftest import checkpoint_bytes, make_checkpoint, raw_bytes

MIB = 1 << 20


def test_budget_bounds_bytes_in_flight_and_buffers_are_reused() -> None:
    stager = HostStager(3 * MIB, stage_host_tensors=True)
    tensors = [torch.full((MIB,), i, dtype=torch.uint8) for i in range(12)]
    staged_queue: list = []
    lock = threading.Lock()
    seen: list[int] = []

    def consumer() -> None:
        # Start only once the producer has filled the budget (nothing was released yet).
        deadline = time.monotonic() + 10
        while stager.in_flight_bytes < 3 * MIB and time.monotonic() < deadline:
            time.sleep(0.001)
        done = 0
        while done < len(tensors):
            with lock:
                item = staged_queue.pop(0) if staged_queue else None
            if item is None:
                time.sleep(0.001)
                continue
            time.sleep(0.005)  # a slow encode: the producer must wait for budget
            seen.append(int(item.wait()[0]))
            seen.append(stager.in_flight_bytes)
            item.release()
            done += 1

    thread = threading.Thread(target=consumer)
    thread.start()
    for i, t in enumerate(tensors):
        staged = stager.stage(f"t{i}", t)
        assert stager.in_flight_bytes <= 3 * MIB
        with lock:
            staged_queue.append(staged)
    thread.join(10)
    assert seen[0::2] == list(range(12))  # each buffer held its own tensor's bytes
    assert max(seen[1::2]) <= 3 * MIB
    assert stager.stats.peak_in_flight_bytes == 3 * MIB
    assert stager.stats.budget_wait_s > 0
    assert stager.stats.copied == 12
    assert stager.stats.buffers_allocated <= 4  # reused, not one per tensor
    assert stager.in_flight_bytes == 0


def test_the_best_idle_buffer_is_taken_among_buffers_of_other_sizes() -> None:
    """Idle buffers are tensors: taking one must not compare it with the others (``==`` on
    tensors is elementwise, which raised here for a model of mixed tensor sizes)."""
    stager = HostStager(64 * MIB, stage_host_tensors=True)
    big = stager.stage("big", torch.ones(8 * MIB, dtype=torch.uint8))
    small = stager.stage("small", torch.ones(MIB, dtype=torch.uint8))
    other = stager.stage("other", torch.ones(MIB, dtype=torch.uint8))
    for staged in (big, small, other):
        staged.release()  # idle: 8 MiB, then two of 1 MiB
    again = [stager.stage(f"again{i}", torch.full((MIB,), i, dtype=torch.uint8)) for i in (1, 2)]
    assert [int(s.wait()[0]) for s in again] == [1, 2]
    assert stager.stats.buffers_allocated == 3  # both small ones reused, nothing new
    for staged in again:
        staged.release()


def test_a_tensor_larger_than_the_budget_goes_alone() -> None:
    stager = HostStager(MIB, stage_host_tensors=True)
    small = stager.stage("small", torch.zeros(MIB // 2, dtype=torch.uint8))
    done = threading.Event()

    def stage_big() -> None:
        big = stager.stage("big", torch.ones(4 * MIB, dtype=torch.uint8))
        assert int(big.wait().sum()) == 4 * MIB
        big.release()
        done.set()

    thread = threading.Thread(target=stage_big)
    thread.start()
    assert not done.wait(0.1)  # waits for the small one to be released
    small.release()
    thread.join(5)
    assert done.is_set()
    assert stager.stats.peak_in_flight_bytes == 4 * MIB


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without CUDA")
def test_pinning_failure_falls_back_to_pageable_buffers() -> None:
    stager = HostStager(8 * MIB, pin_memory=True, stage_host_tensors=True)
    t = torch.randn(64, 32).to(torch.bfloat16)
    staged = stager.stage("t", t)
    assert staged.wait().tobytes() == raw_bytes(t)
    staged.release()
    assert stager.stats.pinned is False
    assert stager.stats.buffers_allocated == 1


@pytest.mark.parametrize("through_pool", [False, True])
def test_staged_bytes_of_every_layout(through_pool: bool) -> None:
    stager = HostStager(64 * MIB, stage_host_tensors=through_pool)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(16, 24, generator=g)
    cases = {
        "transposed_bf16": base.to(torch.bfloat16).t(),
        "sliced_fp32": base[::2, 3:17],
        "bool": base > 0,
        "fp8": base.to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, dtype=torch.bfloat16),
        # One element with stride 2 (torch calls it contiguous) and a lazily negated view:
        # the pool path once raised on both (`.view(uint8)` rejects them).
        "one_strided": base.to(torch.bfloat16).reshape(-1)[::2][:1],
        "negative": torch._neg_view(base),
    }
    for name, t in cases.items():
        staged = stager.stage(name, t)
        logical = t.resolve_neg().clone(memory_format=torch.contiguous_format)
        assert staged.wait().tobytes() == raw_bytes(logical), name
        staged.release()
    array = np.arange(30, dtype=">i4").reshape(5, 6).T
    staged = stager.stage("numpy", array)
    assert staged.wait().tobytes() == np.ascontiguousarray(array).astype("<i4").tobytes()
    staged.release()
    assert stager.in_flight_bytes == 0


def test_publisher_through_the_buffer_pool_matches_the_direct_path(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(7)
    model = {f"w{i}": torch.randn(256, 256, generator=g).to(torch.bfloat16) for i in range(6)}
    base = make_checkpoint(tmp_path / "base", model)
    new = {n: t.clone() for n, t in model.items()}
    for i, t in enumerate(new.values()):
        t[i] += 1.0
    indexes = []
    for pooled in (False, True):
        store = ds.VersionStore(str(tmp_path / f"store-{pooled}"))
        # A budget of ~1.5 tensors forces the producer to wait for the encode pool.
        pub = ds.DeltaPublisher(
            store,
            base,
            workers=2,
            stage_host_tensors=pooled,
            max_inflight_bytes=3 * 128 * 1024 // 2,
        )
        pub.seed()
        # Transposed views: the staged bytes must be the logical (row-major) content.
        pub.publish((n, t.t().contiguous().t()) for n, t in new.items())
        assert pub.last_staging is not None
        assert pub.last_staging.copied == (6 if pooled else 0)
        assert pub.last_staging.peak_in_flight_bytes <= (MIB if pooled else 3 * 128 * 1024 // 2)
        indexes.append(store.index(1))
        local = tmp_path / f"local-{pooled}"
        ds.pull_weights(local, store, 1, base_dir=base)
        got = checkpoint_bytes(local)
        assert all(got[n] == raw_bytes(t) for n, t in new.items())
    assert indexes[0].weight_map == indexes[1].weight_map
    assert indexes[0].totals["changed_bytes"] == indexes[1].totals["changed_bytes"]


def test_a_model_of_mixed_tensor_sizes_publishes_through_the_buffer_pool(tmp_path: Path) -> None:
    """Buffers of several sizes sit idle between tensors (as for a CUDA model of embeddings,
    norms and MLPs): every version publishes and pulls to the trainer's bytes."""
    g = torch.Generator().manual_seed(8)
    shapes = [(1024, 1024), (64,), (256, 256), (1024, 1024), (256, 256), (64,), (512, 1024)]
    model = {
        f"w{i}": torch.randn(*shape, generator=g).to(torch.bfloat16)
        for i, shape in enumerate(shapes)
    }
    base = make_checkpoint(tmp_path / "base", model)
    store = ds.VersionStore(str(tmp_path / "store"))
    pub = ds.DeltaPublisher(store, base, workers=2, stage_host_tensors=True)
    pub.seed()
    for step in range(1, 4):
        for t in model.values():
            t.view(-1)[step::97] += 1.0
        pub.publish(model)
        assert pub.last_staging is not None and pub.last_staging.copied == len(model)
        local = tmp_path / f"local{step}"
        ds.pull_weights(local, store, step, base_dir=base)
        got = checkpoint_bytes(local)
        assert all(got[n] == raw_bytes(t) for n, t in model.items())


def test_a_group_is_staged_in_one_buffer_returned_with_its_last_tensor() -> None:
    stager = HostStager(64 * MIB, stage_host_tensors=True)
    g = torch.Generator().manual_seed(9)
    tensors = [
        ("a", torch.randn(100, generator=g).to(torch.bfloat16)),
        ("b", torch.randn(7, 3, generator=g).t()),  # not contiguous: its logical bytes
        ("c", torch.randint(0, 255, (33,), generator=g, dtype=torch.uint8)),
    ]
    staged = stager.stage_group([flat_bytes(torch, t) for _, t in tensors])
    for (name, tensor), one in zip(tensors, staged, strict=True):
        assert one.wait().tobytes() == raw_bytes(tensor.contiguous()), name
    assert (stager.stats.staged, stager.stats.copied, stager.stats.buffers_allocated) == (3, 3, 1)
    assert stager.in_flight_bytes == MIB  # one buffer for the three
    staged[0].release()
    staged[0].release()  # idempotent: the buffer is not returned early
    staged[2].release()
    assert stager.in_flight_bytes == MIB
    staged[1].release()
    assert stager.in_flight_bytes == 0
    again = stager.stage_group([flat_bytes(torch, tensors[0][1])])
    assert stager.stats.buffers_allocated == 1  # the group's buffer, reused
    again[0].release()


@pytest.mark.parametrize("device_snapshot", [False, True], ids=["staged", "device-snapshot"])
def test_a_generator_may_reuse_one_buffer_for_every_tensor_it_yields(
    tmp_path: Path, device_snapshot: bool
) -> None:
    """A bucketed gather yields each tensor in a buffer it fills again for the next: what
    goes through the pool (a CUDA tensor, here ``stage_host_tensors``) is read as it is
    taken, grouped or not, so each version holds the bytes each tensor had when yielded."""
    g = torch.Generator().manual_seed(10)
    model = {f"e{i:02d}": torch.randn(64, 64, generator=g).to(torch.bfloat16) for i in range(40)}
    model["norm"] = torch.randn(256, generator=g)
    model["big"] = torch.randn(1024, 1024, generator=g).to(torch.bfloat16)  # not grouped
    base = make_checkpoint(tmp_path / "base", model)
    store = ds.VersionStore(str(tmp_path / "store"))
    pub = ds.DeltaPublisher(
        store, base, workers=2, stage_host_tensors=True, device_snapshot=device_snapshot
    )
    pub.seed()

    def bucketed() -> Iterator[tuple[str, torch.Tensor]]:
        buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        for name, tensor in model.items():
            buffer = buffers.setdefault((tensor.shape, tensor.dtype), torch.empty_like(tensor))
            buffer.copy_(tensor)  # the gather, into the one buffer of this shape
            yield name, buffer

    for step in range(1, 3):
        for i, tensor in enumerate(model.values()):
            if step == 2 and i == 3:
                tensor.add_(1.0)  # a dense change: staged whole
            else:
                tensor.view(-1)[(step + i) :: 61] += 1.0
        pub.publish(bucketed())
        local = tmp_path / f"local{step}"
        ds.pull_weights(local, store, step, base_dir=base)
        got = checkpoint_bytes(local)
        wrong = [n for n, t in model.items() if got[n] != raw_bytes(t)]
        assert not wrong, (step, wrong[:5])

"""Check the CUDA path of the publisher on a GPU machine: publish GPU tensors, pull, verify.

Exercises what CPU tests cannot: pinned host buffers, non-blocking device-to-host copies
waited on by CUDA events inside the encode pool, non-contiguous device tensors, the pageable
fallback (``pin_memory=False``), the diff on the device (``device_snapshot``), tensors of
mixed sizes (small ones grouped), a generator that refills one buffer for every tensor it
yields (each tensor must be read before the next is asked for), a full version from device
tensors, and a 2-rank collective publish of device tensors (gloo coordination, spawned ranks
sharing the GPU). Exits non-zero on any mismatch.

    python benchmarks/gpu_check.py                 # on a machine with CUDA
    python benchmarks/gpu_check.py --device cpu    # same logic on CPU (host tensors staged)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from deltastore.testing.servers import free_port

MB = 1_000_000


def model_on(device: str, size_mb: int, step: int) -> dict[str, Any]:
    """A deterministic bf16 model on ``device``; ``step`` nudges a slice of each tensor."""
    import torch

    g = torch.Generator().manual_seed(0)
    tensors = {}
    rows = 1024
    cols = max(1, size_mb * MB // (16 * rows * 2))
    for i in range(16):
        t = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        for s in range(1, step + 1):
            t[(s * 37 + i) % rows :: 97] += 0.5 * s
        tensors[f"model.layers.{i}.weight"] = t.to(device)
    # Small tensors (MoE experts, norms) take the grouped device diff with device_snapshot.
    for i in range(64):
        t = torch.randn(64, 64, generator=g).to(torch.bfloat16)
        for s in range(1, step + 1):
            t[(s + i) % 64 :: 13] += 0.5 * s
        tensors[f"model.experts.{i}.weight"] = t.to(device)
    norm = torch.randn(256, generator=g)
    for s in range(1, step + 1):
        norm[s * 7 % 256] += 0.5 * s
    tensors["model.norm.weight"] = norm.to(device)
    return tensors


def host_bytes(tensor: Any) -> bytes:
    import torch

    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_local(local: Path, expected: dict[str, Any]) -> None:
    from safetensors import safe_open

    got = {}
    for path in sorted(local.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                got[name] = host_bytes(fh.get_tensor(name))
    wrong = [n for n, t in expected.items() if got.get(n) != host_bytes(t)]
    if wrong:
        raise SystemExit(f"FAIL: pulled tensors differ from the device tensors: {wrong[:5]}")


def refilled(tensors: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each tensor yielded in the one buffer of its shape and dtype, refilled for the next
    (on the device's current stream, as a gather would): what a publish reads late is wrong."""
    import torch

    buffers: dict[tuple[Any, ...], Any] = {}
    for name, tensor in tensors.items():
        key = (tensor.shape, tensor.stride(), tensor.dtype)
        buffer = buffers.setdefault(key, torch.empty_like(tensor))
        buffer.copy_(tensor)
        yield name, buffer


def single_process(args: argparse.Namespace, tmp: Path, base: Path) -> None:
    import deltastore as ds

    device = args.device
    for label, pin, on_device in (
        ("pinned", None, False),
        ("pageable", False, False),
        ("device-snapshot", None, True),  # the diff on the device, only changes to the host
        # A bucketed gather: a generator refilling one buffer for each tensor it yields.
        ("reused-buffer", None, False),
        ("reused-buffer-device-snapshot", None, True),
    ):
        store = ds.VersionStore(str(tmp / f"store-{label}"))
        pub = ds.DeltaPublisher(
            store,
            base,
            workers=args.workers,
            pin_memory=pin,
            stage_host_tensors=device == "cpu",
            max_inflight_bytes=args.inflight_mb * MB,
            device_snapshot=on_device,
        )
        pub.seed()
        local = tmp / f"host-{label}"
        for step in range(1, args.steps + 1):
            tensors = model_on(device, args.size, step)
            # One transposed view: the staged bytes must be the logical row-major content.
            name0 = "model.layers.0.weight"
            tensors[name0] = tensors[name0].t().contiguous().t()
            full = step == args.steps
            started = time.perf_counter()
            passed = refilled(tensors) if label.startswith("reused") else tensors.items()
            result = pub.publish(passed, full=full)
            seconds = time.perf_counter() - started
            metrics = pub.pop_metrics()
            staging = pub.last_staging
            assert staging is not None
            if on_device and (staging.device_diffed, staging.copied) != (len(tensors), 0):
                raise SystemExit(f"FAIL: {staging.device_diffed} tensors diffed on the device")
            if device == "cuda" and not on_device and staging.copied != len(tensors):
                raise SystemExit(f"FAIL: {staging.copied} of {len(tensors)} tensors staged")
            if device == "cuda" and pin is None and not on_device and staging.pinned is not True:
                raise SystemExit("FAIL: pinned buffers were not used on a CUDA machine")
            if pin is False and staging.pinned:
                raise SystemExit("FAIL: pin_memory=False still pinned")
            if staging.peak_in_flight_bytes > max(args.inflight_mb * MB, 64 * 1024**2):
                raise SystemExit(f"FAIL: {staging.peak_in_flight_bytes} bytes in flight")
            ds.pull_weights(local, store, result.version, base_dir=base)
            check_local(local, tensors)
            print(
                json.dumps(
                    {
                        "mode": label,
                        "version": result.version,
                        "kind": result.kind,
                        "density": round(result.density, 5),
                        "wire_mb": round(result.wire_bytes / MB, 2),
                        "publish_s": round(seconds, 3),
                        "copy_s": round(metrics["copy_s"], 3),
                        "encode_s": round(metrics["encode_s"], 3),
                        "diff_s": round(metrics["diff_s"], 3),
                        "gb_per_s": round(result.total_bytes / seconds / 1e9, 2),
                        "pinned": staging.pinned,
                        "device_bytes_to_host": staging.device_bytes_to_host,
                        "buffers": staging.buffers_allocated,
                        "peak_in_flight_mb": round(staging.peak_in_flight_bytes / MB, 1),
                        "budget_wait_s": round(staging.budget_wait_s, 3),
                        "copy_wait_s": round(staging.copy_wait_s, 3),
                    }
                )
            )


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    import deltastore as ds

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    if args.device == "cuda":
        torch.cuda.set_device(0)
    pub = ds.DeltaPublisher(
        ds.VersionStore(os.path.join(tmp, "store-ranks")),
        os.path.join(tmp, "base"),
        workers=args.workers,
        stage_host_tensors=args.device == "cpu",
    )
    pub.seed()
    for step in range(1, args.steps + 1):
        tensors = model_on(args.device, args.size, step)
        mine = [(n, t) for i, (n, t) in enumerate(sorted(tensors.items())) if i % world == rank]
        pub.publish(mine)
    dist.barrier()
    dist.destroy_process_group()


def two_ranks(args: argparse.Namespace, tmp: Path, base: Path) -> None:
    import torch.multiprocessing as mp

    import deltastore as ds

    port = free_port()
    # Spawned, not forked: a forked child cannot use CUDA.
    mp.start_processes(_rank, args=(2, port, args, str(tmp)), nprocs=2, start_method="spawn")
    store = ds.VersionStore(str(tmp / "store-ranks"))
    index = store.index(args.steps)
    local = tmp / "host-ranks"
    ds.pull_weights(local, store, args.steps, base_dir=base)
    check_local(local, model_on("cpu", args.size, args.steps))
    print(
        json.dumps(
            {
                "mode": "2 ranks",
                "version": args.steps,
                "shards": sorted(set(index.weight_map.values())),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--size", type=int, default=512, help="model size in MB (bf16)")
    parser.add_argument("--steps", type=int, default=3, help="the last step is a full version")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--inflight-mb", type=int, default=256)
    parser.add_argument("--skip-ranks", action="store_true")
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here; run with --device cpu to check the logic")
    with tempfile.TemporaryDirectory(prefix="deltastore-gpu-") as name:
        tmp = Path(name)
        base = tmp / "base"
        base.mkdir()
        save_file(model_on("cpu", args.size, 0), str(base / "model.safetensors"))
        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        print(f"device {args.device}: {gpu}")
        single_process(args, tmp, base)
        if not args.skip_ranks:
            two_ranks(args, tmp, base)
    print("OK: device tensors published, pulled and verified byte for byte")
    sys.exit(0)


if __name__ == "__main__":
    main()

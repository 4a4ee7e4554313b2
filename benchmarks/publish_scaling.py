"""Per-tensor publish cost against the tensor count (docs/publishing.md, *Scaling*).

Builds synthetic MoE-shaped bf16 models (many small expert tensors), seeds a publisher on a
local store, changes every tensor at a low density (an RL-like step) and times one publish
per size. Cost must grow linearly with the tensor count: the per-tensor milliseconds stay
flat, so the ratio to the smallest size stays near 1.

    python benchmarks/publish_scaling.py                      # 2,000 / 8,000 / 32,000 tensors
    python benchmarks/publish_scaling.py --sizes 2000 8000 --tensor-kib 64 --workers 2
    python benchmarks/publish_scaling.py --profile 8000       # cProfile top entries at 8,000
    python benchmarks/publish_scaling.py --encoding auto      # packed shards, sparse-v2

Each size also times the pull of the timed version onto a host one step behind.

The tensor size shrinks with the count (``--budget-mib`` of model in all at the largest size,
``--tensor-kib`` at most), so memory stays bounded on a small machine.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

KIB = 1024


def make_model(count: int, tensor_bytes: int, seed: int = 0) -> dict[str, Any]:
    """``count`` bf16 expert tensors of ``tensor_bytes`` each, named like a MoE model."""
    import torch

    g = torch.Generator().manual_seed(seed)
    elements = tensor_bytes // 2
    experts = 64
    model: dict[str, Any] = {}
    for i in range(count):
        layer, expert = divmod(i, experts)
        name = f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
        model[name] = torch.randn(elements, generator=g).to(torch.bfloat16)
    return model


def step(model: dict[str, Any], density: float, seed: int = 1) -> dict[str, Any]:
    """The model after one RL-like step: ``density`` of each tensor's elements nudged."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in model.items():
        new = tensor.clone()
        n = max(1, int(new.numel() * density))
        idx = torch.randint(0, new.numel(), (n,), generator=g)
        new[idx] = (new[idx].float() + 0.01).to(new.dtype)
        out[name] = new
    return out


def publish_once(
    count: int, tensor_bytes: int, workers: int, profile: bool, encoding: str
) -> dict[str, Any]:
    """Seed, publish one untimed step (warms caches and any compiled kernel), then time one
    publish of ``count`` changed tensors and one pull of it onto a host at the step before;
    optionally profile the publish."""
    from safetensors.torch import save_file

    import deltastore as ds

    model = make_model(count, tensor_bytes)
    first = step(model, 0.004)
    new = step(first, 0.004)
    with tempfile.TemporaryDirectory(prefix="deltastore-scaling-") as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        save_file(model, str(base / "model.safetensors"))
        store = Path(tmp) / "store"
        publisher = ds.DeltaPublisher(store, base, workers=workers, encoding=encoding)
        publisher.seed()
        publisher.publish(first.items())
        host = Path(tmp) / "host"
        ds.pull_weights(host, store, 1, base_dir=base, workers=workers)
        profiler = cProfile.Profile() if profile else None
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        result = publisher.publish(new.items())
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - started
        started = time.perf_counter()
        ds.pull_weights(host, store, 2, base_dir=base, workers=workers)
        pull_seconds = time.perf_counter() - started
    if profiler is not None:
        stats = pstats.Stats(profiler).sort_stats("tottime")
        stats.print_stats(8)
    return {
        "tensors": count,
        "tensor_kib": tensor_bytes // KIB,
        "model_mib": round(count * tensor_bytes / KIB / KIB, 1),
        "encoding": encoding,
        "publish_s": round(seconds, 3),
        "ms_per_tensor": round(1000 * seconds / count, 4),
        "pull_s": round(pull_seconds, 3),
        "pull_ms_per_tensor": round(1000 * pull_seconds / count, 4),
        "tensors_changed": result.tensors_changed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000, 32000])
    parser.add_argument("--tensor-kib", type=int, default=64, help="largest tensor size")
    parser.add_argument("--budget-mib", type=int, default=512, help="model bytes at most")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--profile", type=int, default=None, help="profile at this size only")
    parser.add_argument("--encoding", default="xor", help="xor (default), auto, sparse-v2, ...")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [args.profile] if args.profile else args.sizes
    rows = []
    for count in sizes:
        tensor_bytes = min(args.tensor_kib * KIB, args.budget_mib * KIB * KIB // count)
        tensor_bytes -= tensor_bytes % 2
        rows.append(
            publish_once(count, tensor_bytes, args.workers, args.profile is not None, args.encoding)
        )
    smallest, smallest_pull = rows[0]["ms_per_tensor"], rows[0]["pull_ms_per_tensor"]
    for row in rows:
        row["ratio_to_smallest"] = round(row["ms_per_tensor"] / smallest, 2)
        row["pull_ratio_to_smallest"] = round(row["pull_ms_per_tensor"] / smallest_pull, 2)
        if args.json:
            print(json.dumps(row))
        else:
            print(
                f"{row['tensors']:>7} tensors x {row['tensor_kib']:>3} KiB "
                f"({row['model_mib']:>6} MiB): publish {row['publish_s']:>7.3f} s, "
                f"{row['ms_per_tensor']:.4f} ms/tensor, x{row['ratio_to_smallest']:.2f}; "
                f"pull {row['pull_s']:>7.3f} s, {row['pull_ms_per_tensor']:.4f} ms/tensor, "
                f"x{row['pull_ratio_to_smallest']:.2f}"
            )


if __name__ == "__main__":
    main()

"""Codec cost per tensor: microseconds per 64 KB bf16 expert tensor, one thread.

Each path encodes every tensor of a MoE-shaped step (``--tensors`` tensors of 32,768 bf16
elements, ``--density`` of them moved ±1 ulp) and frames its payload with zstd-1, as the
publisher does; ``reference`` is the reference-style ``xor`` + zstd-1. Best of ``--repeat``,
all in one process, ratios against ``reference``; wire is the frames' bytes per tensor.
``apply`` is the pull side's codec work per tensor: bounded decompress of the frame and apply
in place onto a copy of the old bytes (the reference: decompress and XOR in place), each
result checked bit-exact once.
``--profile PATH`` writes a cProfile of one pass of every path to PATH.

    python benchmarks/codec_per_tensor.py
    python benchmarks/codec_per_tensor.py --tensors 8000 --density 0.004 --json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from deltastore.cli.bench import moe_model, simulated_step
from deltastore.codecs import Encoding, compress, decompress, get_encoding, sparse
from deltastore.codecs.sparse import AutoEncoding, CompactSparseEncoding

Pair = tuple[np.ndarray, np.ndarray]


def paths() -> dict[str, Callable[[np.ndarray, np.ndarray], bytes]]:
    """Every encode path measured, as old, new -> zstd-1 frame."""
    found: dict[str, Callable[[np.ndarray, np.ndarray], bytes]] = {
        "reference": lambda old, new: compress(np.bitwise_xor(old, new)),
    }
    for label, use_jit in (("numpy", False), ("numba", True)):
        if use_jit and sparse.compiled_backend(None) is None:
            continue
        compact, auto = CompactSparseEncoding(use_jit=use_jit), AutoEncoding(use_jit=use_jit)
        found[f"sparse-v2 {label}"] = lambda o, n, e=compact: compress(
            e.encode(o, n, itemsize=2).payload
        )
        found[f"auto {label}"] = lambda o, n, e=auto: compress(e.encode(o, n, itemsize=2).payload)
    return found


def appliers() -> dict[str, Callable[[np.ndarray, bytes], None]]:
    """Per path, (target, frame) -> the payload decompressed within its bound, applied."""

    def through(encoding: Encoding) -> Callable[[np.ndarray, bytes], None]:
        def apply(target: np.ndarray, frame: bytes) -> None:
            bound = encoding.max_payload_size(target.size)
            encoding.apply(target, decompress(frame, max_size=bound, what="f"), tensor="t")

        return apply

    found = {"reference": through(get_encoding("xor"))}
    for label, use_jit in (("numpy", False), ("numba", True)):
        if not use_jit or sparse.compiled_backend(None) is not None:
            found[f"sparse-v2 {label}"] = through(CompactSparseEncoding(use_jit=use_jit))
            found[f"auto {label}"] = through(AutoEncoding(use_jit=use_jit))
    return found


def measure(pairs: list[Pair], repeat: int) -> dict[str, dict[str, float]]:
    """Per path: best µs per tensor to encode and to apply, and frame bytes per tensor."""
    results: dict[str, dict[str, float]] = {}
    apply_with = appliers()
    for name, encode in paths().items():
        encode(*pairs[0])  # loads numba (and compiles on a cold cache) outside the timing
        best = float("inf")
        for _ in range(repeat):
            begun = time.perf_counter()
            frames = [encode(old, new) for old, new in pairs]
            best = min(best, time.perf_counter() - begun)
        apply = apply_with[name]
        targets = [old.copy() for old, _ in pairs]
        for target, frame, (_, new) in zip(targets, frames, pairs, strict=True):
            apply(target, frame)
            assert target.tobytes() == new.tobytes(), name
        best_apply = float("inf")
        for _ in range(repeat):  # each apply of a self-inverse payload swaps old and new
            begun = time.perf_counter()
            for target, frame in zip(targets, frames, strict=True):
                apply(target, frame)
            best_apply = min(best_apply, time.perf_counter() - begun)
        results[name] = {
            "us_per_tensor": best / len(pairs) * 1e6,
            "apply_us_per_tensor": best_apply / len(pairs) * 1e6,
            "wire_per_tensor": sum(map(len, frames)) / len(pairs),
        }
    reference = results["reference"]
    for row in results.values():
        row["time_vs_reference"] = row["us_per_tensor"] / reference["us_per_tensor"]
        row["apply_vs_reference"] = row["apply_us_per_tensor"] / reference["apply_us_per_tensor"]
        row["wire_vs_reference"] = row["wire_per_tensor"] / reference["wire_per_tensor"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--density", type=float, default=0.004)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", default=None, help="write a cProfile of one pass here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    before = moe_model(args.tensors, seed=0)
    after = simulated_step(before, args.density, seed=1)
    pairs = [
        (
            before[n].view(torch.uint8).numpy().reshape(-1),
            after[n].view(torch.uint8).numpy().reshape(-1),
        )
        for n in before
    ]
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(measure, pairs, 1)
        profiler.dump_stats(args.profile)
    results = measure(pairs, args.repeat)
    report = {
        "tensors": len(pairs),
        "density": args.density,
        "load": os.getloadavg(),
        "paths": results,
    }
    if args.json:
        print(json.dumps(report))
        return
    print(f"{len(pairs)} tensors of 64 KB, density {args.density}, load {os.getloadavg()[0]:.2f}")
    for name, row in results.items():
        print(
            f"{name:16s} encode {row['us_per_tensor']:7.1f} µs ({row['time_vs_reference']:.2f}x)"
            f"  apply {row['apply_us_per_tensor']:7.1f} µs ({row['apply_vs_reference']:.2f}x)"
            f"  {row['wire_per_tensor']:7.1f} B/tensor ({row['wire_vs_reference']:.3f}x)"
        )


if __name__ == "__main__":
    main()

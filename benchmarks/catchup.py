"""Catch-up vs stepwise apply: a host k versions behind, timed both ways in one process.

    .venv/bin/python benchmarks/catchup.py                    # 10 versions, xor and overwrite
    .venv/bin/python benchmarks/catchup.py --versions 20 --tensors 512 --repeat 5

Builds a model (``--tensors`` tensors of about ``--elements`` bf16 elements), publishes
``--versions`` deltas with the real :class:`DeltaPublisher` (each changes ``--fraction`` of the
tensors at ``--density`` of their bytes), then, from a host at v0:

* **stepwise**: ``pull_weights`` v1, v2, ..., vk one call each (what a host that kept up does);
* **catch-up**: one ``pull_weights`` to vk (each changed tensor read once per version, the
  chain folded, written and verified once).

Both end byte-identical (checked). Prints the best of ``--repeat`` runs and the ratio
stepwise / catch-up (>1 means catch-up is faster).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time

import numpy as np
import torch
from safetensors.torch import save_file

from deltastore import DeltaPublisher, pull_weights
from deltastore.format.checkpoint import scan_checkpoint


def build_model(tensors: int, elements: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i // 8}.w{i % 8}": torch.randn(elements, generator=g).to(torch.bfloat16)
        for i in range(tensors)
    }


def write_base(directory: str, model: dict[str, torch.Tensor], shards: int = 4) -> None:
    os.makedirs(directory, exist_ok=True)
    names = sorted(model)
    weight_map = {}
    for s in range(shards):
        file_name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: model[n] for n in names[s::shards]}, os.path.join(directory, file_name))
        weight_map.update(dict.fromkeys(names[s::shards], file_name))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)


def publish(args: argparse.Namespace, work: str, base: str, encoding: str) -> str:
    store = os.path.join(work, f"store-{encoding}")
    publisher = DeltaPublisher(store, base, encoding=encoding)
    publisher.seed()
    rng = np.random.default_rng(args.seed)
    model = build_model(args.tensors, args.elements, args.seed)
    names = sorted(model)
    for _ in range(args.versions):
        chosen = rng.choice(len(names), size=max(1, int(len(names) * args.fraction)), replace=False)
        for i in chosen:
            raw = model[names[i]].view(torch.uint8).clone().numpy()
            k = max(1, int(raw.size * args.density))
            flips = rng.integers(1, 256, size=k, dtype=np.uint8)
            raw[rng.choice(raw.size, size=k, replace=False)] ^= flips
            model[names[i]] = torch.from_numpy(raw).view(torch.bfloat16)
        publisher.publish(model.items())
    return store


def checkpoint_bytes(directory: str) -> dict[str, bytes]:
    out = {}
    for name, tensor in scan_checkpoint(directory).items():
        with open(tensor.file, "rb") as fh:
            fh.seek(tensor.entry.start)
            out[name] = fh.read(tensor.entry.nbytes)
    return out


def run(args: argparse.Namespace, work: str, base: str, store: str) -> dict[str, float]:
    stepwise_s, catchup_s = [], []
    payloads = bytes_read = 0
    template = os.path.join(work, "host-v0")
    shutil.rmtree(template, ignore_errors=True)
    pull_weights(template, store, 0, base)
    for _ in range(args.repeat):
        for path in ("stepwise", "catchup"):
            shutil.rmtree(os.path.join(work, path), ignore_errors=True)
            shutil.copytree(template, os.path.join(work, path))
        started = time.perf_counter()
        for version in range(1, args.versions + 1):
            pull_weights(os.path.join(work, "stepwise"), store, version, base, workers=args.workers)
        stepwise_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        result = pull_weights(
            os.path.join(work, "catchup"), store, args.versions, base, workers=args.workers
        )
        catchup_s.append(time.perf_counter() - started)
        assert result.action == "applied", result.plan
        payloads, bytes_read = result.payloads_read, result.bytes_read
    same = checkpoint_bytes(os.path.join(work, "stepwise")) == checkpoint_bytes(
        os.path.join(work, "catchup")
    )
    if not same:
        raise SystemExit("catch-up and stepwise results differ")
    return {
        "stepwise_s": min(stepwise_s),
        "catchup_s": min(catchup_s),
        "payloads": payloads,
        "bytes_read": bytes_read,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=256)
    parser.add_argument("--elements", type=int, default=65536, help="bf16 elements per tensor")
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=0.3, help="tensors changed per version")
    parser.add_argument("--density", type=float, default=0.01, help="bytes changed per tensor")
    parser.add_argument("--encoding", choices=["xor", "overwrite", "both"], default="both")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="scratch dir (default: a temp dir, removed after)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = args.workdir or tempfile.mkdtemp(prefix="deltastore-catchup-")
    try:
        base = os.path.join(work, "base")
        write_base(base, build_model(args.tensors, args.elements, args.seed))
        size_mb = args.tensors * args.elements * 2 / 1e6
        print(
            f"model: {args.tensors} tensors, {size_mb:.1f} MB bf16; {args.versions} versions, "
            f"{args.fraction:.0%} of tensors x {args.density:.1%} of bytes changed each; "
            f"workers={args.workers}, best of {args.repeat}"
        )
        print(f"{'encoding':>9} {'stepwise s':>11} {'catch-up s':>11} {'ratio':>7} {'payloads':>9}")
        encodings = ["xor", "overwrite"] if args.encoding == "both" else [args.encoding]
        for encoding in encodings:
            store = publish(args, work, base, encoding)
            r = run(args, work, base, store)
            ratio = r["stepwise_s"] / r["catchup_s"]
            print(
                f"{encoding:>9} {r['stepwise_s']:>11.3f} {r['catchup_s']:>11.3f} "
                f"{ratio:>6.2f}x {int(r['payloads']):>9}"
            )
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

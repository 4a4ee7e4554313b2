"""Publish with ``device_snapshot=True`` (the diff on the tensors' device) against the staged
path (every byte copied to the host, then compared there), on the same model and steps, in one
process.

A bf16 model of ``--size-gb`` in ``--tensors`` tensors lives on ``--device``; each step moves
``--density`` of its elements by one ulp where they lie (what an optimizer step does to most
changed bf16 weights). Both publishers publish every step into their own local store; the
first step (which, on the device path, copies the model once more into device memory) is
reported apart, the others best of. On a GPU the figures to read are the publish ratio and the
bytes that crossed to the host; the reference's full publish (~19 s for a 62 GB node of 8 GPUs,
7.75 GB a GPU) is scaled to this size for comparison.

    python benchmarks/device_diff.py --device cuda --size-gb 8     # on a GPU machine
    python benchmarks/device_diff.py --device cpu --size-gb 0.5    # the same code on CPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import deltastore as ds

GB = 1e9
REFERENCE_S_PER_GB = 19 / 7.75
"""The reference's full publish of a 62 GB node (8 GPUs), per GB of one GPU's share."""


def make_model(size_gb: float, tensors: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    elements = int(size_gb * GB / 2 / tensors)
    return {
        f"model.layers.{i}.weight": torch.randn(elements, generator=g).to(torch.bfloat16)
        for i in range(tensors)
    }


def step_model(model: dict[str, torch.Tensor], density: float, seed: int) -> None:
    """Move ``density`` of each tensor's elements by one ulp, in place, on its device."""
    g = torch.Generator(device=next(iter(model.values())).device).manual_seed(seed)
    for tensor in model.values():
        flat = tensor.view(-1).view(torch.int16)
        count = max(1, int(flat.numel() * density))
        chosen = torch.randint(0, flat.numel(), (count,), generator=g, device=flat.device)
        flat[chosen] += 1


def host_work(
    base: dict[str, torch.Tensor], model: dict[str, torch.Tensor], encoding: str
) -> dict[str, float]:
    """Seconds of host work, one thread, best of 3, for the step ``base`` → ``model``: the
    staged path's encode and digest of the whole new bytes against the device path's coding of
    the changes and digest of the snapshot plus them (the host's share once a GPU has diffed)."""
    from deltastore.codecs import CHECKSUMS, ENCODINGS, XorChanges
    from deltastore.publish.device import hexdigest_after

    chosen, checksum = ENCODINGS[encoding], CHECKSUMS["xxh3-128"]
    olds = [t.view(-1).view(torch.uint8).numpy() for t in base.values()]
    news = [t.cpu().view(-1).view(torch.uint8).numpy() for t in model.values()]
    changes = []
    for old, new in zip(olds, news, strict=True):
        positions = (old.view("<u2") != new.view("<u2")).nonzero()[0]
        changes.append(
            XorChanges(positions, old.view("<u2")[positions] ^ new.view("<u2")[positions])
        )

    def staged() -> None:
        for old, new in zip(olds, news, strict=True):
            chosen.encode_framed([old], [new], [2])
            checksum.hexdigest(new)

    def on_device() -> None:
        for old, change in zip(olds, changes, strict=True):
            chosen.encode_changes(old, change, itemsize=2)
            hexdigest_after(checksum, old, change)

    out = {}
    for label, work in (("staged", staged), ("device", on_device)):
        times = []
        for _ in range(3):
            begun = time.perf_counter()
            work()
            times.append(time.perf_counter() - begun)
        out[label] = min(times)
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size-gb", type=float, default=0.5)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--density", type=float, default=0.004)
    parser.add_argument("--steps", type=int, default=4, help="steps published (the first apart)")
    parser.add_argument("--encoding", default="auto")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    model = make_model(args.size_gb, args.tensors)
    with tempfile.TemporaryDirectory(prefix="device-diff-") as work:
        base = Path(work) / "base"
        base.mkdir()
        save_file(model, str(base / "model.safetensors"))
        model = {name: t.to(args.device) for name, t in model.items()}
        publishers = {}
        for label, on_device in (("staged", False), ("device", True)):
            publishers[label] = ds.DeltaPublisher(
                Path(work) / label,
                base,
                encoding=args.encoding,
                workers=args.workers,
                device_snapshot=on_device,
            )
            publishers[label].seed()
        times: dict[str, list[float]] = {label: [] for label in publishers}
        to_host: dict[str, int] = {}
        for step in range(1, args.steps + 1):
            step_model(model, args.density, step)
            sync(args.device)
            # Alternated, so neither side always runs on the warmer machine.
            order = list(publishers) if step % 2 else list(reversed(publishers))
            for label in order:
                begun = time.perf_counter()
                publishers[label].publish(model)
                sync(args.device)
                times[label].append(time.perf_counter() - begun)
                staging: Any = publishers[label].last_staging
                if label == "device":
                    to_host[label] = staging.device_bytes_to_host
                else:
                    to_host[label] = args.size_gb * GB
        best = {label: min(t[1:] or t) for label, t in times.items()}
        # The last step against the one before it, for the host work of each path.
        previous = {name: t.clone().cpu() for name, t in model.items()}
        step_model(model, args.density, args.steps + 1)
        host = host_work(previous, model, args.encoding)
        result = {
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "size_gb": args.size_gb,
            "tensors": args.tensors,
            "density": args.density,
            "encoding": args.encoding,
            "first_publish_s": {label: t[0] for label, t in times.items()},
            "publish_s": best,
            "device_vs_staged": best["device"] / best["staged"],
            "bytes_to_host": to_host,
            "host_work_s": host,
            "host_work_device_vs_staged": host["device"] / host["staged"],
            "reference_scaled_s": REFERENCE_S_PER_GB * args.size_gb,
            "device_vs_reference": best["device"] / (REFERENCE_S_PER_GB * args.size_gb),
        }
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>22}: {value}")


if __name__ == "__main__":
    main()
